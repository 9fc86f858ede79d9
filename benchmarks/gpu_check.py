"""GPU checks in one short run (a CUDA machine; see README "GPU figures").

    python benchmarks/gpu_check.py [--quick] [--out FILE.json] [--checks a,b,...] [--budget-s S]

The full run takes its checks in the order of CHECKS (issue 48's goals first: 6., 2. on the small
Llama, 7.; then 1., 4., 3., 2. on the large one, 5.) and starts none after --budget-s seconds
(default 330: with the deadline's 90 s, 7 minutes; a 15-minute GPU loan leaves room for the machine's start and a rerun); those left
are listed under "skipped" (exit status 2 when all that ran are ok). Each check's JSON is
printed as it ends and the document so far written to --out, so a run stopped from outside
keeps what it measured; no job a check launches runs past --deadline-s (default: the budget +
90 s), so one slow check fails alone instead of taking the rest of the loan. On the lent device
machine only what is written under $OUT comes back (and 12,000 characters of output): --out
defaults to $OUT/gpu.json there, and README's block is rewritten here afterwards from it:

    python benchmarks/gpu_check.py                                     # on the device: $OUT/gpu.json
    python benchmarks/gpu_check.py --readme --from-json <fetched>/gpu.json   # here

1. The Triton weight-gradient kernel (codegen/wgrad.py) compiled for the GPU, not interpreted:
   for bf16 and fp16 inputs at several (tokens, in, out) shapes, including ones that are not
   multiples of the block sizes, one call into a main_grad already holding values; error
   against float64 as a fraction of sum|dy||x| + |main_grad|; time (triton.testing.do_bench)
   against torch's two ways: `main_grad += dy.t() @ x` (a 16-bit gradient, then an add) and
   `main_grad.addmm_(dy.t().float(), x.float())` (the fp32 fallback).
2. A training step on the GPU: fxtron.launch of one NCCL rank (Mesh(1)), Llamas of hidden 1024
   (8 layers, batch 8 x 1024) and hidden 4096 (4 layers, batch 4 x 2048), bf16 compute with fp32 parameters and gradient accumulation fused
   into the Triton kernel, against the unmodified model under the same precision policy in the
   same process: losses, first-step gradients and weights after 3 AdamW steps compared with the
   mixed-precision tests' tolerances (tests/test_mixed_precision.py), and the median step time
   of each (CUDA-synchronized wall clock) as a ratio.
3. Recomputation on the GPU (issue 17): one NCCL rank trains a Llama at real width (hidden 4096,
   2 layers, batch 1 x 4096, bf16) without recomputation, with recompute="selective" and with
   recompute="full": the allocator's peak over one step (torch.cuda.max_memory_allocated, from
   a reset after the warm-up), the bytes saved for backward at their peak (the memory
   timeline), the step time, and the first step's gradients, which must equal the run
   without recomputation bit for bit (the job runs torch's deterministic algorithms: flash
   attention's backward is not deterministic otherwise, nor then are two runs without it).
4. One context-parallel attention block (ops/cp/blocks.py `_block` + `_block_backward`, the
   ring's unit; on CUDA codegen/attention.py's fused kernels): bf16, B=1, 32 heads, head dim
   128, top-left causal, forward and backward, for L = 2048, 4096, 8192, against torch's flash
   attention with its log-sum-exp on the same block: the median time and the peak memory
   (allocated during forward and backward, inputs included) as ratios; `ok` within 1.2x time and
   1.5x memory, with out and the gradients matching torch's.
5. `fxtron train` as a user runs it (`python -m fxtron train`, its own process, --dtype bf16
   --world-size 1) on a transformers Llama directory (~0.95B: hidden 2048, 16 layers, ffn 5632,
   16 heads, vocab 32000; save_pretrained with safetensors) and a Megatron dataset of random
   documents (fxtron's writer), batch 8 x 2048, against the same model in a plain PyTorch loop
   under the trainer's precision policy, eager and under torch.compile: median step time after
   warm-up (CUDA-synchronized), tokens/s, MFU (the trainer's step_flops over the bf16 peak),
   peak memory; `ok` when the run completes and its first losses equal the eager loop's within
   the mixed-precision tolerance. --trainer-only runs it alone; --no-compile drops the compiled
   baseline.
6. compile=True (codegen/regions.py) at world 1 on the small Llama of 2., against torch.compile of
   the unmodified model under the same precision policy: the step times and their ratio (the
   goal: <= 0.95x), fxtron uncompiled beside them, the numbers within the mixed-precision
   tolerances. At world 1 the compiled program's linears are fxtron::master_linear inside its
   one compiled region (the fp32 weight cast there, its weight gradient accumulated in fp32:
   compiler/passmanager.py linears_in_regions); beside it compile=True with
   gradient_accumulation_fusion=False (`..._unfused`), the linears aten ops whose weight
   gradients are bf16 as torch.compile's are: what the fp32 weight gradient costs.
   --compiled-only runs it alone; --no-compile drops it.
7. cuda_graphs=True (runtime/graphs.py) at world 1 (one NCCL rank) on the small Llama of 2., bf16:
   the program whose step is captured in a CUDA graph (one warm-up step, step 2 captured, then
   replayed) against the same program uncaptured: losses, first-step gradients and weights after
   3 steps within the mixed-precision tolerances (the figures reported: they differ by
   capturable Adam's float32 bias corrections alone), and the median step time of each (the
   timed steps are replays). --cuda-graphs-only runs it alone. Without CUDA (the dry run) the
   key says "refused: <reason>" -- parallelize's refusal of a CPU device -- and is ok.
--readme [README.md] rewrites README's GPU figures block (between its gpu-figures markers) from
the run's JSON with the date and the machine; with --from-json FILE.json, from a saved document
and without running. --cpu-dry-run runs the checks' logic on tiny shapes on a CPU (5. without its
compiled baseline unless --dry-run-compile: Inductor's CPU build takes minutes).
Prints one JSON document (and writes it with --out); exits non-zero if a check fails.
`--cpu-dry-run` runs checks 2-4's logic on tiny shapes on CPU (4: L=64, 2 heads, torch's CPU
flash kernel as the reference; times reported, not held to the bounds).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import math
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0])   # the repository root, when run as a script
if "--cpu-dry-run" in sys.argv:   # the wgrad kernel in Triton's interpreter: decided when fxtron imports it
    os.environ.setdefault("TRITON_INTERPRET", "1")

import fxtron  # noqa: E402
from fxtron.codegen.wgrad import TRITON_KERNEL, kernel_for, wgrad_accumulate  # noqa: E402
from fxtron.models.llama import Llama, LlamaConfig  # noqa: E402
from fxtron.ops.cp.blocks import _block, _block_backward  # noqa: E402

SHAPES = [(8192, 4096, 4096), (4096, 4096, 11008), (4096, 11008, 4096), (1000, 1000, 3000), (77, 4096, 4096)]
QUICK_SHAPES = [(4096, 4096, 4096), (1000, 1000, 3000)]
DRY_RUN_SHAPES = [(40, 24, 36), (7, 16, 16)]      # interpreted: several tiles, masked edges
# (config, batch, sequence): a small model, where one step's GPU work is short enough that the
# CPU's Python overhead can show, and a 7B-layer-shaped one (hidden 4096, 4 layers)
TRAIN_CASES = {
    "small": (LlamaConfig(vocab_size=32000, max_seq_len=1024, n_layer=8, n_head=16, n_kv_head=8, dim=1024,
                          ffn_dim=2816), 8, 1024),
    "large": (LlamaConfig(vocab_size=32000, max_seq_len=2048, n_layer=4, n_head=32, n_kv_head=8, dim=4096,
                          ffn_dim=11008), 4, 2048),
}
STEPS, LR = 3, 1e-3
TIMED = 10


def check_kernel(shapes, device: str = "cuda") -> list[dict]:
    """1. The weight-gradient kernel against float64 and torch. On the CPU (the dry run, where
    TRITON_INTERPRET=1 is set before fxtron is imported) the same kernel runs in Triton's
    interpreter, timed by the wall clock."""
    if device == "cuda":
        import triton.testing
        bench = triton.testing.do_bench
    else:
        def bench(fn):
            return 1e3 * statistics.median(_sync_time(fn) for _ in range(3))
    backend = "auto" if device == "cuda" else "triton"

    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        for tokens, d_in, d_out in shapes:
            x = torch.randn(tokens, d_in, device=device, generator=gen).to(dtype)
            dy = torch.randn(tokens, d_out, device=device, generator=gen).to(dtype)
            start = torch.randn(d_out, d_in, device=device, generator=gen)
            kernel = kernel_for(x, dy, start, backend=backend)
            mg = start.clone()
            wgrad_accumulate(x, dy, mg, backend=backend)
            _sync()
            ref = start.double() + dy.double().t() @ x.double()
            scale = dy.double().abs().t() @ x.double().abs() + start.double().abs()
            err = float(((mg.double() - ref).abs() / scale).max())
            mg16 = start.clone()
            mg16 += dy.t() @ x
            err16 = float(((mg16.double() - ref).abs() / scale).max())
            del ref, scale
            flops = 2 * tokens * d_in * d_out
            t = {
                "fxtron_wgrad": bench(lambda: wgrad_accumulate(x, dy, mg, backend=backend)),
                "torch_16bit_matmul_add": bench(lambda: mg.add_(dy.t() @ x)),
                "torch_fp32_addmm": bench(lambda: mg.addmm_(dy.t().float(), x.float())),
            }
            rows.append({"dtype": str(dtype).removeprefix("torch."), "tokens": tokens, "in": d_in, "out": d_out,
                         "kernel": kernel, "error": err, "error_torch_16bit": err16, "ms": t,
                         "tflops": {k: flops / (v * 1e-3) / 1e12 for k, v in t.items()},
                         "speedup_vs_16bit_matmul_add": t["torch_16bit_matmul_add"] / t["fxtron_wgrad"],
                         "speedup_vs_fp32_addmm": t["torch_fp32_addmm"] / t["fxtron_wgrad"],
                         # fp32 summation of `tokens` products: |error| <= tokens * 2^-24 * sum|terms|
                         # (the standard bound); the 16-bit path rounds the whole gradient once more
                         "ok": kernel == TRITON_KERNEL and err <= tokens * 2.0 ** -24})
    return rows


CP_BLOCK_LENGTHS = (2048, 4096, 8192)
CP_BLOCK_TIME, CP_BLOCK_MEMORY = 1.2, 1.5


def _torch_flash_block(q, k, v, do, scale):
    """torch's flash attention with its log-sum-exp, forward then backward, on one causal block."""
    aten = torch.ops.aten
    if q.is_cuda:
        r = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
        out, lse = r[0], r[1]
        grads = aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, out, lse, r[2], r[3], q.shape[-2], k.shape[-2], 0.0, True, r[6], r[7], scale=scale)
    else:
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
        grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(do, q, k, v, out, lse, 0.0, True,
                                                                          scale=scale)
    return (out, *grads)


