"""Tensor-parallel benchmarks (CPU, gloo).

    .venv/bin/python -m pytest benchmarks/bench_tp.py --benchmark-only      # ~4-5 min on 2 cores

1. Training-step time, tp=2 (test_train_step). One Llama-style model (TRAIN_CFG: hidden 256,
   4 layers, 8 query heads / 4 key-value heads, SwiGLU ffn 688, vocab 256), global batch
   8 x 128 tokens, AdamW, trained by every system below in ONE job of 2 gloo processes with one
   torch thread each:
     fxtron_tp2      fxtron.parallelize(model, Mesh(2, tp=2)) -> program(rank).train_step, its tp
                     collectives through the shared-memory channel (ops/shm.py, the default
                     for ranks of one host)
     fxtron_tp2_sp   the same with sequence_parallel=True
     fxtron_tp2_gloo the same as fxtron_tp2 with every collective on gloo (shm.disabled())
     fxtron_tp2_unfused  gradient_accumulation_fusion=False
     fxtron_tp2_compiled compile=True: each rank's regions between fxtron's ops compiled by
                     Inductor (fxtron/codegen/regions.py; on the CPU in fp32 its linears,
                     attention and the tp all-reduces between them are the regions' own, not
                     fused or cut: compiler/passmanager.py linears_in_regions; one region between
                     the vocab-parallel embedding and loss); its compilation is in setup, not timed
     fxtron_tp2_sp_compiled  the same with sequence_parallel=True (its gathers and
                     reduce-scatters over the sequence inside the regions too)
     dtensor_tp2     torch.distributed.tensor.parallel.parallelize_module over
                     init_device_mesh("cpu", (2,)): ColwiseParallel wq/wk/wv/w1/w3,
                     RowwiseParallel wo/w2; embeddings, norms and the output head replicated
     megatron_tp2    Megatron-core 0.16.1's own GPTModel (local layer spec: its ColumnParallelLinear
                     / RowParallelLinear, DotProductAttention, VocabParallelEmbedding,
                     vocab-parallel cross entropy; torch RMSNorm), tensor_model_parallel_size=2
                     over the job's 2 ranks, fp32, no fusions, holding make_model()'s weights in
                     its layout (benchmarks/mcore_gpt.py: how, and the three CUDA-only defaults
                     it meets on CPU); AdamW over its local parameters. megatron-core is
                     installed --no-deps beside the venv when absent (as tests/test_data.py
                     does); where it cannot be installed or imported the system is left out and
                     the table's notes say why
     single_process  the unmodified model in rank 0's process (1 thread) while rank 1 waits
                     in a barrier (a blocked gloo barrier uses no CPU)
     single_process_compiled  the same under torch.compile (the compiled baseline)
   All start from the same weights and see the same batches in the same order; their
   timed blocks are interleaved (rounds x steps per round, order rotating each round) so
   that load from other work on the machine falls on all alike. Each step is timed
   with time.perf_counter on rank 0. pytest-benchmark's table shows these per-step times
   (the test "times" a no-op under a timer that replays the worker's measurements, so
   min/median/stddev are the real per-step figures); extra_info holds the medians, the
   ratios ("ratio_vs_single_process", "ratio_vs_dtensor", "ratio_vs_megatron",
   "ratio_vs_single_process_compiled") and the issues' targets (TARGETS: fxtron_tp2 <= 0.5x
   DTensor and <= 0.75x one process; fxtron_tp2_compiled <= 0.50x Megatron-core tp=2 and
   <= 0.60x torch.compile's one process), which are reported, never asserted. The first and
   last losses of every system are checked against single_process's (first within 1e-4, last
   within 1e-2), so every baseline trains the same model.
   The notes give the GEMM floor of a tp=2 step on this machine: rank 0's matmul FLOPs in one
   step (FlopCounterMode over a step of fxtron_tp2_unfused, whose GEMMs are the compiled
   program's) over the rate of a per-rank MLP GEMM with both ranks busy (extra_info
   "rank_gemm_floor_s"; the attention's FLOPs beside it), and where 0.50x Megatron-core's
   step falls against it.

   DTensor note: the shipped Attention views to heads with the configured head count
   (`view(B, T, self.n_head, hd)`), which fails on the local half of a ColwiseParallel
   output. dtensor_tp2 therefore runs `LocalHeadsAttention` below: the same module and
   parameters with the head count read from the local tensor's shape (view(B, T, -1, hd));
   the math is unchanged.

2. Compile time against depth (test_compile_time): fxtron.parallelize(Llama(n_layer=L)) built
   on the meta device (COMPILE_CFG: hidden 64), Mesh(2, tp=2), then pm.compiled(0) (rank 0's
   compilation) and pm.graph(0) (its printed graph), for L in 2, 4, 8, 16, 32. Reported
   separately: trace (parallelize = torch.export + checks), per-rank compile, graph
   rendering; the end-of-run table adds the per-layer slopes (least squares) and the figure
   at 32 layers. One warm-up trace runs first (the first torch.export in a process pays for
   imports and caches).
"""
from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fxtron
from fxtron.models.llama import Attention, Llama, LlamaConfig, apply_rotary
from fxtron.ops import shm
import mcore_gpt
from replay import ReplayTimer, eager_step, noop, timed_job

