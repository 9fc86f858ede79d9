"""Ops: the kernels an op's run-time form calls, provided from above.

The op vocabulary (this package) says *what* a step computes; codegen/ says *which kernel*
computes it (a Triton GEMM on CUDA, a torch call elsewhere). So that ops never import the layer
above, codegen registers each kernel here under the name the op asks for, with the function
that says which implementation a call takes (Thunder's executors claim ops the same way).
fxtron's package import loads codegen, so every kernel is in place before any op runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Kernel:
    """`run(*args)` computes the op's step; `choose(*args) -> str` names the implementation
    that call takes (it reads devices and dtypes only, so it also answers on fake tensors)."""
    name: str
    run: Callable
    choose: Callable[..., str]


_KERNELS: dict[str, Kernel] = {}


def register_kernel(kernel: Kernel) -> Kernel:
    _KERNELS[kernel.name] = kernel
    return kernel


def kernel(name: str) -> Kernel:
    """The kernel registered as `name` (codegen/ registers them when fxtron is imported)."""
    try:
        return _KERNELS[name]
    except KeyError:
        raise RuntimeError(f"no kernel registered as {name!r}: fxtron.codegen registers the kernels "
                           "the ops call; import fxtron (not fxtron.ops alone)") from None


__all__ = ["Kernel", "kernel", "register_kernel"]
