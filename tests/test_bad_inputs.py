"""Models and inputs that must be refused with a clear message, or handled (issue: reliability,
item 5). A float64 model: at tp > 1 a ParallelizeError at parallelize (tensor parallel's ops
compute in 32 bits or less); with data, pipeline and context parallel it trains in float64 --
its gradients clipped by their global norm, summed in float64 -- losses and gradients equal to the model in one process to float64 round-off, the fused linears
left to autograd and the gradient buffer float64. A sequence longer than the model's position
table (or a table sliced to it) is refused at the step with the limit and what sets it. Ids
outside the vocabulary that the model computes (idx + 1), which the step's check of its inputs
cannot see, are refused by the vocab-parallel embedding and cross entropy themselves (at tp=2
they were masked on both ranks and trained on silently; one process raises an IndexError)."""
from __future__ import annotations

import pytest
import torch

import fxtron
from fxtron.tools.testing import adamw, cases_fixture, max_abs_diff, ranks_of, reference_training, train_program
from tp_models import batch, batches, make

MESHES = [fxtron.Mesh(2), fxtron.Mesh(2, pp=2), fxtron.Mesh(2, cp=2)]
_opt = adamw(eps=1e-8, weight_decay=0.01)         # torch's defaults
CLIP = 0.5      # below every step's norm: the global norm is summed in float64 too (it was fp32's: 3e-8 off)


def _batches():
    return batches("llama", 4, [16, 8], seed=1)


def test_float64_at_tp2_is_refused_at_parallelize():
    with pytest.raises(fxtron.ParallelizeError, match=r"parameter tok_embeddings\.weight is float64.*model\.float\(\)"):
        fxtron.parallelize(make("llama").double(), fxtron.Mesh(2, tp=2), example_inputs=batch("llama", 2, 8, 0)[0])


def _run(rank, mesh, case):
    pm = fxtron.parallelize(make("llama").double(), mesh, example_inputs=batch("llama", 2, 8, 0)[0],
                            microbatches=2 if mesh.pp > 1 else 1, clip_grad=CLIP)
    prog = pm.program(rank)
    out = train_program(prog, _batches(), _opt(prog.parameters()))
    out["dtypes"] = {p.dtype for p in prog.parameters()} | {prog.grad_buffer.data.dtype}
    return out


trained = cases_fixture({2: [(m, ["f64"]) for m in MESHES]}, _run)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_float64_trains_like_one_process(trained, mesh):
    ref = reference_training(make("llama").double(), _batches(), _opt, clip_grad=CLIP)
    assert min(ref["norms"]) > CLIP, ref["norms"]
    for rank, got in enumerate(ranks_of(trained, mesh, "f64")):
        assert got["dtypes"] == {torch.float64}
        assert max(abs(a - b) for a, b in zip(got["norms"], ref["norms"])) < 1e-13, (rank, got["norms"], ref["norms"])
        assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) < 1e-13, (rank, got["losses"])
        assert max_abs_diff(got["grads"], ref["grads"])[0] < 1e-14
        assert max_abs_diff(got["state"], {k: v for k, v in ref["state"].items() if k in got["state"]})[0] < 1e-12


def test_a_sequence_longer_than_the_model_takes_is_refused_at_the_step():
    for name, limit, why in (("gpt", 128, "the position table wpe.weight has 128 rows"),
                             ("llama", 64, "buffer rope_cos is cut to the sequence from 64 positions")):
        prog = fxtron.parallelize(make(name), fxtron.Mesh(1), example_inputs=batch(name, 2, 8, 0)[0]).program(0)
        opt = _opt(prog.parameters())
        with pytest.raises(fxtron.ParallelizeError, match=f"{limit + 8} tokens .*longer than the model takes: {why}; "
                                                          f"use at most {limit} tokens"):
            prog.train_step(batch(name, 2, limit + 8, 0)[0], opt)
        assert prog.train_step(batch(name, 2, limit, 0)[0], opt) > 0        # the longest it takes runs
    # a model whose positions are computed (transformers' rotary) sets no limit
    from fxtron.compiler.trace import trace
    from fxtron.passes.limits import seq_limit
    args, kwargs = batch("hf-llama", 2, 8, 0)
    assert seq_limit(trace(make("hf-llama"), args, example_kwargs=kwargs)) is None


