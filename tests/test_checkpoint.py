"""Checkpoints: saved by every rank with torch.distributed.checkpoint, loaded on another mesh.

One gloo job of 4 processes trains 2 steps on one mesh, saves (parameters, buffers, AdamW
state), trains 2 more; then, in the same processes, programs for other meshes load the
checkpoint and train the same 2 steps. A resumed run must give the same losses as the one that
never stopped (up to float32 round-off of the different layouts), and the checkpoint read in
one process must equal the uninterrupted single-process model after 2 steps. Meshes cover
tp=2 x pp=2 -> tp=4, pp=2 x dp=2 with the distributed optimizer -> tp=2 x dp=2 without it
(the embedding in a param group of its own, which the second stage's ranks do not hold),
one process -> tp=2 x pp=2 (zero=1), transformers' GPT-2 (Conv1D, fused c_attn split on
dim 1) tp=2 x dp=2 -> pp=2 x dp=2, and mixtures of experts: Mixtral's experts split over ep=2 and
their features over tp=2 (a 2-D device mesh, gate|up stored in parts) -> ep=2 x pp=2, Qwen3-MoE's
whole -> ep=2 x tp=2.
"""
from __future__ import annotations

import pytest
import torch

import fxtron
from fxtron.runtime.groups import init_distributed
from fxtron.tools.testing import adamw, max_abs_diff, run_on_ranks
from tp_models import batch, batches, make

pytestmark = pytest.mark.slow      # one 4-process gloo job

STEPS = 4   # save after 2
_opt = adamw()


def _steps(name):
    return batches(name, 8, [16, 12, 16, 8], seed=10)


def _program(name, mesh, kw, rank):
    args, kwargs = batch(name, 2, 8, seed=0)
    pm = fxtron.parallelize(make(name, layers=4), mesh, example_inputs=args, example_kwargs=kwargs, **kw)
    return pm.program(rank)


def _train(prog, opt, steps):
    return [prog.train_step(a, opt, kwargs=kw) for a, kw in steps]


