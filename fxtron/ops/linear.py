"""Ops: the linear whose weight gradient accumulates straight into an fp32 `main_grad`
(Megatron's gradient_accumulation_fusion), with the weight-gradient GEMM deferrable so that it
overlaps the communication of the input gradient (Megatron's
LinearWithGradAccumulationAndAsyncCommunication).

`fxtron::linear(x, weight, bias, weight_in_out)`: y = x W^T + b (or x W + b). Its backward
computes the input gradient first; the weight gradient goes through the "wgrad" kernel (codegen/wgrad.py's `wgrad_accumulate`)
into `weight.main_grad` when the program gave the weight one (otherwise it is returned to
autograd as usual). While a `WgradQueue` is active (a program's train_step), those
weight-gradient GEMMs are queued instead of run: the next communicating op's backward
(copy_to_region, gather_from_sequence) starts its collective asynchronously, runs the queue
while the bytes move, then waits. codegen/fuse.py rewrites a graph's linears into this op.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from fxtron.core.records import FRESH_GRADS, FSDP_GATHERED, GRAD_REPORTS, SEQUENCE_GATHERED, SequenceGathered
from fxtron.ops.kernels import kernel
from fxtron.ops.recompute import recomputing
from fxtron.ops.registry import OpSpec, register

_QUEUE: contextvars.ContextVar["WgradQueue | None"] = contextvars.ContextVar("fxtron_wgrad_queue", default=None)


class WgradQueue:
    """Weight-gradient GEMMs waiting for a communication to hide behind. A `deferred` queue
    (the zero-bubble schedule's backward) keeps them past every communication and past the
    end of backward, until `run()` (the schedule's W pass)."""

    def __init__(self, deferred: bool = False):
        self.jobs: list[Callable[[], None]] = []
        self.deferred = deferred
        self._held: dict[int, int] = {}   # storage -> bytes the queued jobs hold (inputs, output gradients)

    def hold(self, *tensors: Tensor) -> None:
        """Count `tensors` as held by the queued jobs (each storage once): a deferred W pass
        keeps its linears' saved inputs, which autograd has released, and their output gradients."""
        for t in tensors:
            st = t.untyped_storage()
            self._held[st.data_ptr()] = st.nbytes()

    @property
    def held_bytes(self) -> int:
        """Bytes the queued jobs hold (what a deferred W pass keeps from its B)."""
        return sum(self._held.values())

    @contextlib.contextmanager
    def active(self):
        token = _QUEUE.set(self)
        try:
            yield self
        finally:
            _QUEUE.reset(token)
            self.drain()

    def drain(self) -> None:
        if not self.deferred:
            self.run()

    def run(self) -> None:
        """Run every queued weight-gradient GEMM now."""
        jobs, self.jobs = self.jobs, []
        self._held = {}
        for job in jobs:
            job()


def active_queue() -> WgradQueue | None:
    return _QUEUE.get()


def _accumulate(x: Tensor, dy: Tensor, main_grad, weight_in_out: bool, report=None) -> None:
    """main_grad += the weight gradient; then tell the data-parallel buffer (when the program
    gave the weight a `report`) that this contribution is complete. `main_grad` may be a
    function giving it (zero=3's, asked when the GEMM runs). Nothing of it is recorded by
    autograd, wherever it runs: in backward, in a queue drained after it or by the W pass, in a
    backward that records (create_graph)."""
    if torch.is_grad_enabled():
        with torch.no_grad():
            return _accumulate(x, dy, main_grad, weight_in_out, report)
    if callable(main_grad):
        main_grad = main_grad()
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    a, b = (x2, dy2) if weight_in_out else (dy2, x2)
    if FRESH_GRADS.take(main_grad):    # the step's first contribution (runtime/dp.py, core/records.py)
        if a.dtype == main_grad.dtype:
            torch.mm(a.t(), b, out=main_grad)        # written, as autograd's weight gradient is: no read of it
            if report is not None:
                report()
            return
        main_grad.zero_()
    if main_grad.dtype != torch.float32:   # a 16-bit gradient buffer (grad_reduce_dtype)
        main_grad.addmm_(a.t().to(main_grad.dtype), b.to(main_grad.dtype))
    elif a.dtype == torch.float32:  # fp32 inputs: torch's GEMM accumulates in place (the kernel's choice for them)
        main_grad.addmm_(a.t(), b)
    elif weight_in_out:   # main_grad [in, out] += x^T dy
        kernel("wgrad").run(dy, x, main_grad)
    else:                 # main_grad [out, in] += dy^T x
        kernel("wgrad").run(x, dy, main_grad)
    if report is not None:
        report()


class Regather:
    """How a tensor all-gathered from sequence-parallel shards (ops/sp.py gather_from_sequence)
    is gathered again in backward. The gathered tensor's record (core/records.py
    SEQUENCE_GATHERED: the shard, this Regather) says so; a linear whose input it is saves the shard for backward instead of the whole
    tensor and gathers it again there (Megatron's sequence-parallel linear). The linears that
    share one gathered input (q, k and v projections) share one gather in backward, made by the
    first and dropped after the last. It holds no tensor until backward: the shard lives only
    as a saved tensor (so a recomputed region's checkpoint drops it)."""

    def __init__(self, start_gather: Callable[[Tensor], Any]):
        self._start = start_gather   # shard -> a work whose wait() returns the whole (ops/transport.py)
        self.savers = 0        # linears that saved the shard
        self._full: Tensor | None = None
        self._work = None
        self._taken = 0

    def begin(self, shard: Tensor) -> Callable[[], Tensor]:
        """Start gathering the whole tensor again from `shard` (the one saved: a recomputed
        region's own), unless a saver before did; the call returned waits and gives it. Only
        local computation may run in between."""
        if self._full is None and self._work is None:
            self._work = self._start(shard)

        def finish() -> Tensor:
            if self._full is None:
                self._full, self._work = self._work.wait(), None
            out = self._full
            self._taken += 1
            if self._taken >= self.savers:       # the last saver has it: hold it no longer
                self._full, self._taken = None, 0
            return out
        return finish


def gathered(x: Tensor) -> SequenceGathered | None:
    """The record (core/records.py SequenceGathered: the sequence shard `x` was all-gathered
    from, how to gather it again), if it was."""
    return SEQUENCE_GATHERED.get(x)


def _linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], weight_in_out: bool) -> Tensor:
    """The forward GEMM with the bias added inside it (addmm, as nn.Linear's F.linear), not in a
    second pass over the output."""
    if not weight_in_out:
        return torch.nn.functional.linear(x, weight, bias)
    if bias is None:
        return torch.matmul(x, weight)
    return torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[1])


