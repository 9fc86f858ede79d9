"""Tests: ops.wgrad — the fused weight-gradient accumulation (main_grad += dy^T @ x in fp32).

Every case is checked against a float64 reference built from the very inputs the kernel saw
(16-bit inputs are exact in float64), so only the error of accumulating in fp32 remains:

    |main_grad - ref| <= RTOL * (|main_grad0| + sum over calls of |dy|^T @ |x|)    elementwise

RTOL = 1e-5 for every input dtype: a sum of K fp32 terms is off by at most K * 2^-24 of the sum
of magnitudes (3.8e-6 at the K <= 64 tokens per call used here), products of bf16/fp16 values
are exact in fp32, and each call adds one rounding of main_grad. A 16-bit weight gradient
(the unfused path in bf16) misses this bound by far; a test shows that.

The Triton kernel runs in Triton's interpreter on CPU tensors. The interpreter is chosen when
the kernel is decorated, i.e. when fxtron.codegen.wgrad is first imported with
TRITON_INTERPRET=1, so those cases run in ONE subprocess (this file run as a script) and report
back as JSON; the pytest process itself stays uninterpreted.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from fxtron.codegen import wgrad
from fxtron.codegen.wgrad import TORCH_KERNEL, TRITON_KERNEL, kernel_for, wgrad_accumulate
from fxtron.tools.testing import scaled

RTOL = 1e-5
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    lead: tuple[int, ...] = (37,)   # token dims of x and dy
    d_in: int = 45
    d_out: int = 29
    layout: str = "contiguous"      # contiguous | x_t | both_t | seq_first | grad_t
    calls: int = 1                  # micro-batches accumulated into one main_grad


CASES = {
    "fp32": Case(torch.float32),
    "bf16": Case(torch.bfloat16),
    "fp16": Case(torch.float16),
    "fp32_x_transposed": Case(torch.float32, layout="x_t"),
    "bf16_both_transposed": Case(torch.bfloat16, layout="both_t"),
    "bf16_3d_seq_first": Case(torch.bfloat16, lead=(7, 5), layout="seq_first"),
    "fp16_main_grad_transposed": Case(torch.float16, layout="grad_t"),
    "bf16_tall": Case(torch.bfloat16, lead=(50,), d_in=33, d_out=70),   # 5 tile-rows: partial group
    "fp32_3_microbatches": Case(torch.float32, calls=3),
    "bf16_3_microbatches": Case(torch.bfloat16, lead=(20,), calls=3),
    "bf16_no_tokens": Case(torch.bfloat16, lead=(0,)),
    "fp16_one_token_1d": Case(torch.float16, lead=()),
    "bf16_no_in_features": Case(torch.bfloat16, d_in=0),
}


def _inputs(case: Case, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch: x [*lead, in] and dy [*lead, out] in the case's dtype and layout."""
    def make(feat: int, transposed: bool) -> torch.Tensor:
        if case.layout == "seq_first":  # [b, s, f] stored, used as [s, b, f] (Megatron's layout)
            return torch.randn(case.lead[1], case.lead[0], feat, generator=gen).to(case.dtype).transpose(0, 1)
        if transposed:                  # [f, T] stored, used as [T, f]: strides (1, T)
            return torch.randn(feat, *case.lead, generator=gen).to(case.dtype).t()
        return torch.randn(*case.lead, feat, generator=gen).to(case.dtype)

    x = make(case.d_in, case.layout in ("x_t", "both_t"))
    dy = make(case.d_out, case.layout == "both_t")
    return x, dy


