"""fxtron.ops: the graph's op vocabulary -- the custom ops per-rank graphs call (Megatron's
conjugate communication pairs over any mesh axis, the vocab-parallel embedding and cross
entropy, the fused weight-gradient linear, random streams, recomputed regions), each with its fake and autograd
forms and, in `registry`, what it communicates over which axis. Importing this package
registers every torch.ops.fxtron op. Above fxtron.core; below passes and runtime.
"""
from fxtron.ops import cp, ep, fsdp, kernels, linear, registry, scan, statistics, tp, sp, vocab  # noqa: F401 - registers torch.ops.fxtron.*

__all__ = ["cp", "ep", "fsdp", "kernels", "linear", "registry", "scan", "sp", "statistics", "tp", "vocab"]