# ---------------------------------------------------------------- configuration
TRAIN_CFG = LlamaConfig(vocab_size=256, max_seq_len=128, n_layer=4, n_head=8, n_kv_head=4,
                        dim=256, ffn_dim=688)
BATCH, SEQ = 8, 128
N_BATCHES = 4                 # distinct global batches, cycled
WARMUP_STEPS = 3              # per system, untimed
ROUNDS, STEPS_PER_ROUND = 6, 4  # timed steps per system = ROUNDS * STEPS_PER_ROUND
LR = 1e-3
TARGETS = {"fxtron_tp2": "<= 0.5x dtensor_tp2, <= 0.75x single_process",
           "fxtron_tp2_compiled": "<= 0.50x megatron_tp2, <= 0.60x single_process_compiled",
           "fxtron_tp2_sp_compiled": "<= 0.50x megatron_tp2, <= 0.60x single_process_compiled"}
# fxtron_tp2_sp: with sequence parallel (norms and residual adds on 1/tp of the tokens, all-reduces
# become reduce-scatter + all-gather). fxtron_tp2_gloo: the same program with its tp collectives on gloo instead of the shared-memory
# channel (ops/shm.py): the transport's share of the step. fxtron_tp2_unfused: no
# gradient-accumulation fusion, so no weight-gradient GEMM is deferred behind the input
# gradient's all-reduce (the overlap's effect on the step)
# fxtron_tp2_compiled: compile=True (codegen/regions.py: Inductor between fxtron's ops, the fp32
# linears inside the regions);
# single_process_compiled: torch.compile of the unmodified model in rank 0's process (the
# compiled baseline; rank 1 waits as for single_process); megatron_tp2: Megatron-core's tp=2
# GPTModel (mcore_gpt.py), when megatron-core can be installed and imported
MEGATRON = "megatron_tp2"
SYSTEMS = ["fxtron_tp2", "fxtron_tp2_sp", "fxtron_tp2_gloo", "fxtron_tp2_unfused", "fxtron_tp2_compiled",
           "fxtron_tp2_sp_compiled", "dtensor_tp2", MEGATRON, "single_process", "single_process_compiled"]
ONE_PROCESS = ("single_process", "single_process_compiled")

COMPILE_LAYERS = [2, 4, 8, 16, 32]
COMPILE_ROUNDS = {2: 3, 4: 3, 8: 2, 16: 1, 32: 1}


def compile_cfg(n_layer: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=256, max_seq_len=64, n_layer=n_layer, n_head=4, n_kv_head=2,
                       dim=64, ffn_dim=172)


def _cfg_str(cfg: LlamaConfig) -> str:
    return (f"Llama L={cfg.n_layer} dim={cfg.dim} heads={cfg.n_head}/{cfg.n_kv_head}kv "
            f"ffn={cfg.ffn_dim} vocab={cfg.vocab_size}")


