"""Tensor parallel: the compiled per-rank programs train exactly like the unmodified model.

Two gloo jobs (2 and 4 processes) run every case: tp=2, tp=4 and tp=2 x dp=2, for the shipped
GPT (fused QKV, tied embeddings) and Llama (GQA, rotary, SwiGLU) and for transformers' GPT-2
(Conv1D weights, fused c_attn) and Llama. Each case trains AdamW steps on global batches whose
sequence length changes, and compares losses, the gradients of the first step (gathered to full
shape) and the weights at the end with the single-process model.
"""
from __future__ import annotations

import pytest
import torch

import fxtron
from fxtron.tools.testing import adamw, assert_trains_like, cases_fixture, reference_training, train_program
from tp_models import OP_NAMES, NAMES, RULE_NAMES, batch, batches, make

pytestmark = pytest.mark.slow      # gloo jobs of 2 and 4 processes

SEQS = [16, 12, 16]
BATCH = 4
_opt = adamw()


def _batches(name):
    return batches(name, BATCH, SEQS, seed=10)


def _train_parallel(rank: int, name: str, mesh: fxtron.Mesh, sp: bool = False) -> dict:
    model = make(name)
    args, kwargs = batch(name, 2, 8, seed=0)
    pm = fxtron.parallelize(model, mesh, example_inputs=args, example_kwargs=kwargs, sequence_parallel=sp)
    prog = pm.program(rank)
    out = train_program(prog, _batches(name), _opt(prog.parameters()))
    return {**out, "local": {n: p.shape for n, p in prog.named_parameters()}}


def _train_dropout(rank: int, mesh: fxtron.Mesh, seed: int) -> dict:
    model = make("gpt", dropout=0.2)
    pm = fxtron.parallelize(model, mesh, example_inputs=batch("gpt", 2, 8, seed=0)[0])
    prog = pm.program(rank, seed=seed)
    opt = _opt(prog.parameters())
    losses = [prog.train_step(a, opt) for a, _ in _batches("gpt")]
    replicated = {n: p.detach().clone() for n, p in prog.named_parameters()
                  if tuple(p.shape) == tuple(dict(model.named_parameters())[n].shape)}
    return {"losses": losses, "replicated": replicated}


def _meta_program(rank: int, mesh: fxtron.Mesh) -> dict:
    """A model built on the meta device: each rank allocates and initializes only its shards."""
    from fxtron.models import build
    model = build("gpt-tiny", device="meta")
    pm = fxtron.parallelize(model, mesh, example_inputs=batch("gpt", 2, 8, seed=0)[0])
    prog = pm.program(rank)
    local = {n: tuple(p.shape) for n, p in prog.named_parameters()}
    state = prog.full_state_dict()
    loss = prog.train_step(_batches("gpt")[0][0], _opt(prog.parameters()))
    return {"local": local, "loss": loss, "state": state}


def _run_case(rank: int, mesh: fxtron.Mesh, case: str):
    if case == "meta":
        return _meta_program(rank, mesh)
    if case == "dropout":
        return [_train_dropout(rank, mesh, seed) for seed in (0, 0, 1)]
    return _train_parallel(rank, case.removesuffix("+sp"), mesh, sp=case.endswith("+sp"))


MESHES = {2: [fxtron.Mesh(2, tp=2)], 4: [fxtron.Mesh(4, tp=4), fxtron.Mesh(4, tp=2)]}
# sequence parallel: every model at tp=2 and at tp=4 (the other transformers architectures:
# test_zoo.py)
SP_NAMES = {str(MESHES[2][0]): NAMES, str(MESHES[4][0]): NAMES}


def _cases(mesh: fxtron.Mesh) -> list[str]:
    cases = list(NAMES)
    if mesh.tp == 2 and mesh.dp == 1:
        cases += OP_NAMES + RULE_NAMES
    cases += [name + "+sp" for name in SP_NAMES.get(str(mesh), [])]
    if mesh.tp == 2 and mesh.dp == 1:
        cases += ["meta", "dropout"]
    return cases


results = cases_fixture({world: [(m, _cases(m)) for m in meshes] for world, meshes in MESHES.items()}, _run_case)


