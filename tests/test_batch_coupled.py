"""Math across the batch dim computed over the global batch, or an error (issue 49 item 2).

BatchNorm in training normalizes with the mean and variance of the batch it sees: one process
sees the global batch, a data-parallel rank only its slice. passes/statistics.py writes each
training batch norm out with its statistics averaged over the dp ranks (fxtron::batch_all_reduce,
whose backward sums the gradient: SyncBatchNorm's math) and the running statistics updated from
those global values, the same on every rank. Held to one process on the global batch over three
AdamW steps: an MLP with BatchNorm1d, a conv net with BatchNorm2d, a BatchNorm1d over (B, D, T)
tokens with a symbolic sequence, at dp=2, dp=2 with zero=1, dp=2 x tp=2 (the norm's channels
split over tp too) and dp=2 x cp=2 (the sequence split: the means over it sum over cp first);
losses within 2e-6, first-step gradients within 1e-6, weights and running statistics within
1e-5 of one process, running statistics bitwise equal on every rank. A stack of four
linear-norm blocks cut into pipeline stages (pp=2, and dp=2 x pp=2) updates each norm's running
statistics and batch count on the stage holding it, once a step (the count's add_ is fed by no
activation: it was left out of every stage, and the counts stayed where they were). The fast
tier trains the MLP and CLIP at dp=2, the control and the stack at pp=2; the rest is marked slow.

A contrastive loss over in-batch negatives gathers them over dp (CLIP's way): an InfoNCE loss
(q @ k.T / t against arange(B)) at dp=2 and dp=2 with zero=1, CLIP's symmetric loss at dp=2 and
dp=4, and with q and k split over tp=2 (colwise), within the same bounds of one process on the
global batch.

What fxtron cannot make global is a ParallelizeError naming the op and its module, found on the
graph by shapes (not model names): a (B, B) similarity used otherwise (a logsumexp over its
columns), a softmax over the batch dim, in-batch negatives or a batch norm when microbatches
split the batch (no rank ever holds the global batch). A model without any of these gets nothing
added (the control: no collective in its graph).
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import fxtron
from fxtron.core import meta
from fxtron.tools.testing import (adamw, assert_trains_like, cases_fixture, max_abs_diff, ranks_of, reference_training,
                                  run_on_ranks, train_program)

_opt = adamw()
BN_KEYS = ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked")


# ------------------------------------------------------------------------------ models and data
class BNMLP(torch.nn.Module):
    """Linear (no bias: the norm removes it), BatchNorm1d, ReLU, a head, a mean cross entropy."""

    def __init__(self, bn: bool = True):
        super().__init__()
        self.l1 = torch.nn.Linear(8, 16, bias=not bn)
        self.bn = torch.nn.BatchNorm1d(16) if bn else torch.nn.Identity()
        self.l2 = torch.nn.Linear(16, 4)

    def forward(self, x, y):
        return F.cross_entropy(self.l2(torch.relu(self.bn(self.l1(x)))), y)


class BNConv(torch.nn.Module):
    """Conv2d, BatchNorm2d (statistics over the batch and both spatial dims), pooled, a head."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, bias=False)
        self.bn = torch.nn.BatchNorm2d(8, momentum=0.3)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x, y):
        h = torch.relu(self.bn(self.conv(x)))
        return F.cross_entropy(self.head(h.mean((2, 3))), y)


class BNSeq(torch.nn.Module):
    """Tokens embedded, a BatchNorm1d over (B, D, T) (statistics over the batch and the symbolic
    sequence), an MLP and a head over a vocabulary."""

    def __init__(self, vocab: int = 64, dim: int = 16):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.bn = torch.nn.BatchNorm1d(dim)
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.down = torch.nn.Linear(4 * dim, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, idx, targets):
        h = self.bn(self.emb(idx).transpose(1, 2)).transpose(1, 2)
        h = h + self.down(F.gelu(self.up(h)))
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


class BNBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(8, 8, bias=False)
        self.bn = torch.nn.BatchNorm1d(8)

    def forward(self, x):
        return torch.relu(self.bn(self.l(x)))


class BNStack(torch.nn.Module):
    """Four blocks of linear, BatchNorm1d, ReLU (pipeline stages cut between them) and a head."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(BNBlock() for _ in range(4))
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x, y):
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x), y)


class Similarity(torch.nn.Module):
    def forward(self, q, k):
        return q @ k.T / 0.1


class InfoNCE(torch.nn.Module):
    """Two encoders and a contrastive loss over in-batch negatives: sample i's positive is k_i,
    every other sample's k a negative."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.sim = torch.nn.Linear(8, 16), torch.nn.Linear(8, 16), Similarity()

    def forward(self, a, b):
        logits = self.sim(F.normalize(self.q(a), dim=-1), F.normalize(self.k(b), dim=-1))
        return F.cross_entropy(logits, torch.arange(a.shape[0]))


class CLIP(InfoNCE):
    """CLIP's symmetric loss: the transposed similarity against the same targets too."""

    def forward(self, a, b):
        logits = self.sim(F.normalize(self.q(a), dim=-1), F.normalize(self.k(b), dim=-1))
        labels = torch.arange(a.shape[0])
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


class ColumnLoss(InfoNCE):
    """The same similarity, its loss written with a logsumexp over the columns and the diagonal:
    not a cross entropy against arange(B), which fxtron gathers."""

    def forward(self, a, b):
        logits = self.sim(F.normalize(self.q(a), dim=-1), F.normalize(self.k(b), dim=-1))
        return torch.logsumexp(logits, dim=0).mean() - logits.diagonal().mean()


class BatchSoftmax(torch.nn.Module):
    """Per-sample losses weighted by a softmax over the batch (attention over the samples)."""

    def __init__(self):
        super().__init__()
        self.score, self.head = torch.nn.Linear(8, 1), torch.nn.Linear(8, 4)

    def forward(self, x, y):
        w = torch.softmax(self.score(x).squeeze(-1), dim=0)
        return (w * F.cross_entropy(self.head(x), y, reduction="none")).sum()


MODELS = {"mlp": BNMLP, "stack": BNStack, "conv": BNConv, "seq": BNSeq, "plain": lambda: BNMLP(bn=False), "nce": InfoNCE, "clip": CLIP, "columns": ColumnLoss,
          "softmax": BatchSoftmax}


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    m = MODELS[name]()
    for bn in m.modules():
        if isinstance(bn, torch.nn.modules.batchnorm._BatchNorm):
            with torch.no_grad():      # running statistics other than the defaults, as after training
                bn.running_mean.uniform_(-0.5, 0.5)
                bn.running_var.uniform_(0.5, 2.0)
                bn.num_batches_tracked.fill_(7)
    return m


def _data(name: str, steps: int = 3) -> list:
    out = []
    for s in range(steps):
        g = torch.Generator().manual_seed(s)
        if name == "conv":
            x = torch.randn(8, 3, 6, 6, generator=g) * 2 + 0.5
            out.append(((x, torch.randint(0, 4, (8,), generator=g)), {}))
        elif name == "seq":
            ids = torch.randint(0, 64, (8, (9, 5, 9)[s]), generator=g)      # sequences a multiple of 2 x cp
            out.append(((ids[:, :-1].clone(), ids[:, 1:].clone()), {}))
        elif name in ("nce", "clip", "columns"):      # two views of each sample
            out.append(((torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)), {}))
        else:
            out.append(((torch.randn(8, 8, generator=g) * 2 + 0.5, torch.randint(0, 4, (8,), generator=g)), {}))
    return out


def _options(name: str) -> dict:
    return {} if name == "seq" else dict(seq_dim=None)


def _parallelize(name: str, mesh: fxtron.Mesh, **kw) -> fxtron.ParallelModel:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxtron.parallelize(_model(name), mesh, example_inputs=_data(name)[0][0], **_options(name), **kw)


