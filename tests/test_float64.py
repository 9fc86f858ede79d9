"""A float64 model (issue: reliability, item 5): at tp > 1 a ParallelizeError at parallelize
(tensor parallel's ops compute in 32 bits or less); with data, pipeline and context parallel
it trains in float64 -- losses and gradients equal to the model in one process to float64
round-off, the fused linears left to autograd and the gradient buffer float64."""
from __future__ import annotations

import pytest
import torch

import fxtron
from fxtron.testing import max_abs_diff, ranks_of, reference_training, run_cases, train_program
from tp_models import batch, make

MESHES = [fxtron.Mesh(2), fxtron.Mesh(2, pp=2), fxtron.Mesh(2, cp=2)]


def _batches():
    return [batch("llama", 4, 16, 1), batch("llama", 4, 8, 2)]


def _opt(params):
    return torch.optim.AdamW(params, lr=1e-3)


def test_float64_at_tp2_is_refused_at_parallelize():
    with pytest.raises(fxtron.ParallelizeError, match=r"parameter tok_embeddings\.weight is float64.*model\.float\(\)"):
        fxtron.parallelize(make("llama").double(), fxtron.Mesh(2, tp=2), example_inputs=batch("llama", 2, 8, 0)[0])


def _run(rank, mesh, case):
    pm = fxtron.parallelize(make("llama").double(), mesh, example_inputs=batch("llama", 2, 8, 0)[0],
                            microbatches=2 if mesh.pp > 1 else 1)
    prog = pm.program(rank)
    out = train_program(prog, _batches(), _opt(prog.parameters()))
    out["dtypes"] = {p.dtype for p in prog.parameters()} | {prog.grad_buffer.data.dtype}
    return out


@pytest.fixture(scope="module")
def trained():
    return run_cases({2: [(m, ["f64"]) for m in MESHES]}, _run)


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_float64_trains_like_one_process(trained, mesh):
    ref = reference_training(make("llama").double(), _batches(), _opt)
    for rank, got in enumerate(ranks_of(trained, mesh, "f64")):
        assert got["dtypes"] == {torch.float64}
        assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) < 1e-13, (rank, got["losses"])
        assert max_abs_diff(got["grads"], ref["grads"])[0] < 1e-14
        assert max_abs_diff(got["state"], {k: v for k, v in ref["state"].items() if k in got["state"]})[0] < 1e-12