def run_case(case: Case, backend: str, seed: int = 0) -> dict:
    """Accumulate `calls` micro-batches into a random main_grad; compare with float64.
    Returns the worst error as a fraction of its bound ("ratio" <= 1 passes) and the kernel."""
    gen = torch.Generator().manual_seed(seed)
    if case.layout == "grad_t":
        main_grad = torch.randn(case.d_in, case.d_out, generator=gen).t()  # strides (1, out)
    else:
        main_grad = torch.randn(case.d_out, case.d_in, generator=gen)
    ref = main_grad.double()
    scale = main_grad.double().abs()
    kernels = set()
    for _ in range(case.calls):
        x, dy = _inputs(case, gen)
        tokens = math.prod(case.lead)
        x64, dy64 = x.double().reshape(tokens, case.d_in), dy.double().reshape(tokens, case.d_out)
        ref = ref + dy64.t() @ x64
        scale = scale + dy64.abs().t() @ x64.abs()
        kernels.add(kernel_for(x, dy, main_grad, backend=backend))
        out = wgrad_accumulate(x, dy, main_grad, backend=backend)
        assert out is main_grad
    err = (main_grad.double() - ref).abs()
    bound = RTOL * scale
    return {"ratio": float((err / bound.clamp_min(1e-300)).max()) if err.numel() else 0.0,
            "max_err": float(err.max()) if err.numel() else 0.0,
            "kernels": sorted(kernels), "dtype": str(main_grad.dtype)}


# ------------------------------------------------------------------------------ CPU: addmm_
@pytest.mark.parametrize("name", list(CASES))
def test_cpu_addmm_within_bound(name):
    res = run_case(CASES[name], backend="auto")
    assert res["kernels"] == [TORCH_KERNEL]
    assert res["dtype"] == "torch.float32"
    assert res["ratio"] <= 1.0, f"{name}: error {res['max_err']:.3g} is {res['ratio']:.2f}x the bound"


def test_unfused_16bit_weight_gradient_misses_the_bound():
    """The bound is tight enough to see a bf16 weight gradient rounded before the add."""
    case = CASES["bf16"]
    gen = torch.Generator().manual_seed(0)
    main_grad = torch.randn(case.d_out, case.d_in, generator=gen)
    x, dy = _inputs(case, gen)
    ref = main_grad.double() + dy.double().t() @ x.double()
    scale = main_grad.double().abs() + dy.double().abs().t() @ x.double().abs()
    unfused = main_grad + (dy.t() @ x).float()  # a bf16 [out, in] gradient, then the add
    assert ((unfused.double() - ref).abs() / scale).max() > 10 * RTOL


def test_no_autograd_history():
    x = torch.randn(5, 4, requires_grad=True)
    dy = torch.randn(5, 3)
    main_grad = torch.zeros(3, 4)
    wgrad_accumulate(x, dy, main_grad)
    assert main_grad.grad_fn is None and not main_grad.requires_grad


# ------------------------------------------------------------------------------ dispatch
def test_kernel_for_cpu_and_meta():
    x, dy, g = torch.randn(8, 6), torch.randn(8, 4), torch.zeros(4, 6)
    assert kernel_for(x, dy, g) == TORCH_KERNEL
    assert kernel_for(x, dy, g, backend="torch") == TORCH_KERNEL
    m = dict(device="meta")
    assert kernel_for(torch.empty(2, 3, 6, dtype=torch.bfloat16, **m),
                      torch.empty(2, 3, 4, dtype=torch.bfloat16, **m), torch.empty(4, 6, **m)) == TORCH_KERNEL


