"""The cp attention block's kernels (codegen/attention.py): which kernel each call takes, the
fused CUDA calls' shapes and dtypes on fake CUDA tensors (no GPU needed), and on a GPU the fused
block's forward and backward against float64 matmuls."""
from __future__ import annotations

import pytest
import torch

import fxtron  # noqa: F401 - registers the kernels
from fxtron.codegen.attention import (CPU_FLASH, EFFICIENT, FLASH, MATMUL, block_kernel, choose_backward,
                                      choose_forward)
from fxtron.ops.cp.blocks import _block, _block_backward

bf16, f16, f32, f64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


# ------------------------------------------------------------------------------ the choice
@pytest.mark.parametrize("args, kw, want", [
    (("cuda", bf16, "none", 128, 128), {}, FLASH),
    (("cuda", f16, "none", 128, 128), dict(causal=True, lq=64, lk=64), FLASH),
    (("cuda", bf16, "none", 128, 128), dict(causal=True, lq=32, lk=64), EFFICIENT),   # flash: bottom-right only
    (("cuda", bf16, "none", 128, 128), dict(lq=32, lk=64), FLASH),
    (("cuda", bf16, "bool", 128, 128), {}, EFFICIENT),
    (("cuda", bf16, "additive", 128, 128), {}, EFFICIENT),
    (("cuda", bf16, "additive", 128, 128), dict(causal=True), FLASH),                  # causal: no other mask
    (("cuda", f32, "none", 128, 128), {}, EFFICIENT),
    (("cuda", f32, "bool", 64, 64), {}, EFFICIENT),
    (("cuda", f64, "none", 128, 128), {}, MATMUL),
    (("cuda", bf16, "none", 192, 128), {}, EFFICIENT),                                 # MLA
    (("cuda", bf16, "none", 512, 512), {}, EFFICIENT),                                 # beyond flash's 256
    (("cuda", bf16, "none", 100, 100), {}, MATMUL),
    (("cuda", bf16, "none", 128, 128), dict(dropout=True), MATMUL),
    (("cuda", bf16, "additive", 128, 128), dict(norm=True), MATMUL),
    (("cpu", bf16, "none", 64, 64), {}, CPU_FLASH),
    (("cpu", f64, "additive", 64, 64), {}, CPU_FLASH),
    (("cpu", f32, "none", 64, 32), {}, MATMUL),
    (("cpu", f32, "none", 64, 64), dict(dropout=True), MATMUL),
    (("mps", f16, "none", 64, 64), {}, MATMUL),
])
def test_block_kernel_choice(args, kw, want):
    assert block_kernel(*args, **kw) == want


def test_choice_reads_the_call():
    q, k, v = torch.empty(1, 2, 8, 16), torch.empty(1, 2, 16, 16), torch.empty(1, 2, 16, 8)
    assert choose_forward(q, k, k, None, False) == CPU_FLASH
    assert choose_forward(q, k, v, None, False) == MATMUL
    assert choose_backward(q, k, k, None, False, None, torch.ones(1, 2, 8)) == MATMUL


# ------------------------------------------------------------------------------ fake CUDA
def _fake_cuda(dtype, mask, causal, dv=32):
    from torch._subclasses.fake_tensor import FakeTensorMode
    b, h, lq, lk, d = 2, 4, 48, 80 if not causal else 48, 32
    with FakeTensorMode():
        def t(*shape, dt=dtype):
            return torch.empty(*shape, dtype=dt, device="cuda")
        q, k, v = t(b, h, lq, d), t(b, h, lk, d), t(b, h, lk, dv)
        m = (None if mask == "none" else t(1, h, lq, lk, dt=torch.bool) if mask == "bool"
             else t(b, 1, lq, lk, dt=torch.float32))
        which = choose_forward(q, k, v, m, causal)
        out, lse = _block(q, k, v, 0.125, m, causal)
        dq, dk, dv_ = _block_backward(t(b, h, lq, dv), q, k, v, out, lse, 0.125, m, causal)
        return which, (out, lse, dq, dk, dv_), (q, k, v)


