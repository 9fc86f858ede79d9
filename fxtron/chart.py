"""Pictures of pipeline schedules: one row per pipeline rank, a box per forward (F),
backward (B) and weight-gradient (W) pass, labelled with its microbatch (and chunk), waits
for messages as thin grey bars below, sends as thin red bars above. Measured timelines (each rank's `prog.timeline()`) and
unit-time simulations (`runtime.schedules.simulate`) draw the same way."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")   # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402

_COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}


def _draw(rows: list[list[tuple[str, int, int, float, float]]], path: str, title: str, unit: str) -> str:
    fig, ax = plt.subplots(figsize=(max(8.0, 0.5 * max((len(r) for r in rows), default=1)), 0.7 * len(rows) + 1.2))
    end = max((e for r in rows for *_, e in r), default=1.0)
    for y, row in enumerate(rows):
        for kind, mb, chunk, start, stop in row:
            if kind in ("recv", "send"):   # waiting for a message / posting sends
                ax.barh(y + (0.42 if kind == "recv" else -0.42), max(stop - start, end / 400), left=start, height=0.12,
                        color="#999999" if kind == "recv" else "#C44E52")
                continue
            ax.barh(y, stop - start, left=start, height=0.7, color=_COLORS[kind], alpha=0.55 + 0.45 * (chunk == 0),
                    edgecolor="black", linewidth=0.4)
            if stop - start > end / 120:
                ax.text((start + stop) / 2, y, f"{mb}" + (f".{chunk}" if chunk else ""), ha="center", va="center",
                        fontsize=7)
    ax.set_yticks(range(len(rows)), [f"pp rank {r}" for r in range(len(rows))])
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    ax.legend(handles, ["forward", "backward", "weight grad"], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def draw_simulation(sim, path: str, title: str = "") -> str:
    """A unit-time simulation (runtime.schedules.Simulation) as a picture at `path`."""
    rows = [[(a.kind, a.microbatch, a.chunk, float(s), float(e)) for a, s, e in spans] for spans in sim.spans]
    return _draw(rows, path, f"{title}  (simulated; bubble {float(sim.bubble_fraction):.3f} of ideal)", "time (units)")


def draw_timelines(timelines: list[list], path: str, title: str = "") -> str:
    """Measured timelines, one list of runtime.executor.Event per pipeline rank."""
    rows = [[(e.kind, e.microbatch, e.chunk, e.start * 1e3, e.end * 1e3) for e in events] for events in timelines]
    return _draw(rows, path, f"{title}  (measured)", "time (ms)")