def test_the_step_checks_every_batch_after_a_good_one():
    """The step remembers the input shapes that passed (the checks' text is built only on a
    failure) and reads each id input's range with one reduction: after good steps, a batch of
    another dtype, of disagreeing dims, or with an id out of range is still refused, ignored
    targets (-100) still pass, and a new batch shape that is good runs."""
    prog = fxtron.parallelize(make("gpt"), fxtron.Mesh(1), example_inputs=batch("gpt", 2, 8, 0)[0]).program(0)
    opt = _opt(prog.parameters())
    x, y = batch("gpt", 2, 8, 0)[0]
    for _ in range(2):
        assert prog.train_step((x, y), opt) > 0
    with pytest.raises(fxtron.ParallelizeError, match=r"is torch\.int32, but the model was traced with torch\.int64"):
        prog.train_step((x.int(), y), opt)
    with pytest.raises(fxtron.ParallelizeError, match=r"dim 1 of input 1 of shape \(2, 7\) is 7, but dim 1 of input 0 is 8"):
        prog.train_step((x, y[:, :-1]), opt)
    bad = x.clone()
    bad[1, 3] = 256
    with pytest.raises(fxtron.ParallelizeError, match=r"input 0 of shape \(2, 8\) holds the id 256 at \(1, 3\)"):
        prog.train_step((bad, y), opt)
    bad = y.clone()
    bad[0, 0] = -7
    with pytest.raises(fxtron.ParallelizeError, match=r"input 1 .* holds the id -7 at \(0, 0\)"):
        prog.train_step((x, bad), opt)
    ignored = y.clone()
    ignored[:, -2:] = -100
    assert prog.train_step((x, ignored), opt) > 0
    x4, y4 = batch("gpt", 4, 16, 1)[0]
    assert prog.train_step((x4, y4), opt) > 0
    bad = x4.clone()
    bad[3, 15] = -1
    with pytest.raises(fxtron.ParallelizeError, match=r"holds the id -1 at \(3, 15\)"):
        prog.train_step((bad, y4), opt)


# ------------------------------------------------------------------------------ ids outside the vocabulary
def test_vocab_parallel_ops_refuse_ids_outside_the_vocabulary():
    """One process's embedding and cross entropy raise an IndexError on an id outside [0, V);
    a vocabulary split over ranks masks it on every rank (a zero row, a target of logit 0) and
    trained on silently. The ops now refuse it, naming the id, where it is and the bound."""
    from fxtron.ops import vocab
    w, lg = torch.randn(8, 4), torch.randn(2, 3, 8)
    ids = torch.tensor([[1, 2, 3], [4, 8, 0]])
    with pytest.raises(fxtron.ParallelizeError, match=r"token id 8 at index \(1, 1\) is outside the vocabulary \[0, 8\)"):
        torch.ops.fxtron.vocab_parallel_embedding(w, ids, 0, -1, 8)
    ids[1, 1] = -1
    with pytest.raises(fxtron.ParallelizeError, match=r"token id -1 .* \[0, 8\)"):
        torch.ops.fxtron.vocab_parallel_embedding(w, ids, 0, -1, 8)
    ids[1, 1] = 7
    assert torch.equal(torch.ops.fxtron.vocab_parallel_embedding(w, ids, 0, -1, 8), torch.nn.functional.embedding(ids, w))
    target = torch.tensor([[1, 2, -100], [4, 5, 0]])       # ignore_index passes
    got = vocab.vocab_parallel_cross_entropy(lg, target, 0, -100, 1, 0.0, "")
    assert torch.allclose(got, torch.nn.functional.cross_entropy(lg.flatten(0, 1), target.flatten()))
    target[0, 0] = 9
    with pytest.raises(fxtron.ParallelizeError, match=r"target 9 at index \(0, 0\) .* \[0, 8\) .*not ignore_index=-100"):
        vocab.vocab_parallel_cross_entropy(lg, target, 0, -100, 1, 0.0, "")


