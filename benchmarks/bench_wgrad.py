"""Benchmarks: ops.wgrad — the weight-gradient GEMM fused into fp32 main_grad accumulation.

    .venv/bin/python -m pytest benchmarks/bench_wgrad.py --benchmark-only     # ~20 s on 2 cores

Two ways to add one micro-batch's weight gradient to a linear's fp32 main_grad [out, in]:
  fused    wgrad_accumulate(x, dy, main_grad): one GEMM whose accumulation lands in main_grad
           (CPU: addmm_ in fp32, 16-bit inputs upcast first; GPU: the Triton kernel)
  unfused  main_grad += dy.t() @ x: a separate [out, in] weight gradient in the inputs' dtype
           (rounded to bf16 when the inputs are bf16), then an add

1. CPU (test_cpu_wgrad): fp32 and bf16 inputs at (tokens, in, out) in CPU_SIZES. Both paths of a
   size are timed in one fixture with time.perf_counter, interleaved round by round (order
   alternating) so load from other work falls on both alike; pytest-benchmark's table replays
   those per-call times. extra_info: median_ms, GFLOP/s, `speedup_fused_vs_unfused` (unfused
   median / fused median), both paths' error against float64 (as a fraction of
   sum|dy||x| + |main_grad|), and the bytes each path allocates besides main_grad.
2. CUDA (test_cuda_wgrad, skipped without a GPU): bf16 inputs, 8192 tokens x 4096 in x 4096 out.
   The Triton kernel against torch matmul + add, the torch fallback (addmm_ on upcast inputs)
   and, where this torch has it, cuBLAS addmm with out_dtype=float32 into main_grad. Timed with
   triton.testing.do_bench (L2 flushed before each call) after one autotuning call; extra_info:
   TFLOP/s, `speedup_vs_torch_matmul_add`, the peak extra memory of one call, the error, and
   the autotuner's chosen config.
Nothing here asserts a speed; each path's result is checked against float64 first.
"""
from __future__ import annotations

import statistics
import time

import pytest
import torch

from replay import ReplayTimer, noop

from fxtron.codegen import wgrad
from fxtron.codegen.wgrad import TRITON_KERNEL, kernel_for, wgrad_accumulate

CPU_SIZES = [(2048, 1024, 1024), (1024, 1024, 4096)]   # (tokens, in, out)
CPU_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CPU_ROUNDS = 6                                          # timed calls per path, interleaved
GPU_SIZE = (8192, 4096, 4096)                           # (tokens, in, out)
VARIANTS = ["fused", "unfused"]


def _fused(x, dy, main_grad):
    wgrad_accumulate(x, dy, main_grad)


def _unfused(x, dy, main_grad):
    main_grad += dy.t() @ x   # a [out, in] gradient in x's dtype, then the add


def _error(fn, x, dy) -> float:
    """Worst |error| of one call into a zero main_grad, as a fraction of sum|dy||x|."""
    main_grad = torch.zeros(dy.shape[1], x.shape[1], device=x.device)
    fn(x, dy, main_grad)
    x64, dy64 = x.double(), dy.double()
    ref = dy64.t() @ x64
    scale = dy64.abs().t() @ x64.abs()
    return float(((main_grad.double() - ref).abs() / scale.clamp_min(1e-300)).max())


def _size_str(size) -> str:
    tokens, d_in, d_out = size
    return f"{tokens}x{d_in}->{d_out}"


# ---------------------------------------------------------------- pytest-benchmark glue
REPLAY = ReplayTimer()
_noop = noop