# ---------------------------------------------------------------- models
class LocalHeadsAttention(Attention):
    """Attention with the head count taken from the (possibly tensor-parallel local) shape:
    the same parameters and math as fxtron.models.llama.Attention, usable under DTensor TP
    where wq/wk/wv return this rank's heads only."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        hd = self.head_dim
        q = self.wq(x).view(B, T, -1, hd).transpose(1, 2)  # (B, nh_local, T, hd)
        k = self.wk(x).view(B, T, -1, hd).transpose(1, 2)  # (B, nkv_local, T, hd)
        v = self.wv(x).view(B, T, -1, hd).transpose(1, 2)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        n_rep = q.shape[1] // k.shape[1]
        if n_rep > 1:
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # (B, T, nh_local * hd)
        return self.resid_drop(self.wo(y))


def make_model(cfg: LlamaConfig = TRAIN_CFG) -> Llama:
    torch.manual_seed(0)
    return Llama(cfg)


def make_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for i in range(N_BATCHES):
        g = torch.Generator().manual_seed(100 + i)
        ids = torch.randint(0, TRAIN_CFG.vocab_size, (BATCH, SEQ + 1), generator=g)
        out.append((ids[:, :-1].clone(), ids[:, 1:].clone()))
    return out


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR)


# ---------------------------------------------------------------- the training job (per rank)
def _setup_fxtron(rank: int, mesh: fxtron.Mesh, example, fusion: bool = True, transport: str = "shm",
                  sp: bool = False, compile: bool = False):
    t0 = time.perf_counter()
    pm = fxtron.parallelize(make_model(), mesh, example_inputs=example, gradient_accumulation_fusion=fusion,
                            sequence_parallel=sp, compile=compile)
    prog = pm.program(rank)
    compile_s = time.perf_counter() - t0
    opt = _adamw(prog.parameters())
    if transport == "gloo":
        def step(b):
            with shm.disabled():
                return prog.train_step(b, opt)
        return step, compile_s
    return (lambda b: prog.train_step(b, opt)), compile_s


def _setup_dtensor(rank: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    t0 = time.perf_counter()
    model = make_model()
    for layer in model.layers:
        layer.attn.__class__ = LocalHeadsAttention  # same parameters, heads from the local shape
    dmesh = init_device_mesh("cpu", (2,))
    plan = {}
    for i in range(len(model.layers)):
        for name in ("attn.wq", "attn.wk", "attn.wv", "mlp.w1", "mlp.w3"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.wo", "mlp.w2"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(model, dmesh, plan)
    setup_s = time.perf_counter() - t0
    return _eager_step(model), setup_s


def _setup_megatron():
    """Megatron-core's tp=2 GPTModel with make_model()'s weights, and AdamW over its local
    parameters (without sequence parallel the parameters Megatron replicates over tp get equal
    gradients on both ranks: no extra sync). Megatron's parallel_state is initialized here, on
    the job's default process group; _train_job destroys it at the end."""
    t0 = time.perf_counter()
    mcore_gpt.init(tp=2)
    gpt, forward = mcore_gpt.build(make_model(), 2, BATCH, SEQ)
    return eager_step(forward, _adamw(gpt.parameters())), time.perf_counter() - t0


def _eager_step(model):
    """One plain eager training step of `model` (the DTensor and one-process baselines)."""
    return eager_step(model, _adamw(model.parameters()))


def _setup_single(compiled: bool = False):
    model = make_model()
    return _eager_step(torch.compile(model) if compiled else model)


def _rates(seconds: float = 0.6) -> dict[str, float]:
    """This process's rate (ops/s) of a GEMM (a per-rank MLP projection, compute-bound) and of
    an elementwise multiply over 45 MB of tensors (memory-bound: out of cache)."""
    x, w = torch.randn(1024, 256), torch.randn(688, 256)
    a = [torch.randn(8, 128, 688) for _ in range(8)]
    out = {}
    for name, fn in (("gemm", lambda i: x @ w.t()), ("mul", lambda i: a[i % 8] * a[(i + 3) % 8])):
        for i in range(3):
            fn(i)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            fn(n)
            n += 1
        out[name] = n / (time.perf_counter() - t0)
    return out


def _contention_probe(rank: int) -> dict[str, float]:
    """How much of one core's speed each rank keeps when both ranks work at once (rank 0's rate
    with rank 1 busy / with rank 1 blocked in a barrier). Two processes share the machine's
    memory bandwidth and caches: where a memory-bound multiply keeps ~2/3 of its speed, the
    memory-bound third of a training step (norms, residual adds, SwiGLU, rotary, optimizer)
    cannot run twice as fast with tp=2, whatever the parallel program does."""
    dist.barrier()
    alone = _rates() if rank == 0 else None
    dist.barrier()
    both = _rates()
    dist.barrier()
    return {**{k: both[k] / alone[k] for k in both}, "gemm_flops": both["gemm"] * GEMM_FLOPS} if rank == 0 else {}


