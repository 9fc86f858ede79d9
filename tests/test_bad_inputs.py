"""Models and inputs that must be refused with a clear message, or handled (issue: reliability,
item 5). A float64 model: at tp > 1 a ParallelizeError at parallelize (tensor parallel's ops
compute in 32 bits or less); with data, pipeline and context parallel it trains in float64 --
losses and gradients equal to the model in one process to float64 round-off, the fused linears
left to autograd and the gradient buffer float64. A sequence longer than the model's position
table (or a table sliced to it) is refused at the step with the limit and what sets it."""
from __future__ import annotations

import pytest
import torch

import fxtron
from fxtron.tools.testing import adamw, cases_fixture, max_abs_diff, ranks_of, reference_training, train_program
from tp_models import batch, batches, make

MESHES = [fxtron.Mesh(2), fxtron.Mesh(2, pp=2), fxtron.Mesh(2, cp=2)]
_opt = adamw(eps=1e-8, weight_decay=0.01)         # torch's defaults


def _batches():
    return batches("llama", 4, [16, 8], seed=1)


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


trained = cases_fixture({2: [(m, ["f64"]) for m in MESHES]}, _run)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_float64_trains_like_one_process(trained, mesh):
    ref = reference_training(make("llama").double(), _batches(), _opt)
    for rank, got in enumerate(ranks_of(trained, mesh, "f64")):
        assert got["dtypes"] == {torch.float64}
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
