"""`fxtron bench`: run the pytest-benchmark suite (benchmarks/ beside the package, in a source
checkout) and print one table: every figure beside the baseline measured in the same run (one
process, PyTorch DTensor, the unoverlapped variant, or a paper's formula) and their ratio.
Results are saved as pytest-benchmark JSON (default .benchmarks/latest.json), comparable
between commits with `pytest-benchmark compare`.

--quick runs the benchmarks that take a few minutes on 2 cores (pipeline schedules, data
parallel, activation memory); the full suite adds tensor-parallel step and compile times and
the weight-gradient kernels.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tabulate import tabulate

QUICK = ["bench_pipeline.py", "bench_data_parallel.py", "bench_activation_memory.py"]

# extra_info keys that put a figure beside its baseline: key -> (baseline, what the ratio is)
_PAIRS = {
    "ratio_vs_single_process": "one process",
    "ratio_vs_dtensor": "PyTorch DTensor tp=2",
    "ratio_vs_after_backward": "all-reduce after backward",
    "ratio_vs_ddp": "PyTorch DDP, dp=2",
    "ratio_vs_zero0": "zero=0, dp=4",
    "speedup_fused_vs_unfused": "unfused GEMM then add",
    "optimizer_state_ratio": "optimizer state without zero",
}


def benchmarks_dir() -> Path:
    root = Path(__file__).resolve().parent.parent / "benchmarks"
    if not root.is_dir():
        raise SystemExit("fxtron bench runs the benchmarks of a source checkout (benchmarks/ beside fxtron/)")
    return root


def run(*, quick: bool = False, output: str = ".benchmarks/latest.json", extra: list[str] | None = None) -> int:
    root = benchmarks_dir()
    files = [str(root / f) for f in QUICK] if quick else [str(root)]
    out = Path(output).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", *files, "--benchmark-only", f"--benchmark-json={out}", *(extra or [])]
    print("$ " + " ".join(cmd), flush=True)
    rc = subprocess.call(cmd, cwd=root.parent, env={**os.environ})
    if out.exists():
        print(summarize(str(out)))
    return rc


def summarize(path: str) -> str:
    """One row per figure with a baseline: benchmark, measured, baseline, ratio; plus the
    pipeline bubbles beside their formulas and activation bytes beside the paper's."""
    data = json.load(open(path))
    rows = []
    for b in data.get("benchmarks", []):
        info = b.get("extra_info", {})
        name = b["name"].replace("test_", "")
        median = b["stats"]["median"]
        for key, baseline in _PAIRS.items():
            if key in info and isinstance(info[key], (int, float)):
                rows.append([name, f"{median * 1e3:.1f} ms" if median > 1e-6 else "-", baseline, f"{info[key]:.2f}x"])
        if "bubble_measured" in info:
            rows.append([name, f"bubble {info['bubble_measured']:.3f}", f"formula {info['bubble_formula']:.3f}",
                         f"{info['bubble_measured'] / max(info['bubble_formula'], 1e-9):.2f}x"])
        if "held_bytes" in info and info.get("held_formula"):
            rows.append([name, f"held {info['held_bytes'] / 2**20:.2f} MiB", f"Rajbhandari {info['held_formula'] / 2**20:.2f} MiB",
                         f"{info['held_bytes'] / info['held_formula']:.2f}x"])
            rows.append([name, f"sent {info['sent_bytes'] / 2**20:.2f} MiB", f"ring {info['sent_formula'] / 2**20:.2f} MiB",
                         f"{info['sent_bytes'] / info['sent_formula']:.2f}x"])
        if "bytes_per_layer" in info and info.get("paper_bytes_16bit"):
            rows.append([name, f"{info['bytes_per_layer'] / 2**20:.2f} MiB/layer",
                         f"paper {info['paper_bytes_16bit'] / 2**20:.2f} MiB (16-bit)",
                         f"{info['bytes_per_layer'] / info['paper_bytes_16bit']:.2f}x"])
    machine = data.get("machine_info", {})
    head = f"fxtron bench: {len(data.get('benchmarks', []))} benchmarks on {machine.get('cpu', {}).get('brand_raw', '?')}"
    return head + "\n" + tabulate(rows, headers=["benchmark", "measured", "baseline", "ratio"])