class ShiftedIds(torch.nn.Module):
    """Looks up idx + 1 and predicts targets + 1: ids the model computes, which the step's check
    of its inputs (runtime/batch.py: ids that reach a table or a loss unchanged) does not see."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 16)
        self.head = torch.nn.Linear(16, 64)

    def forward(self, idx, targets):
        logits = self.head(self.emb(idx + 1))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), (targets + 1).flatten())


def _out_of_vocab(rank, mesh, case):
    """tp=2, the vocabulary of 64 split in two: ids 0..62 run; an input id 63 (looked up as 64),
    then a target 63 (its 12th when flattened), each a step."""
    torch.manual_seed(0)
    ids = torch.randint(0, 63, (2, 9))
    pm = fxtron.parallelize(ShiftedIds(), mesh, example_inputs=(ids[:, :-1], ids[:, 1:]),
                            plan={"emb": "vocab", "head": "colwise"})
    prog = pm.program(rank)
    opt = _opt(prog.parameters())
    out = {"ok": prog.train_step((ids[:, :-1], ids[:, 1:]), opt)}
    for what, i in (("input", 0), ("target", 1)):
        args = [ids[:, :-1].clone(), ids[:, 1:].clone()]
        args[i][1, 3] = 63
        try:
            prog.train_step(tuple(args), opt)
            out[what] = None
        except fxtron.ParallelizeError as e:
            out[what] = str(e)
    out["graph"] = " ".join(str(n.target) for n in pm.compiled(rank).gm.graph.nodes)
    return out


vocab_job = cases_fixture({2: [(fxtron.Mesh(2, tp=2), ["out-of-vocab"])]}, _out_of_vocab)


def test_computed_ids_outside_the_vocabulary_are_an_error_at_tp2(vocab_job):
    for got in ranks_of(vocab_job, fxtron.Mesh(2, tp=2), "out-of-vocab"):
        assert "vocab_parallel_embedding" in got["graph"] and "vocab_parallel_cross_entropy" in got["graph"]
        assert got["ok"] > 0
        assert got["input"] and "token id 64 at index (1, 3) is outside the vocabulary [0, 64)" in got["input"], got
        assert got["target"] and "target 64 at index (11,) is outside the vocabulary [0, 64)" in got["target"], got


def _per_rank(rank, mesh, case):
    args = batch("gpt", 4, 8, 0)[0]
    prog = fxtron.parallelize(make("gpt"), mesh, example_inputs=args).program(rank)
    opt = torch.optim.SGD(prog.parameters(), lr=0.1)
    out = {}
    try:                                      # each rank its own batch: a DistributedSampler's habit
        prog.train_step(batch("gpt", 4, 8, seed=rank)[0], opt)
        out["own"] = None
    except fxtron.ParallelizeError as e:
        out["own"] = str(e)
    out["same"] = prog.train_step(args, opt)  # then the same global batch on both: the step runs
    return out


per_rank_job = cases_fixture({2: [(fxtron.Mesh(2), ["per-rank"]), (fxtron.Mesh(2, tp=2), ["per-rank"])]}, _per_rank)


@pytest.mark.slow
@pytest.mark.parametrize("mesh, group", [(fxtron.Mesh(2), "dp"), (fxtron.Mesh(2, tp=2), "tp")], ids=["dp2", "tp2"])
def test_ranks_given_different_batches_are_refused_at_the_first_step(per_rank_job, mesh, group):
    """Each rank its own batch trained silently on pieces of both (tp=2: a loss of 5.5977 where
    the two batches' are 5.5649 and 5.5541); every rank now says so, naming the group, before
    anything of the step runs."""
    for got in ranks_of(per_rank_job, mesh, "per-rank"):
        assert got["own"] and got["own"].startswith(f"the ranks of group {group} (ranks 0, 1) were given different "
                                                    "batches: every rank passes the same global batch"), got
        assert got["same"] > 0


def test_a_batch_fingerprint_is_its_contents_by_place():
    from fxtron.runtime.batch import fingerprint
    ids = torch.randint(0, 64, (4, 9))
    ids[0, :2] = torch.tensor([1, 2])
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    base = fingerprint(((ids, x), {"mask": ids > 3}))
    assert torch.equal(base, fingerprint(((ids.clone(), x.clone()), {"mask": ids > 3})))
    swapped = ids.clone()
    swapped[0, :2] = torch.tensor([2, 1])                  # two ids changed places: the same sum, another print
    assert not torch.equal(base, fingerprint(((swapped, x), {"mask": ids > 3})))
    y = x.clone()
    y[3, 7] = -y[3, 7] if y[3, 7] != 0 else 1.0
    assert not torch.equal(base, fingerprint(((ids, y), {"mask": ids > 3})))
    assert not torch.equal(base, fingerprint(((ids[:, :8], x), {"mask": ids > 3})))      # another shape


def test_a_loss_fn_that_returns_no_scalar_is_refused_at_parallelize():
    """As a model returning a non-scalar is: the first train_step raised autograd's own
    'grad can be implicitly created only for scalar outputs'."""
    x = torch.randn(4, 8)
    with pytest.raises(fxtron.ParallelizeError, match=r"^loss_fn returned a tensor of shape \(.*\), not a scalar loss"):
        fxtron.parallelize(torch.nn.Linear(8, 4), fxtron.Mesh(1), example_inputs=(x,), loss_fn=lambda o: o.mean(-1))
    with pytest.raises(fxtron.ParallelizeError, match="^loss_fn returned tuple, not a scalar loss"):
        fxtron.parallelize(torch.nn.Linear(8, 4), fxtron.Mesh(1), example_inputs=(x,), loss_fn=lambda o: (o.mean(),))


class _Pair(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(8, 4)

    def forward(self, x):
        y = self.w(x)
        return y.pow(2).mean(), y


def test_a_tuple_with_the_loss_first_is_said_so():
    """transformers under return_dict=False returns (loss, logits, ...): the refusal said 'call it
    with targets or labels' to a user who had; it names the scalar and the loss_fn that takes it."""
    x = torch.randn(4, 8)
    with pytest.raises(fxtron.ParallelizeError, match=r"returned a tuple \(a scalar, a 2-d tensor\).*"
                                                      r"loss_fn=lambda output: output\[0\]"):
        fxtron.parallelize(_Pair(), fxtron.Mesh(1), example_inputs=(x,))
    pm = fxtron.parallelize(_Pair(), fxtron.Mesh(1), example_inputs=(x,), loss_fn=lambda output: output[0])
    assert pm.program(0) is not None


class _NoGradLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x):
        with torch.no_grad():
            return self.lin(x).pow(2).mean()


