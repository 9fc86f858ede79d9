"""The shipped mixture-of-experts model (fxtron/models/moe.py; issue: expert parallel, item 1).

Without processes: the grouped GEMM op against a loop of per-expert matmuls in float64 (forward
and both gradients, groups of zero rows included, rows past the last offset zero), the MoE
layer against a token-by-token reference (router softmax, top-k renormalised, SwiGLU experts,
shared expert), the Switch loss against its formula (1 under uniform routing), the model
exported with symbolic batch and sequence, and the presets built on meta.

Then one gloo job trains two AdamW steps equal to one process: tp=2 (experts' gate/up split by
columns and down by rows, the router whole, no op run replicated), tp=2 with sequence
parallel, pp=2 (the layers' summed aux loss crossing the stage boundary as one scalar) and
dp=2, whose load-balancing statistics are the global batch's (summed over dp, per microbatch):
the reference trains the whole batch (as its microbatches where the case has them). With
moe_aux_loss='local' (Megatron's default, opt-in) the loss is the mean over the dp ranks of each
rank's own: the reference trains the dp ranks' pieces as microbatches.
Expert parallel (the pass that finds each MoE layer and dispatches its copies), against one
process: ep=2 (its collectives' order checked, the routing and the bytes sent after a step
checked against the single-process routing), ep=2 on 4 ranks with clipping (experts reduced
over expert-dp), ep=4, ep=4 with a routing so scarce every rank sends some experts nothing,
ep=2 x pp=2, ep=2 with zero=1, ep=2 x tp=2 with sequence parallel, the local aux loss (ep=2
and dp=2 against the dp ranks' pieces), and capacity-factor routing against an independent capped
reference. In the same job, ep=2: the dropless dispatch and combine ops (fxtron/ops/ep.py) around the local
experts' grouped GEMM equal all experts on one rank in float64, forward and backward, with
uneven token counts and an expert that receives nothing from a rank.
"""
from __future__ import annotations

import math
import os
import warnings

import pytest
import torch
import torch.nn.functional as F

import fxtron
from fxtron.models import build, example_inputs
from fxtron.ops import registry
from fxtron.models.moe import Experts, MoEConfig, MoETransformer, SparseMoE, grouped_mm, switch_aux_loss
from fxtron.tools.testing import (adamw, assert_trains_like, cases_fixture, max_abs_diff, ranks_of, reference_training,
                            train_program)

CFG = MoEConfig(vocab_size=128, max_seq_len=64, n_layer=2, n_head=4, n_kv_head=2, dim=32, ffn_dim=48,
                n_experts=4, top_k=2, shared_ffn_dim=32, aux_loss_coef=0.05)


#: a routing skewed by scarcity: 8 experts, one per token, 6 tokens per rank at ep=4 -- every
#: rank sends some experts nothing (zero-row splits in both all-to-alls)
SKEW = MoEConfig(vocab_size=128, max_seq_len=64, n_layer=2, n_head=4, n_kv_head=2, dim=32, ffn_dim=48,
                 n_experts=8, top_k=1, aux_loss_coef=0.05)


def _model(key=None):
    torch.manual_seed(0)
    return MoETransformer(SKEW if key == "ep4-skew" else CFG)