def _fxtron_block(q, k, v, do, scale):
    """fxtron's cp block: `_block` (out, lse in fp32), then `_block_backward` given them."""
    out, lse = _block(q, k, v, scale, None, True)
    return (out, *_block_backward(do, q, k, v, out, lse, scale, None, True))


def _peak(fn) -> int | None:
    """Peak bytes allocated while `fn` runs, what was allocated before it included (CUDA only)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def check_cp_block(lengths=CP_BLOCK_LENGTHS, heads: int = 32, head_dim: int = 128, timed: int = TIMED,
                   device: str = "cuda") -> list[dict]:
    """4. fxtron's cp attention block against torch's flash attention on the same block."""
    from fxtron.codegen.attention import choose_forward
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for n in lengths:
        q, k, v, do = (torch.randn(1, heads, n, head_dim, device=device, generator=gen).to(torch.bfloat16)
                       for _ in range(4))
        scale = head_dim ** -0.5
        row = {"L": n, "heads": heads, "head_dim": head_dim, "dtype": "bfloat16",
               "kernel": choose_forward(q, k, v, None, True)}
        ours, ref = _fxtron_block(q, k, v, do, scale), _torch_flash_block(q, k, v, do, scale)
        # the same kernel family in bf16: out and grads agree to bf16's rounding of the outputs
        row["max_diff"] = {name: float((a.float() - b.float()).abs().max()) / max(float(b.float().abs().max()), 1e-6)
                           for name, a, b in zip(("out", "dq", "dk", "dv"), ours, ref)}
        del ours, ref
        fns = {"fxtron": lambda: _fxtron_block(q, k, v, do, scale), "torch_flash": lambda: _torch_flash_block(q, k, v, do, scale)}
        ms, mem = {}, {}
        for name, fn in fns.items():
            for _ in range(2):
                fn()
            ms[name] = 1e3 * statistics.median(_sync_time(fn) for _ in range(timed))
            mem[name] = _peak(fn)
        row["ms"] = ms
        row["time_ratio"] = ms["fxtron"] / ms["torch_flash"]
        row["peak_bytes"] = mem
        row["memory_ratio"] = None if mem["fxtron"] is None else mem["fxtron"] / mem["torch_flash"]
        numerics = all(d <= 2.0 ** -6 for d in row["max_diff"].values())
        if device == "cuda":
            row["ok"] = (numerics and row["kernel"] == "flash" and row["time_ratio"] <= CP_BLOCK_TIME
                         and row["memory_ratio"] <= CP_BLOCK_MEMORY)
        else:       # a dry run: tiny shapes on a shared CPU time Python, not the kernels
            row["ok"] = numerics and row["kernel"] == "cpu_flash"
        rows.append(row)
        del q, k, v, do
    return rows


def _batches(n: int, cfg: LlamaConfig, batch: int, seq: int):
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(100 + i)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
        out.append((ids[:, :-1].clone(), ids[:, 1:].clone()))
    return out


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A float32 copy on the CPU, never the tensor itself (.float().cpu() of an fp32 CPU tensor
    is the same tensor, which later steps would change under the comparison)."""
    return t.detach().float().cpu().clone()