@torch.library.custom_op("fxtron::linear", mutates_args=())
def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], weight_in_out: bool) -> Tensor:
    """y = x W^T + b (weight [out, in], as nn.Linear) or y = x W + b (weight_in_out: [in, out],
    as Conv1D / mm)."""
    return _linear(x, weight, bias, weight_in_out)


@linear.register_fake
def _linear_fake(x, weight, bias, weight_in_out):
    out = weight.shape[1] if weight_in_out else weight.shape[0]
    return x.new_empty((*x.shape[:-1], out))


def _setup(ctx, inputs, output):
    x, weight, bias, ctx.weight_in_out = inputs
    ctx.fsdp = FSDP_GATHERED.get(weight)   # a weight gathered under zero=3 (ops/fsdp.py, core/records.py)
    if ctx.fsdp is not None:     # keep the handle, not the whole weight: backward gathers it again
        ctx.weight = None
    else:
        ctx.weight = weight      # the Parameter itself: its main_grad attribute is read in backward
    ctx.has_bias = bias is not None
    ctx.x_dtype = x.dtype
    ctx.regather = None
    if not ctx.needs_input_grad[1]:  # a frozen weight: no weight gradient, so no input kept (nor,
        return                       # under sequence parallel, gathered again in backward)
    g = gathered(x)
    ctx.regather = g.regather if g is not None else None
    if g is None:
        ctx.save_for_backward(x)
        return
    ctx.save_for_backward(g.shard)   # sequence parallel: keep the shard, gather it again in backward
    if not recomputing():            # a recomputation's ctx is not run backward: no saver more
        ctx.regather.savers += 1