# ---------------------------------------------------------------- 1. CPU
@pytest.fixture(scope="module")
def cpu_results() -> dict:
    """(dtype name, size) -> {"times": {variant: [s, ...]}, "err": {variant: float}}."""
    fns = {"fused": _fused, "unfused": _unfused}
    out = {}
    gen = torch.Generator().manual_seed(0)
    for name, dtype in CPU_DTYPES.items():
        for size in CPU_SIZES:
            tokens, d_in, d_out = size
            x = torch.randn(tokens, d_in, generator=gen).to(dtype)
            dy = torch.randn(tokens, d_out, generator=gen).to(dtype)
            main_grad = torch.zeros(d_out, d_in)
            err = {v: _error(fns[v], x, dy) for v in VARIANTS}
            assert err["fused"] < 1e-5, (name, size, err)   # fp32 accumulation of exact products
            times = {v: [] for v in VARIANTS}
            for v in VARIANTS:                              # warm-up: one untimed call each
                fns[v](x, dy, main_grad)
            for r in range(CPU_ROUNDS):
                for v in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
                    t0 = time.perf_counter()
                    fns[v](x, dy, main_grad)
                    times[v].append(time.perf_counter() - t0)
            out[(name, size)] = {"times": times, "err": err}
    return out


@pytest.mark.benchmark(group="wgrad accumulate, CPU (measured, interleaved)", timer=REPLAY)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("size", CPU_SIZES, ids=_size_str)
@pytest.mark.parametrize("dtype_name", list(CPU_DTYPES))
def test_cpu_wgrad(benchmark, cpu_results, bench_report, dtype_name, size, variant):
    res = cpu_results[(dtype_name, size)]
    times = res["times"][variant]
    REPLAY.load(times)
    benchmark.pedantic(_noop, rounds=len(times), iterations=1)

    tokens, d_in, d_out = size
    med = {v: statistics.median(res["times"][v]) for v in VARIANTS}
    elem = torch.finfo(CPU_DTYPES[dtype_name]).bits // 8
    # besides main_grad: fused upcasts 16-bit x and dy to fp32; unfused makes an [out, in] gradient
    extra = {"fused": 0 if elem == 4 else 4 * tokens * (d_in + d_out), "unfused": elem * d_out * d_in}
    info = {
        "tokens": tokens, "in": d_in, "out": d_out, "input_dtype": dtype_name, "path": variant,
        "threads": torch.get_num_threads(),
        "median_ms": med[variant] * 1e3, "gflops": 2 * tokens * d_in * d_out / med[variant] / 1e9,
        "speedup_fused_vs_unfused": med["unfused"] / med["fused"],
        "max_rel_err": res["err"][variant], "extra_bytes": extra[variant],
    }
    if variant == "fused":
        info["kernel"] = kernel_for(torch.empty(1, d_in, dtype=CPU_DTYPES[dtype_name]),
                                    torch.empty(1, d_out, dtype=CPU_DTYPES[dtype_name]),
                                    torch.empty(d_out, d_in))
    benchmark.extra_info.update(info)

    section = bench_report.setdefault("wgrad accumulate into fp32 main_grad, CPU", {
        "headers": ["inputs", "tokens x in -> out", "fused ms", "unfused ms", "unfused / fused",
                    "fused err", "unfused err", "unfused extra MiB"],
        "rows": [],
        "notes": ["fused: wgrad_accumulate (addmm_ in fp32); unfused: main_grad += dy.t() @ x. "
                  f"Medians of {CPU_ROUNDS} interleaved calls; err: worst |error| / sum|dy||x|.",
                  "bf16 GEMMs run slowly on CPUs without native bf16 (AVX512-BF16/AMX); the "
                  "fused path upcasts and runs an fp32 GEMM instead."],
    })
    if variant == "fused":
        section["rows"].append([dtype_name, _size_str(size), f"{med['fused'] * 1e3:.1f}",
                                f"{med['unfused'] * 1e3:.1f}", f"{med['unfused'] / med['fused']:.2f}x",
                                f"{res['err']['fused']:.1e}", f"{res['err']['unfused']:.1e}",
                                f"{extra['unfused'] / 2**20:.1f}"])


# ---------------------------------------------------------------- 2. CUDA
GPU_VARIANTS = ["triton_fused", "torch_matmul_add", "torch_addmm_fp32_upcast", "torch_addmm_out_dtype"]
_cuda = pytest.mark.skipif(not torch.cuda.is_available() or wgrad.triton is None or wgrad.INTERPRETED,
                           reason="needs a CUDA GPU and compiled (not interpreted) triton")