GEMM_FLOPS = 2 * 1024 * 256 * 688     # one _rates() GEMM


def _step_flops(step, batch) -> dict[str, float]:
    """The FLOPs of one step of `step` on this rank (FlopCounterMode, forward and backward):
    "gemm", its matmuls (mm, addmm, bmm); "attention", its scaled_dot_product_attention counted
    as if not causal (torch's formulas; the CPU flash kernel skips the masked half's blocks).
    The GEMMs' at the GEMM rate of _contention_probe is the time this rank's step cannot go
    below on this machine."""
    from torch.utils import flop_counter as fc
    aten = torch.ops.aten

    def forward(q, k, v, *args, out_shape=None, **kwargs):
        return fc.sdpa_flop_count(q, k, v)

    def backward(grad_out, q, k, v, *args, out_shape=None, **kwargs):
        return fc.sdpa_backward_flop_count(grad_out, q, k, v)

    cpu_flash = {aten._scaled_dot_product_flash_attention_for_cpu: forward,      # (by op packet)
                 aten._scaled_dot_product_flash_attention_for_cpu_backward: backward}
    with fc.FlopCounterMode(display=False, custom_mapping=cpu_flash) as counter:
        step(batch)
    counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    attention = sum(v for k, v in counts.items() if "attention" in k)
    return {"gemm": float(counter.get_total_flops() - attention), "attention": float(attention)}


def _train_job(rank: int, mesh: fxtron.Mesh, systems: list[str]) -> dict:
    """Runs in each of the 2 processes (1 torch thread). Returns rank 0's per-step times and
    losses for every system of `systems` (rank 1 returns its own, unused)."""
    batches = make_batches()
    runners, setup = {}, {}
    runners["fxtron_tp2"], setup["fxtron_tp2"] = _setup_fxtron(rank, mesh, batches[0])
    runners["fxtron_tp2_sp"], setup["fxtron_tp2_sp"] = _setup_fxtron(rank, mesh, batches[0], sp=True)
    runners["fxtron_tp2_gloo"], setup["fxtron_tp2_gloo"] = _setup_fxtron(rank, mesh, batches[0], transport="gloo")
    runners["fxtron_tp2_unfused"], setup["fxtron_tp2_unfused"] = _setup_fxtron(rank, mesh, batches[0], fusion=False)
    runners["fxtron_tp2_compiled"], setup["fxtron_tp2_compiled"] = _setup_fxtron(rank, mesh, batches[0], compile=True)
    runners["fxtron_tp2_sp_compiled"], setup["fxtron_tp2_sp_compiled"] = _setup_fxtron(rank, mesh, batches[0], sp=True,
                                                                                       compile=True)
    runners["dtensor_tp2"], setup["dtensor_tp2"] = _setup_dtensor(rank)
    if MEGATRON in systems:
        runners[MEGATRON], setup[MEGATRON] = _setup_megatron()
    if rank == 0:
        runners["single_process"] = _setup_single()
        runners["single_process_compiled"] = _setup_single(compiled=True)
    steps = {s: 0 for s in systems}
    losses = {s: [] for s in systems}
    times = {s: [] for s in systems}
    cpu_waiting = []  # rank 1's CPU seconds while blocked in the barrier during single_process

    def run_block(system: str, n: int, timed: bool) -> None:
        dist.barrier()
        if system not in runners:  # rank 1 during single_process: wait for rank 0
            c0 = time.process_time()
            dist.barrier()
            cpu_waiting.append(time.process_time() - c0)
            return
        for _ in range(n):
            b = batches[steps[system] % N_BATCHES]
            t0 = time.perf_counter()
            loss = runners[system](b)
            dt = time.perf_counter() - t0
            steps[system] += 1
            losses[system].append(loss)
            if timed:
                times[system].append(dt)
        if system in ONE_PROCESS:
            dist.barrier()

    for system in systems:
        run_block(system, WARMUP_STEPS, timed=False)
    for r in range(ROUNDS):
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        for system in order:
            run_block(system, STEPS_PER_ROUND, timed=True)
    dist.barrier()
    if MEGATRON in systems:
        mcore_gpt.destroy()
    # after the timed rounds, an extra step of the unfused program: the same GEMMs as the compiled
    # one's, all through the dispatcher (Inductor's code calls its GEMMs past it, and the fused
    # weight-gradient accumulation's GEMM is not an aten op FlopCounterMode sees)
    flops = _step_flops(runners["fxtron_tp2_unfused"], batches[0])
    contention = _contention_probe(rank)
    return {"times": times, "losses": losses, "setup_s": setup, "threads": torch.get_num_threads(),
            "cpu_waiting_s": sum(cpu_waiting), "contention": contention, "rank_step_flops": flops}


