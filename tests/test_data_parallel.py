"""Equivalence: data-parallel training on gloo ranks equals the model trained in one process.

One job per world size (processes cost ~2 s each to start); every case runs inside it. Each
case trains a few AdamW steps on global batches whose sequence length changes between steps
(the compiled program is symbolic in batch and sequence), and compares the loss of every step,
the gradients of the first step and the weights at the end with the single-process run.
"""
from __future__ import annotations

import time

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


class _MaskInput(torch.nn.Module):
    """Attention under an (S, S) mask the caller passes in: its first dim sits at batch_dim, and
    torch.export equates it with the sequence."""

    def __init__(self):
        super().__init__()
        self.emb, self.qkv, self.out = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 64)

    def forward(self, mask, ids, labels):
        h = self.emb(ids)
        q = self.qkv(h).view(h.shape[0], h.shape[1], 2, 8).transpose(1, 2)
        a = torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask).transpose(1, 2).reshape(h.shape)
        return torch.nn.functional.cross_entropy(self.out(h + a).flatten(0, 1), labels.flatten())


def _mask_batches():
    g = torch.Generator().manual_seed(7)
    # the mask first: the trace names its symbols by the role most inputs give them (by the first
    # input's, the sequence was named B and the ids' batch refused as "B in both places")
    return [(torch.ones(s, s, dtype=torch.bool).tril(), torch.randint(0, 64, (BATCH, s), generator=g),
             torch.randint(0, 64, (BATCH, s), generator=g)) for s in SEQS]


def _mask_model():
    torch.manual_seed(0)
    return _MaskInput()


def _job(rank: int, world: int) -> dict:
    mesh = fxtron.Mesh(world)
    out = {}
    # an (S, S) mask input is whole on every rank and microbatch (dp split its rows: a size mismatch)
    steps = _mask_batches()
    prog = fxtron.parallelize(_mask_model(), mesh, example_inputs=steps[0], microbatches=2).program(rank)
    opt = _opt(prog.parameters())
    losses = [prog.train_step(b, opt) for b in steps]
    out["mask-input"] = {"losses": losses, "state": prog.full_state_dict()}
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


def test_an_sxs_mask_input_is_whole_on_every_rank(job):
    world, results = job
    ref = reference_training(_mask_model(), _mask_batches(), _opt)
    for rank, res in enumerate(results):
        got = res["mask-input"]
        assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) < 1e-5, (rank, got["losses"], ref["losses"])
        wdiff, where = max_abs_diff(got["state"], ref["state"])
        assert wdiff < 1e-5, f"rank {rank}: weight {where} differs by {wdiff:.3g}"


# ----------------------------------------------------------------------------- between steps
#: (zero, overlap_param_gather): the distributed optimizer's all-gathers of the updated
#: parameters end with the step by default, and stay in flight into the next step's forward with
#: overlap_param_gather (Megatron's), where prog.settle() or fxtron's own readers wait for them
BETWEEN = [(1, False), (2, False), (1, True)]


def _between(model, opt, step, batch, after):
    """One step of `step(batch)`, then what the user does before the next: halve every weight by
    hand, read their squares, and (a post-hook registered once) clamp them."""
    loss = step(batch)
    read = after()
    with torch.no_grad():
        squares = sum(float(p.double().pow(2).sum()) for p in model.parameters())
        for p in model.parameters():
            p.mul_(0.5)
    return loss, squares, read


