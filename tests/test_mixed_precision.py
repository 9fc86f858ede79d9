"""Mixed precision: programs compute in bf16 (or fp16 with dynamic loss scaling) while AdamW
updates fp32 parameters from fp32 gradients; compared at tp=2 (and, for a few cases, tp=4)
with the single-process model under the same policy (fp32 parameters, forward with 16-bit
copies).

Tolerances fit 16-bit arithmetic: the two runs round in different places (the tp run sums
bf16 partial products across ranks and computes the cross entropy in fp32), so losses agree
to a couple of bf16 ulps, first-step gradients to 2^-5 (bf16) / 2^-8 (fp16) of the largest
gradient, and weights after 3 AdamW steps to within two runs moving apart by their full
updates (2 x 3 x lr: each AdamW step moves a weight by at most about lr), since
Adam turns rounding-level gradient noise into full-size updates.
"""
from __future__ import annotations

import pytest
import torch

import fxtron
from fxtron.tools.testing import adamw, max_abs_diff, reference_training, run_on_ranks, train_program
from tp_models import batch, batches, make

pytestmark = pytest.mark.slow      # gloo jobs of 2 and 4 processes

LR, STEPS = 1e-3, 3
# (model, dtype, sequence parallel)
CASES = [("gpt", torch.bfloat16, False), ("llama", torch.bfloat16, False), ("llama", torch.bfloat16, True),
         ("hf-gpt2", torch.bfloat16, False), ("hf-llama", torch.bfloat16, True), ("gpt", torch.float16, False)]
GRAD_TOL = {torch.bfloat16: 2.0**-5, torch.float16: 2.0**-8}
# clipping under fp16's loss scale: the norm and the coefficient are the model's, not the scaled
# gradients' (0.05: below the global norm, ~3, so every step clips)
CLIP = 0.05
# tp=4 (a second job of 4 processes): a shipped and a transformers model, with and without sp
CASES_TP4 = [("gpt", torch.bfloat16, True), ("hf-llama", torch.bfloat16, False)]
_opt = adamw(LR)


def _batches(name):
    return batches(name, 4, [16, 12, 16], seed=100)


def _key(name, dtype, sp):
    return f"{name}-{str(dtype)[6:]}" + ("-sp" if sp else "")


def _job(rank: int, mesh: fxtron.Mesh, cases: list) -> dict:
    out = {}
    for name, dtype, sp in cases:
        a, kw = batch(name, 2, 8, seed=0)
        pm = fxtron.parallelize(make(name), mesh, example_inputs=a, example_kwargs=kw, dtype=dtype,
                                sequence_parallel=sp)
        prog = pm.program(rank)
        opt = _opt(prog.parameters())
        res = {**train_program(prog, _batches(name), opt), "dtypes": {p.dtype for p in prog.parameters()}}
        if dtype == torch.float16:
            clipped = fxtron.parallelize(make(name), mesh, example_inputs=a, example_kwargs=kw, dtype=dtype,
                                         sequence_parallel=sp, clip_grad=CLIP).program(rank)
            copt = _opt(clipped.parameters())
            res["clipped"] = {**train_program(clipped, _batches(name), copt), "skipped": clipped.scaler.skipped}
        if prog.scaler is not None:
            res["scale"], res["skipped"] = prog.scaler.scale, prog.scaler.skipped
            prog.scaler.scale = 1e38                       # force an overflow: the step is skipped
            before = {n: p.detach().clone() for n, p in prog.named_parameters()}
            a, kw = _batches(name)[0]
            prog.train_step(a, opt, kwargs=kw)
            res["overflow"] = (prog.scaler.skipped, prog.scaler.scale,
                               all(torch.equal(before[n], p) for n, p in prog.named_parameters()))
        out[_key(name, dtype, sp)] = res
    return out


def _reference(name: str, dtype: torch.dtype) -> dict:
    """The same policy in one process: fp32 parameters, forward with 16-bit copies."""
    return reference_training(make(name), _batches(name), _opt, dtype=dtype)


@pytest.fixture(scope="module")
def results():
    mesh = fxtron.Mesh(2, tp=2)
    return run_on_ranks(_job, mesh, mesh, CASES)


@pytest.fixture(scope="module")
def results_tp4():
    mesh = fxtron.Mesh(4, tp=4)
    return run_on_ranks(_job, mesh, mesh, CASES_TP4)


ALL = [(2,) + c for c in CASES] + [(4,) + c for c in CASES_TP4]


@pytest.mark.parametrize("tp,name,dtype,sp", ALL, ids=[f"tp{c[0]}-" + _key(*c[1:]) for c in ALL])
def test_16bit_training_matches_the_same_policy_in_one_process(request, tp, name, dtype, sp):
    results = request.getfixturevalue("results" if tp == 2 else "results_tp4")
    ref = _reference(name, dtype)
    for rank, res in enumerate(results):
        got = res[_key(name, dtype, sp)]
        assert got["dtypes"] == {torch.float32}          # the optimizer's parameters stay fp32
        for a, b in zip(got["losses"], ref["losses"]):
            assert abs(a - b) <= 2.0**-6 * abs(b), (rank, got["losses"], ref["losses"])
        gmax = max(g.abs().max().item() for g in ref["grads"].values())
        dg, where = max_abs_diff(got["grads"], ref["grads"])
        assert dg <= GRAD_TOL[dtype] * gmax, f"rank {rank}: gradient of {where} off by {dg:.3g} (max {gmax:.3g})"
        state = {k: v for k, v in ref["state"].items() if k in got["state"]}
        dw, where = max_abs_diff(got["state"], state)
        assert dw <= 2 * STEPS * LR, f"rank {rank}: weight {where} off by {dw:.3g}"


def test_fp16_dynamic_loss_scaling(results):
    for res in results:
        got = res[_key("gpt", torch.float16, False)]
        assert got["scale"] == 2.0**16 and got["skipped"] == 0
        skipped, scale, unchanged = got["overflow"]
        assert skipped == 1 and scale == 0.5e38 and unchanged


def test_fp16_clips_the_model_s_gradients_not_the_scaled_ones(results):
    """clip_grad under fp16: the global norm reported and clipped to is the model's (the scaled
    gradients' over the loss scale), as the one-process model's clip_grad_norm_ sees it."""
    ref = reference_training(make("gpt"), _batches("gpt"), _opt, dtype=torch.float16, clip_grad=CLIP)
    for rank, res in enumerate(results):
        got = res[_key("gpt", torch.float16, False)]["clipped"]
        assert got["skipped"] == 0
        for a, b in zip(got["norms"], ref["norms"]):
            assert abs(a - b) <= 2.0**-6 * b, (rank, got["norms"], ref["norms"])
        state = {k: v for k, v in ref["state"].items() if k in got["state"]}
        dw, where = max_abs_diff(got["state"], state)
        assert dw <= 2 * STEPS * LR, f"rank {rank}: weight {where} off by {dw:.3g}"


def test_dtype_is_checked():
    with pytest.raises(fxtron.ParallelizeError, match="dtype"):
        fxtron.parallelize(make("gpt"), fxtron.Mesh(1), example_inputs=batch("gpt", 2, 8, 0)[0], dtype=torch.int8)