# case key -> (model, world, mesh axes, parallelize options)
CASES = {"mlp-dp2": ("mlp", 2, {}, {}), "conv-dp2": ("conv", 2, {}, {}), "seq-dp2": ("seq", 2, {}, {}),
         "mlp-dp2-zero1": ("mlp", 2, {}, dict(zero=1)), "seq-dp2-tp2": ("seq", 4, dict(tp=2), {}),
         "seq-dp2-cp2": ("seq", 4, dict(cp=2), {}),
         "plain-dp2": ("plain", 2, {}, {}), "nce-dp2": ("nce", 2, {}, {}), "nce-dp2-zero1": ("nce", 2, {}, dict(zero=1)),
         "clip-dp2": ("clip", 2, {}, {}), "clip-dp4": ("clip", 4, {}, {}),
         # the norm's channels split over tp (l1 colwise): each tp rank's channels' statistics over dp
         "mlp-dp2-tp2-split": ("mlp", 4, dict(tp=2), dict(plan={"l1": "colwise", "l2": "rowwise"})),
         "clip-dp2-tp2-split": ("clip", 4, dict(tp=2), dict(plan={"q": "colwise", "k": "colwise"})),
         # pipeline stages, each holding two blocks' norms: their buffers' writes run on their stage
         "stack-pp2": ("stack", 2, dict(pp=2), {}), "stack-dp2-pp2": ("stack", 4, dict(pp=2), {})}


def _mesh(key):
    _, world, axes, _ = CASES[key]
    return fxtron.Mesh(world, **axes)


def _run(rank, mesh, key):
    name, _, _, options = CASES[key]
    pm = _parallelize(name, mesh, **options)
    prog = pm.program(rank)
    out = train_program(prog, _data(name), _opt(prog.parameters()))
    out["graph"] = [str(n.target) for n in pm.compiled(rank).gm.graph.nodes if n.op == "call_function"]
    if rank == 0:
        out["summary"] = pm.summary()
    return out


#: the fast tier's cases (one two-process job); the rest are marked slow
FAST = ("mlp-dp2", "clip-dp2", "plain-dp2", "stack-pp2")


def _jobs(keys):
    jobs: dict[int, list] = {}
    for key in keys:
        jobs.setdefault(CASES[key][1], []).append((_mesh(key), [key]))
    return jobs


def _marks(key):
    return [] if key in FAST else [pytest.mark.slow]


def _results(request, key):
    return ranks_of(request.getfixturevalue("trained" if key in FAST else "trained_slow"), _mesh(key), key)


trained = cases_fixture(lambda: _jobs(FAST), _run)
trained_slow = cases_fixture(lambda: _jobs([k for k in CASES if k not in FAST]), _run)


# ------------------------------------------------------------------------------ against one process
@pytest.mark.parametrize("key", [pytest.param(k, marks=_marks(k)) for k in CASES
                                 if CASES[k][0] not in ("plain", "nce", "clip", "stack")])
def test_batch_norm_trains_over_the_global_batch(request, key):
    name = CASES[key][0]
    ref = reference_training(_model(name), _data(name), _opt)
    ranks = _results(request, key)
    for rank, got in enumerate(ranks):
        worst = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]))
        stats = {k: float((got["state"][k].double() - ref["state"][k].double()).abs().max()) for k in BN_KEYS}
        print(f"{key} rank {rank}: losses {worst:.2e}, running statistics {stats}")
        assert_trains_like(got, ref, rank=rank)       # the state holds the running statistics too
        assert int(got["state"]["bn.num_batches_tracked"]) == 7 + 3
        for k in BN_KEYS:       # every rank the same, bit for bit
            assert torch.equal(got["state"][k], ranks[0]["state"][k]), (rank, k)
    assert sum("batch_all_reduce" in t for t in ranks[0]["graph"]) == 2          # mean, variance
    assert "batch_norm" not in " ".join(ranks[0]["graph"])
    assert "batch norms' mean and variance over every dp rank's samples" in ranks[0]["summary"]
    assert "in bn" in ranks[0]["summary"], ranks[0]["summary"]


