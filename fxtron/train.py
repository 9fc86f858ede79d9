"""`fxtron train`'s entry, kept for its users: the trainer is fxtron.trainer (loop.py)."""
from __future__ import annotations

from fxtron.trainer.loop import reference_differs, run, write_trace

__all__ = ["reference_differs", "run", "write_trace"]