def _batch(b, s, seed):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(CFG.vocab_size, (b, s + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def test_grouped_mm_equals_a_loop_of_matmuls_in_float64():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(11, 5, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(4, 5, 3, dtype=torch.float64, generator=g, requires_grad=True)
    offs = torch.tensor([3, 3, 8, 10], dtype=torch.int32)          # group 1 empty; row 10 past the end
    out = grouped_mm(x, w, offs)
    ref, start = torch.zeros(11, 3, dtype=torch.float64), 0
    for e, end in enumerate(offs.tolist()):
        ref[start:end] = x[start:end] @ w[e]
        start = end
    assert torch.allclose(out, ref, atol=1e-14, rtol=0) and out[10].abs().max() == 0
    grad = torch.randn(11, 3, dtype=torch.float64, generator=g)
    gx, gw = torch.autograd.grad(out, (x, w), grad)
    rx, rw = torch.autograd.grad(ref, (x, w), grad)
    assert torch.allclose(gx, rx, atol=1e-14, rtol=0) and torch.allclose(gw, rw, atol=1e-14, rtol=0)
    assert gw[1].abs().max() == 0                                    # no rows, no gradient


def test_the_layer_equals_a_token_by_token_reference():
    torch.manual_seed(1)
    moe = SparseMoE(CFG).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(2, 5, CFG.dim, dtype=torch.float64)
    with torch.no_grad():
        y, aux, counts = moe(x)
    t = x.reshape(-1, CFG.dim)
    probs = torch.softmax(t @ moe.router.weight.T, -1)
    ref, seen = torch.zeros_like(t), torch.zeros(CFG.n_experts, dtype=torch.float64)
    for i in range(t.shape[0]):
        w, chosen = probs[i].topk(CFG.top_k)
        for wj, e in zip(w / w.sum(), chosen.tolist()):
            gate, up = (moe.experts.gate_up[e] @ t[i]).chunk(2)
            ref[i] += wj * (moe.experts.down[e] @ (F.silu(gate) * up))
            seen[e] += 1
        ref[i] += moe.shared(t[i:i + 1])[0]
    assert (y.reshape(-1, CFG.dim) - ref).abs().max() < 1e-13
    assert torch.equal(counts.double(), seen)
    f, P = seen / (t.shape[0] * CFG.top_k), probs.mean(0)
    assert abs(float(aux) - CFG.n_experts * float((f * P).sum())) < 1e-13


def test_the_switch_loss_is_one_under_uniform_routing():
    probs = torch.full((6, 4), 0.25)
    assert float(switch_aux_loss(probs, torch.tensor([3.0, 3.0, 3.0, 3.0]), top_k=2)) == pytest.approx(1.0)


def test_the_model_exports_with_symbolic_batch_and_sequence():
    model = _model()
    prog = fxtron.parallelize(model, fxtron.Mesh(1), example_inputs=_batch(2, 8, 0)).program(0)
    for b, s in ((2, 8), (3, 12), (5, 6)):
        x, y = _batch(b, s, b + s)
        assert abs(float(prog(x, y)) - float(model(x, y))) < 1e-6
    assert len(model.last_aux) == CFG.n_layer and all(c.sum() == 5 * 6 * CFG.top_k for c in model.last_tokens_per_expert)


def test_presets_build_on_meta():
    m = build("mixtral-8x7b", device="meta")
    assert isinstance(m, MoETransformer) and m.layers[0].mlp.experts.gate_up.shape == (8, 2 * 14336, 4096)
    assert fxtron.models.num_parameters(m) == pytest.approx(46.7e9, rel=0.01)      # Mixtral-8x7B's 46.7B
    d = build("deepseek-moe-16b", device="meta")
    assert d.layers[0].mlp.experts.down.shape == (64, 2048, 1408) and d.layers[0].mlp.shared is not None
    x, y = example_inputs("moe-tiny", 2, 16)
    assert float(build("moe-tiny")(x, y)) > 0


# ------------------------------------------------------------------------------ training
STEPS = [_batch(4, 16, 10), _batch(4, 12, 11)]
SKEW_STEPS = [_batch(4, 6, 12), _batch(4, 6, 13)]


def _steps(key):
    return SKEW_STEPS if key == "ep4-skew" else STEPS


_opt = adamw(eps=1e-4)


CASES = {"tp2": (dict(tp=2), {}), "tp2-sp": (dict(tp=2), dict(sequence_parallel=True)),
         "pp2": (dict(pp=2), dict(microbatches=2)), "dp2": ({}, {}),
         # expert parallel: the experts split over the ep ranks, which are the dense layers' dp ranks
         "ep2": (dict(ep=2), {}), "ep2-clip": (dict(ep=2), dict(clip_grad=0.05)),    # 4 ranks: experts all-reduced over expert-dp (2)
         "ep4": (dict(ep=4), {}), "ep4-skew": (dict(ep=4), {}), "ep2-pp2": (dict(ep=2, pp=2), dict(microbatches=2)),
         # the distributed optimizer: dense gradients reduce-scattered over dp (4), the experts' over expert-dp (2)
         "ep2-zero": (dict(ep=2), dict(zero=1, clip_grad=0.05)),
         # each ep rank's experts split over tp too (Megatron's expert-tp), tokens on sequence shards
         "ep2-tp2-sp": (dict(ep=2, tp=2), dict(sequence_parallel=True)),
         # Megatron's default, local aux loss (opt-in, a change of the model): each dp rank's own statistics
         "ep2-local": (dict(ep=2), dict(moe_aux_loss="local")), "dp2-local": ({}, dict(moe_aux_loss="local")),
         # capacity-factor routing (opt-in, a change of the model): each expert takes at most ceil(c k T / E)
         # of a rank's copies; the reference caps each rank's piece the same way (CappedExperts), each
         # piece with its own aux loss
         "ep2-cap": (dict(ep=2), dict(moe_capacity_factor=1.0, moe_aux_loss="local")),
         # ... padded to capacity (Megatron's moe_pad_expert_input_to_capacity): the same numbers, fixed splits
         "ep2-cap-pad": (dict(ep=2), dict(moe_capacity_factor=1.0, moe_pad_to_capacity=True, moe_aux_loss="local")),
         # mixed precision: bf16 compute copies, fp32 main weights and gradients (the 16-bit policy's tolerances)
         "ep2-bf16": (dict(ep=2), dict(dtype=torch.bfloat16))}
FOUR = ("ep2-clip", "ep4", "ep4-skew", "ep2-pp2", "ep2-zero", "ep2-tp2-sp")     # cases of the 4-process job


def _pieces(item, n=2):
    x, y = item
    k = x.shape[0] // n
    return fxtron.Microbatches([((x[i * k:(i + 1) * k], y[i * k:(i + 1) * k]), {}) for i in range(n)])


def _global_microbatches(item, dp, m):
    """The global batch's microbatches as a program cuts it: microbatch i is every dp rank's
    i-th microbatch of its slice."""
    x, y = item
    k = x.shape[0] // (dp * m)
    parts = [[slice((r * m + i) * k, (r * m + i + 1) * k) for r in range(dp)] for i in range(m)]
    return fxtron.Microbatches([((torch.cat([x[p] for p in part]), torch.cat([y[p] for p in part])), {})
                                for part in parts])


def _reference_batches(key, steps):
    """What one process trains for `key`: the whole batch, as its microbatches where the case
    has them (the load-balancing statistics per microbatch, as gradient accumulation computes
    them); with moe_aux_loss='local', every dp rank's piece on its own."""
    axes, kw = CASES[key]
    dp = (4 if key in FOUR else 2) // (axes.get("tp", 1) * axes.get("pp", 1))
    m = kw.get("microbatches", 1)
    if kw.get("moe_aux_loss") == "local":
        return [_pieces(s, dp * m) for s in steps] if dp * m > 1 else steps
    return [_global_microbatches(s, dp, m) for s in steps] if m > 1 else steps


def _halves(item):
    return _pieces(item, 2)


def _inputs(key):
    return [_halves(s) for s in STEPS] if key == "pp2" else [(s, {}) for s in _steps(key)]


#: the warning that the load-balancing loss's statistics are each microbatch's (passes/statistics.py)
PER_MICROBATCH = r"with microbatches=\d+, .* computed per microbatch"


def _run(rank, mesh, key):
    axes, kw = CASES[key]
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxtron.ParallelizeWarning)      # nothing left replicated or gathered unasked
        warnings.filterwarnings("ignore", PER_MICROBATCH, fxtron.ParallelizeWarning)  # (said: the aux loss's, pp2)
        if key in ("tp2-sp", "ep2-tp2-sp"):
            warnings.simplefilter("ignore", fxtron.ParallelizeWarning)  # the (B, S/tp) -> tokens fold gathers (README)
        pm = fxtron.parallelize(_model(key), mesh, example_inputs=_batch(2, 8, 0), **kw)
        prog = pm.program(rank)
    batches = _inputs(key)
    if key in ("ep2", "ep2-tp2-sp"):     # the job checks every collective's order and sizes across its group first
        from fxtron.ops import ledger
        before = ledger.stats()["checked"]
        opt, losses = _opt(prog.parameters()), []
        for step, (args, kw) in enumerate(batches):
            ledger.tally(reset=True)
            losses.append(prog.train_step(args, opt, kwargs=kw))
            if step == 0:                # what the first step's routing did
                a2a = sum(v[2] for (_, op), v in ledger.tally().items() if op == "all_to_all")
                grads, load, sent = prog.full_grads(), prog.expert_load(), prog.last_dispatch.bytes_sent
                if key == "ep2":         # an evaluation between steps keeps the step's figures, its own apart
                    prog.eval_step(batches[1][0], kwargs=batches[1][1])
                    after_eval = (prog.expert_load(), prog.last_dispatch.bytes_sent,
                                  prog.last_eval_dispatch.bytes_sent)
        return {"losses": losses, "grads": grads, "state": prog.full_state_dict(), "load": load, "sent": sent,
                "checked": ledger.stats()["checked"] - before, "a2a": a2a,
                "after_eval": after_eval if key == "ep2" else None}
    if key in ("ep2-cap", "ep2-cap-pad"):          # the copies dropped over capacity, the bytes sent, per step
        opt, dropped, sent, losses = _opt(prog.parameters()), [], [], []
        for step, (args, kw) in enumerate(batches):
            losses.append(prog.train_step(args, opt, kwargs=kw))
            dropped.append(sum(prog.last_dispatch.dropped.values()))
            sent.append(prog.last_dispatch.bytes_sent)
            if step == 0:
                grads, load = prog.full_grads(), prog.expert_load()
        return {"losses": losses, "grads": grads, "state": prog.full_state_dict(), "dropped": dropped, "sent": sent,
                "load": load}
    if key == "ep4-skew":         # the copies this rank's tokens sent each expert, per layer
        out = train_program(prog, batches, _opt(prog.parameters()))
        return {**out, "sent": [c.clone() for c in prog.last_dispatch.copies.values()]}
    if key in ("ep2-clip", "ep2-zero"):
        out = train_program(prog, batches, _opt(prog.parameters()))
        return {**out, "norm": prog.last_grad_norm}
    if key in ("pp2", "ep2-pp2"):
        losses, grads = [], None
        opt = _opt(prog.parameters())
        for step, item in enumerate(batches):
            losses.append(prog.train_step(item if key == "pp2" else item[0], opt))
            if step == 0:
                grads = prog.full_grads()
        return {"losses": losses, "grads": grads, "state": prog.full_state_dict()}
    return train_program(prog, batches, _opt(prog.parameters()))


# ------------------------------------------------------------------------------ the ep ops
EP = fxtron.Mesh(2, ep=2)
E, H, F_OUT, K = 4, 6, 5, 2


def _routed(r, lone=False):
    """ep rank r's copies for the ops tests, float64: a different number per rank, rank 0
    sending expert 3 none (`lone`: one). Returns the generator (for what follows), the
    count, the copies x, the order sorting them by expert, the offsets and all E experts'
    weights."""
    g = torch.Generator().manual_seed(100 + r)
    copies = (7 + 3 * r) * K
    x = torch.randn(copies, H, dtype=torch.float64, generator=g)
    experts = torch.randint(0, E, (copies,), generator=g)
    if r == 0:
        experts[experts == 3] = 2
        if lone:
            experts[0] = 3
    order = torch.argsort(experts, stable=True)
    offs = torch.cumsum(torch.bincount(experts, minlength=E), 0).to(torch.int32)
    return g, copies, x, order, offs, torch.randn(E, H, F_OUT, dtype=torch.float64,
                                                  generator=torch.Generator().manual_seed(0))


def _ep_ops(rank, mesh):
    """Each rank's copies (a different number per rank; rank 0 sends expert 3 none) through
    dispatch -> this rank's experts' grouped GEMM -> combine, against all experts on the
    rank's own copies, in float64; the experts' gradients are returned for the sum over ranks."""
    from fxtron.ops import ledger
    from fxtron.ops.ep import ep_combine, ep_dispatch
    from fxtron.runtime.groups import groups_for
    group = groups_for(mesh).group("ep").group_name
    g, copies, x, order, offs, w = _routed(rank)
    local = E // mesh.ep
    mine = w[rank * local:(rank + 1) * local].clone().requires_grad_()
    xs = x[order].clone().requires_grad_()
    issued = [ledger.stats()["operations"]]              # the collectives each phase issues (the ledger's count)
    rows, local_offs, counts = ep_dispatch(xs, offs, group, mesh.ep)
    issued.append(ledger.stats()["operations"])
    y = ep_combine(grouped_mm(rows, mine, local_offs), offs, counts, xs.shape[0], group, mesh.ep)
    issued.append(ledger.stats()["operations"])
    gy = torch.randn(y.shape, dtype=torch.float64, generator=g)
    (y * gy).sum().backward()
    issued.append(ledger.stats()["operations"])
    xr, wr = x[order].clone().requires_grad_(), w.clone().requires_grad_()
    yr = grouped_mm(xr, wr, offs)
    (yr * gy).sum().backward()
    return {"dy": float((y - yr).abs().max()), "dx": float((xs.grad - xr.grad).abs().max()),
            "grad_mine": mine.grad, "grad_ref": wr.grad, "received": rows.shape[0], "counts": counts,
            "issued": [b - a for a, b in zip(issued, issued[1:])]}


EP_TP = fxtron.Mesh(4, ep=2, tp=2)
EP_TP_OPS = ["ep-tp-ops", "ep-tp-ops-cap", "ep-tp-ops-cap-pad"]


def _ep_tp_ops(rank, mesh, capacity, pad):
    """ep=2 x tp=2 (Megatron's order, ops/ep.py): the tp ranks of an ep rank hold the same
    copies; each dispatches its share, the expert rank gathers the shares over tp, its experts
    run split by rows over tp (each tp rank half the input features: a partial sum), the
    partial rows are reduce-scattered back to their shares, combined and put back among the
    copies. Against all experts on the ep rank's own copies in float64 (capped as a reference
    written here caps them; padded to capacity or not): the sum over tp of the outputs and of the copies' gradients, and
    each tp rank's half of its experts' gradient."""
    from fxtron.ops import ledger
    from fxtron.ops.ep import ep_combine, ep_dispatch, ep_gather, ep_scatter, ep_share, ep_unshare
    from fxtron.runtime.groups import groups_for
    groups = groups_for(mesh)
    ep_g, tp_g = groups.group("ep").group_name, groups.group("tp").group_name
    r, j = mesh.coords(rank)["ep"], mesh.coords(rank)["tp"]
    _, copies, x, order, offs, w = _routed(r, lone=True)    # expert 3 one copy from ep rank 0: a share empty
    local, half = E // mesh.ep, slice(j * H // 2, (j + 1) * H // 2)
    mine = w[r * local:(r + 1) * local].clone().requires_grad_()
    xs = x[order].clone().requires_grad_()
    issued = [ledger.stats()["operations"]]
    share, share_offs = ep_share(xs, offs, tp_g, 2, "", capacity, pad)
    rows, loffs, counts = ep_dispatch(share, share_offs, ep_g, 2)
    rows, loffs, every = ep_gather(rows, loffs, counts, tp_g, 2)
    issued.append(ledger.stats()["operations"])
    partial = grouped_mm(rows[:, half], mine[:, half], loffs)      # split by rows over tp
    back = ep_combine(ep_scatter(partial, every, tp_g, 2), share_offs, counts, share.shape[0], ep_g, 2)
    y = ep_unshare(back, offs, xs.shape[0], tp_g, 2, capacity, pad)
    issued.append(ledger.stats()["operations"])
    gy = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(200 + r))
    (y * gy).sum().backward()
    issued.append(ledger.stats()["operations"])
    keep = torch.ones(copies, 1, dtype=torch.float64)           # the reference's capacity: first copies of each expert
    if capacity:
        cap, start = math.ceil(capacity * copies / E), 0
        for end in offs.tolist():
            keep[start + cap:end] = 0
            start = end
    xr, wr = x[order].clone().requires_grad_(), w.clone().requires_grad_()
    yr = grouped_mm(xr, wr, offs) * keep
    (yr * gy).sum().backward()
    return {"y": y.detach(), "dx": xs.grad, "rows": share.shape[0], "cap": math.ceil(capacity * copies / E), "y_ref": yr.detach(), "dx_ref": xr.grad, "grad_mine": mine.grad[:, half],
            "grad_ref": wr.grad, "ep": r, "half": half, "issued": [b - a for a, b in zip(issued, issued[1:])]}


# transformers' MoE models (experts as fused 3-D weights run by their grouped_mm), expert parallel
#: case -> (model, mesh axes, parallelize options, the pieces one process trains: dp ranks x microbatches).
#: Mixtral at ep=2 x pp=2 and Qwen3-MoE at ep=2 x tp=2 train and resume in tests/test_checkpoint.py;
#: Mixtral at ep=4 and ep=2 x pp=2 and Qwen3-MoE at ep=2 x tp=2 with sp pass here too (kept out of CI's time)
HF = {"hf-mixtral-ep2": ("hf-mixtral", dict(ep=2), {}, 2), "hf-qwen3moe-ep2": ("hf-qwen3moe", dict(ep=2), {}, 2),
      "hf-qwen3moe-ep4": ("hf-qwen3moe", dict(ep=4), {}, 4),
      "hf-mixtral-ep2-tp2-sp": ("hf-mixtral", dict(ep=2, tp=2), dict(sequence_parallel=True), 2),
      "hf-qwen3moe-ep2-pp2": ("hf-qwen3moe", dict(ep=2, pp=2), dict(microbatches=2), 4),
      "hf-olmoe-ep2": ("hf-olmoe", dict(ep=2), {}, 2)}
MORE_HF = {"hf-mixtral-ep4": ("hf-mixtral", dict(ep=4), {}, 4),
           "hf-qwen3moe-ep2-tp2-sp": ("hf-qwen3moe", dict(ep=2, tp=2), dict(sequence_parallel=True), 2),
           "hf-mixtral-ep2-pp2": ("hf-mixtral", dict(ep=2, pp=2), dict(microbatches=2), 4),
           # GraniteMoE's 3-D experts (the router a bare weight): the grouped GEMM's path, as Mixtral's
           "hf-granitemoe-ep2-tp2": ("hf-granitemoe", dict(ep=2, tp=2), {}, 2)}
if os.environ.get("FXTRON_MORE_TESTS"):          # FXTRON_MORE_TESTS=1 pytest tests/test_moe.py: every pair
    HF.update(MORE_HF)


def _hf_world(key) -> int:
    return math.prod(HF[key][1].values())


def _hf_steps(name):
    from tp_models import batches
    return batches(name, 4, [12, 10], seed=20)


def _hf_pieces(item, n):
    _, kw = item
    k = 4 // n
    return fxtron.Microbatches([((), {a: t[i * k:(i + 1) * k] for a, t in kw.items()}) for i in range(n)])


def _hf_run(rank, mesh, key):
    from tp_models import batch, make
    name, _, kw, _ = HF[key]
    a, ex = batch(name, 2, 8, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxtron.ParallelizeWarning)
        warnings.filterwarnings("ignore", PER_MICROBATCH, fxtron.ParallelizeWarning)
        if kw.get("sequence_parallel"):
            warnings.simplefilter("ignore", fxtron.ParallelizeWarning)  # the (B, S/tp) -> tokens fold gathers (README)
        torch.manual_seed(0)
        pm = fxtron.parallelize(make(name), mesh, example_inputs=a, example_kwargs=ex, **kw)
    prog = pm.program(rank)
    return train_program(prog, _hf_steps(name), _opt(prog.parameters()))


def _dispatch_case(rank, mesh, key):
    if key in HF:
        return _hf_run(rank, mesh, key)
    if key.startswith("ep-tp-ops"):
        return _ep_tp_ops(rank, mesh, 0.0 if key == "ep-tp-ops" else 1.0, key.endswith("pad"))
    return _ep_ops(rank, mesh) if key == "ep-ops" else _run(rank, mesh, key)


def _jobs():
    jobs = [(fxtron.Mesh(2, **axes), [key]) for key, (axes, _) in CASES.items() if key not in FOUR] + [(EP, ["ep-ops"])]
    jobs += [(fxtron.Mesh(2, **HF[k][1]), [k]) for k in HF if _hf_world(k) == 2]
    four = [(fxtron.Mesh(4, **CASES[k][0]), [k]) for k in FOUR] + [(EP_TP, EP_TP_OPS)]
    four += [(fxtron.Mesh(4, **HF[k][1]), [k]) for k in HF if _hf_world(k) == 4]
    return {2: jobs, 4: four}


trained = cases_fixture(_jobs, _dispatch_case, check_collectives=True)


@pytest.mark.slow
def test_ep_dispatch_and_combine_equal_all_experts_on_one_rank(trained):
    out = ranks_of(trained, EP, "ep-ops")
    total = sum(o["grad_ref"] for o in out)              # every rank's copies reach the owning rank
    local = E // 2
    for rank, o in enumerate(out):
        assert o["dy"] < 1e-13 and o["dx"] < 1e-13, o
        assert (o["grad_mine"] - total[rank * local:(rank + 1) * local]).abs().max() < 1e-12
    assert int(out[1]["counts"][0, 1]) == 0              # rank 0 sent expert 3 (rank 1's second) nothing
    # the all-to-alls each phase issues, as the op registry says (what pm.collectives counts)
    specs = registry.specs()
    d, c = specs["ep_dispatch"], specs["ep_combine"]
    for o in out:
        assert o["issued"] == [d.forward.count, c.forward.count, d.backward.count + c.backward.count], o["issued"]
        assert {d.forward.kind, d.backward.kind, c.forward.kind, c.backward.kind} == {"all_to_all"}
    assert sum(o["received"] for o in out) == (7 + 10) * K


@pytest.mark.slow
@pytest.mark.parametrize("key", EP_TP_OPS)
def test_ep_shares_over_tp_equal_all_experts_on_one_rank(trained, key):
    out = ranks_of(trained, EP_TP, key)
    total = sum(o["grad_ref"] for o in out if o["half"].start == 0)      # each ep rank's copies once
    local = E // 2
    for o in out:
        pair = [p for p in out if p["ep"] == o["ep"]]                     # the ep rank's two tp ranks
        assert (sum(p["y"] for p in pair) - o["y_ref"]).abs().max() < 1e-13
        assert (sum(p["dx"] for p in pair) - o["dx_ref"]).abs().max() < 1e-13
        want = total[o["ep"] * local:(o["ep"] + 1) * local, o["half"]]
        assert (o["grad_mine"] - want).abs().max() < 1e-12
    if key != "ep-tp-ops":
        assert any((o["y_ref"] == 0).all(1).any() for o in out)           # copies really dropped
    if key.endswith("pad"):                                               # each share: E x ceil(C / tp) rows
        assert all(o["rows"] == E * math.ceil(o["cap"] / 2) for o in out), [(o["rows"], o["cap"]) for o in out]
    specs = registry.specs()
    sh, d, ga, sc, c = (specs[n] for n in ("ep_share", "ep_dispatch", "ep_gather", "ep_scatter", "ep_combine"))
    for o in out:
        assert o["issued"] == [d.forward.count + ga.forward.count, sc.forward.count + c.forward.count,
                               d.backward.count + ga.backward.count + sc.backward.count + c.backward.count], o["issued"]
    assert sh.forward is None and sh.backward is None


class CappedExperts(Experts):
    """The capacity-factor reference, written independently of ops/ep.py: the experts of one
    piece (one rank's tokens) run on every copy, then each expert's copies past the first
    ceil(c x copies / E) (in their sorted order) give zero -- as if never sent."""

    capacity = 1.0

    def forward(self, x, offs):
        out = super().forward(x, offs)
        ends = offs.tolist()
        cap = math.ceil(self.capacity * x.shape[0] / len(ends))
        keep = torch.zeros(x.shape[0], 1, dtype=out.dtype)
        start = 0
        for end in ends:
            keep[start:min(end, start + cap)] = 1
            self.dropped += max(0, end - start - cap)
            start = end
        return out * keep


def _capped(model):
    for layer in model.layers:
        capped = CappedExperts(CFG)
        capped.load_state_dict(layer.mlp.experts.state_dict())
        capped.dropped = 0
        layer.mlp.experts = capped
    return model


@pytest.mark.slow
@pytest.mark.parametrize("key", list(CASES))
def test_trains_like_one_process(trained, key):
    # the whole batch (its microbatches' aux losses each their own, as gradient accumulation); with
    # moe_aux_loss='local' every dp rank's piece on its own
    clip = CASES[key][1].get("clip_grad")
    steps = _steps(key)
    model = _capped(_model(key)) if key.startswith("ep2-cap") else _model(key)
    dtype = CASES[key][1].get("dtype")
    ref = reference_training(model, _reference_batches(key, steps), _opt, clip_grad=clip, dtype=dtype)
    axes = CASES[key][0]
    mesh = fxtron.Mesh(4 if key in FOUR else 2, **axes)
    for rank, got in enumerate(ranks_of(trained, mesh, key)):
        if dtype is not None:             # test_mixed_precision's tolerances of the 16-bit policy
            assert all(abs(a - b) <= 2.0**-6 * abs(b) for a, b in zip(got["losses"], ref["losses"])), got["losses"]
            gmax = max(g.abs().max().item() for g in ref["grads"].values())
            dg, where = max_abs_diff(got["grads"], ref["grads"])
            assert dg <= 2.0**-5 * gmax, f"rank {rank}: gradient of {where} off by {dg:.3g} (max {gmax:.3g})"
            dw, where = max_abs_diff(got["state"], {k: v for k, v in ref["state"].items() if k in got["state"]})
            assert dw <= 2 * len(steps) * 1e-3, f"rank {rank}: weight {where} off by {dw:.3g}"
            continue
        assert_trains_like(got, ref, rank=rank)
        if clip is not None:                 # the norm: dense over tp-pp, experts over tp-ep-pp
            assert abs(got["norm"] - ref["norms"][-1]) < 1e-5 * ref["norms"][-1], (got["norm"], ref["norms"])
        if key.startswith("ep2-cap"):        # copies really dropped, as many as the reference's caps dropped
            want = sum(layer.mlp.experts.dropped for layer in model.layers)
            assert sum(o["dropped"][0] + o["dropped"][1] for o in ranks_of(trained, mesh, key)) == want > 0
            # expert_load() counts what the experts received: every routed copy but the dropped ones
            # (it counted them routed, 71 copies to an expert whose ranks take 2 x 32)
            routed = CFG.n_layer * STEPS[0][0].shape[0] * STEPS[0][0].shape[1] * CFG.top_k
            dropped = sum(o["dropped"][0] for o in ranks_of(trained, mesh, key))
            assert sum(int(v.sum()) for v in got["load"].values()) == routed - dropped, (got["load"], dropped)
        if key == "ep2-cap-pad":    # fixed splits: L experts x C rows to the other rank and back, whatever the routing
            copies = STEPS[0][0].shape[0] // 2 * STEPS[0][0].shape[1] * CFG.top_k
            cap, local = math.ceil(copies / CFG.n_experts), CFG.n_experts // 2
            assert got["sent"][0] == CFG.n_layer * (2 * 2 * local * cap * CFG.dim * 4 + 2 * local * 8), got["sent"]
            assert got["sent"][0] > ranks_of(trained, mesh, "ep2-cap")[rank]["sent"][0]
            if rank == 0:           # and pm.collectives' formula, which fixed splits make exact
                pm = fxtron.parallelize(_model(key), mesh, example_inputs=_batch(2, 8, 0), **CASES[key][1])
                formula = sum(r.evaluate(2, 16)[1] for r in pm.collectives(0) if r.group == "ep")
                assert formula == got["sent"][0], (formula, got["sent"])
        if key == "ep4-skew":
            assert any((c == 0).any() for c in got["sent"]), got["sent"]      # some expert got nothing from here
        if "checked" in got:
            assert got["checked"] >= 2 * 12, got["checked"]    # 2 steps x 12 all-to-alls at least


@pytest.mark.slow
def test_ep_reports_the_routing_and_the_bytes_it_sent(trained):
    """ep=2, first step: the copies each expert received over the global batch equal the
    single-process model's routing of it (routing is per token), and the bytes each rank sent
    equal what the routing implies: twice (forward, and the gradients back) its own copies
    bound for the other rank's experts (dispatch) and the other rank's copies its experts
    computed (combine), plus the per-expert counts twice per layer."""
    model = _model()
    x, y = STEPS[0]
    with torch.no_grad():
        model(x, y)
    whole = model.last_tokens_per_expert
    out = ranks_of(trained, fxtron.Mesh(2, ep=2), "ep2")
    local = CFG.n_experts // 2
    bound = []                         # per rank: its copies bound for the other rank's experts
    for rank in range(2):
        with torch.no_grad():
            model(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])      # this rank's tokens (dp)
        theirs = slice(local, None) if rank == 0 else slice(0, local)
        bound.append(sum(int(c.to(torch.int64)[theirs].sum()) for c in model.last_tokens_per_expert))
    for rank, got in enumerate(out):
        assert sorted(got["load"]) == [f"layers.{i}.mlp.experts" for i in range(CFG.n_layer)]
        for i in range(CFG.n_layer):
            assert torch.equal(got["load"][f"layers.{i}.mlp.experts"], whole[i].to(torch.int64)), (rank, i)
        rows = 2 * (bound[rank] + bound[1 - rank])
        assert got["sent"] == rows * CFG.dim * 4 + CFG.n_layer * 2 * local * 8, (rank, got["sent"], bound)
        # the ledger's tally of the step's all-to-alls: the same bytes (it counted none)
        assert got["a2a"] == got["sent"], (rank, got["a2a"], got["sent"])
        # an eval_step after the step: expert_load and bytes_sent still the step's (they were the evaluation's)
        load_after, sent_after, eval_sent = got["after_eval"]
        assert all(torch.equal(load_after[n], got["load"][n]) for n in got["load"]) and sent_after == got["sent"]
        assert eval_sent > 0 and eval_sent != got["sent"], (eval_sent, got["sent"])
    # ep=2 x tp=2 (the same tokens per ep rank): each tp rank sends its share, Megatron's order --
    # the two tp ranks of an ep rank together send what it sends at tp=1, and the counts each
    for rank, got in enumerate(ranks_of(trained, fxtron.Mesh(4, ep=2, tp=2), "ep2-tp2-sp")):
        for i in range(CFG.n_layer):
            assert torch.equal(got["load"][f"layers.{i}.mlp.experts"], whole[i].to(torch.int64)), (rank, i)
    pairs = ranks_of(trained, fxtron.Mesh(4, ep=2, tp=2), "ep2-tp2-sp")
    for ep_rank, got in enumerate(out):
        both = [p["sent"] for p in pairs[2 * ep_rank:2 * ep_rank + 2]]
        assert sum(both) == got["sent"] + CFG.n_layer * 2 * local * 8, (ep_rank, both, got["sent"])
        assert min(both) < 0.75 * got["sent"], both                   # each about half, not the whole


@pytest.mark.slow
@pytest.mark.parametrize("key", list(HF))
def test_transformers_moe_trains_like_one_process(trained, key):
    """transformers' Mixtral and Qwen3-MoE at ep=2, ep=4, ep=2 x tp=2 with sequence parallel and
    ep=2 x pp=2, and OLMoE at ep=2, against the unmodified model training the same pieces (the dp ranks' and
    microbatches'; transformers' load-balancing loss is off by default)."""
    from tp_models import make
    name, axes, _, pieces = HF[key]
    torch.manual_seed(0)
    ref = reference_training(make(name), [_hf_pieces(s, pieces) for s in _hf_steps(name)], _opt)
    for rank, got in enumerate(ranks_of(trained, fxtron.Mesh(_hf_world(key), **axes), key)):
        assert_trains_like(got, ref, rank=rank)
