"""Trainer, metrics: every --log-interval steps one line (Megatron's training_log fields:
step, consumed samples, time per step, learning rate (the schedule's after the step, the next
step's, as Megatron logs it), global batch, loss, the loss scale under fp16, grad norm, skipped steps; with tokens/s, MFU and memory); --log-file one JSON object per step; --tensorboard-dir
TensorBoard scalars; a progress bar on a terminal, plain lines elsewhere. Memory as users read
it: this rank's parameters, gradients, optimizer state and peak activations
(runtime/memory.py rank_bytes) and the device's (or process's) peak. Checkpoint saves and the
resume are lines and fields of the step's record too. Written by one rank
(`writer`: the last pipeline stage's first rank holds the loss first). With --trace, the last
step of every rank as a Chrome trace and a picture of the schedule (`write_trace`)."""
from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from pathlib import Path

import torch

#: dense bf16 peak FLOP/s by device name (MFU's default denominator)
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "V100": 125e12}


def device_peak_flops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def memory_bytes() -> int:
    """The device's peak allocated bytes (CUDA), else this process's peak resident size."""
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    import resource
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def step_flops(traced) -> float:
    """Model FLOPs of one training step read off the traced graph (forward matmuls and
    attention at the global batch's size, x 3 for the backward's two GEMMs)."""
    from fxtron.passes.pp import node_flops
    return 3.0 * sum(node_flops(n) for n in traced.graph.nodes)


def writes_metrics(groups) -> bool:
    """The rank that writes metrics: the first rank of the last pipeline stage."""
    if groups is None:
        return True
    return groups.index("pp") == groups.size("pp") - 1 and all(
        groups.index(a) == 0 for a in ("tp", "cp", "ep", "dp"))


