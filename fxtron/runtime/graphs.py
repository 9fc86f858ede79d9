"""Runtime, CUDA graphs: a program's whole training step -- forward, backward, the gradient sync,
clipping and the optimizer's step -- captured once in a torch.cuda.CUDAGraph and replayed every
step after (`cuda_graphs=True`, the codegen section): one launch a step instead of thousands.

How (torch.cuda.graphs' recipe, as Megatron-core's full-iteration graph does it):

- the first `cuda_graph_warmup` steps run eagerly on a side stream; they train like any step
  and make what a capture cannot: NCCL's communicators, the optimizer's state (Adam's moments,
  its step count a device tensor: `capturable=True`), the gradient buffers, the allocator's
  blocks;
- the next step is captured into the graph's private memory pool (capture_error_mode
  "thread_local": other threads, NCCL's watchdog among them, may query CUDA meanwhile), every
  rank between two barriers, then replayed; the capture itself computes nothing;
- every step copies its batch (the rank's slice, on the device) into static input buffers and
  the batch's statistics (ops/statistics.py: the global token counts a mean loss divides by)
  into static tensors the graph reads, then replays;
- what the uncaptured step reads on the host is kept on the device and read after the replay:
  the loss (its sum over dp inside the graph) and the gradient norm (clip_grad; skip_nonfinite);
- each param group's learning rate is a device tensor the graph reads; a float the caller sets
  between steps (a schedule's) is copied into it before the replay. Every other
  hyperparameter is fixed at capture: a change is refused.

The numbers: the step is the uncaptured one's, with Adam's capturable arithmetic (bias
corrections on the device, in float32) from the first step, warm-up included.

Refused, as a ParallelizeError naming the reason and what to change, as early as it is known:
at parallelize (config/sections.py `Config._cuda_graph_rules`): a CPU device, fp16's loss
scaling (its overflow check is read on the host), pipeline schedules and microbatches, zero,
recomputation, context parallel (masked attention reads its pieces on the host), expert
parallel, the collective check; at program build (`check_program`):
random draws and data-dependent shapes in the graph (codegen/regions.py `host_bound`, carried
by the RankSpec), a
program that is not on CUDA, process groups not on NCCL (gloo, and its shared-memory channel,
ops/shm.py); at a step (`CapturedStep`): optimizers other than Adam / AdamW, another
optimizer than the captured one, a batch of another shape than the captured one (one graph per
shape would hold a memory pool and static buffers each: pad the batches to one length), a
`Microbatches` list. A step whose gradient norm is not finite under skip_nonfinite cannot be
skipped (the optimizer's step is in the graph): the error comes after it, naming the step.
"""
from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.distributed as dist

from fxtron.errors import ParallelizeError
from fxtron.ops import ledger
from fxtron.ops.linear import WgradQueue
from fxtron.ops.statistics import BatchContext
from fxtron.runtime import optim
from fxtron.runtime.batch import Microbatches

#: the optimizers a captured step takes: their step count and learning rate live on the device
#: (capturable=True), so a replay steps them as the eager step would
CAPTURABLE = (torch.optim.Adam, torch.optim.AdamW)

_OFF = "; or turn cuda_graphs off"


def check_program(bound, groups, device: torch.device) -> None:
    """ParallelizeError, at program build, for what a captured step cannot replay on this rank:
    `bound`, the graph's random draws and data-dependent shapes (RankSpec.host_bound, found by
    codegen/regions.py host_bound), a program that is not on CUDA, process groups whose
    collectives a CUDA graph cannot capture (gloo; the shared-memory channel), the collective
    check (gloo, from the host)."""
    why = list(bound)
    if device.type != "cuda":
        why.append(f"the program runs on {device.type} (CUDA graphs capture CUDA kernels alone): build it in a "
                   "process of fxtron.launch(..., backend='nccl') or init_distributed on a GPU machine")
    if groups is not None:
        if groups.channels:
            why.append("the shared-memory channel (ops/shm.py) carries collectives through host memory, outside any "
                       "CUDA stream: turn it off (fxtron.launch(..., shm_transport=False), FXTRON_SHM=0, --no-shm) "
                       "and launch with backend='nccl'")
        elif "nccl" not in str(groups.backend):
            why.append(f"the process groups are on {groups.backend}, whose collectives run on the host (NCCL's are "
                       "kernels a CUDA graph captures): launch with backend='nccl'")
    if ledger.checking():
        why.append("the collective check agrees every collective with its peers over gloo from the host: turn it "
                   "off (check_collectives=False, FXTRON_CHECK_COLLECTIVES=0)")
    if why:
        raise ParallelizeError("cuda_graphs=True cannot capture this program's step: " + "; ".join(why) + _OFF)


def _shapes(flat: list, values: dict) -> list:
    return ([(tuple(x.shape), x.dtype) for x in flat]
            + [(k, tuple(v.shape), v.dtype) for k, v in sorted(values.items())])


