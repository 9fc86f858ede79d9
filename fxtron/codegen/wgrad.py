"""Codegen: the weight-gradient GEMM fused with gradient accumulation (Megatron's
`gradient_accumulation_fusion`, apex's `wgrad_gemm_accum_fp32`).

For a linear `y = x @ W.T` (W is [out, in], nn.Linear's layout) the weight gradient of one
micro-batch is `dy^T @ x`: a GEMM whose reduction runs over the tokens. Megatron keeps an fp32
`main_grad` beside each 16-bit weight and adds every micro-batch's gradient to it; fused, the
GEMM's epilogue adds its fp32 accumulator straight into `main_grad`, so no 16-bit weight
gradient is materialized, nothing is rounded to 16 bits, and there is no second pass over a
[out, in] tensor:

    main_grad[o, i] += sum_t dy[t, o] * x[t, i]          # M = out, N = in, K = tokens

The kernel is the Triton matmul tutorial's (python/tutorials/03-matrix-multiplication.py) with
A = dy^T read through dy's strides (no transpose is copied), B = x, and the store replaced by a
read-add-write of the main_grad tile. Each program owns one [BLOCK_SIZE_M, BLOCK_SIZE_N] tile
of main_grad, walks the tokens BLOCK_SIZE_K at a time, accumulates in fp32 with `tl.dot`, and
programs are ordered in groups of GROUP_SIZE_M tile-rows so that neighbouring programs share
dy and x tiles in L2. Any strides, any sizes (edges are masked).

Dispatch (a kernel is taken only where its check accepts the call; everything else is torch):

| kernel                    | takes                                                     |
|---------------------------|-----------------------------------------------------------|
| triton_wgrad_accum_fp32   | CUDA tensors, bf16/fp16 inputs (fp32 only if asked for)    |
| addmm_fp32                | everything: `main_grad.addmm_(dy.t().float(), x.float())`  |

fp32 inputs on a GPU go to addmm_ because cuBLAS already accumulates in place (beta=1) there.
With TRITON_INTERPRET=1 set before this module is imported, `backend="triton"` runs the kernel
in Triton's interpreter on CPU tensors (slow: for tests).
"""
from __future__ import annotations

import math
import os
from contextlib import nullcontext
from typing import Literal

import torch
from torch import Tensor

from fxtron.ops.kernels import Kernel, register_kernel

try:  # triton is a Linux-only dependency; without it everything takes the torch path
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

TRITON_KERNEL = "triton_wgrad_accum_fp32"
TORCH_KERNEL = "addmm_fp32"
Backend = Literal["auto", "triton", "torch"]

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_HALF_DTYPES = (torch.bfloat16, torch.float16)