def _between_job(rank: int) -> dict:
    mesh = fxtron.Mesh(2)
    out = {}
    for zero, overlap in BETWEEN:
        model = build("gpt-tiny", seed=0)
        pm = fxtron.parallelize(model, mesh, example_inputs=example_inputs("gpt-tiny", batch=4, seq=8), zero=zero,
                                overlap_param_gather=overlap)
        prog = pm.program(rank)
        opt = torch.optim.SGD(prog.parameters(), lr=0.1, momentum=0.9)
        clamp = opt.register_step_post_hook(lambda o, a, k: [p.data.clamp_(-0.2, 0.2) for p in prog.parameters()])
        first = {k: v.clone() for k, v in prog.state_dict().items()}
        rows = []
        for i, batch in enumerate(_batches("gpt-tiny")):
            rows.append(_between(prog, opt, lambda b: prog.train_step(b, opt), batch,
                                 prog.settle if overlap else (lambda: None)))
        state = prog.full_state_dict()
        from fxtron.runtime.memory import rank_bytes
        grads = rank_bytes(prog)["grad_bytes"]        # the trainer's log line's (zero=2: the shards' copies)
        shards = sum(p.grad.numel() * p.grad.element_size() for p in prog.zero.shards if p.grad is not None)
        # overlap: a state loaded between steps is not overwritten by a gather still in flight
        loss = None
        if overlap:
            # (no post-hook, which waits for the gathers; rank 1 late to the step's gathers: rank 0's
            # are still in flight as it loads)
            clamp.remove()
            late = opt.register_step_pre_hook(lambda o, a, k: time.sleep(0.5 if rank == 1 else 0))
            prog.train_step(_batches("gpt-tiny")[0], opt)
            late.remove()
            prog.load_state_dict(first)
            loss = prog.train_step(_batches("gpt-tiny")[1], opt)
        out[zero, overlap] = {"rows": rows, "state": state, "loaded_loss": loss, "grads": (grads, shards)}
    return out


def test_what_the_user_does_to_the_weights_between_steps_holds_under_zero():
    """Under zero=1/2 the updated parameters are all-gathered over dp after the step. They
    landed only at the next step (or a state-dict read): a weight the user halved by hand
    between steps was overwritten by the gather (0.13 off the one-process weights after 3 steps),
    a read of them saw the other rank's shard from before the update, a step post-hook's clamp
    was undone (weights of 1.03 after clamping to 0.05), and a state loaded between steps was
    overwritten. Now the step waits for its gathers, as Megatron's default does; with
    overlap_param_gather they stay in flight into the next forward, and prog.settle() (the
    documented wait), the post-hooks and load_state_dict wait for them first."""
    results = run_on_ranks(_between_job, 2)
    for zero, overlap in BETWEEN:
        model = build("gpt-tiny", seed=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        opt.register_step_post_hook(lambda o, a, k: [p.data.clamp_(-0.2, 0.2) for p in model.parameters()])

        def step(batch):
            opt.zero_grad()
            loss = model(*batch)
            loss.backward()
            opt.step()
            return float(loss.detach())
        first = {k: v.clone() for k, v in model.state_dict().items()}
        ref = [_between(model, opt, step, b, lambda: None) for b in _batches("gpt-tiny")]
        state = {k: v.clone() for k, v in model.state_dict().items()}
        loaded = None
        if overlap:
            opt._optimizer_step_post_hooks.clear()
            step(_batches("gpt-tiny")[0])
            model.load_state_dict(first)
            loaded = step(_batches("gpt-tiny")[1])
        for rank, res in enumerate(results):
            got = res[zero, overlap]
            for (loss, squares, _), (loss_r, squares_r, _) in zip(got["rows"], ref):
                assert abs(loss - loss_r) < 1e-5 and abs(squares - squares_r) < 1e-5 * squares_r, \
                    (zero, overlap, rank, got["rows"], ref)
            dw, where = max_abs_diff(got["state"], state)
            assert dw < 1e-6, (zero, overlap, rank, dw, where)
            assert max(float(v.abs().max()) for v in got["state"].values()) <= 0.2 + 1e-7
            if overlap:
                assert abs(got["loaded_loss"] - loaded) < 1e-5, (rank, got["loaded_loss"], loaded)
            if zero == 2:     # the log's gradient bytes count the shards kept after backward (it said 0 B)
                grads, shards = got["grads"]
                assert grads == shards > 0, got["grads"]