def _describe(shapes: list) -> str:
    return ", ".join(str(s[0]) if len(s) == 2 else f"{s[0]} {s[1]}" for s in shapes)


class CapturedStep:
    """A program's captured training step (module docstring), made at its first step:
    `warmup` eager steps, then the capture (`captured_at`, the step's number in this program,
    `capture_s` its seconds), then replays."""

    def __init__(self, prog, warmup: int):
        self.prog, self.warmup = prog, warmup
        self.device = next(iter(prog.parameters())).device
        self.steps = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.captured_at: int | None = None
        self.capture_s = 0.0
        self.flat: list[torch.Tensor] | None = None      # static input buffers
        self.batch: BatchContext | None = None           # static statistics
        self.shapes: list | None = None
        self.optimizers: list | None = None
        self.lrs: list[tuple[dict, torch.Tensor]] = []   # (param group, its device lr)
        self.fixed: list[dict] | None = None             # the other hyperparameters, as at the first step
        self.loss: torch.Tensor | None = None            # the graph's outputs, read after a replay
        self.norm: torch.Tensor | None = None

    def line(self) -> str:
        """One line for the start-up log: where the step stands."""
        if self.graph is None:
            return (f"cuda_graphs: warming up ({self.steps} of {self.warmup} eager steps on a side stream); step "
                    f"{self.warmup + 1} is captured")
        return (f"cuda_graphs: step {self.captured_at} captured in one CUDA graph in {self.capture_s:.2f} s (forward, "
                "backward, gradient sync, optimizer); every later step copies its batch in and replays it")

    # ---------------------------------------------------------------- the step
    def step(self, inputs, optimizer, kwargs: dict | None) -> float:
        """One training step (Program.train_step's contract): the batch copied into the static
        buffers, then an eager warm-up step, the capture and its replay, or a replay; the global
        batch's loss, read after it."""
        prog = self.prog
        if isinstance(inputs, Microbatches):
            raise ParallelizeError("cuda_graphs=True captures one forward and backward per step; a Microbatches list "
                                   "is run by the schedule from the host: pass one batch" + _OFF)
        opts = optim.optimizers(optimizer)
        self._check_optimizers(opts)
        args, kw = prog.local_batch(inputs, kwargs)
        self._load(prog._flat_inputs(args, kw), prog._batch.context(inputs, kwargs))
        self._sync_lr()
        if self.graph is None and self.steps < self.warmup:
            if self.device.type == "cuda":
                side = torch.cuda.Stream(device=self.device)
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    loss, norm = self._body(opts)
                torch.cuda.current_stream().wait_stream(side)
            else:        # (the warm-up's work runs anywhere; the tests run it on the CPU)
                loss, norm = self._body(opts)
        else:
            if self.graph is None:
                self._capture(opts)
            self.graph.replay()
            loss, norm = self.loss, self.norm
        self.steps += 1
        prog._events, prog._last_runner = [], None
        return self._read(loss, norm)

    def _check_optimizers(self, opts: list) -> None:
        if self.optimizers is not None:
            if [id(o) for o in opts] != [id(o) for o in self.optimizers]:
                raise ParallelizeError("cuda_graphs=True: this step's optimizer is not the one the step was captured "
                                       "with (its state and hyperparameters are in the graph): pass the same one, or "
                                       "build the program again")
            now = self._hyperparameters()
            if now != self.fixed:
                if len(now) != len(self.fixed):
                    changed = "the param groups"
                else:
                    changed = ", ".join(f"the parameters of group {i}" if k == "params" else
                                        f"{k} of group {i} ({was.get(k)!r} -> {g.get(k)!r})"
                                        for i, (g, was) in enumerate(zip(now, self.fixed))
                                        for k in sorted(set(g) | set(was), key=str) if g.get(k) != was.get(k))
                raise ParallelizeError(f"cuda_graphs=True: {changed} changed since this program's first step; the "
                                       "captured step holds every optimizer setting but lr as it was then: set them "
                                       "before the first step" + _OFF)
            return
        for o in opts:
            if type(o) not in CAPTURABLE:
                raise ParallelizeError(
                    f"cuda_graphs=True steps torch.optim.Adam and AdamW (capturable: their step count and learning "
                    f"rate device tensors the graph reads), not {type(o).__module__}.{type(o).__name__}: use AdamW"
                    + _OFF)
        capturable = self.device.type == "cuda"      # (torch's capturable Adam runs on CUDA alone)
        for o in opts:
            o.defaults["capturable"] = capturable
            for g in o.param_groups:
                g["capturable"] = capturable
                lr = torch.tensor(float(g["lr"]), dtype=torch.float32, device=self.device)
                g["lr"] = lr
                self.lrs.append((g, lr))
            for p, st in o.state.items():       # a loaded checkpoint's step counts: onto their parameters' device
                if torch.is_tensor(st.get("step")) and st["step"].device != p.device:
                    st["step"] = st["step"].to(p.device, torch.float32)
        self.optimizers = list(opts)
        self.fixed = self._hyperparameters()

    def _hyperparameters(self) -> list[dict]:
        """Every param group's settings but lr (their parameters by identity), as comparable reprs."""
        return [{"params": [id(p) for p in g["params"]],
                 **{k: repr(v) for k, v in g.items() if k not in ("params", "lr")}}
                for o in self.optimizers for g in o.param_groups]

    def _sync_lr(self) -> None:
        """A learning rate set between steps (a float) into the device tensor the graph reads."""
        for g, lr in self.lrs:
            if g["lr"] is not lr:
                lr.fill_(float(g["lr"]))
                g["lr"] = lr

    def _load(self, flat: list, batch: BatchContext) -> None:
        """The step's inputs and statistics into the static buffers (made at the first step)."""
        shapes = _shapes(flat, batch.values)
        if self.shapes is None:
            self.shapes = shapes
            self.flat = [x.detach().clone() for x in flat]
            self.batch = BatchContext(batch.pieces, {k: v.detach().clone() for k, v in batch.values.items()})
            return
        if shapes != self.shapes:
            raise ParallelizeError(
                f"cuda_graphs=True: this step's inputs are ({_describe(shapes)}), this program's first step's "
                f"({_describe(self.shapes)}): a CUDA graph replays the shapes it was captured with (one graph per "
                "shape would hold its own memory pool and static buffers); pad every batch to one shape (e.g. "
                "labels at ignore_index)" + _OFF)
        with torch.no_grad():
            for static, x in zip(self.flat, flat):
                static.copy_(x, non_blocking=True)
            for k, v in batch.values.items():
                self.batch.values[k].copy_(v, non_blocking=True)

    def _body(self, opts: list) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Program.train_step's work on the static buffers with nothing read on the host: the
        global loss and the gradient norm (None when nothing needs it) as device tensors."""
        prog = self.prog
        optim.zero_grad(opts)
        with prog.grads.accumulation(), self.batch.active():       # (accumulation zeroes the main_grads)
            loss = prog._run_graph(self.flat)
            total = prog._start_global_loss(loss.detach().to(torch.promote_types(loss.dtype, torch.float32)),
                                            on_device=True)
            prog.grads.last_backward(None)
            with WgradQueue().active() if prog._tp_comm else contextlib.nullcontext():
                loss.backward()
        norm = prog.grads.finalize(read_norm=False)
        if norm is None and prog.skip_nonfinite:
            norm = prog.grads.norm()
        for o in opts:
            o.step()
        return total(), norm

    def _capture(self, opts: list) -> None:
        if self.device.type != "cuda":
            raise ParallelizeError(f"cuda_graphs=True: the program's parameters are on {self.device}, and a CUDA "
                                   "graph captures CUDA kernels alone" + _OFF)
        self._barrier()        # every rank captures together (as Megatron-core's full-iteration graph does)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        t0 = time.perf_counter()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.loss, self.norm = self._body(opts)
        except RuntimeError as e:
            raise ParallelizeError(
                f"cuda_graphs=True: capturing step {self.steps + 1} failed ({e}); something in the step reads the "
                "device on the host or synchronizes (see the first line of torch's message)" + _OFF) from e
        torch.cuda.synchronize()
        self._barrier()
        self.capture_s = time.perf_counter() - t0
        self.graph, self.captured_at = graph, self.steps + 1

    def _barrier(self) -> None:
        if self.prog.groups is not None and dist.is_initialized():
            with ledger.collective(dist.group.WORLD, "barrier"):
                dist.barrier()

    def _read(self, loss: torch.Tensor, norm: torch.Tensor | None) -> float:
        """The step's loss and norm on the host, after the replay."""
        prog = self.prog
        value = float(loss)
        if norm is not None:
            prog.grads.last_norm = float(norm)
        prog.last_step_skipped = False
        ledger.step_end(prog.groups)
        if prog.skip_nonfinite and norm is not None and not math.isfinite(prog.grads.last_norm):
            raise ParallelizeError(
                f"step {self.steps} of this program: the global gradient norm is {prog.grads.last_norm} (loss "
                f"{value}); under cuda_graphs=True the optimizer's step is inside the graph and cannot be skipped, so "
                "the weights now hold non-finite values. Resume from the last checkpoint with a lower learning rate "
                "or clip_grad, or turn cuda_graphs off (such steps are then skipped)")
        return value


def captured_step(prog, inputs, optimizer, kwargs: dict | None) -> float:
    """Program.train_step under cuda_graphs=True: the program's CapturedStep (made at its first
    step) runs it."""
    if prog.captured is None:
        prog.captured = CapturedStep(prog, prog.config.codegen.cuda_graph_warmup)
    return prog.captured.step(inputs, optimizer, kwargs)


__all__ = ["CAPTURABLE", "CapturedStep", "captured_step", "check_program"]