def _opt(params):
    return torch.optim.AdamW(params, lr=LR, eps=1e-6, weight_decay=0.1)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _sync_time(fn) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def _profile(fn, n: int = 3) -> str:
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as p:
        for _ in range(n):
            fn()
        _sync()
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    return (p.key_averages().table(sort_by=key, row_limit=12) + "\n"
            + p.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def _train_job(rank: int, mesh: fxtron.Mesh, cfg: LlamaConfig, batch_size: int, seq: int, timed: int,
               profile: bool = False) -> dict:
    torch.manual_seed(0)
    model = Llama(cfg)
    batches = _batches(STEPS, cfg, batch_size, seq)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    res = {"fxtron": _fxtron_run(rank, mesh, model, batches, dev, timed, profile)}
    res["eager"] = _eager_run(model, batches, dev, timed, profile)
    return res


def _fxtron_run(rank, mesh, model, batches, dev, timed, profile, compile: bool = False, **options) -> dict:
    """fxtron: fp32 parameters, bf16 compute, wgrad fused into main_grad (Triton); with
    `compile`, its regions between fxtron's ops compiled by Inductor (codegen/regions.py);
    `options`, parallelize's other options (cuda_graphs=True)."""
    pm = fxtron.parallelize(model, mesh, example_inputs=batches[0], dtype=torch.bfloat16, compile=compile, **options)
    prog = pm.program(rank)
    opt = _opt(prog.parameters())
    losses, grads = [], None
    for step, b in enumerate(batches):
        losses.append(prog.train_step(b, opt))
        if step == 0:
            grads = {k: _copy(v) for k, v in prog.full_grads().items()}
    res = {"losses": losses, "grads": grads,
           "state": {k: _copy(v) for k, v in prog.full_state_dict().items()},
           "param_device": str(next(iter(prog.parameters())).device)}
    b = tuple(t.to(dev) for t in batches[0])
    for _ in range(2):
        prog.train_step(b, opt)
    res["step_s"] = statistics.median(_sync_time(lambda: prog.train_step(b, opt)) for _ in range(timed))
    if profile:
        res["profile"] = _profile(lambda: prog.train_step(b, opt))
    return res


def _eager_run(model, batches, dev, timed, profile, compiled: bool = False) -> dict:
    """The unmodified model, same policy: fp32 parameters, forward with bf16 copies; with
    `compiled`, the forward (casts included) and its backward under torch.compile."""
    ref = model.to(dev)
    opt = _opt(ref.parameters())

    def forward(tensors, batch):
        cast = {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in tensors.items()}
        return torch.func.functional_call(ref, cast, batch)
    forward = torch.compile(forward) if compiled else forward

    def step(batch):
        opt.zero_grad(set_to_none=True)
        tensors = {**dict(ref.named_parameters()), **dict(ref.named_buffers())}
        loss = forward(tensors, tuple(t.to(dev) for t in batch))
        loss.backward()
        return loss

    losses, grads = [], None
    for i, batch in enumerate(batches):
        loss = step(batch)
        if i == 0:
            grads = {n: _copy(p.grad) for n, p in ref.named_parameters()}
        opt.step()
        losses.append(float(loss.detach()))
    res = {"losses": losses, "grads": grads, "state": {k: _copy(v) for k, v in ref.state_dict().items()}}

    b = tuple(t.to(dev) for t in batches[0])

    def full_step():
        step(b)
        opt.step()
    for _ in range(2):
        full_step()
    res["step_s"] = statistics.median(_sync_time(full_step) for _ in range(timed))
    if profile:
        res["profile"] = _profile(full_step)
    return res


def _agreement(got: dict, ref: dict, cfg: LlamaConfig, batch_size: int, seq: int) -> dict:
    """`got`'s run against `ref`'s (losses, first-step gradients, weights after STEPS steps) with
    the mixed-precision tests' tolerances: the figures and whether they hold (`numbers_ok`)."""
    dloss = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
    gmax = max(g.abs().max().item() for g in ref["grads"].values())
    dgrad = max((got["grads"][k] - ref["grads"][k]).abs().max().item() for k in ref["grads"])
    dw = max((got["state"][k] - ref["state"][k]).abs().max().item() for k in ref["state"] if k in got["state"])
    return {"model": f"Llama dim={cfg.dim} L={cfg.n_layer} heads={cfg.n_head}/{cfg.n_kv_head} "
                     f"ffn={cfg.ffn_dim} vocab={cfg.vocab_size}, batch {batch_size}x{seq}, bf16",
            "loss_rel_diff": dloss, "grad_max_diff_over_max": dgrad / gmax, "weight_max_diff": dw,
            "numbers_ok": dloss <= 2.0 ** -6 and dgrad <= 2.0 ** -5 * gmax and dw <= 2 * STEPS * LR}


def check_training(cfg: LlamaConfig, batch_size: int, seq: int, timed: int, profile: bool = False) -> dict:
    mesh = fxtron.Mesh(1)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    r = fxtron.launch(_train_job, mesh, args=(mesh, cfg, batch_size, seq, timed, profile), backend=backend,
                      timeout_s=_time_left(400))[0]
    if profile:
        print("== fxtron\n" + r["fxtron"]["profile"] + "\n== eager\n" + r["eager"]["profile"], flush=True)
        r["fxtron"].pop("profile"), r["eager"].pop("profile")
    f, e = r["fxtron"], r["eager"]
    out = _agreement(f, e, cfg, batch_size, seq)
    numbers_ok = out.pop("numbers_ok")
    out.update({"param_device": f["param_device"], "losses_fxtron": f["losses"], "losses_eager": e["losses"],
                "step_s_fxtron": f["step_s"], "step_s_eager": e["step_s"], "ratio": f["step_s"] / e["step_s"]})
    out["ok"] = numbers_ok and ("cuda" in f["param_device"] or not torch.cuda.is_available())
    return out


def _compiled_job(rank: int, mesh: fxtron.Mesh, cfg: LlamaConfig, batch_size: int, seq: int, timed: int) -> dict:
    torch.manual_seed(0)
    model = Llama(cfg)
    batches = _batches(STEPS, cfg, batch_size, seq)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    res = {"fxtron": _fxtron_run(rank, mesh, model, batches, dev, timed, False, compile=True)}
    res["fxtron"]["wall_s"] = time.perf_counter() - t0
    res["fxtron_uncompiled"] = _fxtron_run(rank, mesh, model, batches, dev, timed, False)
    # the linears unfused: aten ops of the compiled region, their weight gradients in bf16 as
    # torch.compile's are (the compiled program's own: fxtron::master_linear, fp32 weight gradients)
    res["fxtron_unfused"] = _fxtron_run(rank, mesh, model, batches, dev, timed, False, compile=True,
                                        gradient_accumulation_fusion=False)
    t0 = time.perf_counter()
    res["torch_compile"] = _eager_run(model, batches, dev, timed, False, compiled=True)
    res["torch_compile"]["wall_s"] = time.perf_counter() - t0
    return res


def check_compiled(cfg: LlamaConfig, batch_size: int, seq: int, timed: int) -> dict:
    """compile=True at world 1 against torch.compile of the unmodified model under the same
    precision policy (and fxtron uncompiled): step times and their ratios, the losses, gradients
    and weights of the compiled program against torch.compile's within the mixed-precision
    tolerances; `meets_goal` at <= 0.95x torch.compile's step (reported; `ok` is the numbers)."""
    mesh = fxtron.Mesh(1)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    r = fxtron.launch(_compiled_job, mesh, args=(mesh, cfg, batch_size, seq, timed), backend=backend,
                      timeout_s=_time_left(900))[0]
    f, u, c, n = r["fxtron"], r["fxtron_uncompiled"], r["torch_compile"], r["fxtron_unfused"]
    out = _agreement(f, c, cfg, batch_size, seq)
    out["ok"] = out.pop("numbers_ok")
    unfused = _agreement(n, c, cfg, batch_size, seq)
    out.update({"step_s_fxtron_compiled_unfused": n["step_s"],
                "ratio_unfused_vs_torch_compile": n["step_s"] / c["step_s"],
                "unfused_numbers_ok": unfused["numbers_ok"]})
    out.update({"losses_fxtron_compiled": f["losses"], "losses_torch_compile": c["losses"],
                "step_s_fxtron_compiled": f["step_s"], "step_s_fxtron": u["step_s"],
                "step_s_torch_compile": c["step_s"], "ratio_vs_torch_compile": f["step_s"] / c["step_s"],
                "ratio_uncompiled_vs_compiled": u["step_s"] / f["step_s"],
                "wall_s_fxtron_compiled": f["wall_s"], "wall_s_torch_compile": c["wall_s"]})
    out["meets_goal"] = out["ratio_vs_torch_compile"] <= 0.95
    return out


def _cuda_graphs_job(rank: int, mesh: fxtron.Mesh, cfg: LlamaConfig, batch_size: int, seq: int, timed: int) -> dict:
    torch.manual_seed(0)
    model = Llama(cfg)
    batches = _batches(STEPS, cfg, batch_size, seq)
    dev = torch.device("cuda")
    return {"captured": _fxtron_run(rank, mesh, model, batches, dev, timed, False, cuda_graphs=True,
                                    cuda_graph_warmup=1),
            "uncaptured": _fxtron_run(rank, mesh, model, batches, dev, timed, False)}


def check_cuda_graphs(cfg: LlamaConfig, batch_size: int, seq: int, timed: int) -> dict:
    """7. cuda_graphs=True against the same program uncaptured (module docstring); without
    CUDA, parallelize's refusal."""
    if not torch.cuda.is_available():
        try:
            fxtron.parallelize(Llama(cfg), fxtron.Mesh(1), example_inputs=_batches(1, cfg, batch_size, seq)[0],
                               dtype=torch.bfloat16, cuda_graphs=True)
        except fxtron.ParallelizeError as e:
            return {"ok": True, "status": f"refused: {e}"}
        return {"ok": False, "status": "cuda_graphs=True was not refused on a machine without CUDA"}
    mesh = fxtron.Mesh(1)
    r = fxtron.launch(_cuda_graphs_job, mesh, args=(mesh, cfg, batch_size, seq, timed), backend="nccl",
                      timeout_s=_time_left(600), shm_transport=False)[0]
    c, u = r["captured"], r["uncaptured"]
    out = _agreement(c, u, cfg, batch_size, seq)
    out["ok"] = out.pop("numbers_ok")
    out.update({"status": "captured", "losses_captured": c["losses"], "losses_uncaptured": u["losses"],
                "step_s_captured": c["step_s"], "step_s_uncaptured": u["step_s"],
                "ratio_captured_vs_uncaptured": c["step_s"] / u["step_s"]})
    return out


RECOMPUTE_CASE = (LlamaConfig(vocab_size=32000, max_seq_len=8192, n_layer=2, n_head=32, n_kv_head=8, dim=4096,
                              ffn_dim=11008), 1, 4096)


def _recompute_job(rank: int, mesh: fxtron.Mesh, cfg: LlamaConfig, batch_size: int, seq: int, timed: int) -> dict:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        # bit-equal gradients need deterministic kernels: flash attention's backward adds dQ up with
        # atomics otherwise (two runs without recomputation could differ), and cuBLAS needs a fixed
        # workspace (set before this process's first GEMM)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    batches = _batches(1, cfg, batch_size, seq)
    example = tuple(t[:, :seq // 2].contiguous() for t in batches[0])
    b = tuple(t.to(dev) for t in batches[0])
    out = {}
    for recompute in (None, "selective", "full"):
        torch.manual_seed(0)
        pm = fxtron.parallelize(Llama(cfg), mesh, example_inputs=example, dtype=torch.bfloat16, recompute=recompute)
        prog = pm.program(rank)
        opt = torch.optim.SGD(prog.parameters(), lr=0.0)     # the same weights every step: comparable runs
        prog.train_step(b, opt)
        grads = {k: _copy(v) for k, v in prog.full_grads().items()}
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        prog.track_memory = True
        prog.train_step(b, opt)
        saved = max(smp.activations for smp in prog.memory_timeline())
        prog.track_memory = False
        peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else None
        step = statistics.median(_sync_time(lambda: prog.train_step(b, opt)) for _ in range(timed))
        out[str(recompute)] = {"peak_allocated": peak, "saved_peak": saved, "step_s": step, "grads": grads}
        prog = opt = pm = None     # this configuration's memory given back before the next
        gc.collect()               # (a reference cycle would keep it until the collector runs)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def check_recompute(cfg: LlamaConfig, batch_size: int, seq: int, timed: int) -> dict:
    mesh = fxtron.Mesh(1)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    r = fxtron.launch(_recompute_job, mesh, args=(mesh, cfg, batch_size, seq, timed), backend=backend,
                      timeout_s=_time_left(400))[0]
    base = r["None"]
    out = {"model": f"Llama dim={cfg.dim} L={cfg.n_layer} heads={cfg.n_head}/{cfg.n_kv_head} ffn={cfg.ffn_dim}, "
                    f"batch {batch_size}x{seq}, bf16"}
    ok = True
    for key, got in r.items():
        same = all(torch.equal(got["grads"][k], base["grads"][k]) for k in base["grads"])
        ok = ok and same
        out[key] = {"peak_allocated_GiB": got["peak_allocated"] / 2**30 if got["peak_allocated"] else None,
                    "saved_for_backward_GiB": got["saved_peak"] / 2**30, "step_s": got["step_s"],
                    "step_vs_none": got["step_s"] / base["step_s"], "grads_equal_bitwise": same}
    out["ok"] = ok
    return out


# ----------------------------------------------------------------------------- 4. `fxtron train` vs PyTorch
#: the trainer's case (a ~0.95B transformers Llama) and the dry run's; `steps` per run, the first
#: `warmup` of them (start-up, compilation) left out of the median
TRAINER_CASE = dict(hidden=2048, layers=16, ffn=5632, heads=16, vocab=32000, batch=8, seq=2048, steps=8, warmup=3,
                    documents=500, lr=3e-4, dtype="bf16")
TRAINER_TINY = dict(hidden=64, layers=2, ffn=96, heads=4, vocab=256, batch=2, seq=32, steps=5, warmup=2,
                    documents=200, lr=3e-4, dtype="bf16")
#: dense bf16 peak of an H200 (the MFU denominator where the device's is not known: the dry run)
H200_PEAK = 989e12
#: the first steps whose losses must agree (later steps drift apart by bf16 rounding of the updates)
TRAINER_LOSS_STEPS = 3


def _trainer_inputs(case: dict, root: str, dev: torch.device) -> tuple[str, str]:
    """A transformers Llama directory (random init, save_pretrained with safetensors, bf16 as
    released checkpoints are) and a Megatron dataset of random-token documents written by
    fxtron's own writer. Returns (model directory, dataset prefix)."""
    import os

    import numpy as np
    import transformers

    from fxtron.data.indexed import IndexedDatasetWriter, token_dtype
    cfg = transformers.LlamaConfig(vocab_size=case["vocab"], hidden_size=case["hidden"],
                                   intermediate_size=case["ffn"], num_hidden_layers=case["layers"],
                                   num_attention_heads=case["heads"], num_key_value_heads=case["heads"],
                                   max_position_embeddings=max(2048, case["seq"]), tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(dev):          # initialized where it is fast (0.9B on a CPU takes a while)
        model = transformers.LlamaForCausalLM(cfg)
    path = os.path.join(root, "llama")
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()     # the device's memory free for `fxtron train`'s process
    rng = np.random.RandomState(0)
    prefix = os.path.join(root, "tokens")
    w = IndexedDatasetWriter(prefix, token_dtype(case["vocab"]))
    for _ in range(case["documents"]):
        w.add_document(rng.randint(0, case["vocab"] - 1, size=rng.randint(case["seq"] // 8, 2 * case["seq"])))
    w.finalize()
    return path, prefix


def _trainer_args(case: dict, model_dir: str, prefix: str, peak: float) -> list[str]:
    """`fxtron train`'s flags for the case (the plain loop reads the same configuration)."""
    return ["--model", model_dir, "--data", prefix, "--split", "98,2,0", "--dtype", case["dtype"],
            "--world-size", "1", "--batch", str(case["batch"]), "--seq", str(case["seq"]),
            "--steps", str(case["steps"]), "--lr", str(case["lr"]), "--peak-flops", str(peak)]


def _trainer_run(case: dict, model_dir: str, prefix: str, root: str, peak: float, timeout_s: int) -> dict:
    """`python -m fxtron train` as a user runs it, in its own process; its --log-file's records
    (the trainer's step time: perf_counter around train_step, which ends on the loss's .item()
    after the optimizer step, so the device's work is in it; MFU from its step_flops; memory:
    torch.cuda.max_memory_allocated of the rank)."""
    import os
    import subprocess

    log = os.path.join(root, "train.jsonl")
    repo = __file__.rsplit("/", 2)[0]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "fxtron", "train", *_trainer_args(case, model_dir, prefix, peak), "--log-file", log]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                       timeout=_time_left(timeout_s))
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"fxtron train exited {p.returncode}: {p.stdout[-3000:]}")
    records = {}
    for line in open(log):
        r = json.loads(line)
        records[r["step"]] = r
    steps = [records[k] for k in sorted(records)]
    return {"losses": [r["loss"] for r in steps], "step_times": [r["step_time"] for r in steps],
            "mfu": [r["mfu"] for r in steps], "memory_bytes": max(r["memory_bytes"] for r in steps),
            "wall_s": wall, "command": "python -m fxtron train " + " ".join(cmd[4:])}


def _plain_run(case: dict, model_dir: str, prefix: str, dev: torch.device, compiled: bool, peak: float) -> dict:
    """The same model in a plain PyTorch loop, under the trainer's precision policy (fp32
    parameters and AdamW, each forward on bf16 copies of the parameters and buffers, as
    runtime/precision.py's compute copies): the same batches (the trainer's TrainData), AdamW's
    groups and learning rate (trainer/optim.py); eager, or the loss's forward under torch.compile."""
    import transformers

    from fxtron import config as fxconfig
    from fxtron.trainer.config import TrainConfig
    from fxtron.trainer.data import TrainData
    from fxtron.trainer.models import TrainModel
    from fxtron.trainer.optim import optimizer, schedule, set_lr

    ap = argparse.ArgumentParser()
    fxconfig.add_arguments(ap, TrainConfig)
    cfg = fxconfig.from_arguments(ap.parse_args(_trainer_args(case, model_dir, prefix, peak)), TrainConfig)
    dtype = cfg.precision.torch_dtype or torch.float32
    data = TrainData(cfg, case["vocab"])
    tm = TrainModel(None, True, case["vocab"], data=cfg.data)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).to(dev)
    model.train()
    opt = optimizer(model.named_parameters(), cfg)
    sched = schedule(cfg)

    def loss_of(tensors, kwargs):
        cast = {n: t.to(dtype) if t.is_floating_point() else t for n, t in tensors.items()}
        return torch.func.functional_call(model, cast, (), kwargs).loss

    fwd = torch.compile(loss_of) if compiled else loss_of
    losses, times = [], []
    for step in range(case["steps"]):
        _, kw = tm.inputs(data.train_batch(step * case["batch"]))
        kw = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        set_lr(opt, sched.lr)
        _sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = fwd({**dict(model.named_parameters()), **dict(model.named_buffers())}, kw)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        _sync()
        times.append(time.perf_counter() - t0)
        sched.step()
    out = {"losses": losses, "step_times": times,
           "memory_bytes": torch.cuda.max_memory_allocated() if dev.type == "cuda" else None,
           "params": sum(p.numel() for p in model.parameters())}
    model = opt = fwd = None     # this run's memory given back before the next
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def check_trainer(case: dict, *, compile_baseline: bool = True, timeout_s: int = 420) -> dict:
    """`fxtron train` (a subprocess) on a transformers Llama directory and a Megatron dataset,
    against the same model in a plain PyTorch loop, eager and under torch.compile: the median
    step time after warm-up, tokens/s, MFU (the trainer's FLOPs per step, from its step_flops,
    over the device's bf16 peak; 6 x parameters x tokens beside it), peak memory, and whether
    fxtron's first losses equal the eager loop's within the mixed-precision tolerance (that,
    and the run completing, is `ok`; speed is reported, not gated)."""
    import tempfile

    from fxtron.trainer.metrics import device_peak_flops
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    peak = device_peak_flops() or H200_PEAK
    tokens = case["batch"] * case["seq"]
    w = case["warmup"]
    out = {"model": f"transformers Llama hidden={case['hidden']} L={case['layers']} ffn={case['ffn']} "
                    f"heads={case['heads']} vocab={case['vocab']}, batch {case['batch']}x{case['seq']}, "
                    f"{case['dtype']}, {case['steps']} steps (median of the last {case['steps'] - w})",
           "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "peak_flops": peak}
    with tempfile.TemporaryDirectory(prefix="fxtron-gpu-check-") as root:
        t0 = time.perf_counter()
        model_dir, prefix = _trainer_inputs(case, root, dev)
        out["setup_s"] = time.perf_counter() - t0
        f = _trainer_run(case, model_dir, prefix, root, peak, timeout_s)
        out["command"] = f.pop("command").replace(root, "$TMP")
        runs = {"fxtron": f, "eager": _plain_run(case, model_dir, prefix, dev, False, peak)}
        if compile_baseline:
            t0 = time.perf_counter()
            runs["compiled"] = _plain_run(case, model_dir, prefix, dev, True, peak)
            runs["compiled"]["wall_s"] = time.perf_counter() - t0
        else:
            out["compiled_note"] = "torch.compile baseline skipped (--no-compile, or a dry run without --dry-run-compile)"
    params = runs["eager"]["params"]
    step_s = statistics.median(f["step_times"][w:])
    # the trainer's FLOPs per step (fxtron.trainer.metrics.step_flops), read back from its MFU
    flops = statistics.median(m * t * peak for m, t in zip(f["mfu"][w:], f["step_times"][w:])) \
        if all(m is not None for m in f["mfu"][w:]) else None
    out.update(params=params, tokens_per_step=tokens, flops_per_step_trainer=flops,
               flops_per_step_6nt=6.0 * params * tokens)
    for name, r in runs.items():
        s = statistics.median(r["step_times"][w:])
        out[name] = {"step_s": s, "tokens_per_s": tokens / s,
                     "mfu": flops / s / peak if flops else None, "mfu_6nt": 6.0 * params * tokens / s / peak,
                     "peak_memory_GiB": r["memory_bytes"] / 2**30 if r["memory_bytes"] and dev.type == "cuda" else None,
                     "first_step_s": r["step_times"][0], "losses": r["losses"]}
        if "wall_s" in r:
            out[name]["wall_s"] = r["wall_s"]
        if name != "fxtron":
            out[name]["fxtron_step_ratio"] = step_s / s
    n = min(TRAINER_LOSS_STEPS, case["steps"])
    e = runs["eager"]["losses"]
    out["loss_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(f["losses"][:n], e[:n]))
    out["loss_tolerance"] = 2.0 ** -6             # the mixed-precision tests' (check_training's)
    out["ok"] = (len(f["losses"]) == case["steps"] and all(map(math.isfinite, f["losses"]))
                 and out["loss_rel_diff"] <= out["loss_tolerance"])
    return out


# ----------------------------------------------------------------------------- README "GPU figures"
README_BEGIN, README_END = "<!-- gpu-figures:begin -->", "<!-- gpu-figures:end -->"

#: the full run's end (time.perf_counter), past which no job it launches runs: set by _full_run
_DEADLINE: list[float | None] = [None]


def _time_left(limit: float) -> float:
    """A launched job's timeout: `limit`, or less where the run's deadline comes sooner (at least
    30 s, so that a job started just before it still reports its error)."""
    if _DEADLINE[0] is None:
        return limit
    return max(30.0, min(limit, _DEADLINE[0] - time.perf_counter()))


def _trainer_table(sec: dict) -> list[str]:
    def gib(v):
        return "-" if v is None else f"{v:.1f}"

    def pct(v):
        return "-" if v is None else f"{100 * v:.1f}%"
    rows = [f"`fxtron train` against the same model in a plain PyTorch loop ({sec['model']}; fp32 parameters and "
            f"AdamW, bf16 compute copies; MFU: the trainer's FLOPs per step over {sec['peak_flops'] / 1e12:.0f} "
            f"TFLOP/s; losses agree within {sec['loss_rel_diff']:.1e} relative over the first steps):", "",
            "| run | step (ms) | tokens/s | MFU | peak memory (GiB) | fxtron step / this |", "|---|---|---|---|---|---|"]
    for name, label in (("fxtron", "fxtron train"), ("eager", "PyTorch eager"), ("compiled", "PyTorch torch.compile")):
        r = sec.get(name)
        if r is None:
            continue
        ratio = "1.00x" if name == "fxtron" else f"{r['fxtron_step_ratio']:.2f}x"
        rows.append(f"| {label} | {1e3 * r['step_s']:.1f} | {r['tokens_per_s']:,.0f} | {pct(r['mfu'])} | "
                    f"{gib(r['peak_memory_GiB'])} | {ratio} |")
    return rows


def _ms(sec: dict, key: str) -> str:
    v = sec.get(key)
    return "-" if v is None else f"{1e3 * v:.1f}"


def _x(sec: dict, key: str) -> str:
    v = sec.get(key)
    return "-" if v is None else f"{v:.2f}x"


def _step_table(title: str, rows: list[tuple[str, str, str]]) -> list[str]:
    return [title, "", "| run | step (ms) | ratio |", "|---|---|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in rows]


def _compiled_table(sec: dict) -> list[str]:
    return _step_table(
        f"compile=True at world 1 against torch.compile of the unmodified model ({sec.get('model', 'the small Llama')}; "
        f"issue 48's goal <= 0.95x: {'met' if sec.get('meets_goal') else 'missed'}):",
        [("fxtron compile=True", _ms(sec, "step_s_fxtron_compiled"), _x(sec, "ratio_vs_torch_compile") + " of torch.compile"),
         ("fxtron compile=True, unfused", _ms(sec, "step_s_fxtron_compiled_unfused"),
          _x(sec, "ratio_unfused_vs_torch_compile") + " of torch.compile"),
         ("torch.compile", _ms(sec, "step_s_torch_compile"), "1.00x"),
         ("fxtron uncompiled", _ms(sec, "step_s_fxtron"), _x(sec, "ratio_uncompiled_vs_compiled") + " of fxtron compiled")])


def _training_table(sec: dict) -> list[str]:
    return _step_table(f"fxtron's uncompiled step at world 1 against the eager model ({sec.get('model', '')}; "
                       "issue 48's item 4: <= 1.0x):",
                       [("fxtron", _ms(sec, "step_s_fxtron"), _x(sec, "ratio") + " of eager"),
                        ("eager", _ms(sec, "step_s_eager"), "1.00x")])


#: the sections that draw a table in README's GPU figures (the rest get a line: ok or not)
README_TABLES = {"trainer": _trainer_table, "compiled": _compiled_table, "training_small": _training_table}


def _machine() -> str:
    """The device (a GPU's name) and the host's CPU count, for the README's figures."""
    import os
    import platform
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else f"no GPU ({platform.machine()})"
    return f"{dev}, {os.cpu_count()} CPUs"


def readme_figures(out: dict, when: str | None = None) -> str:
    """The README's "GPU figures" block of a gpu_check JSON document: the date, the machine,
    each section's table (README_TABLES) or its verdict."""
    when = when or time.strftime("%Y-%m-%d", time.gmtime())
    machine = out.get("machine") or out.get("gpu") or "unknown"
    lines = [README_BEGIN, f"GPU figures, {when}, {machine} (torch {out.get('torch', '?')}; "
                           "`python benchmarks/gpu_check.py --readme`):", ""]
    verdicts = []
    for key, sec in out.items():
        if not isinstance(sec, dict) or "ok" not in sec:
            continue
        if key in README_TABLES and "error" not in sec:      # (a failed check has no figures: its verdict)
            lines += README_TABLES[key](sec) + [""]
        verdicts.append(f"{key} {'ok' if sec['ok'] else 'FAILED'}")
    if verdicts:
        lines += ["Checks: " + ", ".join(verdicts) + ".", ""]
    if out.get("skipped"):
        lines += ["Not run (the run's time budget): " + ", ".join(out["skipped"]) + ".", ""]
    return "\n".join(lines + [README_END])


def write_readme(out: dict, path: str, when: str | None = None) -> None:
    """Rewrite the block between README_BEGIN and README_END in `path` with `out`'s figures;
    where there are no markers yet, the block goes after the paragraph that names
    benchmarks/gpu_check.py."""
    with open(path) as fh:
        text = fh.read()
    block = readme_figures(out, when)
    if README_BEGIN in text and README_END in text:
        head, rest = text.split(README_BEGIN, 1)
        text = head + block + rest.split(README_END, 1)[1]
    else:
        at = text.find("`benchmarks/gpu_check.py`")
        if at < 0:
            raise SystemExit(f"{path}: no {README_BEGIN} markers and no paragraph naming benchmarks/gpu_check.py")
        end = text.find("\n\n", at)
        end = len(text) if end < 0 else end
        text = text[:end] + "\n\n" + block + text[end:]
    with open(path, "w") as fh:
        fh.write(text)


def _rows(rows: list[dict]) -> dict:
    """A check that measures several cases: its rows, and `ok` when every row is."""
    return {"rows": rows, "ok": all(r["ok"] for r in rows)}


def _timed_check(out: dict, key: str, check, strip_losses: bool = False) -> None:
    """out[key] = check(), or its error; with the seconds it took; printed as it comes (without
    the loss lists where `strip_losses`)."""
    t0 = time.perf_counter()
    try:
        out[key] = check()
    except Exception as e:  # noqa: BLE001 - report it with the other figures
        out[key] = {"ok": False, "error": f"{type(e).__name__}: {e}"[-4000:]}
    out[key]["check_s"] = time.perf_counter() - t0
    shown = {k: v for k, v in out[key].items() if "losses" not in k} if strip_losses else out[key]
    print(json.dumps({key: shown}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--checks", default=",".join(CHECKS),
                    help=f"the full run's checks, in order (default: {','.join(CHECKS)})")
    ap.add_argument("--budget-s", type=float, default=330.0,
                    help="start no check after this many seconds (the rest are listed as skipped; default 330: "
                         "a 15-minute GPU loan leaves time for start-up and a rerun)")
    ap.add_argument("--out", default=os.path.join(os.environ["OUT"], "gpu.json") if os.environ.get("OUT") else None,
                    help="write the JSON here after every check (default: $OUT/gpu.json where the device machine "
                         "sets $OUT: only what is written there comes back)")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="no launched job runs past this many seconds (default: --budget-s + 90): a check still "
                         "running then fails with its timeout, and the JSON keeps every other")
    ap.add_argument("--skip-training", action="store_true")
    ap.add_argument("--profile", action="store_true", help="only the small training step, under torch.profiler")
    ap.add_argument("--profile-all", action="store_true", help="every check, and the small step's profile")
    ap.add_argument("--recompute-only", action="store_true", help="only the recomputation memory check (3.)")
    ap.add_argument("--cp-block-only", action="store_true", help="only the cp attention block check (4.)")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="no GPU here: run the training check's logic on a tiny model with gloo")
    ap.add_argument("--trainer-only", action="store_true", help="only `fxtron train` against PyTorch (4.)")
    ap.add_argument("--compiled-only", action="store_true",
                    help="only compile=True against torch.compile (6.; in the dry run: with --dry-run-compile)")
    ap.add_argument("--cuda-graphs-only", action="store_true",
                    help="only cuda_graphs=True against the uncaptured step (7.)")
    ap.add_argument("--no-compile", action="store_true", help="4. without its torch.compile baseline")
    ap.add_argument("--dry-run-compile", action="store_true",
                    help="the dry run's 4. with its torch.compile baseline (Inductor's C++ build: minutes on a CPU)")
    ap.add_argument("--readme", nargs="?", const=__file__.rsplit("/", 2)[0] + "/README.md", metavar="README.md",
                    help="rewrite the GPU figures block of README.md (or this file) from the run's JSON")
    ap.add_argument("--from-json", metavar="FILE.json", help="with --readme: no run, the figures of this JSON")
    a = ap.parse_args()
    if a.from_json:
        with open(a.from_json) as fh:
            write_readme(json.load(fh), a.readme or ap.get_default("readme") or "README.md")
        return 0
    if a.cpu_dry_run:
        tiny = LlamaConfig(vocab_size=256, max_seq_len=32, n_layer=2, n_head=4, n_kv_head=2, dim=64, ffn_dim=96)
        out = {"machine": _machine(), "torch": torch.__version__}
        out["cuda_graphs"] = check_cuda_graphs(tiny, 2, 32, 2)
        if a.cuda_graphs_only:
            print(json.dumps(out, indent=1))
            return 0 if out["cuda_graphs"]["ok"] else 1
        if not a.trainer_only and not a.compiled_only:
            out.update(wgrad=_rows(check_kernel(DRY_RUN_SHAPES, device="cpu")),
                       training=check_training(tiny, 2, 32, 2, profile=a.profile),
                       recompute=check_recompute(tiny, 2, 32, 2),
                       cp_block=_rows(check_cp_block((64,), heads=2, head_dim=16, timed=3, device="cpu")))
        if not a.dry_run_compile and not a.compiled_only:
            print("note: the trainer check's torch.compile baseline is skipped in the dry run (Inductor compiling "
                  "for the CPU took 200 s at tiny shapes on 2 cores); --dry-run-compile runs it", file=sys.stderr)
        if not a.compiled_only:
            out["trainer"] = check_trainer(TRAINER_TINY, compile_baseline=a.dry_run_compile and not a.no_compile)
        if a.dry_run_compile or a.compiled_only:
            out["compiled"] = check_compiled(tiny, 2, 32, 2)
        print(json.dumps(out, indent=1))
        _write(out, a.out)
        if a.readme:
            write_readme(out, a.readme)
        return 0 if all(v["ok"] for v in out.values() if isinstance(v, dict) and "ok" in v) else 1
    if a.cp_block_only:
        out = {"machine": _machine(), "torch": torch.__version__, "cp_block": _rows(check_cp_block())}
        print(json.dumps(out, indent=1))
        return 0 if out["cp_block"]["ok"] else 1
    if a.cuda_graphs_only:
        out = {"machine": _machine(), "torch": torch.__version__,
               "cuda_graphs": check_cuda_graphs(*TRAIN_CASES["small"], TIMED)}
        print(json.dumps(out, indent=1))
        return 0 if out["cuda_graphs"]["ok"] else 1
    if a.compiled_only:
        out = {"machine": _machine(), "torch": torch.__version__, "compiled": check_compiled(*TRAIN_CASES["small"], TIMED)}
        print(json.dumps(out, indent=1))
        return 0 if out["compiled"]["ok"] else 1
    if a.trainer_only:
        out = {"machine": _machine(), "torch": torch.__version__,
               "trainer": check_trainer(TRAINER_CASE, compile_baseline=not a.no_compile)}
        print(json.dumps(out, indent=1))
        if a.readme:
            write_readme(out, a.readme)
        return 0 if out["trainer"]["ok"] else 1
    if a.recompute_only:
        out = {"gpu": torch.cuda.get_device_name(), "recompute": check_recompute(*RECOMPUTE_CASE, TIMED)}
        print(json.dumps(out, indent=1))
        return 0 if out["recompute"]["ok"] else 1
    if a.profile:
        out = {"training": check_training(*TRAIN_CASES["small"], 3, profile=True)}
        print(json.dumps(out, indent=1))
        return 0
    out = {"gpu": torch.cuda.get_device_name(), "machine": _machine(), "torch": torch.__version__}
    try:
        import triton
        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    return _full_run(out, a)


#: the full run's checks, in the order they run: the open issue's goals first (compile=True against
#: torch.compile, the uncompiled step against eager, the captured step), so that a run cut short by
#: its budget still answers them
CHECKS = ("compiled", "training_small", "cuda_graphs", "wgrad", "cp_block", "recompute", "training_large", "trainer")


def _full_run(out: dict, a) -> int:
    """Run `a.checks` in order while the run is within `a.budget_s` seconds (a check starts only
    before then; what was not started is listed under "skipped"), each caught and timed, the JSON
    so far written to `a.out` after each (a run killed from outside keeps what it measured).
    Exit 0 when every check ran and is ok, 1 when one failed, 2 when all that ran are ok but some
    were skipped."""
    want = [c.strip() for c in a.checks.split(",") if c.strip()]
    unknown = [c for c in want if c not in CHECKS]
    if unknown:
        raise SystemExit(f"--checks: unknown {unknown}; choose from {', '.join(CHECKS)}")
    if a.skip_training:
        want = [c for c in want if c in ("wgrad", "cp_block")]
    if a.no_compile:
        want = [c for c in want if c != "compiled"]
    small, large = TRAIN_CASES["small"], TRAIN_CASES["large"]
    run = {
        "compiled": (lambda: check_compiled(*small, TIMED), True),
        "training_small": (lambda: check_training(*small, TIMED, profile=a.profile_all), True),
        "cuda_graphs": (lambda: check_cuda_graphs(*small, TIMED), True),
        "wgrad": (lambda: _rows(check_kernel(QUICK_SHAPES if a.quick else SHAPES)), False),
        "cp_block": (lambda: _rows(check_cp_block(CP_BLOCK_LENGTHS[:1] if a.quick else CP_BLOCK_LENGTHS)), False),
        "recompute": (lambda: check_recompute(*RECOMPUTE_CASE, TIMED), False),
        "training_large": (lambda: check_training(*large, TIMED), True),
        "trainer": (lambda: check_trainer(TRAINER_CASE, compile_baseline=not a.no_compile), False),
    }
    t0 = time.perf_counter()
    _DEADLINE[0] = t0 + (a.deadline_s if a.deadline_s is not None else a.budget_s + 90.0)
    out["skipped"] = []
    _write(out, a.out)           # (a run killed during its first check still leaves the machine's line)
    for name in want:
        spent = time.perf_counter() - t0
        if spent > a.budget_s:
            out["skipped"].append(name)
            continue
        check, strip = run[name]
        _timed_check(out, name, check, strip_losses=strip)
        _write(out, a.out)
        if a.readme:
            write_readme(out, a.readme)
    if out["skipped"]:
        print(f"budget of {a.budget_s:g} s spent after {time.perf_counter() - t0:.0f} s: skipped "
              f"{', '.join(out['skipped'])} (--checks {','.join(out['skipped'])} runs them)", file=sys.stderr)
    ran = [out[c] for c in want if c in out]
    out["ok"] = all(r["ok"] for r in ran)
    out["run_s"] = time.perf_counter() - t0
    text = json.dumps(out, indent=1)
    print(text)
    _write(out, a.out)
    if a.readme:
        write_readme(out, a.readme)
    return 1 if not out["ok"] else 2 if out["skipped"] else 0


def _write(out: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            f.write(json.dumps(out, indent=1))


if __name__ == "__main__":
    sys.exit(main())