# ---------------------------------------------------------------- pytest-benchmark glue
REPLAY = ReplayTimer()
_noop = noop


# ---------------------------------------------------------------- 1. training step
@pytest.fixture(scope="module")
def train_results():
    # megatron-core installed here, once, before the ranks start (they only import it)
    why_not = mcore_gpt.available(install=True)
    systems = [s for s in SYSTEMS if s != MEGATRON or why_not is None]
    out = timed_job(_train_job, fxtron.Mesh(2, tp=2), systems, timeout_s=600, args=(systems,))
    out["left_out"] = {} if why_not is None else {MEGATRON: why_not}
    return out


def _floor_s(res: dict) -> float:
    """Rank 0's matmul FLOPs per tp=2 step at the machine's GEMM rate with both
    ranks busy: no tp=2 step of this model in fp32 goes below it here."""
    return res["rank_step_flops"]["gemm"] / res["contention"]["gemm_flops"]


def _floor_note(res: dict) -> str:
    floor = _floor_s(res)
    flops = res["rank_step_flops"]
    note = (f"GEMM floor: rank 0's matmuls per tp=2 step, {flops['gemm'] / 1e9:.2f} GFLOP (FlopCounterMode), at "
            f"this machine's GEMM rate with both ranks busy ({res['contention']['gemm_flops'] / 1e9:.0f} GFLOP/s): "
            f"{1e3 * floor:.1f} ms, before its attention ({flops['attention'] / 1e9:.2f} GFLOP counted as not causal), "
            "collectives, elementwise work and optimizer")
    if MEGATRON in res["median"]:
        half = 0.5 * res["median"][MEGATRON]
        note += (f"; 0.50x Megatron-core's step is {1e3 * half:.1f} ms, "
                 f"{half / floor:.2f}x the floor ({'below it: out of reach here' if half < floor else 'above it'})")
    return note


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}x"


