"""Models built on the meta device (issue 31, point 1): fxtron's llama-tiny and transformers'
Llama, Qwen3 (q/k norms) and Mixtral (grouped experts) built under torch.device("meta") get
programs whose shards are made rank by rank with the model's own initialization -- transformers'
`_init_weights`, the rotary tables computed -- and train like one process.

Without processes: the meta-built initialization has the statistics transformers' own CPU
build draws (the same constants exactly: norms' ones, the rotary inv_freq), and the summary
says per parameter which init it got. Then a gloo job of 2: each model at tp=2 with sequence
parallel and Mixtral at ep=2, three AdamW steps equal to the CPU-built model in one process
holding the values the meta build made (its whole parameters, made the same block by block)."""
from __future__ import annotations

import warnings

import pytest
import torch

import fxtron
from fxtron import models
from fxtron.runtime.materialize import MetaMaterializer
from fxtron.tools.testing import adamw, assert_trains_like, cases_fixture, ranks_of, reference_training, train_program
from tp_models import batch, make

NAMES = ["llama-tiny", "hf-llama", "hf-qwen3", "hf-mixtral"]


def _build(name: str, device: str | None = None) -> torch.nn.Module:
    if name == "llama-tiny":
        return models.build(name, device=device or "cpu")
    with torch.device(device or "cpu"):
        return make(name)


def _batches(name: str) -> list:
    if name == "llama-tiny":
        return [(models.example_inputs(name, 4, 16, seed=i), {}) for i in range(3)]
    return [batch(name, 4, 8, seed=i) for i in range(3)]


def _whole(name: str) -> torch.nn.Module:
    """The CPU-built model holding the values the meta build makes (seed 0), made whole."""
    meta = _build(name, "meta")
    m = MetaMaterializer(meta, seed=0)
    model = _build(name)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(m.local(n, (), {}, {}))
    return model


@pytest.mark.parametrize("name", NAMES)
def test_meta_init_is_the_models_own(name):
    """Per parameter, the meta build's values against the CPU build's (transformers' own
    initialize_weights / the preset's init_weights): constants equal exactly, random draws with
    the same mean and spread (within 15% of the std); computed buffers equal exactly."""
    torch.manual_seed(0)
    cpu, meta = _build(name), _build(name, "meta")
    m = MetaMaterializer(meta, seed=0)
    for n, p in cpu.named_parameters():
        q = m.local(n, (), {}, {})
        if p.std() == 0:
            assert torch.equal(q, p), n
        else:
            assert abs(q.std() - p.std()) < 0.15 * p.std() and abs(q.mean() - p.mean()) < 0.2 * p.std(), \
                (n, float(q.std()), float(p.std()))
    for n, b in cpu.named_buffers():
        assert torch.equal(m.buffer(n), b), n
    assert m.whole == {} and m.defaulted == [] and m.uncomputed == []
    how = "Llama.init_weights" if name == "llama-tiny" else f"{type(cpu).__name__}._init_weights"
    assert {v.split(":")[0] for v in m.init_of.values()} == {how}
    args, kw = _batches(name)[0]
    pm = fxtron.parallelize(meta, fxtron.Mesh(2, tp=2), example_inputs=args, example_kwargs=kw)
    line = next(x for x in pm.summary().splitlines() if x.startswith("initialization"))
    assert f"{how}: normal(0, 0.02)" in line and f"{how}: ones" in line and "buffers computed by the init" in line


CASES = [(n, "tp2-sp") for n in NAMES] + [("hf-mixtral", "ep2")]
MESHES = {"tp2-sp": fxtron.Mesh(2, tp=2), "ep2": fxtron.Mesh(2, ep=2)}


def _run(rank: int, mesh: fxtron.Mesh, case) -> dict:
    name, how = case
    args, kw = _batches(name)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = fxtron.parallelize(_build(name, "meta"), mesh, example_inputs=args, example_kwargs=kw,
                                sequence_parallel=how == "tp2-sp")
    prog = pm.program(rank)
    return train_program(prog, _batches(name), adamw(1e-3)(prog.parameters()))


trained = cases_fixture({2: [(MESHES[how], [(n, how) for n, h in CASES if h == how]) for how in MESHES]}, _run)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[f"{n}-{h}" for n, h in CASES])
def test_meta_built_model_trains_like_one_process(trained, case):
    name, how = case
    ref = reference_training(_whole(name), _batches(name), adamw(1e-3))
    for rank, got in enumerate(ranks_of(trained, MESHES[how], case)):
        assert_trains_like(got, ref, rank=rank)