def _backward(ctx, dy):
    """The input gradient, then the weight gradient (into main_grad, queued or now), then the
    bias's. The input's is computed only where the input takes a gradient, the weight's only
    where the weight takes one: a frozen weight (requires_grad=False; every weight in a
    program's step has a main_grad, frozen ones too) runs no GEMM, as in autograd, and keeps
    no input for it (under sequence parallel, gathers none again). Under zero=3 the gathered
    weight answers for its parameter."""
    saved = ctx.saved_tensors
    x = saved[0] if saved else None    # (none kept for a frozen weight)
    needs_x, needs_w, needs_b = ctx.needs_input_grad[:3]
    gathering = ctx.regather.begin(x) if ctx.regather is not None else None
    if ctx.fsdp is not None:   # zero=3: the weight gathered again, its gradient into the layer's
        units, unit, index = ctx.fsdp.units, ctx.fsdp.unit, ctx.fsdp.index
        w = units.weight(unit, index)
        # where it accumulates is asked when the GEMM runs (a deferred W pass may run after the
        # layer's gradient of this microbatch was reduced: its share then joins the next reduction)
        main_grad, report = (lambda: units.main_grad(unit, index)), units.reporter(unit)
    else:
        w = ctx.weight
        reported = GRAD_REPORTS.get(w)   # (runtime/grads.py, core/records.py)
        main_grad, report = getattr(w, "main_grad", None), reported.report if reported is not None else None
    if dy.dtype != ctx.x_dtype:    # as Megatron: the weight-gradient GEMM takes both in the input's dtype
        dy = dy.to(ctx.x_dtype)
    dx = dy.matmul(w.t() if ctx.weight_in_out else w) if needs_x else None
    if gathering is not None:  # the input gathered again while the input gradient was computed
        x = gathering()
    grad_w = None
    if main_grad is not None and needs_w:
        job = lambda: _accumulate(x, dy, main_grad, ctx.weight_in_out, report)  # noqa: E731
        queue = active_queue()
        if queue is not None:
            queue.jobs.append(job)
            queue.hold(x, dy)
        else:
            job()
    elif main_grad is not None:      # frozen: nothing to add; its bucket need not wait for it
        if report is not None:
            report()
    elif needs_w:
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        grad_w = x2.t().matmul(dy2) if ctx.weight_in_out else dy2.t().matmul(x2)
    grad_b = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias and needs_b else None
    return dx, grad_w, grad_b, None


linear.register_autograd(_backward, setup_context=_setup)


class _Linear(torch.autograd.Function):
    """fxtron::linear as a program runs it: the op's own forward, setup and backward, applied
    without the dispatcher's round trips through Python that a torch.library op makes on
    every call (~0.1-0.2 ms of CPU per linear and step, which a GPU waiting on its CPU pays)."""

    @staticmethod
    def forward(ctx, x, weight, bias, weight_in_out):
        y = _linear(x, weight, bias, weight_in_out)
        _setup(ctx, (x, weight, bias, weight_in_out), y)
        return y

    backward = staticmethod(_backward)


def linear_eager(x: Tensor, weight: Tensor, bias: Optional[Tensor], weight_in_out: bool) -> Tensor:
    """The run-time form of fxtron::linear (same values and gradients)."""
    return _Linear.apply(x, weight, bias, weight_in_out)


register(OpSpec("linear", eager=linear_eager))


# ------------------------------------------------------------------ the master-weight linear
#: torch has the GEMM with an output dtype of its own (read once: Dynamo, tracing wide_mm inside a
#: compiled region, cannot trace the lookup)
_MM_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()