@pytest.mark.benchmark(group="tp2 train step (worker-measured)", timer=REPLAY)
@pytest.mark.parametrize("system", SYSTEMS)
def test_train_step(benchmark, train_results, bench_report, system):
    section = bench_report.setdefault("tensor parallel training step (tp=2, gloo, 1 thread/process)", {
        "headers": ["system", "median step ms", "IQR ms", "min ms", "vs single process",
                    "vs DTensor tp=2", "vs Megatron-core tp=2", "min vs 1p / DT", "target", "setup s",
                    "last loss"],
        "rows": [],
        "notes": [f"model: {_cfg_str(TRAIN_CFG)}; batch {BATCH}x{SEQ}; AdamW; "
                  f"{WARMUP_STEPS} warm-up + {ROUNDS}x{STEPS_PER_ROUND} timed steps per system, interleaved; "
                  f"rank 0's perf_counter per step; job wall time {train_results['job_s']:.1f} s; "
                  f"rank 1 CPU while waiting in the barrier: {train_results['cpu_waiting_s']:.3f} s",
                  "this machine, rank 0's speed with both ranks busy / with rank 1 idle: GEMM "
                  f"{train_results['contention']['gemm']:.2f}x, memory-bound multiply "
                  f"{train_results['contention']['mul']:.2f}x (two processes share memory bandwidth: the "
                  "memory-bound part of a step does not speed up with tp)",
                  _floor_note(train_results),
                  "ratios are of the medians (\"min vs 1p / DT\": of the fastest steps, steadier on a loaded machine); "
                  "targets (issues): fxtron_tp2 <= 0.5x dtensor_tp2 and <= 0.75x single_process; "
                  "fxtron_tp2_compiled <= 0.50x megatron_tp2 and <= 0.60x single_process_compiled; "
                  "judged on the medians; reported, not asserted"],
    })
    if system in train_results["left_out"]:
        why = train_results["left_out"][system]
        section["notes"].append(f"{system} left out of this run: {why}")
        pytest.skip(f"{system} left out: {why}")
    times = train_results["times"][system]
    med = train_results["median"]
    losses = train_results["losses"]
    # Every baseline trains the same model: same first loss, and the same loss after all steps.
    ref = losses["single_process"]
    assert len(losses[system]) == len(ref)
    assert abs(losses[system][0] - ref[0]) < 1e-4, (system, losses[system][0], ref[0])
    assert abs(losses[system][-1] - ref[-1]) < 1e-2, (system, losses[system][-1], ref[-1])

    REPLAY.load(times)
    benchmark.pedantic(_noop, rounds=len(times), iterations=1)
    q = statistics.quantiles(times, n=4)
    vs_megatron = med[system] / med[MEGATRON] if MEGATRON in med else None
    info = {
        "model": _cfg_str(TRAIN_CFG), "batch": f"{BATCH}x{SEQ}", "processes": 1 if system in ONE_PROCESS else 2,
        "threads_per_process": train_results["threads"], "timed_steps": len(times),
        "median_step_s": med[system], "iqr_s": q[2] - q[0],
        "ratio_vs_single_process": med[system] / med["single_process"],
        "ratio_vs_dtensor": med[system] / med["dtensor_tp2"],
        "ratio_vs_megatron": vs_megatron,
        "ratio_vs_single_process_compiled": med[system] / med["single_process_compiled"],
        # on a loaded machine the fastest steps are the least disturbed: ratios of the minima
        "min_step_s": min(times),
        "ratio_vs_single_process_of_min": min(times) / min(train_results["times"]["single_process"]),
        "ratio_vs_dtensor_of_min": min(times) / min(train_results["times"]["dtensor_tp2"]),
        "loss_first": losses[system][0], "loss_last": losses[system][-1],
        "loss_first_diff_vs_single": abs(losses[system][0] - ref[0]),
        "loss_last_diff_vs_single": abs(losses[system][-1] - ref[-1]),
        "machine_speed_both_busy_vs_alone": {k: v for k, v in train_results["contention"].items()
                                             if k != "gemm_flops"},
        "rank_step_flops": train_results["rank_step_flops"],
        "rank_gemm_floor_s": _floor_s(train_results),
    }
    if system in train_results["setup_s"]:
        info["setup_s"] = train_results["setup_s"][system]
    target = ""
    if system == "fxtron_tp2":
        info["target"] = TARGETS[system]
        info["meets_target_vs_dtensor"] = info["ratio_vs_dtensor"] <= 0.5
        info["meets_target_vs_single_process"] = info["ratio_vs_single_process"] <= 0.75
        target = (f"{'met' if info['meets_target_vs_dtensor'] else 'MISSED'} (<=0.5x DT), "
                  f"{'met' if info['meets_target_vs_single_process'] else 'MISSED'} (<=0.75x 1p)")
    if system in ("fxtron_tp2_compiled", "fxtron_tp2_sp_compiled"):
        info["target"] = TARGETS[system]
        info["meets_target_vs_single_process_compiled"] = info["ratio_vs_single_process_compiled"] <= 0.60
        target = (f"{'met' if info['meets_target_vs_single_process_compiled'] else 'MISSED'} "
                  f"(<=0.60x compiled 1p: {info['ratio_vs_single_process_compiled']:.2f}x)")
        if vs_megatron is None:
            target += ", Megatron-core not run"
        else:
            info["meets_target_vs_megatron"] = vs_megatron <= 0.50
            target += f", {'met' if info['meets_target_vs_megatron'] else 'MISSED'} (<=0.50x Megatron)"
    benchmark.extra_info.update(info)
    section["rows"].append([system, f"{1e3 * med[system]:.1f}", f"{1e3 * info['iqr_s']:.1f}",
                            f"{1e3 * min(times):.1f}", _ratio(info["ratio_vs_single_process"]),
                            _ratio(info["ratio_vs_dtensor"]), _ratio(vs_megatron),
                            f"{info['ratio_vs_single_process_of_min']:.2f}x / {info['ratio_vs_dtensor_of_min']:.2f}x",
                            target,
                            f"{info['setup_s']:.2f}" if "setup_s" in info else "-",
                            f"{info['loss_last']:.5f}"])


