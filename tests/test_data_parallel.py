"""Equivalence: data-parallel training on gloo ranks equals the model trained in one process.

One job per world size (processes cost ~2 s each to start); every case runs inside it. Each
case trains a few AdamW steps on global batches whose sequence length changes between steps
(the compiled program is symbolic in batch and sequence), and compares the loss of every step,
the gradients of the first step and the weights at the end with the single-process run.
"""
from __future__ import annotations

import pytest
import torch

import fxtron
from fxtron.models import build, example_inputs
from fxtron.tools.testing import adamw, max_abs_diff, reference_training, run_on_ranks

pytestmark = pytest.mark.slow      # gloo jobs of 2 and 4 processes

CASES = ["gpt-tiny", "llama-tiny"]
SEQS = [16, 12, 16]        # per step: the sequence length changes, the program does not
BATCH = 8
_opt = adamw()             # eps well above float32 gradient noise (fxtron.tools.testing.adamw)


def _batches(name: str):
    return [example_inputs(name, batch=BATCH, seq=s, seed=100 + i) for i, s in enumerate(SEQS)]


def _job(rank: int, world: int) -> dict:
    mesh = fxtron.Mesh(world)
    out = {}
    for name in CASES:
        model = build(name, seed=0)
        pm = fxtron.parallelize(model, mesh, example_inputs=example_inputs(name, batch=4, seq=8))
        prog = pm.program(rank)
        opt = _opt(prog.parameters())
        losses, grads = [], None
        for step, batch in enumerate(_batches(name)):
            losses.append(prog.train_step(batch, opt))
            if step == 0:
                grads = prog.full_grads()
        out[name] = {"losses": losses, "grads": grads, "state": prog.full_state_dict()}
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"dp{w}")
def job(request):
    return request.param, run_on_ranks(_job, request.param, request.param)


@pytest.fixture(scope="module")
def reference():
    return {name: reference_training(build(name, seed=0), _batches(name), _opt) for name in CASES}


@pytest.mark.parametrize("name", CASES)
def test_dp_equals_single_process(job, reference, name):
    world, results = job
    ref = reference[name]
    for rank, res in enumerate(results):
        got = res[name]
        loss_diff = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]))
        assert loss_diff < 1e-5, (rank, got["losses"], ref["losses"])
        gdiff, where = max_abs_diff(got["grads"], ref["grads"])
        assert gdiff < 1e-6, f"rank {rank}: gradient of {where} differs by {gdiff:.3g}"
        wdiff, where = max_abs_diff(got["state"], ref["state"])
        assert wdiff < 1e-5, f"rank {rank}: weight {where} differs by {wdiff:.3g} after {len(SEQS)} steps"
    # data-parallel replicas hold bit-identical weights: they applied the same averaged gradient
    for res in results[1:]:
        for k, v in res[name]["state"].items():
            assert torch.equal(v, results[0][name]["state"][k]), k
