"""fxtron.codegen: a rank's graph turned into what runs.

Between the passes (which decide placements and collectives) and the runtime (which executes a
rank's program): the rewrite of linears into the fused weight-gradient-accumulation op
(`fuse`), and the kernels the ops call, registered in `fxtron.ops.kernels` with the check that
says which calls each takes (`wgrad`: the Triton GEMM that accumulates into main_grad on CUDA,
addmm_ elsewhere; `attention`: the cp attention block on torch's fused flash or memory-efficient
kernels on CUDA), and the compiled programs (`regions`: under compile=True a bound rank graph
cut at fxtron's ops, the regions between them compiled by Inductor; `calls`: a bound graph's
forward generated again with each aten op called at its C++ entry point). Importing this
package registers every kernel.
"""
from fxtron.codegen import attention, fuse, wgrad  # noqa: F401 - registers the kernels the ops call

__all__ = ["attention", "fuse", "wgrad"]
