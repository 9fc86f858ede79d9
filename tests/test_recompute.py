"""Activation recomputation (parallelize(..., recompute="selective" | "full", recompute_method,
recompute_layers)): which regions are marked, the errors a user can cause, and that a run with
recomputation is the run without it, bit for bit.

With processes: one 4-process gloo job trains each case twice, without and with recomputation
(2 AdamW steps, dropout 0.1 wherever the model has dropout, inside the cp ring too, so every recomputed dropout must
draw its first masks again): tp x pp with sequence parallel and 1F1B, ZB-H1 and the interleaved
schedule, tp x dp with transformers' written-out attention, cp x tp (attention over gathered keys, and the ring),
ep x tp (the all-to-alls run again). Losses, the first step's gradients (gathered) and the
final weights must be equal (torch.equal: the same ops on the same values), and the peak of
the bytes saved for backward lower. The runs without recomputation are the configurations the
other modules hold to the unmodified model.
"""
from __future__ import annotations

import pytest
import torch

import fxtron
from fxtron.tools.activations import peak_saved_bytes, saved_bytes
from fxtron.core import meta
from fxtron.models.moe import MoEConfig, MoETransformer
from fxtron.ops.rng import rng_call
from fxtron.passes.recompute import region_labels
from fxtron.tools.testing import adamw, assert_trains_like, cases_fixture, ranks_of, reference_training, train_program
from tp_models import batch, batches, make

DROPOUT = 0.1


def _model(name: str, layers: int = 2):
    if name == "moe":
        torch.manual_seed(0)
        return MoETransformer(MoEConfig(vocab_size=128, max_seq_len=64, n_layer=2, n_head=4, n_kv_head=2, dim=32,
                                        ffn_dim=48, n_experts=4, top_k=2, shared_ffn_dim=32, aux_loss_coef=0.05))
    if name in ("gpt", "llama", "hf-gpt2-eager"):
        return make(name, dropout=DROPOUT, layers=layers)
    return make(name.removesuffix("-p0"), layers=layers)


def _data(name: str) -> str:
    """The tp_models name whose batches `name` trains on."""
    return {"moe": "nanogpt", "llama-p0": "llama"}.get(name, name)   # nanogpt: ids < 64


def _batch(name: str, b: int, s: int, seed: int):
    return batch(_data(name), b, s, seed)


def _graphs(pm, rank=0):
    return pm.compiled(rank).graphs


# ----------------------------------------------------------------------------- the pass
@pytest.mark.parametrize("name,per_layer", [("gpt", ["scaled_dot_product_attention"]),
                                            ("nanogpt", ["matmul", "softmax", "matmul"]),
                                            ("hf-gpt2-eager", ["matmul", "softmax", "dropout", "matmul"])])
def test_selective_marks_each_attention_core(name, per_layer):
    args, kwargs = _batch(name, 2, 8, 0)
    pm = fxtron.parallelize(_model(name), fxtron.Mesh(1), example_inputs=args, example_kwargs=kwargs,
                            recompute="selective")
    (gm,) = _graphs(pm)
    labels = region_labels(gm)
    assert len(labels) == 2, labels                                 # one core per layer
    for label in labels:
        ops = [str(n.args[1] if n.target is rng_call else n.target) for n in gm.graph.nodes
               if meta.get(n, meta.RECOMPUTE) == label]
        rest = ops
        for op in per_layer:                                        # in order, among the region's ops
            i = next(k for k, o in enumerate(rest) if op in o)
            rest = rest[i + 1:]
        # the region's inputs are q, k, v (and masks, constants): nothing of the layer before the scores
        assert not any("linear" in o or "layer_norm" in o for o in ops), ops
    assert "recompute selective" in pm.summary()