@pytest.mark.skipif(wgrad.triton is None, reason="triton is not installed")
def test_kernel_for_fake_cuda_tensors():
    """The compiler asks on fake tensors; fake CUDA tensors need no GPU. 16-bit -> Triton,
    fp32 -> cuBLAS addmm_ (already fused in place)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        def t(*shape, dtype):
            return torch.empty(*shape, dtype=dtype, device="cuda")
        g = t(29, 45, dtype=torch.float32)
        for dtype, want in [(torch.bfloat16, TRITON_KERNEL), (torch.float16, TRITON_KERNEL),
                            (torch.float32, TORCH_KERNEL)]:
            got = kernel_for(t(4, 37, 45, dtype=dtype), t(4, 37, 29, dtype=dtype), g)
            assert got == (TORCH_KERNEL if wgrad.INTERPRETED else want), dtype
        assert kernel_for(t(37, 45, dtype=torch.float32), t(37, 29, dtype=torch.float32), g,
                          backend="triton") == TRITON_KERNEL


@pytest.mark.skipif(wgrad.INTERPRETED, reason="this process interprets Triton kernels")
def test_forcing_triton_on_cpu_without_interpreter_raises():
    x, dy, g = torch.randn(8, 6), torch.randn(8, 4), torch.zeros(4, 6)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        wgrad_accumulate(x, dy, g, backend="triton")
    assert torch.equal(g, torch.zeros(4, 6))


# ------------------------------------------------------------------------------ bad inputs
@pytest.mark.parametrize("x_shape, dy_shape, g_shape, g_dtype, x_dtype, match", [
    ((37, 45), (37, 29), (45, 29), torch.float32, torch.float32,
     r"x \[37, 45\], dy \[37, 29\], main_grad \[45, 29\].*main_grad must be \[out, in\] = \[29, 45\]"),
    ((37, 45), (36, 29), (29, 45), torch.float32, torch.float32,
     r"x \[37, 45\], dy \[36, 29\].*same leading \(token\) dims, got \[37\] and \[36\]"),
    ((2, 18, 45), (36, 29), (29, 45), torch.float32, torch.float32, r"same leading \(token\) dims"),
    ((37, 45), (37, 29), (29, 45), torch.bfloat16, torch.bfloat16,
     r"main_grad \[29, 45\].*main_grad must be float32, got torch.bfloat16"),
    ((37, 45), (37, 29), (29, 45), torch.float32, torch.float64, r"float32/bfloat16/float16"),
    ((), (37, 29), (29, 45), torch.float32, torch.float32, r"x \[\].*feature dim"),
])
def test_bad_inputs_raise_value_error(x_shape, dy_shape, g_shape, g_dtype, x_dtype, match):
    x = torch.zeros(x_shape, dtype=x_dtype)
    dy = torch.zeros(dy_shape, dtype=torch.float32 if x_dtype == torch.float64 else x_dtype)
    g = torch.zeros(g_shape, dtype=g_dtype)
    with pytest.raises(ValueError, match=match):
        wgrad_accumulate(x, dy, g)
    with pytest.raises(ValueError, match=match):
        kernel_for(x, dy, g)


def test_mixed_input_dtypes_and_bad_backend_raise():
    x, g = torch.zeros(4, 6, dtype=torch.bfloat16), torch.zeros(3, 6)
    with pytest.raises(ValueError, match="got torch.bfloat16 and torch.float32"):
        wgrad_accumulate(x, torch.zeros(4, 3), g)
    with pytest.raises(ValueError, match="backend must be"):
        wgrad_accumulate(x, torch.zeros(4, 3, dtype=torch.bfloat16), g, backend="cublas")


# ------------------------------------------------------------------------------ Triton (interpreted)
@pytest.fixture(scope="module")
def interpreted() -> dict:
    """Run every case through the Triton kernel in one TRITON_INTERPRET=1 subprocess."""
    if wgrad.triton is None:
        pytest.skip("triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, __file__, "--interpreted"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=scaled(300))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_interpreter_engaged(interpreted):
    info = interpreted["__info__"]
    assert info["interpreted"] is True
    assert info["auto_on_cpu"] == TORCH_KERNEL  # auto never picks the interpreter


@pytest.mark.parametrize("name", list(CASES))
def test_triton_kernel_within_bound(interpreted, name):
    res = interpreted[name]
    assert res["kernels"] == [TRITON_KERNEL]
    assert res["dtype"] == "torch.float32"
    assert res["ratio"] <= 1.0, f"{name}: error {res['max_err']:.3g} is {res['ratio']:.2f}x the bound"


def _interpreted_main() -> None:
    assert wgrad.INTERPRETED, "run with TRITON_INTERPRET=1"
    x, dy, g = torch.randn(8, 6), torch.randn(8, 4), torch.zeros(4, 6)
    out = {"__info__": {"interpreted": wgrad.INTERPRETED, "auto_on_cpu": kernel_for(x, dy, g)}}
    for name, case in CASES.items():
        out[name] = run_case(case, backend="triton")
    print(json.dumps(out))


if __name__ == "__main__" and "--interpreted" in sys.argv:
    _interpreted_main()