@pytest.mark.parametrize("key", [pytest.param(k, marks=_marks(k)) for k in CASES if CASES[k][0] == "stack"])
def test_batch_norms_on_pipeline_stages_update_their_buffers_once_a_step(request, key):
    """Each stage's norms update their running statistics and count their batches (a write of a
    buffer that no activation feeds: num_batches_tracked.add_(1)) on the stage holding them."""
    ref = reference_training(_model("stack"), _data("stack"), _opt)
    for rank, got in enumerate(_results(request, key)):
        for i in range(4):
            k = f"layers.{i}.bn"
            stats = {n: float((got["state"][f"{k}.{n}"].double() - ref["state"][f"{k}.{n}"].double()).abs().max())
                     for n in ("running_mean", "running_var")}
            print(f"{key} rank {rank} {k}: running statistics {stats}")
            assert int(got["state"][f"{k}.num_batches_tracked"]) == 7 + 3, (rank, k)
        assert_trains_like(got, ref, rank=rank)


def test_a_model_without_batch_coupling_is_untouched(trained):
    ranks = ranks_of(trained, _mesh("plain-dp2"), "plain-dp2")
    ref = reference_training(_model("plain"), _data("plain"), _opt)
    for rank, got in enumerate(ranks):
        assert_trains_like(got, ref, rank=rank)
    assert not any("batch_all_reduce" in t for t in ranks[0]["graph"]), ranks[0]["graph"]
    assert "batch norm" not in ranks[0]["summary"]
    # no collective in the graph; the batch norm model's graph all-reduces its two statistics (and their gradients)
    assert _parallelize("plain", fxtron.Mesh(2)).collectives(0, graphs_only=True) == []
    synced = _parallelize("mlp", fxtron.Mesh(2)).collectives(0, graphs_only=True)
    assert len(synced) == 4 and all("batch_all_reduce" in str(c) for c in synced), synced


@pytest.mark.parametrize("key", [pytest.param(k, marks=_marks(k)) for k in CASES if CASES[k][0] in ("nce", "clip")])
def test_in_batch_negatives_are_gathered_over_dp(request, key):
    name, world = CASES[key][:2]
    ref = reference_training(_model(name), _data(name), _opt)
    ranks = _results(request, key)
    for rank, got in enumerate(ranks):
        dg, where = max_abs_diff(got["grads"], ref["grads"])
        print(f"{key} rank {rank}: losses {got['losses']} vs {ref['losses']}, gradients {dg:.2e} ({where})")
        assert_trains_like(got, ref, rank=rank)
    graph = " ".join(ranks[0]["graph"])
    sides = 2 if name == "clip" else 1     # CLIP: k gathered for the rows of q, q for the rows of k
    assert graph.count("batch_gather") == sides and graph.count("batch_offset") == sides, graph
    assert f"in-batch negatives gathered over dp={_mesh(key).dp}" in ranks[0]["summary"] and "in sim" in ranks[0]["summary"]


# ------------------------------------------------------------------------------ without processes
def test_in_batch_negatives_fxtron_cannot_gather_are_an_error_naming_the_op_and_module():
    with pytest.raises(fxtron.ParallelizeError) as e:      # not a cross entropy against arange(B)
        _parallelize("columns", fxtron.Mesh(2)).compiled(0)
    text = str(e.value)
    assert "aten.matmul" in text and "in sim" in text and "(B, B)" in text, text
    assert "dp=1 and microbatches=1" in text, text
    # microbatches: one process holds every microbatch's negatives at once, no rank does
    with pytest.raises(fxtron.ParallelizeError, match="reads across the batch dim"):
        _parallelize("nce", fxtron.Mesh(2), microbatches=2).compiled(0)
    with pytest.raises(fxtron.ParallelizeError, match="reads across the batch dim"):
        _parallelize("nce", fxtron.Mesh(1), microbatches=2).compiled(0)
    _parallelize("columns", fxtron.Mesh(1)).compiled(0)        # one piece: the one-process model