@pytest.mark.parametrize("microbatches", [1, 2])
def test_a_loss_without_a_gradient_is_refused_at_the_step(microbatches):
    """autograd's own 'element 0 of tensors does not require grad' said what instead, on the
    plain step and the microbatched (schedule's) one."""
    x = torch.randn(4, 8)
    prog = fxtron.parallelize(_NoGradLoss(), fxtron.Mesh(1), example_inputs=(x,), microbatches=microbatches).program(0)
    with pytest.raises(fxtron.ParallelizeError, match="^the loss carries no gradient to any parameter: the model "
                                                      "computes it under torch.no_grad"):
        prog.train_step((x,), torch.optim.SGD(prog.parameters(), lr=0.1))
    assert prog.eval_step((x,)) > 0


class _Scaled(torch.nn.Module):
    """A loss divided by a count and gated by a flag the caller passes as Python values (as
    transformers' num_items_in_batch may be an int, and output_router_logits is a bool)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(4, 4)

    def forward(self, x, count=1, flag=True):
        loss = self.w(x).pow(2).sum() / count
        return loss * 2 if flag else loss


def test_a_python_value_that_differs_from_the_traced_one_is_refused():
    """torch.export makes a Python input (an int, a bool) a constant of the program. A step given
    another value computed with the traced one without a word: transformers' num_items_in_batch
    passed as an int, 60 at the trace and 30 at the next step, gave gradients half the model's,
    and a Mixtral traced with output_router_logits=True kept adding its aux loss when stepped with
    False. Now each differing value is refused naming the input and both values; the same value,
    or a tensor where the trace had one, trains."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4)
    prog = fxtron.parallelize(_Scaled(), fxtron.Mesh(1), example_inputs=(x,),
                              example_kwargs={"count": 60, "flag": True}).program(0)
    opt = torch.optim.SGD(prog.parameters(), lr=0.1)
    prog.train_step((x,), opt, kwargs={"count": 60, "flag": True})
    with pytest.raises(fxtron.ParallelizeError, match=r"keyword count is 30, but the model was traced with 60: .*"
                                                      r"pass it as a tensor \(torch\.tensor\(30\)\)"):
        prog.train_step((x,), opt, kwargs={"count": 30, "flag": True})
    with pytest.raises(fxtron.ParallelizeError, match=r"keyword flag is False, but the model was traced with True: .*"
                                                      r"parallelize the model again with False"):
        prog.train_step((x,), opt, kwargs={"count": 60, "flag": False})
    with pytest.raises(fxtron.ParallelizeError, match=r"keyword count is a tensor, but the model was traced with the "
                                                      r"Python value 60"):
        prog.train_step((x,), opt, kwargs={"count": torch.tensor(60), "flag": True})
    with pytest.raises(fxtron.ParallelizeError, match=r"positional input 0 is float .*traced with a tensor there"):
        prog.train_step((1.5,), opt, kwargs={"count": 60, "flag": True})
    # a tensor count changes with every step, as the model's own does
    model = _Scaled()
    prog = fxtron.parallelize(model, fxtron.Mesh(1), example_inputs=(x,),
                              example_kwargs={"count": torch.tensor(60.0)}).program(0)
    got = [prog.train_step((x,), torch.optim.SGD(prog.parameters(), lr=0.0), kwargs={"count": torch.tensor(c)})
           for c in (60.0, 30.0)]
    want = [float(model(x, count=torch.tensor(c)).detach()) for c in (60.0, 30.0)]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-6 * max(want), (got, want)