# ------------------------------------------------------------------------------ the kernel
if triton is not None:
    # Decided once, when the kernel below is decorated: triton.jit builds an interpreted
    # function iff TRITON_INTERPRET=1 (triton.knobs.runtime.interpret) at that moment.
    _knobs = getattr(triton, "knobs", None)
    INTERPRETED = (bool(_knobs.runtime.interpret) if _knobs is not None
                   else os.environ.get("TRITON_INTERPRET") == "1")

    def _autotune_configs() -> list:
        """Block shapes to try, the tutorial's best few for 16-bit GEMMs on recent GPUs. The
        interpreter runs every program in numpy, so it gets one small config (which still
        leaves several tiles, a partial group and masked edges at test sizes)."""
        if INTERPRETED:
            return [triton.Config({"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16,
                                   "GROUP_SIZE_M": 2})]
        # Sizes checked by compiling for sm_90 (bf16, unit strides): all use wgmma; the read-add-
        # write epilogue holds a main_grad tile beside the accumulator, so the 128x256/8-warp and
        # 128x128/4-warp configs spill a little there (once per tile); 128x128/8-warp does not.
        def cfg(m, n, k, stages, warps):
            return triton.Config({"BLOCK_SIZE_M": m, "BLOCK_SIZE_N": n, "BLOCK_SIZE_K": k, "GROUP_SIZE_M": 8},
                                 num_stages=stages, num_warps=warps)
        return [cfg(128, 256, 64, 3, 8), cfg(256, 128, 64, 3, 8), cfg(128, 128, 64, 3, 8),
                cfg(128, 128, 64, 4, 4), cfg(128, 64, 32, 4, 4), cfg(64, 128, 32, 4, 4)]

    def _prune_configs(configs, named_args, **kwargs) -> list:
        """fp32 operands take the FMA path (no tensor cores), whose tiles spill massively above
        64 accumulator values per thread; keep only those configs for fp32."""
        if named_args["x_ptr"].dtype != torch.float32:
            return configs
        return [c for c in configs
                if c.kwargs["BLOCK_SIZE_M"] * c.kwargs["BLOCK_SIZE_N"] <= 64 * 32 * c.num_warps]

    # The token count is left out of the key: micro-batches of varying length reuse one tuning.
    # restore_value: tuning runs the kernel once per config, and each run adds into main_grad.
    @triton.autotune(configs=_autotune_configs(), key=["M", "N"], restore_value=["main_grad_ptr"],
                     prune_configs_by={"early_config_prune": _prune_configs})
    @triton.jit
    def _wgrad_accum_kernel(
        # Pointers: A = dy^T [M, K] (read through dy's strides), B = x [K, N], C = main_grad [M, N]
        dy_ptr, x_ptr, main_grad_ptr,
        # Problem size: M = out features, N = in features, K = tokens
        M, N, K,
        # Strides, in elements, of A = dy^T (stride_am is dy's feature stride, stride_ak its
        # token stride), of B = x, and of C = main_grad
        stride_am, stride_ak,
        stride_bk, stride_bn,
        stride_cm, stride_cn,
        # Meta-parameters
        BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
        GROUP_SIZE_M: tl.constexpr,
        UPCAST: tl.constexpr,         # dot in fp32 (the interpreter's bf16 tl.dot is wrong)
        DOT_PRECISION: tl.constexpr,  # fp32 inputs: "ieee" or "tf32", as torch allows
    ):
        """main_grad[M, N] += dy^T[M, K] @ x[K, N], accumulated in fp32."""
        # -- which tile of main_grad: grouped ordering, GROUP_SIZE_M tile-rows at a time (L2 reuse)
        pid = tl.program_id(axis=0)
        num_pid_m = tl.cdiv(M, BLOCK_SIZE_M)
        num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
        num_pid_in_group = GROUP_SIZE_M * num_pid_n
        group_id = pid // num_pid_in_group
        first_pid_m = group_id * GROUP_SIZE_M
        group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
        pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
        pid_n = (pid % num_pid_in_group) // group_size_m

        # -- first A and B tiles. Rows/columns past the edge wrap (% M, % N) onto valid ones, so
        # the loop needs no M/N masks; the store below drops them. int64 offsets: any extent.
        offs_am = ((pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)) % M).to(tl.int64)
        offs_bn = ((pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)) % N).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_SIZE_K).to(tl.int64)
        a_ptrs = dy_ptr + (offs_am[:, None] * stride_am + offs_k[None, :] * stride_ak)
        b_ptrs = x_ptr + (offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn)

        # -- K-loop over the tokens; the accumulator is fp32 whatever the inputs are
        accumulator = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
            k_left = K - k * BLOCK_SIZE_K  # tokens past the end load as 0 and add nothing
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            accumulator = tl.dot(a, b, accumulator, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_SIZE_K * stride_ak
            b_ptrs += BLOCK_SIZE_K * stride_bk

        # -- epilogue (the fusion): read this tile of main_grad, add the fp32 accumulator, write
        # it back. No 16-bit weight gradient exists at any point.
        offs_cm = (pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)).to(tl.int64)
        offs_cn = (pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)).to(tl.int64)
        c_ptrs = main_grad_ptr + stride_cm * offs_cm[:, None] + stride_cn * offs_cn[None, :]
        c_mask = (offs_cm[:, None] < M) & (offs_cn[None, :] < N)
        c = tl.load(c_ptrs, mask=c_mask, other=0.0)
        tl.store(c_ptrs, c + accumulator, mask=c_mask)
