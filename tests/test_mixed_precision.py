"""Mixed precision: programs compute in bf16 (or fp16 with dynamic loss scaling) while AdamW
updates fp32 parameters from fp32 gradients; compared at tp=2 with the single-process model
under the same policy (fp32 parameters, forward with 16-bit copies).

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
from fxtron.models import build, example_inputs
from fxtron.testing import max_abs_diff, reference_training, run_on_ranks

LR, STEPS = 1e-3, 3
CASES = [("gpt-tiny", torch.bfloat16), ("llama-tiny", torch.bfloat16), ("gpt-tiny", torch.float16)]
GRAD_TOL = {torch.bfloat16: 2.0**-5, torch.float16: 2.0**-8}


def _opt(params):
    return torch.optim.AdamW(params, lr=LR, eps=1e-6, weight_decay=0.1)


def _batches(name):
    return [example_inputs(name, batch=4, seq=s, seed=100 + i) for i, s in enumerate([16, 12, 16])]


def _job(rank: int, mesh: fxtron.Mesh) -> dict:
    out = {}
    for name, dtype in CASES:
        pm = fxtron.parallelize(build(name, seed=0), mesh, example_inputs=example_inputs(name, batch=4, seq=8),
                                dtype=dtype)
        prog = pm.program(rank)
        opt = _opt(prog.parameters())
        losses, grads = [], None
        for step, b in enumerate(_batches(name)):
            losses.append(prog.train_step(b, opt))
            if step == 0:
                grads = prog.full_grads()
        res = {"losses": losses, "grads": grads, "state": prog.full_state_dict(),
               "dtypes": {p.dtype for p in prog.parameters()}}
        if prog.scaler is not None:
            res["scale"], res["skipped"] = prog.scaler.scale, prog.scaler.skipped
            prog.scaler.scale = 1e38                       # force an overflow: the step is skipped
            before = {n: p.detach().clone() for n, p in prog.named_parameters()}
            prog.train_step(_batches(name)[0], opt)
            res["overflow"] = (prog.scaler.skipped, prog.scaler.scale,
                               all(torch.equal(before[n], p) for n, p in prog.named_parameters()))
        out[(name, str(dtype))] = res
    return out


@pytest.fixture(scope="module")
def results():
    mesh = fxtron.Mesh(2, tp=2)
    return run_on_ranks(_job, mesh, mesh)


@pytest.mark.parametrize("name,dtype", CASES, ids=[f"{n}-{str(d)[6:]}" for n, d in CASES])
def test_16bit_training_matches_the_same_policy_in_one_process(results, name, dtype):
    ref = reference_training(build(name, seed=0), _batches(name), _opt, dtype=dtype)
    for rank, res in enumerate(results):
        got = res[(name, str(dtype))]
        assert got["dtypes"] == {torch.float32}          # the optimizer's parameters stay fp32
        for a, b in zip(got["losses"], ref["losses"]):
            assert abs(a - b) <= 2.0**-6 * abs(b), (rank, got["losses"], ref["losses"])
        gmax = max(g.abs().max().item() for g in ref["grads"].values())
        dg, where = max_abs_diff(got["grads"], {k: v.float() for k, v in ref["grads"].items()})
        assert dg <= GRAD_TOL[dtype] * gmax, f"rank {rank}: gradient of {where} off by {dg:.3g} (max {gmax:.3g})"
        dw, where = max_abs_diff(got["state"], ref["state"])
        assert dw <= 2 * STEPS * LR, f"rank {rank}: weight {where} off by {dw:.3g}"


def test_fp16_dynamic_loss_scaling(results):
    for res in results:
        got = res[("gpt-tiny", str(torch.float16))]
        assert got["scale"] == 2.0**16 and got["skipped"] == 0
        skipped, scale, unchanged = got["overflow"]
        assert skipped == 1 and scale == 0.5e38 and unchanged


def test_dtype_is_checked():
    with pytest.raises(fxtron.ParallelizeError, match="dtype"):
        fxtron.parallelize(build("gpt-tiny"), fxtron.Mesh(1), example_inputs=example_inputs("gpt-tiny"),
                           dtype=torch.int8)