@pytest.mark.parametrize("dtype", [bf16, f32])
@pytest.mark.parametrize("mask, causal", [("none", True), ("none", False), ("bool", False), ("additive", False)])
def test_fused_blocks_on_fake_cuda_tensors(dtype, mask, causal):
    which, (out, lse, dq, dk, dv), (q, k, v) = _fake_cuda(dtype, mask, causal)
    assert which == (FLASH if dtype == bf16 and mask == "none" else EFFICIENT)
    assert out.shape == q.shape[:-1] + (v.shape[-1],) and lse.shape == q.shape[:-1]
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    for t in (out, lse, dq, dk, dv):
        assert t.dtype == torch.float32 and t.device.type == "cuda"


def test_mla_block_on_fake_cuda_takes_efficient_attention():
    which, (out, lse, dq, dk, dv), (q, k, v) = _fake_cuda(bf16, "none", True, dv=16)
    assert which == EFFICIENT
    assert out.shape[-1] == 16 and dv.shape == v.shape and dq.dtype == torch.float32


# ------------------------------------------------------------------------------ on a GPU
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [bf16, f32])
@pytest.mark.parametrize("mask, causal", [("none", True), ("none", False), ("bool", False), ("additive", False),
                                          ("floor", False)])
def test_fused_block_equals_float64_matmuls_on_gpu(dtype, mask, causal):
    """Forward (out, lse) and backward (given the final out and lse) of the fused block against
    `_block(..., fused=False)` in float64; rows that see no key (dead) and, under an additive
    mask, rows whose every key is at finfo.min (floor) included."""
    g = torch.Generator(device="cuda").manual_seed(0)
    b, h, lq, lk, d = 2, 4, 100, 100 if causal else 136, 64
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", generator=g) for n in (lq, lk, lk, lq))
    m = None
    if mask != "none":
        seen = torch.rand(b, 1, lq, lk, device="cuda", generator=g) > 0.3
        seen[:, :, 3] = False                                           # a dead row
        m = seen if mask == "bool" else torch.where(seen, torch.randn(seen.shape, device="cuda", generator=g),
                                                    float("-inf"))
        if mask == "floor":
            m[:, :, 5] = torch.where(seen[:, :, 5], torch.finfo(torch.float32).min, float("-inf"))
    want = _block(q.double(), k.double(), v.double(), 0.125, m if m is None or m.dtype == torch.bool else m.double(),
                  causal, fused=False)
    assert choose_forward(q.to(dtype), k.to(dtype), v.to(dtype), m, causal) != MATMUL
    out, lse = _block(q.to(dtype), k.to(dtype), v.to(dtype), 0.125, m, causal)
    tol = dict(atol=3e-2, rtol=3e-2) if dtype == bf16 else dict(atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(out.double(), want[0], **tol)
    finite = torch.isfinite(want[1])
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse.double()[finite], want[1][finite], **tol)
    if mask == "floor":
        return      # the backward of a row at the floor divides its probabilities: matmuls (norm)
    grads = _block_backward(do.to(dtype), q.to(dtype), k.to(dtype), v.to(dtype), want[0].to(torch.float32),
                            want[1].to(torch.float32), 0.125, m, causal)
    ref = _block_backward(do.double(), q.double(), k.double(), v.double(), want[0], want[1], 0.125,
                          m if m is None or m.dtype == torch.bool else m.double(), causal, fused=False)
    for got, exp in zip(grads, ref):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), exp, **tol)


# ------------------------------------------------------------------------------ the summary
@pytest.mark.parametrize("kw, dropout, want", [
    ({}, 0.0, "cp attention blocks on cpu (float32): fused: torch's CPU flash kernel for blocks.*.attn"),
    (dict(device="cuda"), 0.0, "cp attention blocks on cuda (float32): fused: memory-efficient attention for "
                               "blocks.*.attn"),
    (dict(device="cuda", dtype="bf16"), 0.0, "cp attention blocks on cuda (bfloat16): fused: flash attention for "
                                             "blocks.*.attn"),
    (dict(device="cuda", dtype="bf16"), 0.1, "cp attention blocks on cuda (bfloat16): matmuls (each block's scores "
                                             "materialized in fp32) for blocks.*.attn (ring_attention: dropout, "
                                             "causal)"),
])
def test_summary_says_which_kernels_the_blocks_take(kw, dropout, want):
    from tp_models import batch, make
    pm = fxtron.parallelize(make("gpt", dropout=dropout), fxtron.Mesh(2, cp=2), example_inputs=batch("gpt", 2, 8, 0)[0],
                            cp_comm_type="p2p", **kw)
    assert want in pm.summary().splitlines()