def test_full_marks_layers_uniform_and_block():
    args, _ = _batch("gpt", 2, 8, 0)
    model = _model("gpt", layers=4)
    for kw, want in [(dict(), ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]),
                     (dict(recompute_layers=2), ["blocks.0..1", "blocks.2..3"]),
                     (dict(recompute_layers=3), ["blocks.0..2", "blocks.3"]),
                     (dict(recompute_method="block", recompute_layers=3), ["blocks.0", "blocks.1", "blocks.2"])]:
        pm = fxtron.parallelize(model, fxtron.Mesh(1), example_inputs=args, recompute="full", **kw)
        assert region_labels(_graphs(pm)[0]) == want
    # block under pp: the first layer of each stage (Megatron counts per pipeline rank)
    pm = fxtron.parallelize(model, fxtron.Mesh(2, pp=2), example_inputs=args, microbatches=2, recompute="full",
                            recompute_method="block", recompute_layers=1)
    assert [region_labels(g) for r in (0, 1) for g in _graphs(pm, r)] == [["blocks.0"], ["blocks.2"]]
    assert "pp rank 1: blocks.2" in pm.summary()
    # the per-rank graph shows each node's region
    rows = pm.graph(1).splitlines()
    assert rows[1].split()[-1] == "recompute"
    assert any("blocks.2.attn.qkv" in r and r.split()[-2:] == ["blocks.2.attn.qkv", "blocks.2"] for r in rows), rows


@pytest.mark.parametrize("kw,msg", [(dict(recompute="everything"), "recompute must be one of"),
                                    (dict(recompute="selective", recompute_layers=2), "belong to recompute='full'"),
                                    (dict(recompute="full", recompute_layers=0), "recompute_layers must be a positive int"),
                                    (dict(recompute="full", recompute_method="blocks"), "recompute_method must be"),
                                    (dict(recompute_layers=2), "need recompute='full'")])
def test_bad_options_name_what_to_change(kw, msg):
    args, _ = _batch("gpt", 2, 8, 0)
    with pytest.raises(fxtron.ParallelizeError, match=msg):
        fxtron.parallelize(_model("gpt"), fxtron.Mesh(1), example_inputs=args, **kw)


def test_full_needs_layers():
    args, _ = _batch("cumsum-mlp", 2, 8, 0)
    pm = fxtron.parallelize(make("cumsum-mlp"), fxtron.Mesh(1), example_inputs=args, recompute="full")
    with pytest.raises(fxtron.ParallelizeError, match="recomputes whole transformer layers"):
        pm.program(0)


_opt = adamw(eps=1e-6, weight_decay=0.01)


def _saved_peak(prog, steps):
    """(losses, first step's gradients, final weights, peak bytes saved for backward over the steps)."""
    opt = _opt(prog.parameters())
    losses, grads, peak = [], None, 0
    prog.track_memory = True
    for step, (args, kwargs) in enumerate(steps):
        losses.append(prog.train_step(args, opt, kwargs=kwargs))
        peak = max(peak, max(m.activations for m in prog.memory_timeline()))
        if step == 0:
            grads = prog.full_grads()
    return losses, grads, prog.full_state_dict(), peak


@pytest.mark.parametrize("kw", [dict(recompute="selective"), dict(recompute="full"),
                                dict(recompute="full", recompute_layers=2),
                                dict(recompute="full", recompute_method="block", recompute_layers=1)],
                         ids=["selective", "full", "full-uniform2", "full-block1"])
def test_one_process_equals_the_run_without(kw):
    steps = batches("gpt", 4, [16, 16], seed=10)
    args, _ = steps[0]
    base = _saved_peak(fxtron.parallelize(_model("gpt", 4), fxtron.Mesh(1), example_inputs=args).program(0), steps)
    got = _saved_peak(fxtron.parallelize(_model("gpt", 4), fxtron.Mesh(1), example_inputs=args, **kw).program(0), steps)
    _assert_equal(base, got, str(kw))


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_one_process_equals_the_unmodified_model(recompute):
    """Without dropout, a recomputed program trains as the unmodified model in one process does
    (Llama, written-out attention of transformers' GPT-2: losses, first-step gradients, weights)."""
    for name in ("llama", "hf-gpt2-eager"):
        steps = batches(name, 4, [16, 8], seed=10)
        args, kwargs = _batch(name, 2, 8, 0)
        pm = fxtron.parallelize(make(name), fxtron.Mesh(1), example_inputs=args, example_kwargs=kwargs,
                                recompute=recompute)
        assert region_labels(pm.compiled(0).graphs[0])
        prog = pm.program(0)
        got = train_program(prog, steps, _opt(prog.parameters()))
        assert_trains_like(got, reference_training(make(name), steps, _opt))


def _assert_equal(base, got, where):
    assert base[0] == got[0], (where, base[0], got[0])
    for k in base[1]:
        assert torch.equal(base[1][k], got[1][k]), f"{where}: gradient of {k} differs by {(base[1][k] - got[1][k]).abs().max()}"
    for k in base[2]:
        assert torch.equal(base[2][k], got[2][k]), f"{where}: {k} differs after the steps"
    assert got[3] < base[3], (where, got[3], base[3])


