"""`fxtron train`'s entry (the trainer itself is fxtron.trainer): `run`, what the one-process
comparison cannot model (`reference_differs`), and the last step's trace (`write_trace`).

The run is described by one `fxtron.config.TrainConfig`: parallelize's sections (tensor,
pipeline, data_parallel, ..., debug) and the trainer's own (mesh, model, data, optimizer,
training); `fxtron train` generates its flags from it and reads it from TOML.
"""
from __future__ import annotations

from pathlib import Path

from fxtron.config import TrainConfig


def reference_differs(cfg: TrainConfig) -> list[str]:
    """The options under which the one-process reference (trainer.loop.reference) is another training."""
    out = []
    if cfg.precision.dtype != "fp32":
        out.append(f"dtype={cfg.precision.dtype} (the reference computes in fp32)")
    if cfg.data_parallel.grad_reduce_dtype not in (None, "fp32"):
        out.append(f"grad_reduce_dtype={cfg.data_parallel.grad_reduce_dtype}")
    if cfg.experts.capacity_factor is not None:
        out.append(f"moe_capacity_factor={cfg.experts.capacity_factor} (tokens dropped per rank)")
    return out


def run(cfg: TrainConfig) -> dict:
    """Train the run `cfg` (fxtron.trainer.loop.run)."""
    from fxtron.trainer.loop import run as train
    return train(cfg)


def write_trace(cfg: TrainConfig, results: list[dict]) -> dict[str, str]:
    """The last step of every rank into cfg.training.trace: trace.json (Chrome trace: each rank's passes
    and memory) and schedule.png (the pipeline ranks of the first data-parallel replica, their
    memory below). Returns the paths written."""
    from fxtron import chart

    out = Path(cfg.training.trace)
    out.mkdir(parents=True, exist_ok=True)
    mesh = cfg.mesh.mesh()
    paths = {"trace": chart.write_trace(str(out / "trace.json"), [r["timeline"] for r in results],
                                        [r["memory"] for r in results])}
    first = [r for r in range(mesh.world_size)
             if all(v == 0 for k, v in mesh.coords(r).items() if k not in ("pp", "ep", "edp", "etp"))]
    first = sorted(first, key=lambda r: mesh.coords(r)["pp"])[:mesh.pp]
    paths["picture"] = chart.draw_timelines([results[r]["timeline"] for r in first], str(out / "schedule.png"),
                                            title=f"{cfg.model.name}, " + " ".join(f"{a}={getattr(mesh, a)}" for a in
                                                                             ("tp", "pp", "dp", "cp", "ep")
                                                                             if getattr(mesh, a) > 1) + ", last step",
                                            memory=[results[r]["memory"] for r in first])
    peak = max(s.activations for r in results for s in r["memory"])
    print(f"trace of the last step: {paths['trace']} (Perfetto, chrome://tracing), {paths['picture']}; "
          f"peak activations saved for backward on a rank: {peak / 2**20:.2f} MiB")
    return paths