else:  # pragma: no cover
    INTERPRETED = False


def _launch_triton(x2: Tensor, dy2: Tensor, main_grad: Tensor) -> None:
    """main_grad += dy2^T @ x2 with the Triton kernel; x2 [K, N], dy2 [K, M], checked already."""
    K, N = x2.shape
    M = dy2.shape[1]
    if M == 0 or N == 0:
        return
    if x2.dtype == torch.float32:
        # Follow torch's own setting for fp32 GEMMs (default "highest": no TF32).
        precision = "tf32" if torch.backends.cuda.matmul.allow_tf32 and not INTERPRETED else "ieee"
    else:
        precision = "tf32"  # triton's default; ignored for 16-bit operands
    grid = lambda META: (triton.cdiv(M, META["BLOCK_SIZE_M"]) * triton.cdiv(N, META["BLOCK_SIZE_N"]),)  # noqa: E731
    # Triton launches on the current device: switch only when main_grad lives elsewhere
    switch = main_grad.is_cuda and main_grad.device.index != torch.cuda.current_device()
    with torch.cuda.device(main_grad.device) if switch else nullcontext():
        _wgrad_accum_kernel[grid](
            dy2, x2, main_grad,
            M, N, K,
            dy2.stride(1), dy2.stride(0),
            x2.stride(0), x2.stride(1),
            main_grad.stride(0), main_grad.stride(1),
            UPCAST=INTERPRETED and x2.dtype == torch.bfloat16,
            DOT_PRECISION=precision,
        )


def _launch_addmm(x2: Tensor, dy2: Tensor, main_grad: Tensor) -> None:
    """main_grad += dy2^T @ x2 as one fused addmm_ in fp32. 16-bit inputs are upcast first:
    that costs fp32 copies of x and dy (activation-sized), never a [out, in] weight gradient."""
    main_grad.addmm_(dy2.t().float(), x2.float())


# ------------------------------------------------------------------------------ the checks
def _flatten(x: Tensor, dy: Tensor, main_grad: Tensor) -> tuple[Tensor, Tensor]:
    """Validate a call; return x and dy as 2-D [tokens, features]. (Runs once per linear and
    micro-batch: the checks are plain comparisons, and messages are built only on failure.)"""
    def where() -> str:
        def shape(t: Tensor) -> str:
            return f"[{', '.join(str(s) for s in t.shape)}]"
        return f"wgrad_accumulate(x {shape(x)}, dy {shape(dy)}, main_grad {shape(main_grad)})"

    if x.ndim < 1 or dy.ndim < 1:
        raise ValueError(f"{where()}: x and dy need a feature dim (x [..., in], dy [..., out])")
    if main_grad.ndim != 2 or main_grad.shape[0] != dy.shape[-1] or main_grad.shape[1] != x.shape[-1]:
        raise ValueError(f"{where()}: main_grad must be [out, in] = [{dy.shape[-1]}, {x.shape[-1]}] "
                         f"(nn.Linear's weight layout), got {list(main_grad.shape)}")
    if x.shape[:-1] != dy.shape[:-1]:
        raise ValueError(f"{where()}: x and dy must have the same leading (token) dims, "
                         f"got {list(x.shape[:-1])} and {list(dy.shape[:-1])}")
    if main_grad.dtype != torch.float32:
        raise ValueError(f"{where()}: main_grad must be float32, got {main_grad.dtype}")
    if x.dtype != dy.dtype or x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"{where()}: x and dy must share one of float32/bfloat16/float16, "
                         f"got {x.dtype} and {dy.dtype}")
    if not (x.device == dy.device == main_grad.device):
        raise ValueError(f"{where()}: tensors on different devices: {x.device}, {dy.device}, "
                         f"{main_grad.device}")
    tokens = math.prod(x.shape[:-1])  # not reshape(-1, f): that fails when f == 0
    # views where the strides allow (2-D inputs always); otherwise reshape copies
    return x.reshape(tokens, x.shape[-1]), dy.reshape(tokens, dy.shape[-1])  # (T, in), (T, out)


