"""Errors a user can cause, raised at the boundary of every public entry point."""


class ParallelizeError(ValueError):
    """A model, mesh or option that fxtron cannot parallelize as asked.

    The message names the node, module path or parameter, the shapes involved, and what to
    change. Subclasses ValueError so generic handlers still catch it.
    """


class CompileError(RuntimeError):
    """A compiler pass failed on a model in a way no check foresaw: a bug in fxtron, or an op
    or pattern it does not know. The message names the pass, the rank and the mesh; the
    original exception is its __cause__. (Mistakes a user can fix raise ParallelizeError.)"""


class LaunchError(RuntimeError):
    """A rank of a job started by `fxtron.launch` failed; the message carries its traceback."""


class PeerError(LaunchError, ParallelizeError):
    """A peer rank died (killed, out of memory, a crash without a traceback): the message names
    the rank and its exit (code or signal) where it is known, and what this rank was doing.
    Raised by the launcher (runtime/launch.py) when a rank exits without a report, and by a
    rank's collective or transfer whose backend says the other side closed (ops/ledger.py).
    Subclasses LaunchError and ParallelizeError, which callers caught before it existed."""


class RefusalError(LaunchError, ParallelizeError):
    """Every rank of a launched job that failed raised the same ParallelizeError: a mistake
    known only once the processes had started (a model whose trace cannot be split as the mesh
    asks, a batch the step refuses). Its message comes once, then the first such rank's
    traceback, where a LaunchError would give every rank's and what each was doing. Raised by
    the launcher (runtime/launch.py); a LaunchError and a ParallelizeError, as callers catch."""


class ParallelizeWarning(UserWarning):
    """fxtron did less than the mesh asks and the result is still correct: a layer left
    replicated, an op run replicated for want of a sharding rule. `pm.summary()` lists each;
    `parallelize(..., strict=True)` turns them into ParallelizeError."""


def warn_or_raise(message: str, *, strict: bool, fix: str, advice: str = "", stacklevel: int = 2) -> None:
    """fxtron does less than asked, and correctly: a ParallelizeWarning saying `message` (then
    `advice`, if any), or under strict mode a ParallelizeError saying it and then `fix`, what to
    change."""
    if strict:
        raise ParallelizeError(f"{message}{fix}")
    import warnings
    warnings.warn(f"{message}{advice}", ParallelizeWarning, stacklevel=stacklevel + 1)