# ----------------------------------------------------------------------------- with processes
# key -> (model, mesh axes, options, recompute options)
CASES = {
    "tp2-pp2-sp-1f1b-full": ("gpt", dict(tp=2, pp=2), dict(microbatches=2, sequence_parallel=True), dict(recompute="full")),
    "tp2-pp2-zb-selective": ("llama", dict(tp=2, pp=2), dict(microbatches=2, schedule="zb-h1"), dict(recompute="selective")),
    "tp2-pp2-interleaved-block": ("gpt", dict(tp=2, pp=2), dict(microbatches=2, schedule="interleaved", virtual_stages=2),
                                  dict(recompute="full", recompute_method="block", recompute_layers=1)),
    "tp2-dp2-eager-selective": ("hf-gpt2-eager", dict(tp=2), dict(sequence_parallel=True), dict(recompute="selective")),
    # the gathered keys' attention draws its dropout inside (from the stream it is told)
    "cp2-tp2-gather-selective": ("llama", dict(cp=2, tp=2), dict(cp_comm_type="all_gather"), dict(recompute="selective")),
    # Ulysses: the attention of the rank's heads draws its dropout again from where it began
    "cp2-tp2-a2a-selective": ("llama", dict(cp=2, tp=2), dict(cp_comm_type="a2a"), dict(recompute="selective")),
    # the ring (no attention dropout: it takes none) sends its key blocks around again in backward
    "cp2-tp2-ring-full": ("llama-p0", dict(cp=2, tp=2), {}, dict(recompute="full")),
    # ... and with attention dropout inside the ring: each block's mask drawn again from the seed
    # the recomputed ring draws where the first one did
    "cp2-ring-dropout-selective": ("llama", dict(cp=2), {}, dict(recompute="selective")),
    # a2a+p2p: the all-to-alls and the ring of the groups (with dropout) run again in the recomputed forward
    "cp4-a2a+p2p-full": ("llama", dict(cp=4), dict(cp_comm_type="a2a+p2p", cp_a2a_size=2), dict(recompute="full")),
    "ep2-tp2-sp-full": ("moe", dict(ep=2, tp=2), dict(sequence_parallel=True), dict(recompute="full")),
}
LAYERS = {"tp2-pp2-interleaved-block": 4, "tp2-pp2-sp-1f1b-full": 4}


def _run(rank, mesh, key):
    import warnings
    name, _, kw, rc = CASES[key]
    layers = LAYERS.get(key, 2)
    steps = batches(_data(name), 4, [16, 8], seed=10)
    args, kwargs = _batch(name, 2, 8, 0)
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fxtron.ParallelizeWarning)     # what the configurations warn of, tested elsewhere
        for extra in ({}, rc):
            pm = fxtron.parallelize(_model(name, layers), mesh, example_inputs=args, example_kwargs=kwargs, **kw, **extra)
            out.append((*_saved_peak(pm.program(rank), steps), _estimate(pm, rank, steps)))
    return out


def _estimate(pm, rank, steps):
    """inspect's estimate of the peak saved for backward over `steps` (tools/activations.py: the
    rank's graphs run on fake tensors), or None where it cannot run (expert parallel's
    data-dependent dispatch)."""
    ids = [next(t for t in (*a, *k.values()) if isinstance(t, torch.Tensor)) for a, k in steps]
    b = ids[0].shape[0] // (pm.mesh.dp * pm.config.pipeline.microbatches)
    seq = max(t.shape[1] for t in ids)
    try:
        return peak_saved_bytes(pm, rank, saved_bytes(pm, rank, b, seq))
    except fxtron.ParallelizeError:
        return None


def _jobs():
    by_mesh: dict[str, tuple] = {}
    for key, (_, axes, _, _) in CASES.items():
        mesh = fxtron.Mesh(4, **axes)
        by_mesh.setdefault(str(mesh), (mesh, []))[1].append(key)
    return {4: list(by_mesh.values())}


results = cases_fixture(_jobs, _run, timeout_s=900)


@pytest.mark.slow
@pytest.mark.parametrize("key", list(CASES))
def test_recomputation_changes_no_number(results, key):
    mesh = fxtron.Mesh(4, **CASES[key][1])
    for rank, (base, got) in enumerate(ranks_of(results, mesh, key)):
        _assert_equal(base, got, f"{key} rank {rank}")


