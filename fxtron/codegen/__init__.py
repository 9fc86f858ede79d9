"""fxtron.codegen: per-rank code generation -- linears rewritten to the fused
weight-gradient-accumulation op, each with the kernel it runs (ops/wgrad.py: a Triton GEMM on
CUDA, addmm_ on CPU)."""
from fxtron.codegen.fuse import fuse_linears, fused_weights
from fxtron.ops.wgrad import kernel_for, wgrad_accumulate

__all__ = ["fuse_linears", "fused_weights", "kernel_for", "wgrad_accumulate"]