def _late(prog) -> tuple[list, list]:
    """The last quarter of the parameters, and the quarter before it."""
    params = list(prog.parameters())
    n = len(params)
    return params[n * 3 // 4:], params[n // 2:n * 3 // 4]


def _grouped(named) -> torch.optim.AdamW:
    """GROUPED's AdamW: the embedding in a group of its own (a tenth of the learning rate, no
    weight decay), left out where empty -- the first pipeline stage has two groups, the second
    one, and a rank of another mesh both: the groups a checkpoint holds differ by rank."""
    named = list(named)
    groups = [{"params": [p for n, p in named if n.startswith("tok_embeddings")], "lr": 1e-4, "weight_decay": 0.0},
              {"params": [p for n, p in named if not n.startswith("tok_embeddings")]}]
    return _opt([g for g in groups if g["params"]])


def _optimizer(case: str, prog, resumed: bool):
    """The case's AdamW: under PARTIAL over the last quarter of the parameters first, the
    quarter before it a group added after the first step (they step once less); resumed, both
    groups from the start. The first half is in no group (a rank whose shards of the
    distributed optimizer hold only those has no state). Under GROUPED, _grouped's."""
    if case == GROUPED:
        return _grouped(prog.named_parameters())
    if case != PARTIAL:
        return _opt(prog.parameters())
    late, early = _late(prog)
    opt = _opt(late)
    if resumed:
        opt.add_param_group({"params": early})
    return opt


def _train_case(case: str, prog, opt, steps):
    if case != PARTIAL:
        return _train(prog, opt, steps)
    losses = _train(prog, opt, steps[:1])
    opt.add_param_group({"params": _late(prog)[1]})
    return losses + _train(prog, opt, steps[1:])


CASES = {   # name: (model, save mesh, options, load mesh, options)
    "tp2xpp2->tp4": ("gpt", fxtron.Mesh(4, tp=2, pp=2), dict(microbatches=2), fxtron.Mesh(4, tp=4), {}),
    "pp2xdp2-zero->tp2xdp2": ("llama", fxtron.Mesh(4, pp=2), dict(microbatches=2, zero=1), fxtron.Mesh(4, tp=2), {}),
    "one-process->tp2xpp2-zero": ("gpt", fxtron.Mesh(1), {}, fxtron.Mesh(4, tp=2, pp=2), dict(microbatches=2, zero=1)),
    "hf-gpt2:tp2xdp2->pp2xdp2": ("hf-gpt2", fxtron.Mesh(4, tp=2), {}, fxtron.Mesh(4, pp=2), dict(microbatches=2)),
    # fused qkv of unequal parts (q 8 heads, k and v 4 each) saved per part, resharded 2 -> 4 ways
    "hf-phi3:tp2xdp2->tp4": ("hf-phi3", fxtron.Mesh(4, tp=2), {}, fxtron.Mesh(4, tp=4), {}),
    # experts split over ep (stored per expert range), resharded 2 -> 4 ways, and whole -> 2 ways with pp
    "hf-mixtral:ep2xtp2-sp->ep2xpp2": ("hf-mixtral", fxtron.Mesh(4, ep=2, tp=2), dict(sequence_parallel=True),
                                       fxtron.Mesh(4, ep=2, pp=2), dict(microbatches=2)),
    "hf-qwen3moe:one-process->ep2xtp2": ("hf-qwen3moe", fxtron.Mesh(1), {}, fxtron.Mesh(4, ep=2, tp=2), {}),
    # the distributed optimizer over some parameters: three dp ranks' shards hold no state, and the
    # parameters of a group added later have another step count
    "gpt:dp4-zero-partial->tp2xdp2": ("gpt", fxtron.Mesh(4), dict(zero=1), fxtron.Mesh(4, tp=2), {}),
}
PARTIAL = "gpt:dp4-zero-partial->tp2xdp2"
# the embedding's own param group, on the first pipeline stage's ranks alone when saved
GROUPED = "pp2xdp2-zero->tp2xdp2"


def _job(rank: int, root: str) -> dict:
    out = {}
    for case, (name, save_mesh, save_kw, load_mesh, load_kw) in CASES.items():
        path = f"{root}/{case}"
        steps = _steps(name)
        if rank < save_mesh.world_size:
            if save_mesh.world_size > 1:
                init_distributed(save_mesh)
            prog = _program(name, save_mesh, save_kw, rank)
            opt = _optimizer(case, prog, False)
            before = _train_case(case, prog, opt, steps[:2])
            prog.save(path, opt)
            if case == PARTIAL:     # (a rank whose shards hold no optimizer state)
                out[(case, "stateless")] = not any(prog.zero._inner.state.get(s) for s in prog.zero.shards)
            out[(case, "uninterrupted")] = before + _train(prog, opt, steps[2:])
        # the other ranks of the job wait for the save (a one-process save runs on rank 0 only)
        init_distributed(load_mesh)
        torch.distributed.barrier()
        if rank < load_mesh.world_size:
            prog = _program(name, load_mesh, load_kw, rank)
            opt = _optimizer(case, prog, True)
            prog.load(path, opt)
            out[(case, "resumed")] = _train(prog, opt, steps[2:])
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    res = run_on_ranks(_job, fxtron.Mesh(4), root, timeout_s=600)
    return root, res


@pytest.mark.parametrize("case", list(CASES))
def test_resume_gives_the_same_losses(results, case):
    _, res = results
    want = res[0][(case, "uninterrupted")]
    for rank_res in res:
        got = rank_res.get((case, "resumed"))
        if got is None:
            continue
        assert max(abs(a - b) for a, b in zip(got, want[2:])) < 2e-6, (got, want)


@pytest.mark.parametrize("case", [c for c in CASES if c != PARTIAL])
def test_checkpoint_loads_in_one_process(results, case):
    root, _ = results
    name = CASES[case][0]
    model = make(name, layers=4)
    opt = _grouped(model.named_parameters()) if case == GROUPED else _opt(model.parameters())
    for a, kw in _steps(name)[:2]:
        opt.zero_grad(set_to_none=True)
        out = model(*a, **kw)
        (out if isinstance(out, torch.Tensor) else out.loss).backward()
        opt.step()
    full = fxtron.load_full_state_dict(f"{root}/{case}")
    own = {k: v for k, v in model.state_dict().items() if k in full}
    assert set(own) == set(full)
    diff, where = max_abs_diff(full, own)
    assert diff < 1e-5, f"{where} differs by {diff}"
    fresh = make(name, layers=4)
    missing, unexpected = fresh.load_state_dict(full, strict=False)
    assert not unexpected and all(k in dict(fresh.named_buffers()) or k.endswith("lm_head.weight") for k in missing)


def test_checkpoint_has_optimizer_state(results):
    root, _ = results
    # the partial optimizer's: each parameter's own step (2, or 1 for the group added after the first
    # step), none for what it never held
    _, res = results
    assert any(r.get((PARTIAL, "stateless")) for r in res), "no dp rank without optimizer state"
    full = fxtron.load_full_state_dict(f"{root}/{PARTIAL}", optimizer=True)
    steps = {k.split("/")[1]: float(v) for k, v in full.items() if k.startswith("optim/") and k.endswith("/step")}
    model = make("gpt", layers=4)
    names = [n for n, _ in model.named_parameters()]
    n = len(names)
    assert steps == {**{k: 2.0 for k in names[n * 3 // 4:]}, **{k: 1.0 for k in names[n // 2:n * 3 // 4]}}, steps
    full = fxtron.load_full_state_dict(f"{root}/tp2xpp2->tp4", optimizer=True)
    assert "optim/blocks.0.attn.qkv.weight/exp_avg" in full
    assert full["optim/blocks.0.attn.qkv.weight/exp_avg"].shape == full["blocks.0.attn.qkv.weight"].shape