def _addmm_out_dtype(x, dy, main_grad):
    # cuBLAS with bf16 operands and an fp32 C, beta=1, in place (torch's addmm.dtype_out)
    torch.addmm(main_grad, dy.t(), x, out_dtype=torch.float32, out=main_grad)


@pytest.fixture(scope="module")
def cuda_results() -> dict:
    from triton.testing import do_bench
    tokens, d_in, d_out = GPU_SIZE
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, d_in, device="cuda", generator=gen).bfloat16()
    dy = torch.randn(tokens, d_out, device="cuda", generator=gen).bfloat16()
    main_grad = torch.zeros(d_out, d_in, device="cuda")
    assert kernel_for(x, dy, main_grad) == TRITON_KERNEL
    fns = {
        "triton_fused": _fused,
        "torch_matmul_add": _unfused,
        "torch_addmm_fp32_upcast": lambda x, dy, g: wgrad_accumulate(x, dy, g, backend="torch"),
        "torch_addmm_out_dtype": _addmm_out_dtype,
    }
    out = {}
    for v, fn in fns.items():
        try:
            err = _error(fn, x, dy)   # also autotunes the Triton kernel (first call)
        except (RuntimeError, TypeError, NotImplementedError) as e:   # op missing in this torch
            out[v] = {"skip": f"{type(e).__name__}: {str(e)[:200]}"}
            continue
        if err > 1e-2:   # a wrong result would make its timing meaningless
            if v == "torch_addmm_out_dtype":   # optional: this torch's op may not alias out=self
                out[v] = {"skip": f"wrong result (max rel err {err:.2g})"}
                continue
            raise AssertionError(f"{v}: max rel err {err:.2g}")
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn(x, dy, main_grad)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        ms = do_bench(lambda: fn(x, dy, main_grad), warmup=50, rep=300, return_mode="all")
        out[v] = {"ms": ms, "err": err, "extra_bytes": extra}
    cfg = getattr(wgrad._wgrad_accum_kernel, "best_config", None)
    out["__config__"] = str(cfg) if cfg is not None else None
    return out


@_cuda
@pytest.mark.benchmark(group="wgrad accumulate, CUDA bf16 (do_bench)", timer=REPLAY)
@pytest.mark.parametrize("variant", GPU_VARIANTS)
def test_cuda_wgrad(benchmark, cuda_results, bench_report, variant):
    res = cuda_results[variant]
    if "skip" in res:
        pytest.skip(res["skip"])
    REPLAY.load([t / 1e3 for t in res["ms"]])
    benchmark.pedantic(_noop, rounds=len(res["ms"]), iterations=1)

    tokens, d_in, d_out = GPU_SIZE
    flops = 2 * tokens * d_in * d_out
    med = statistics.median(res["ms"])
    ref = statistics.median(cuda_results["torch_matmul_add"]["ms"])
    info = {"tokens": tokens, "in": d_in, "out": d_out, "input_dtype": "bf16", "path": variant,
            "gpu": torch.cuda.get_device_name(), "median_ms": med, "tflops": flops / (med * 1e-3) / 1e12,
            "speedup_vs_torch_matmul_add": ref / med, "max_rel_err": res["err"],
            "extra_peak_bytes": res["extra_bytes"]}
    if variant == "triton_fused":
        info["triton_config"] = cuda_results["__config__"]
    benchmark.extra_info.update(info)

    section = bench_report.setdefault("wgrad accumulate into fp32 main_grad, CUDA", {
        "headers": ["path", "median ms", "TFLOP/s", "speedup vs matmul+add", "extra peak MiB", "err"],
        "rows": [],
        "notes": [f"bf16 inputs, {tokens} tokens x {d_in} in -> {d_out} out; "
                  f"triton config: {cuda_results['__config__']}"],
    })
    section["rows"].append([variant, f"{med:.3f}", f"{info['tflops']:.0f}", f"{ref / med:.2f}x",
                            f"{res['extra_bytes'] / 2**20:.0f}", f"{res['err']:.1e}"])
