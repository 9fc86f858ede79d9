"""Pictures of pipeline schedules: one row per pipeline rank, a box per forward (F),
backward (B) and weight-gradient (W) pass, labelled with its microbatch (and chunk), waits
for messages as thin grey bars below, sends as thin red bars above. Measured timelines (each rank's `prog.timeline()`) and
unit-time simulations (`runtime.schedules.simulate`) draw the same way; a measured one can
carry each rank's memory timeline (`prog.memory_timeline()`) drawn below it on the same
time axis. `write_trace` writes timelines and memory as a Chrome trace (the JSON Perfetto,
chrome://tracing and TensorBoard read): a process per rank, its passes as spans, its
memory as counters."""
from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")   # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402

_COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}


def _draw(rows: list[list[tuple[str, int, int, float, float]]], path: str, title: str, unit: str,
          memory: list[list] | None = None) -> str:
    width = max(8.0, 0.5 * max((len(r) for r in rows), default=1))
    if memory:
        fig, (ax, mem_ax) = plt.subplots(2, 1, sharex=True, figsize=(width, 0.7 * len(rows) + 4.0),
                                         gridspec_kw={"height_ratios": [0.7 * len(rows) + 0.8, 2.6]})
        _draw_memory(mem_ax, memory)
    else:
        fig, ax = plt.subplots(figsize=(width, 0.7 * len(rows) + 1.2))
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


def _draw_memory(ax, memory: list[list]) -> None:
    """Each rank's live activation bytes (and, dashed, activations + gradients) after every
    pass, as steps over the step's time (ms)."""
    for rank, samples in enumerate(memory):
        if not samples:
            continue
        t = [s.time * 1e3 for s in samples]
        line, = ax.step(t, [s.activations / 2**20 for s in samples], where="post", label=f"pp rank {rank}")
        ax.step(t, [(s.activations + s.grads) / 2**20 for s in samples], where="post", linestyle="--",
                color=line.get_color(), linewidth=0.8)
    ax.set_ylabel("MiB (activations;\n+ gradients dashed)", fontsize=8)
    ax.set_xlabel("time (ms)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.grid(alpha=0.3)


def draw_timelines(timelines: list[list], path: str, title: str = "", memory: list[list] | None = None) -> str:
    """Measured timelines, one list of runtime.pp.executor.Event per pipeline rank; with
    `memory` (each rank's prog.memory_timeline() of the same step) its memory drawn below."""
    rows = [[(e.kind, e.microbatch, e.chunk, e.start * 1e3, e.end * 1e3) for e in events] for events in timelines]
    return _draw(rows, path, f"{title}  (measured)", "time (ms)", memory)


def trace_events(timelines: list[list], memory: list[list] | None = None, ranks: list[int] | None = None) -> list[dict]:
    """Chrome trace events: per rank (process `ranks[i]`, default i) its passes as complete
    spans ("X", microseconds; F, B and W on one thread, waits and sends on another) and its
    memory after each pass as counters ("C": activations and gradients in bytes)."""
    ranks = ranks if ranks is not None else list(range(len(timelines)))
    out: list[dict] = []
    for i, events in enumerate(timelines):
        pid = ranks[i]
        out.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"rank {pid}"}})
        out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "compute"}})
        out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": 1, "args": {"name": "pipeline messages"}})
        for e in events:
            name = f"{e.kind} {e.microbatch}" + (f".{e.chunk}" if e.chunk else "")
            out.append({"name": name, "cat": e.kind, "ph": "X", "pid": pid, "tid": 1 if e.kind in ("recv", "send") else 0,
                        "ts": e.start * 1e6, "dur": max(e.end - e.start, 0.0) * 1e6,
                        "args": {"microbatch": e.microbatch, "chunk": e.chunk, "stage": e.stage}})
        for s in (memory[i] if memory else []):
            args = {"activations": s.activations, "gradients": s.grads}
            if s.allocated is not None:
                args["cuda allocated"] = s.allocated
            out.append({"name": "memory (bytes)", "ph": "C", "pid": pid, "ts": s.time * 1e6, "args": args})
    return out


def write_trace(path: str, timelines: list[list], memory: list[list] | None = None, ranks: list[int] | None = None) -> str:
    """`trace_events` as a Chrome trace file at `path` (open it in Perfetto or chrome://tracing)."""
    with open(path, "w") as f:
        json.dump({"traceEvents": trace_events(timelines, memory, ranks), "displayTimeUnit": "ms"}, f)
    return path