def triton_check(x: Tensor, dy: Tensor, main_grad: Tensor) -> str | None:
    """The Triton kernel's check, on a call that passed validation: None when the kernel can
    take it, else the reason it cannot. Reads only device and dtype (never a token count), so a
    compiler can ask it on fake tensors with symbolic shapes."""
    if triton is None:
        return "triton is not installed"
    if not INTERPRETED and main_grad.device.type != "cuda":
        return (f"tensors on {main_grad.device}: the compiled kernel needs a GPU (set "
                "TRITON_INTERPRET=1 before importing fxtron.codegen.wgrad to interpret it)")
    return None


def _choose(x: Tensor, dy: Tensor, main_grad: Tensor, backend: str) -> str:
    if backend == "torch":
        return TORCH_KERNEL
    reason = triton_check(x, dy, main_grad)
    if backend == "triton":
        if reason is not None:
            raise ValueError(f"wgrad_accumulate(backend='triton'): {reason}")
        return TRITON_KERNEL
    if backend != "auto":
        raise ValueError(f"wgrad_accumulate: backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    # auto: the kernel only where torch has no fused equivalent, i.e. 16-bit inputs on a GPU
    # (fp32 inputs: cuBLAS addmm_ accumulates in place already). Never the interpreter.
    if (reason is None and not INTERPRETED and main_grad.device.type == "cuda"
            and x.dtype in _HALF_DTYPES):
        return TRITON_KERNEL
    return TORCH_KERNEL


# ------------------------------------------------------------------------------ public API
def kernel_for(x: Tensor, dy: Tensor, main_grad: Tensor, *, backend: Backend = "auto") -> str:
    """Which kernel `wgrad_accumulate(x, dy, main_grad, backend=backend)` would run:
    "triton_wgrad_accum_fp32" or "addmm_fp32". Validates the call like wgrad_accumulate
    (ValueError). Works on fake and meta tensors (reads shapes, dtypes and devices only)."""
    _flatten(x, dy, main_grad)
    return _choose(x, dy, main_grad, backend)


@torch.no_grad()
def wgrad_accumulate(x: Tensor, dy: Tensor, main_grad: Tensor, *,
                     backend: Backend = "auto") -> Tensor:
    """Accumulate a linear layer's weight gradient into its fp32 main_grad, in place.

    x:         [..., in]  the layer's input (any strides; leading dims are tokens)
    dy:        [..., out] the gradient of its output, same leading dims and dtype as x
               (float32, bfloat16 or float16)
    main_grad: [out, in]  float32, nn.Linear's weight layout; updated in place
    backend:   "auto" (see the module docstring), "triton" (ValueError if the kernel's check
               refuses the call) or "torch"
    Returns main_grad, after `main_grad += dy_2d^T @ x_2d` summed in fp32. Raises ValueError
    naming the shapes for mismatched shapes, a non-fp32 main_grad, or unsupported dtypes.
    """
    x2, dy2 = _flatten(x, dy, main_grad)  # (T, in), (T, out)
    if _choose(x, dy, main_grad, backend) == TRITON_KERNEL:
        _launch_triton(x2, dy2, main_grad)
    else:
        _launch_addmm(x2, dy2, main_grad)
    return main_grad


register_kernel(Kernel("wgrad", run=wgrad_accumulate, choose=kernel_for))   # what fxtron::linear's backward calls

__all__ = ["wgrad_accumulate", "kernel_for", "triton_check", "TRITON_KERNEL", "TORCH_KERNEL",
           "INTERPRETED"]
