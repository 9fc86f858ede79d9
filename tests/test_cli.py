"""The command line: `python -m fxtron mesh` and `python -m fxtron train`."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fxtron.cli import main
from fxtron.trainer.config import TrainConfig
from fxtron.trainer.loop import run


def test_mesh_table_is_megatrons_example(capsys):
    assert main(["mesh", "--world-size", "16", "--tp", "2", "--pp", "4"]) == 0
    out = capsys.readouterr().out
    assert "tp=2" in out and "pp=4" in out and "dp=2" in out
    row5 = next(line for line in out.splitlines() if line.split()[:1] == ["5"])
    assert "[4,5]" in row5 and "[5,7]" in row5 and "[1,5,9,13]" in row5


def test_mesh_error_says_what_to_change():
    proc = subprocess.run([sys.executable, "-m", "fxtron", "mesh", "--world-size", "10", "--tp", "4"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "ParallelizeError" in proc.stderr and "10" in proc.stderr


@pytest.mark.slow     # two processes
def test_train_matches_one_process(capsys, tmp_path):
    cfg = TrainConfig().replace(model="gpt-tiny", world_size=2, steps=4, batch=4, seq=32, max_bytes=200_000,
                                trace=str(tmp_path), compare=True)
    out = run(cfg)
    assert sorted(out["losses"]) == [1, 2, 3, 4] and out["tokens_per_s"] > 0
    # early steps, before AdamW compounds round-off: equal to float32 precision
    assert out["max_loss_diff"] < 1e-4, out
    assert "loss difference" in capsys.readouterr().out
    # --trace: the last step of both ranks as a Chrome trace (passes as spans, memory as
    # counters: activations saved in forward, given back by backward) and a picture
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    for rank in (0, 1):
        spans = [e["name"] for e in events if e["pid"] == rank and e["ph"] == "X"]
        assert spans == ["F 0", "B 0"], spans
        memory = [e["args"]["activations"] for e in events if e["pid"] == rank and e["ph"] == "C"]
        assert memory[0] == 0 and memory[1] > 100 * memory[2], memory      # start, after F, after B
    assert (tmp_path / "schedule.png").stat().st_size > 0


@pytest.mark.slow     # two processes
def test_train_a_mixture_of_experts_over_ep_shows_the_load(capsys):
    cfg = TrainConfig().replace(model="moe-tiny", world_size=2, ep=2, steps=3, batch=4, seq=32, max_bytes=200_000,
                                compare=True)
    out = run(cfg)
    # the load-balancing loss over the whole batch, as the one-process reference computes it
    assert out["max_loss_diff"] < 1e-4, out
    local = run(cfg.replace(moe_aux_loss="local"))
    # each dp rank's over its own tokens (Megatron's default): the reference trains the ranks' pieces
    assert local["max_loss_diff"] < 1e-4 and local["losses"] != out["losses"], (local, out)
    assert len(out["imbalance"]) == 3 and all(x >= 1.0 for x in out["imbalance"])
    assert "busiest expert over the mean" in capsys.readouterr().out