class Metrics:
    def __init__(self, cfg, *, writer: bool, world: int, flops: float, resumed_from: int | None):
        t = cfg.training
        self.cfg, self.writer, self.world, self.flops = cfg, writer, world, flops
        self.peak = t.peak_flops or device_peak_flops()
        self.resumed_from = resumed_from
        self.log = open(t.log_file, "a") if writer and t.log_file else None
        self.tb = None
        if writer and t.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                from fxtron.errors import ParallelizeError
                raise ParallelizeError("--tensorboard-dir needs the tensorboard package (pip install tensorboard)") from e
            self.tb = SummaryWriter(t.tensorboard_dir)
        self.bar = None
        if writer and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=t.steps, initial=resumed_from or 0, unit="step", dynamic_ncols=True,
                            desc=cfg.model.name)
        self.pending: dict | None = None
        self._resume: dict = {}               # the resume's event, for the first record
        self.losses: list[float] = []
        self._tokens, self._seconds = 0, 0.0
        self._interval: list[dict] = []       # the records since the last printed line
        self._skipped_before = 0              # the skipped count at the interval's start

    def step(self, record: dict) -> None:
        """A finished step's figures (before any evaluation of the same step)."""
        step_time = record["step_time"]
        record["tokens_per_s"] = self.cfg.data.batch * self.cfg.data.seq / step_time
        self._tokens += self.cfg.data.batch * self.cfg.data.seq
        self._seconds += step_time
        record["mfu"] = (self.flops / (step_time * self.world * self.peak)) if self.peak else None
        record["peak_bytes"] = record["memory_bytes"] = memory_bytes()
        if self.resumed_from is not None and not self.losses:
            record["resumed_from"] = self.resumed_from
            record.update(self._resume)
        self.losses.append(record["loss"])
        self.flush()
        self.pending = record
        if not self.writer:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}")
        self._interval.append(record)
        if record["step"] % self.cfg.training.log_interval == 0 or record["step"] == self.cfg.training.steps:
            self._line(record, self._interval, record["skipped"] - self._skipped_before)
            self._interval, self._skipped_before = [], record["skipped"]

    def tokens_per_s(self) -> float:
        """Tokens per second over the run's steps (the first, which compiles, included)."""
        return self._tokens / self._seconds if self._seconds else 0.0

    def eval(self, loss: float) -> None:
        if self.pending is not None:
            self.pending["eval_loss"] = loss
        if self.writer:
            self._print(f" validation loss at step {self.pending['step'] if self.pending else '?'}: {loss:.6E} | "
                        f"ppl: {math.exp(min(loss, 50)):.3f}")

    def loaded(self, event: dict) -> None:
        """The resume's event (trainer/checkpoint.py Checkpointer.loaded): a line now, its
        fields in the first step's record."""
        self._resume = {"checkpoint_loaded": event["path"], "checkpoint_load_seconds": round(event["seconds"], 3)}
        if event.get("optimizer_changed"):
            self._resume["optimizer_settings_changed"] = list(event["optimizer_changed"])
        override = self.cfg.optimizer.override_lr_schedule
        if override:
            self._resume["lr_schedule_overridden"] = list(event["overridden"])
        for key in ("sample_order_changed", "seed_changed"):
            if event.get(key):
                self._resume[key] = True
        if not self.writer:
            return
        for key in ("sample_order_changed", "seed_changed"):
            if event.get(key):
                warnings.warn("train data: " + event[key], stacklevel=2)
        saved = f"saved on {event['saved_mesh']}, " if event.get("saved_mesh") not in (None, event["mesh"]) else ""
        self._print(f"loaded checkpoint {event['path']} from iteration {event['iteration']} on {event['mesh']} "
                    f"({saved}{event['seconds']:.1f} s)"
                    + ("; --save's own, newer than --load's latest: this run continued" if event.get("continued") else ""))
        if event.get("optimizer_changed"):
            self._print("optimizer settings: this run's over the checkpoint's: " + "; ".join(event["optimizer_changed"]))
        if event.get("rng_restored") is False:
            self._print("random streams (dropout): saved on another mesh or seed, restarted from this run's seed "
                        "(a resume on the same mesh continues them)")
        if override:
            self._print("learning-rate schedule: --override-lr-schedule, this run's settings over the checkpoint's: "
                        + ("; ".join(event["overridden"]) if event["overridden"] else "the same as the checkpoint's")
                        + f"; from its position ({self.resumed_from} steps taken)")

    def saved(self, event: dict) -> None:
        """A save's event (Checkpointer.saved): a line now, its fields in the step's record."""
        if self.pending is not None:
            self.pending.update(checkpoint_saved=event["path"], checkpoint_save_seconds=round(event["seconds"], 3))
        if self.writer:
            self._print(f"saved checkpoint {os.path.basename(event['path'])} in {os.path.dirname(event['path'])} "
                        f"({event['seconds']:.1f} s)")

    def flush(self) -> None:
        r, self.pending = self.pending, None
        if r is None or not self.writer:
            return
        if self.log is not None:
            self.log.write(json.dumps(_strict(r), allow_nan=False) + "\n")
            self.log.flush()
        if self.tb is not None:
            for k in ("loss", "lr", "grad_norm", "loss_scale", "tokens_per_s", "step_time", "mfu", "eval_loss"):
                if r.get(k) is not None and isinstance(r[k], (int, float)) and math.isfinite(r[k]):
                    self.tb.add_scalar(f"train/{k}" if k != "eval_loss" else "valid/loss", r[k], r["step"])
            self.tb.flush()

    def close(self) -> None:
        self.flush()
        if self.bar is not None:
            self.bar.close()
        if self.log is not None:
            self.log.close()
        if self.tb is not None:
            self.tb.close()

    def _print(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def _line(self, r: dict, interval: list[dict], skipped: int) -> None:
        """Megatron's log line after step r: the loss, time per iteration, throughput and skipped
        iterations over the --log-interval steps it closes (the loss averaged over those not
        skipped), the rest (learning rate, grad norm, memory) at step r."""
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        norm = "-" if r["grad_norm"] is None else f"{r['grad_norm']:.3f}"
        seconds = sum(x["step_time"] for x in interval) / len(interval)
        losses = [x["loss"] for x in interval if not x.get("step_skipped") and math.isfinite(x["loss"])]
        loss = sum(losses) / len(losses) if losses else float("nan")
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu'] * r['step_time'] / seconds:.1f}%"
        self._print(f"[{stamp}] iteration {r['step']:8d}/{self.cfg.training.steps:8d} | consumed samples: "
                    f"{r['consumed_samples']:12d} | elapsed time per iteration (ms): {1e3 * seconds:.1f} | "
                    f"learning rate: {r['lr']:.6E} | global batch size: {self.cfg.data.batch:5d} | lm loss: "
                    f"{loss:.6E} | " + (f"loss scale: {r['loss_scale']:.1f} | " if r.get("loss_scale") is not None else "")
                    + f"grad norm: {norm} | tokens/s: {self.cfg.data.batch * self.cfg.data.seq / seconds:,.0f}"
                    f" | MFU: {mfu} | memory: {_memory(r)} | number of skipped iterations: {skipped:3d}")


def _strict(record: dict) -> dict:
    """`record` as strict JSON can hold it: a non-finite number (a skipped step's loss or grad
    norm: NaN, inf) written as null, where json would write NaN or Infinity, which JSON has not
    and strict readers (jq, JavaScript, most languages' parsers) refuse; its step_skipped says why."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


def size(n: int) -> str:
    """Bytes for a reader: 1.25 GiB, 12.3 MiB, 4.0 KiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{n} B"


def _memory(r: dict) -> str:
    """The line's memory: this rank's bytes by kind, then the device's (or process's) peak."""
    kinds = [(label, r.get(key)) for label, key in (("params", "param_bytes"), ("grads", "grad_bytes"),
                                                    ("optimizer", "optimizer_bytes"),
                                                    ("activations", "activation_bytes"))]
    held = ", ".join(f"{label} {size(v)}" for label, v in kinds if v is not None)
    peak = f"{'device' if torch.cuda.is_available() else 'process'} peak {size(r['peak_bytes'])}"
    return f"{held}, {peak}" if held else peak


def write_trace(cfg, results: list[dict]) -> dict[str, str]:
    """The last step of every rank into cfg.training.trace: trace.json (Chrome trace: each rank's passes
    and memory) and schedule.png (the pipeline ranks of the first data-parallel replica, their
    memory below). Returns the paths written."""
    from fxtron.tools import chart

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


__all__ = ["Metrics", "PEAK_FLOPS", "device_peak_flops", "memory_bytes", "size", "step_flops", "write_trace",
           "writes_metrics"]
