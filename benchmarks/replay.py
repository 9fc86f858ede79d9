"""Benchmark support: a pytest-benchmark timer that replays durations measured elsewhere (in
worker processes, or in a loop that alternates variants), so pytest-benchmark's statistics
are those of the measured runs."""
from __future__ import annotations


class ReplayTimer:
    """Each round's end-minus-start equals the next recorded duration."""

    __name__ = "replayed_measured_times"

    def __init__(self):
        self._durations: list[float] = []
        self._clock = 0.0
        self._at_start = True

    def load(self, durations: list[float]) -> None:
        self._durations = list(durations)
        self._at_start = True

    def __call__(self) -> float:
        if not self._at_start and self._durations:
            self._clock += self._durations.pop(0)
        self._at_start = not self._at_start
        return self._clock


def noop():
    return None