# ---------------------------------------------------------------- 2. compile time vs depth
def _meta_model_and_inputs(n_layer: int):
    with torch.device("meta"):
        model = Llama(compile_cfg(n_layer))
        idx = torch.zeros(2, 16, dtype=torch.long)
    return model, (idx, idx.clone())


@pytest.fixture(scope="module")
def compile_warm():
    model, inputs = _meta_model_and_inputs(1)
    t0 = time.perf_counter()
    fxtron.parallelize(model, fxtron.Mesh(2, tp=2), example_inputs=inputs).graph(0)
    return time.perf_counter() - t0


def _compile_finalize(section: dict) -> None:
    data = section.pop("data")
    if len(data) < 2:
        return
    layers = sorted(data)

    def slope(key):
        xs = [L for L in layers]
        ys = [data[L][key] for L in layers]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        return b, my - b * mx

    fits = {k: slope(k) for k in ("trace_s", "compile_s", "graph_s", "total_s")}
    section["rows"].append(["slope per layer"] + [f"{1e3 * fits[k][0]:.1f} ms" for k in
                                                   ("trace_s", "compile_s", "graph_s", "total_s")] + ["", ""])
    section["rows"].append(["intercept"] + [f"{fits[k][1]:.2f} s" for k in
                                            ("trace_s", "compile_s", "graph_s", "total_s")] + ["", ""])
    if 32 in data:
        d = data[32]
        section["notes"].append(f"32 layers: trace {d['trace_s']:.2f} s + rank-0 compile {d['compile_s']:.2f} s "
                                f"+ graph render {d['graph_s']:.2f} s = {d['total_s']:.2f} s")


@pytest.mark.benchmark(group="tp2 compile vs depth")
@pytest.mark.parametrize("n_layer", COMPILE_LAYERS)
def test_compile_time(benchmark, compile_warm, bench_report, n_layer):
    parts = []

    def setup():
        return _meta_model_and_inputs(n_layer), {}

    def compile_once(model, inputs):
        t0 = time.perf_counter()
        pm = fxtron.parallelize(model, fxtron.Mesh(2, tp=2), example_inputs=inputs)
        t1 = time.perf_counter()
        pm.compiled(0)
        t2 = time.perf_counter()
        text = pm.graph(0)
        t3 = time.perf_counter()
        parts.append({"trace_s": t1 - t0, "compile_s": t2 - t1, "graph_s": t3 - t2, "total_s": t3 - t0,
                      "traced_nodes": len(pm.traced.graph.nodes), "rank_nodes": len(pm.compiled(0).gm.graph.nodes),
                      "graph_chars": len(text)})

    benchmark.pedantic(compile_once, setup=setup, rounds=COMPILE_ROUNDS[n_layer])
    med = {k: statistics.median(p[k] for p in parts) for k in ("trace_s", "compile_s", "graph_s", "total_s")}
    benchmark.extra_info.update({"model": _cfg_str(compile_cfg(n_layer)) + " (meta)", "n_layer": n_layer,
                                 "rounds": len(parts), **{f"median_{k}": v for k, v in med.items()},
                                 "traced_nodes": parts[0]["traced_nodes"], "rank0_nodes": parts[0]["rank_nodes"],
                                 "warmup_trace_s": compile_warm})

    section = bench_report.setdefault("compile time vs depth (tp=2, meta device)", {
        "headers": ["layers", "trace (parallelize)", "rank-0 compile", "graph(0) render", "total",
                    "compile / layer", "rounds"],
        "rows": [], "data": {}, "finalize": _compile_finalize,
        "notes": [f"model: {_cfg_str(compile_cfg(0)).replace('L=0 ', '')}, built on meta; medians over rounds; "
                  f"a warm-up trace (1 layer, {compile_warm:.2f} s) ran first"],
    })
    section["data"][n_layer] = med
    section["rows"].append([str(n_layer), f"{med['trace_s']:.2f} s", f"{med['compile_s']:.3f} s",
                            f"{med['graph_s']:.3f} s", f"{med['total_s']:.2f} s",
                            f"{1e3 * med['compile_s'] / n_layer:.1f} ms", str(len(parts))])
