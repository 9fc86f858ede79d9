"""fxtron.codegen: per-rank code generation — linears whose weight gradients accumulate into
fp32 main_grad (`fuse_linears`), through `wgrad_accumulate` (Triton GEMM on CUDA, addmm_ on CPU)."""
from fxtron.codegen.wgrad import kernel_for, wgrad_accumulate

__all__ = ["kernel_for", "wgrad_accumulate"]
