"""Gradient accumulation fusion in compiled programs: linears become fxtron::linear, their
weight gradients land in fp32 main_grad buffers, and training is unchanged."""
from __future__ import annotations

import torch

import fxtron
from fxtron.compiler import meta
from fxtron.models import build, example_inputs


def _prog(fusion: bool):
    model = build("llama-tiny", seed=0)
    pm = fxtron.parallelize(model, fxtron.Mesh(1), example_inputs=example_inputs("llama-tiny"),
                            gradient_accumulation_fusion=fusion)
    return pm, pm.program(0)


def test_linears_are_fused_and_show_their_kernel():
    pm, _ = _prog(True)
    fused = [n for n in pm.compiled(0).gm.graph.nodes if n.target == torch.ops.fxtron.linear.default]
    assert len(fused) == 2 * 7 + 1          # 7 linears per layer and the LM head
    assert all(meta.get(n, meta.KERNEL) == "wgrad:addmm_fp32" for n in fused)
    assert "wgrad:addmm_fp32" in pm.graph(0)
    pm, _ = _prog(False)
    assert not any(n.target == torch.ops.fxtron.linear.default for n in pm.compiled(0).gm.graph.nodes)


def test_weight_gradients_accumulate_into_main_grad_and_match_unfused():
    batches = [example_inputs("llama-tiny", batch=4, seq=s, seed=i) for i, s in enumerate([16, 12])]
    runs = {}
    for fusion in (True, False):
        _, prog = _prog(fusion)
        opt = torch.optim.AdamW(prog.parameters(), lr=1e-3)
        buffers = []
        for b in batches:
            prog.train_step(b, opt)
            buffers.append(prog.get_parameter("layers.0.mlp.w1.weight").grad)
        runs[fusion] = (buffers, {n: p.detach().clone() for n, p in prog.named_parameters()})
    fused_grads, fused_state = runs[True]
    # one persistent fp32 buffer, reused every step: no per-step weight-gradient tensor
    assert fused_grads[0] is fused_grads[1] and fused_grads[0].dtype == torch.float32
    assert not hasattr(_prog(True)[1].get_parameter("layers.0.mlp.w1.weight"), "main_grad")
    for name, value in runs[False][1].items():
        torch.testing.assert_close(fused_state[name], value, rtol=0, atol=2e-6, msg=name)