def test_a_softmax_over_the_batch_is_an_error():
    with pytest.raises(fxtron.ParallelizeError) as e:
        _parallelize("softmax", fxtron.Mesh(2)).compiled(0)
    assert "softmax" in str(e.value) and "normalizes along dim [0]" in str(e.value), str(e.value)


def test_batch_norm_over_microbatches_is_an_error():
    for mesh in (fxtron.Mesh(2), fxtron.Mesh(1)):
        with pytest.raises(fxtron.ParallelizeError) as e:
            _parallelize("mlp", mesh, microbatches=2).compiled(0)
        assert "batch norm in training" in str(e.value) and "in bn" in str(e.value), str(e.value)
        assert "microbatches=1" in str(e.value)


class _SumOverB(torch.nn.Module):
    """A mean over the batch written with its size as a Python number (torch.export fixes it at
    the example's: the program then believes every piece of the batch is the whole)."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32)

    def forward(self, x, y):
        return F.cross_entropy(self.head(self.emb(x)).flatten(0, 1), y.flatten(), reduction="sum") / float(x.shape[0])


def test_a_batch_size_the_trace_fixed_is_an_error_when_the_batch_is_cut():
    """dp=2 ran the program traced for 8 rows on each rank's 4: half the loss and gradients,
    without a word; so did microbatches=2 on one rank. One piece: the step refuses another
    batch size, as before."""
    x, y = torch.randint(0, 32, (8, 6)), torch.randint(0, 32, (8, 6))
    for mesh, m in ((fxtron.Mesh(2), 1), (fxtron.Mesh(1), 2)):
        with pytest.raises(fxtron.ParallelizeError, match=r"fixed the batch size at the example's 8 \(input 0, traced "
                                                          r"as \(8, S\)\).*float\(x\.shape\[0\]\).*cut into 2 pieces"):
            fxtron.parallelize(_SumOverB(), mesh, example_inputs=(x, y), microbatches=m)
    prog = fxtron.parallelize(_SumOverB(), fxtron.Mesh(1), example_inputs=(x, y)).program(0)
    with pytest.raises(fxtron.ParallelizeError, match="is 6, but the trace fixed the batch size at the example's 8"):
        prog.train_step((x[:6], y[:6]), torch.optim.SGD(prog.parameters(), lr=0.1))
    # a sequence length read as a number: the step says which dim the trace fixed (it said only the
    # batch and sequence dims may change, of the sequence dim)
    per_token = _SumOverB()
    per_token.forward = lambda x, y: F.cross_entropy(per_token.head(per_token.emb(x)).flatten(0, 1), y.flatten(),
                                                     reduction="sum") / float(x.shape[1])
    prog = fxtron.parallelize(per_token, fxtron.Mesh(1), example_inputs=(x, y)).program(0)
    with pytest.raises(fxtron.ParallelizeError, match=r"dim 1 of input 0 of shape \(8, 4\) is 4, but the trace fixed "
                                                      r"the sequence length at the example's 6"):
        prog.train_step((x[:, :4], y[:, :4]), torch.optim.SGD(prog.parameters(), lr=0.1))


def test_a_float64_batch_norm_corrects_its_running_variance_in_float64():
    """The unbiased correction n / (n - 1) of the global variance is made in the model's dtype
    (it was an fp32 scalar: a float64 model's running_var was 1e-8 off one process at dp=2)."""
    class BN64(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.bn = torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8)

        def forward(self, x, y):
            return (self.bn(self.lin(x)) - y).pow(2).mean()
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    gm = fxtron.parallelize(BN64().double(), fxtron.Mesh(2), example_inputs=(x, y)).compiled(0).gm
    counts = [n for n in gm.graph.nodes if n.target == torch.ops.aten.scalar_tensor.default]
    assert counts and all(n.kwargs["dtype"] == torch.float64 for n in counts), [n.kwargs for n in counts]


class _Regression(torch.nn.Module):
    """A linear head under one of the losses torch reduces by a plain mean or sum."""
    LOSSES = {
        "mse": lambda h, y: F.mse_loss(h, y),
        "mse-sum": lambda h, y: F.mse_loss(h, y, reduction="sum"),
        "l1": lambda h, y: F.l1_loss(h, y),
        "smooth-l1": lambda h, y: F.smooth_l1_loss(h, y, beta=0.5),
        "huber": lambda h, y: F.huber_loss(h, y, delta=0.7),
        "bce-logits": lambda h, y: F.binary_cross_entropy_with_logits(h, (y > 0).to(h.dtype),
                                                                      pos_weight=torch.full((3,), 2.0, dtype=h.dtype)),
        "kl-batchmean": lambda h, y: F.kl_div(F.log_softmax(h, -1), F.softmax(y, -1), reduction="batchmean"),
    }

    def __init__(self, kind: str):
        super().__init__()
        self.kind, self.lin = kind, torch.nn.Linear(4, 3)

    def forward(self, x, y):
        return self.LOSSES[self.kind](self.lin(x), y)


def _regression(kind: str):
    torch.manual_seed(0)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    return _Regression(kind).double(), (x, y)


def _regression_steps(rank, mesh, microbatches):
    out = {}
    for kind in _Regression.LOSSES:
        model, batch = _regression(kind)
        prog = fxtron.parallelize(model, mesh, example_inputs=batch, microbatches=microbatches).program(rank)
        opt = torch.optim.SGD(prog.parameters(), lr=0.1)
        out[kind] = (prog.train_step(batch, opt), prog.full_state_dict())
    return out


@pytest.mark.slow
def test_losses_torch_reduces_by_a_mean_or_sum_are_the_global_batchs():
    """mse, l1, smooth l1, Huber, BCE with logits, KL divergence: were refused at dp=2 and with
    microbatches ("cannot make this op global"); written as their unreduced values and then a
    mean or sum, they train like one process on the global batch (float64: to round-off)."""
    runs = {"dp=2": run_on_ranks(_regression_steps, fxtron.Mesh(2), fxtron.Mesh(2), 1)[0],
            "microbatches=2": _regression_steps(0, fxtron.Mesh(1), 2)}
    for kind in _Regression.LOSSES:
        model, batch = _regression(kind)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(*batch)
        loss.backward()
        opt.step()
        for where, got in runs.items():
            assert abs(got[kind][0] - loss.item()) < 1e-12, (kind, where, got[kind][0], loss.item())
            assert max_abs_diff(got[kind][1], model.state_dict())[0] < 1e-12, (kind, where)


def test_the_verifier_names_a_batch_norm_left_per_rank():
    from fxtron.passes.statistics import check_statistics, find_statistics
    pm = _parallelize("mlp", fxtron.Mesh(2))
    gm = meta.copy_graph(pm.traced)
    for node in find_statistics(gm):      # the loss's mean taken care of: the batch norm left as traced
        meta.set(node, meta.STATISTIC, "as is")
    assert "batch norm in training left on each rank's own samples" in check_statistics(gm)
    assert check_statistics(pm.compiled(0).gm) is None
    report = meta.info(pm.compiled(0).gm).statistics_report
    assert len(report.synced) == 1 and "in bn" in report.synced[0], report


def test_evaluation_keeps_the_running_statistics():
    # the eval graph's batch norm reads its running statistics: nothing across the batch, nothing added
    gm = _parallelize("mlp", fxtron.Mesh(2)).compiled_eval(0).gm
    assert not any(n.target == torch.ops.fxtron.batch_all_reduce.default for n in gm.graph.nodes)
    assert any(n.target == torch.ops.aten.batch_norm.default for n in gm.graph.nodes)