def wide_mm(a: Tensor, b: Tensor, out_dtype: torch.dtype) -> Tensor:
    """a @ b accumulated and returned in `out_dtype` (fp32 for 16-bit a and b): on CUDA one GEMM
    with an fp32 output (cuBLAS accumulates in fp32 either way; nothing is rounded to 16 bits),
    elsewhere the GEMM of the upcast operands (what the fused linear's addmm_ does on the CPU)."""
    if a.dtype == out_dtype:
        return a.mm(b)
    if a.is_cuda and _MM_OUT_DTYPE:
        return torch.ops.aten.mm.dtype(a, b, out_dtype)
    return a.to(out_dtype).mm(b.to(out_dtype))


@torch.library.custom_op("fxtron::master_linear", mutates_args=())
def master_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], weight_in_out: bool) -> Tensor:
    """fxtron::linear as a compiled region holds it under 16-bit compute: `weight` is the fp32
    master weight, cast to x's dtype here (the compute copy), and the weight gradient returned
    for it is the fp32-accumulated GEMM -- the number the fused linear adds into main_grad, not
    autograd's 16-bit gradient of a compute copy. Autograd adds it into main_grad (the
    parameter's .grad: runtime/grads.py's direct accumulation). Placed by codegen/fuse.py where compile=True keeps the linears
    in its regions (compiler/passmanager.py linears_in_regions)."""
    return _linear(x, weight.to(x.dtype), bias, weight_in_out)


master_linear.register_fake(_linear_fake)     # (the output in x's dtype, as the linear's)


class _MasterLinear(torch.autograd.Function):
    """fxtron::master_linear's values and gradients, as the compiled region traces them (Dynamo
    inlines an autograd.Function: the cast and the GEMMs join the region's forward and backward,
    no custom-op call between)."""

    @staticmethod
    def forward(ctx, x, weight, bias, weight_in_out):
        ctx.weight_in_out = weight_in_out
        # which gradients are taken (a frozen weight's GEMM is not run where this runs eagerly,
        # in a recomputed region; a compiled backward drops what no one takes either way)
        ctx.takes = (x.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
        ctx.save_for_backward(x, weight)
        return _linear(x, weight.to(x.dtype), bias, weight_in_out)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        takes_x, takes_w, takes_b = ctx.takes
        dy = dy.to(x.dtype)
        dx = grad_w = grad_b = None
        if takes_x:
            w = weight.to(x.dtype)    # the compute copy again: nothing 16-bit kept from forward
            dx = dy.matmul(w.t() if ctx.weight_in_out else w)
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        if takes_w:
            grad_w = wide_mm(x2.t(), dy2, weight.dtype) if ctx.weight_in_out else wide_mm(dy2.t(), x2, weight.dtype)
        if takes_b:
            grad_b = dy2.sum(0)
        return dx, grad_w, grad_b, None


def _master_setup(ctx, inputs, output):
    x, weight, bias, ctx.weight_in_out = inputs
    ctx.takes = tuple(ctx.needs_input_grad[:3])
    ctx.save_for_backward(x, weight)


master_linear.register_autograd(_MasterLinear.backward, setup_context=_master_setup)


def master_linear_eager(x: Tensor, weight: Tensor, bias: Optional[Tensor], weight_in_out: bool) -> Tensor:
    """The run-time form of fxtron::master_linear (a compiled region's own op: codegen/regions.py)."""
    return _MasterLinear.apply(x, weight, bias, weight_in_out)


register(OpSpec("master_linear", eager=master_linear_eager))


def kernel_name(device: torch.device, dtype: torch.dtype) -> str:
    """The weight-gradient kernel a fused linear with `dtype` activations uses on `device`:
    wgrad_accumulate's own choice (Triton for 16-bit inputs on CUDA, addmm_ otherwise)."""
    kernel_for = kernel("wgrad").choose
    if device.type == "cuda":
        return "wgrad:" + ("triton_wgrad_accum_fp32" if dtype in (torch.bfloat16, torch.float16) else "addmm_fp32")
    probe = torch.empty((1, 1), dtype=dtype, device=device)
    return "wgrad:" + kernel_for(probe, probe, torch.zeros((1, 1), dtype=torch.float32))


__all__ = ["Regather", "WgradQueue", "active_queue", "gathered", "kernel_name", "linear", "linear_eager", "master_linear",
           "master_linear_eager", "wide_mm"]
