"""Activation memory per transformer layer and rank, against Korthikanti et al. 2022's formulas:
no parallelism, tensor parallel, tensor + sequence parallel, and tp + sp with selective and
with full activation recomputation; and the extra compute recomputation costs.

The bytes saved for backward are measured with saved-tensor hooks on a rank's program
(parameters and buffers excluded, each storage counted once, its largest size), for models of 2 and 4
layers: per layer = (bytes(4) - bytes(2)) / 2, so the embedding, head and loss drop out. The
layer is the paper's: GPT with attention written out (`GPTConfig(flash=False)`, Megatron's
unfused core attention, which keeps the s x s scores), dropout 0.1 everywhere. The paper counts
16-bit activations and 1-byte dropout masks; the programs run in fp32, so a floating tensor's
bytes count at 2 per element (what a 16-bit run saves) and a mask's at 1: the "16-bit" column.
Each row must be within 5% of its formula (asserted: a wrong number here is a wrong memory model).

Recomputation's cost: the step time of tp + sp with selective and with full recomputation over
the step time without, in the same run (forward + backward on the rank's slice).
"""
from __future__ import annotations

import time

import pytest
import torch

import fxtron
from fxtron.models.gpt import GPT, GPTConfig
from fxtron.tools.testing import run_on_ranks

S, B, H, A, TP = 128, 4, 256, 8, 2
#: label -> (tp, sequence parallel, recompute)
CONFIGS = {"none": (1, False, None), "tp": (TP, False, None), "tp+sp": (TP, True, None),
           "tp+sp+selective": (TP, True, "selective"), "tp+sp+full": (TP, True, "full")}
TOLERANCE = 0.05


def _model(layers: int):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=S, n_layer=layers, n_head=A, n_embd=H, dropout=0.1, flash=False))


def _saved_bytes(prog, batch) -> int:
    """Bytes saved for backward in 16-bit terms (floating tensors at 2 bytes an element)."""
    params = {p.untyped_storage().data_ptr() for p in [*prog.parameters(), *prog.buffers()]}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params:
            nbytes = storage.nbytes()
            if t.is_floating_point():
                nbytes = nbytes * 2 // t.element_size()
            seen[ptr] = max(seen.get(ptr, 0), nbytes)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = prog(*batch)
    loss.backward()
    return sum(seen.values())


def _step_time(prog, batch, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        prog(*batch).backward()
        best = min(best, time.perf_counter() - t0)
    return best


def _measure(rank: int, configs: dict) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (B, S + 1), generator=g)
    batch = (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
    out = {}
    for label, (tp, sp, recompute) in configs.items():
        if tp == 1 and rank != 0:
            continue                  # no parallelism: rank 0 alone
        per, seconds = {}, None
        for layers in (2, 4):
            mesh = fxtron.Mesh(TP, tp=TP) if tp > 1 else fxtron.Mesh(1)
            example = tuple(x[:, :S // 2].contiguous() for x in batch)   # shorter than the causal buffer
            pm = fxtron.parallelize(_model(layers), mesh, example_inputs=example, sequence_parallel=sp,
                                    recompute=recompute)
            prog = pm.program(rank if tp > 1 else 0)
            per[layers] = _saved_bytes(prog, batch)
            if layers == 4 and tp > 1:
                seconds = _step_time(prog, batch)
        out[label] = {"bytes": (per[4] - per[2]) / 2, "seconds": seconds}
    return out


def paper(label: str) -> float:
    """Korthikanti et al. 2022, bytes per layer and rank (16-bit activations, 1-byte masks)."""
    t = CONFIGS[label][0]
    sbh, extra = S * B * H, 5 * A * S / H
    return {"none": sbh * (34 + extra), "tp": sbh * (10 + 24 / t + extra / t), "tp+sp": sbh * (34 / t + extra / t),
            "tp+sp+selective": sbh * 34 / t, "tp+sp+full": sbh * 2 / t}[label]


FORMULA = {"none": "sbh(34+5as/h)", "tp": "sbh(10+24/t+5as/(ht))", "tp+sp": "sbh(34/t+5as/(ht))",
           "tp+sp+selective": "sbh 34/t", "tp+sp+full": "2sbh/t (the layer input)"}


@pytest.fixture(scope="module")
def measured():
    results = run_on_ranks(_measure, fxtron.Mesh(TP, tp=TP), CONFIGS)
    return {**results[1], "none": results[0]["none"]}


@pytest.mark.parametrize("label", list(CONFIGS))
def test_activation_memory_per_layer(benchmark, bench_report, measured, label):
    got = measured[label]["bytes"]
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    formula = paper(label)
    base = measured["tp+sp"]["seconds"]
    seconds = measured[label]["seconds"]
    overhead = seconds / base if seconds and base and "+" in label and label != "tp+sp" else None
    benchmark.extra_info.update(bytes_per_layer_16bit=got, paper_bytes=formula, ratio=got / formula,
                                step_time_over_no_recompute=overhead)
    section = bench_report.setdefault(
        "activation memory saved for backward, per layer and rank (16-bit terms)", {
            "headers": ["config", "measured", "Korthikanti", "measured / formula", "formula",
                        "step time / tp+sp"],
            "rows": [],
            "notes": [f"GPT layer with written-out attention, s={S}, b={B}, h={H}, a={A}, dropout 0.1, t={TP}; "
                      "per layer = (bytes at 4 layers - bytes at 2 layers) / 2; parameters and buffers excluded; "
                      "floating tensors at 2 bytes an element, masks at 1",
                      "step time: forward + backward of the 4-layer rank program, best of 5, over tp+sp's"]})
    section["rows"].append([label, f"{got / 2**20:.3f} MiB", f"{formula / 2**20:.3f} MiB", f"{got / formula:.3f}",
                            FORMULA[label], f"{overhead:.2f}" if overhead else "-"])
    assert abs(got / formula - 1) < TOLERANCE, f"{label}: {got:.0f} B per layer, the formula {formula:.0f} B"