class _Branching(torch.nn.Module):
    """A model whose Python code branches on the sequence length (a long-context code path)."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32)

    def forward(self, ids, labels):
        h = self.emb(ids)
        if ids.shape[1] > 8:
            h = h * 2.0
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def test_a_size_outside_the_range_the_trace_narrowed_is_said_and_refused_when_strict():
    """torch.export guards a Python branch on a size (S >= 9 for the branch taken at S=12) and
    the graph holds that branch alone: a step of 4 tokens computed the long path, 4.0436 where the
    model gives 3.5677, without a word. fxtron cannot tell a branch that changes the math from
    one that does not (transformers' sliding-window masks, built one way or another below and
    above the window, give the same numbers: refusing them stopped Mistral and Gemma stepping
    past the window of a short example), so a size outside the narrowed range is a
    ParallelizeWarning naming the input, the size and the range, once per side; strict=True
    refuses it. Sizes inside train as the model does."""
    import warnings

    from fxtron.core import meta
    torch.manual_seed(0)
    model = _Branching()
    g = torch.Generator().manual_seed(0)
    ex = torch.randint(0, 32, (4, 12), generator=g)
    pm = fxtron.parallelize(model, fxtron.Mesh(1), example_inputs=(ex, ex))
    assert meta.info(pm.traced).ranges == {meta.SEQ: (9, None)}, meta.info(pm.traced).ranges
    prog = pm.program(0)
    opt = torch.optim.SGD(prog.parameters(), lr=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxtron.ParallelizeWarning)
        for s in (12, 9, 20):
            x = torch.randint(0, 32, (4, s), generator=g)
            got, want = prog.train_step((x, x), opt), float(model(x, x).detach())
            assert abs(got - want) < 1e-6 * want, (s, got, want)
    x = torch.randint(0, 32, (4, 4), generator=g)
    said = r"dim 1 of input 0 of shape \(4, 4\) is 4, but the program holds the model traced for a sequence length >= 9"
    with pytest.warns(fxtron.ParallelizeWarning, match=said):
        prog.train_step((x, x), opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxtron.ParallelizeWarning)
        prog.train_step((x, x), opt)               # once per side of the range
    strict = fxtron.parallelize(_Branching(), fxtron.Mesh(1), example_inputs=(ex, ex), strict=True).program(0)
    with pytest.raises(fxtron.ParallelizeError, match=said + r".*parallelize with an example of length 4"):
        strict.train_step((x, x), torch.optim.SGD(strict.parameters(), lr=0.0))


def test_an_input_that_broadcasts_over_the_batch_is_not_split():
    """transformers takes position_ids of shape (1, S), broadcast over the batch. Under dp=2 the
    step refused it ("global batch 1 ... not divisible by dp=2", the real batch being 4), and so
    did microbatches. An input whose batch dim was 1 in the trace, where the others had the
    batch, and is 1 at the step, now goes whole to every rank and microbatch, which broadcast it
    as the whole batch does (the reviewer's Llama at dp=2 and pp=2: losses within 4.8e-7)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids, "position_ids": torch.arange(16)[None]}
    from fxtron.core.meta import info
    from fxtron.runtime.batch import BatchSlicer
    traced = info(fxtron.parallelize(model, fxtron.Mesh(2), example_kwargs=batch).traced)
    _, kw = BatchSlicer(traced, dp=2, dp_index=1, microbatches=1, device=None).local((), batch)
    assert torch.equal(kw["input_ids"], ids[2:]) and torch.equal(kw["position_ids"], batch["position_ids"])
    pieces = BatchSlicer(traced, dp=1, dp_index=0, microbatches=2, device=None).microbatches((), batch)
    assert [[tuple(t.shape) for t in mb] for mb in pieces] == [[(2, 16), (2, 16), (1, 16)]] * 2, pieces
    assert torch.equal(pieces[1][0], ids[2:])