@pytest.mark.slow
@pytest.mark.parametrize("key", list(CASES))
def test_activation_estimate_is_the_trackers(results, key):
    """What inspect says autograd keeps (tools/activations.py, no processes) is within 10% of what the
    runtime's tracker measured at the peak of each rank's steps, with and without recomputation
    (tp with sp, pp under 1F1B, ZB-H1 (what a deferred W pass keeps from B) and the interleaved
    schedule, cp by gather, ring, a2a and a2a+p2p, transformers' GPT-2, ep x tp: its dispatch estimated
    under uniform routing, which the trained router is close to)."""
    mesh = fxtron.Mesh(4, **CASES[key][1])
    for rank, runs in enumerate(ranks_of(results, mesh, key)):
        for run, got in zip(("without", "with"), runs):
            assert abs(got[4] / got[3] - 1) <= 0.10, (key, rank, run, got[4], got[3])


def test_selective_without_attention_warns_and_strict_refuses():
    args, _ = _batch("cumsum-mlp", 2, 8, 0)
    pm = fxtron.parallelize(make("cumsum-mlp"), fxtron.Mesh(1), example_inputs=args, recompute="selective")
    with pytest.warns(fxtron.ParallelizeWarning, match="found no attention core"):
        pm.compiled(0)
    pm = fxtron.parallelize(make("cumsum-mlp"), fxtron.Mesh(1), example_inputs=args, recompute="selective", strict=True)
    with pytest.raises(fxtron.ParallelizeError, match="found no attention core"):
        pm.compiled(0)


def test_recomputed_collectives_are_counted_twice():
    """A recomputed layer's forward collectives run again in backward: pm.collectives says so
    (tp=2, GPT: 2 all-reduces a layer forward; full recomputation adds them to backward)."""
    args, _ = _batch("gpt", 2, 8, 0)
    def count(**kw):
        recs = fxtron.parallelize(_model("gpt"), fxtron.Mesh(2, tp=2), example_inputs=args, **kw).collectives(0)
        return {(r.kind, r.phase): sum(1 for q in recs if (q.kind, q.phase) == (r.kind, r.phase)) for r in recs}
    plain, full, selective = count(), count(recompute="full"), count(recompute="selective")
    assert full[("all_reduce", "forward")] == plain[("all_reduce", "forward")]
    assert full[("all_reduce", "backward")] == plain[("all_reduce", "backward")] + 2 * 2
    assert selective == plain                      # the attention core communicates nothing


def _one_step(name, **kw):
    args, kwargs = _batch(name, 2, 8, 0)
    pm = fxtron.parallelize(make(name), fxtron.Mesh(1), example_inputs=args, example_kwargs=kwargs, **kw)
    prog = pm.program(0)
    a, k = _batch(name, 4, 16, 1)
    loss = prog.train_step(a, torch.optim.SGD(prog.parameters(), lr=0.0), kwargs=k)
    return loss, prog.full_grads(), region_labels(pm.compiled(0).graphs[0])


@pytest.mark.parametrize("name", ["hf-gemma2", "hf-bloom", "hf-deepseekv3"])
def test_transformers_attention_variants(name):
    """Softcapped scores (Gemma 2: tanh between the matmul and the softmax), ALiBi scores from
    baddbmm (BLOOM), multi-latent attention with experts (DeepSeek-V3): one core a layer found,
    and both granularities equal the run without, bit for bit (all 25 transformers families of
    tests/tp_models.ZOO were checked so once; these three are the shapes the others repeat)."""
    loss, grads, _ = _one_step(name)
    for rc in ("selective", "full"):
        got_loss, got, labels = _one_step(name, recompute=rc)
        assert len(labels) == 2, labels
        assert got_loss == loss and all(torch.equal(grads[k], got[k]) for k in grads), rc


@pytest.mark.slow
def test_recomputed_ring_trains_as_the_unmodified_model(results):
    """The case without dropout (cp x tp, the ring recomputed): against one process as well."""
    key = "cp2-tp2-ring-full"
    name, axes = CASES[key][0], CASES[key][1]
    steps = batches(_data(name), 4, [16, 8], seed=10)
    ref = reference_training(_model(name), steps, _opt)
    for rank, (_, got) in enumerate(ranks_of(results, fxtron.Mesh(4, **axes), key)):
        assert_trains_like({"losses": got[0], "grads": got[1], "state": got[2]}, ref, rank=rank)