@pytest.fixture(scope="module")
def reference():
    return {name: reference_training(make(name), _batches(name), _opt) for name in NAMES + OP_NAMES + RULE_NAMES}


CASES = [(mesh, name) for meshes in MESHES.values() for mesh in meshes for name in NAMES]
CASES += [(mesh, name + "+sp") for meshes in MESHES.values() for mesh in meshes
          for name in SP_NAMES.get(str(mesh), [])]
CASES += [(MESHES[2][0], name) for name in OP_NAMES + RULE_NAMES]


@pytest.mark.parametrize("mesh,name", CASES, ids=[f"tp{m.tp}-dp{m.dp}-{n}" for m, n in CASES])
def test_tp_training_equals_single_process(results, reference, mesh, name):
    ref = reference[name.removesuffix("+sp")]
    for rank in range(mesh.world_size):
        assert_trains_like(results[(str(mesh), name, rank)], ref, rank=rank)


@pytest.mark.parametrize("name", NAMES)
def test_ranks_hold_only_their_shards(results, name):
    mesh = MESHES[4][0]   # tp=4
    local = results[(str(mesh), name, 0)]["local"]
    full = dict(make(name).named_parameters())
    split = [n for n, shape in local.items() if tuple(shape) != tuple(full[n].shape)]
    assert len(split) >= 2 * 6 + 1   # every layer's 4+ matrices and the embedding
    for n in split:
        assert torch.Size(local[n]).numel() * 4 == full[n].numel(), n


def test_dropout_keeps_replicas_identical_and_seeds_repeat(results):
    mesh = MESHES[2][0]
    r0, r1 = results[(str(mesh), "dropout", 0)], results[(str(mesh), "dropout", 1)]
    for run in range(3):
        # replicated regions drew the same masks on both tp ranks: replicated weights stay bit-identical
        assert r0[run]["replicated"].keys() == r1[run]["replicated"].keys()
        assert len(r0[run]["replicated"]) >= 10
        for name, value in r0[run]["replicated"].items():
            assert torch.equal(value, r1[run]["replicated"][name]), name
        assert r0[run]["losses"] == r1[run]["losses"]
    assert r0[0]["losses"] == r0[1]["losses"]            # the same seed repeats the run exactly
    assert r0[0]["losses"] != r0[2]["losses"]            # another seed draws other masks


def _streams_job(rank: int):
    from fxtron.ops.rng import RNGStreams, rng_call
    streams = RNGStreams(seed=3, coords={"tp": rank}, sizes={"tp": 2})
    x = torch.ones(1000)
    with streams.active():
        rep = rng_call("replicated", torch.ops.aten.dropout.default, x, 0.5, True)
        shd = rng_call("sharded:tp", torch.ops.aten.dropout.default, x, 0.5, True)
    return rep, shd


def test_sharded_stream_differs_per_rank_replicated_stream_does_not():
    # no communication: the streams are per-process generators
    (rep0, shd0), (rep1, shd1) = _streams_job(0), _streams_job(1)
    assert torch.equal(rep0, rep1) and not torch.equal(shd0, shd1)


def test_meta_model_is_initialized_shard_by_shard(results):
    from fxtron.runtime.materialize import MetaMaterializer
    from fxtron.models import build
    mesh = MESHES[2][0]
    r0, r1 = results[(str(mesh), "meta", 0)], results[(str(mesh), "meta", 1)]
    assert r0["local"]["blocks.0.mlp.fc1.weight"] == (128, 64)       # half of (256, 64)
    assert r0["local"]["wte.weight"] == (128, 64)
    assert torch.isfinite(torch.tensor(r0["loss"]))
    # both ranks made their shards of the same initialization (block by block, never whole)
    expected = MetaMaterializer(build("gpt-tiny", device="meta"), seed=0)
    for name in ("wte.weight", "blocks.0.attn.qkv.weight", "blocks.1.mlp.fc2.weight", "blocks.0.ln1.weight"):
        assert torch.equal(r0["state"][name], r1["state"][name]), name
        assert torch.equal(r0["state"][name], expected.local(name, (), {}, {})), name
    assert r0["state"]["blocks.0.ln1.weight"].eq(1).all()
