"""Runtime: pretrained weights into a rank's shards, read slice by slice from safetensors files.

`load_pretrained(prog, path, prefix="")` (Program.load_pretrained; every rank calls it): `path`
is a directory written by transformers' save_pretrained (model.safetensors, or shards listed
in model.safetensors.index.json) or one .safetensors file. fxtron keeps the model's own
parameter names, so a checkpoint's keys are the program's names (`prefix`, when given, is what
the checkpoint's keys carry in front of them). Each rank reads from the memory-mapped files only
the rows and columns of its own shards (safetensors' get_slice), for every layout fxtron cuts:
column, row and vocabulary splits, fused projections' interleaved blocks and blocks held whole,
experts over ep and tp; a pipeline rank reads its stages' parameters only, a tied weight
from whichever of its names the file holds. Missing, unexpected and mis-shaped tensors are one
ParallelizeError naming them all, before anything is written into the program.
"""
from __future__ import annotations

import json
import os

import torch

from fxtron.core import layout
from fxtron.errors import ParallelizeError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def checkpoint_files(path: str) -> dict[str, str]:
    """Every tensor key of the safetensors checkpoint at `path` -> the file holding it."""
    from safetensors import safe_open
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, INDEX)):
            with open(os.path.join(path, INDEX)) as f:
                weight_map = json.load(f)["weight_map"]
            return {k: os.path.join(path, v) for k, v in weight_map.items()}
        if os.path.exists(os.path.join(path, SINGLE)):
            path = os.path.join(path, SINGLE)
        else:
            found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            raise ParallelizeError(
                f"{path} holds neither {SINGLE} nor {INDEX}" + (f" (it has {', '.join(found[:4])})" if found else "")
                + "; give the directory save_pretrained wrote, or one .safetensors file")
    elif not os.path.exists(path):
        raise ParallelizeError(f"pretrained weights at {path}: no such file or directory")
    elif not path.endswith(".safetensors"):
        raise ParallelizeError(f"{path} is not a .safetensors file; give the directory save_pretrained wrote, or "
                               "one .safetensors file (convert a .bin with transformers: save_pretrained)")
    with safe_open(path, framework="pt") as f:
        return {k: path for k in f.keys()}


def _runs(index: torch.Tensor) -> list[tuple[int, int]]:
    """Consecutive runs [start, stop) of an increasing index."""
    out, values = [], index.tolist()
    start = prev = values[0]
    for v in values[1:]:
        if v != prev + 1:
            out.append((start, prev + 1))
            start = v
        prev = v
    out.append((start, prev + 1))
    return out


def read_local(sl, full_shape: tuple[int, ...], shards, sizes: dict, coords: dict) -> torch.Tensor:
    """This rank's piece of a tensor of `full_shape` laid out by `shards` (core.params.AxisShard,
    in order), read from a safetensors slice `sl` run by run: only its own elements."""
    index = [torch.arange(n) for n in full_shape]
    for s in shards:
        index[s.dim] = layout.shard(index[s.dim], 0, sizes[s.axis], coords[s.axis], s.interleave, s.whole)
    runs = [_runs(ix) for ix in index]

    def read(d: int, chosen: list) -> torch.Tensor:
        if d == len(runs):
            return sl[tuple(slice(a, b) for a, b in chosen)]
        return torch.cat([read(d + 1, chosen + [r]) for r in runs[d]], dim=d)
    return read(0, [])


def _open(handles: dict, file: str):
    from safetensors import safe_open
    if file not in handles:
        handles[file] = safe_open(file, framework="pt")
    return handles[file]


def load_pretrained(prog, path: str, prefix: str = "") -> None:
    """See the module docstring."""
    files = checkpoint_files(path)
    info = prog.info
    groups = prog.groups
    axes = {s.axis for spec in prog.local.values() for s in spec.shards}
    sizes = {a: groups.size(a) if groups is not None else 1 for a in axes}
    coords = {a: groups.index(a) if groups is not None else 0 for a in axes}
    names_of: dict[str, list[str]] = {}          # canonical name -> every name it goes by
    for alias, name in info.aliases.items():
        names_of.setdefault(name, [name]).append(alias)
    persistent = set(prog.state_dict(keep_vars=True)) - set(dict(prog.named_parameters()))
    known = set(info.params) | set(info.buffers) | set(info.aliases)
    unexpected = sorted(k for k in files if not k.startswith(prefix) or k[len(prefix):] not in known)
    plan, missing, misshaped = [], [], []
    for name, spec in prog.local.items():
        key = next((prefix + n for n in names_of.get(name, [name]) if prefix + n in files), None)
        if key is None:
            missing.append(name)
            continue
        plan.append((name, key, spec.full_shape, spec.shards))
    for name in sorted(persistent):
        if prefix + name in files:
            plan.append((name, prefix + name, None, ()))
        elif name in set(info.buffers):
            missing.append(name)
    handles = {}
    try:
        for name, key, full, _ in plan:
            if full is None:
                continue
            f = _open(handles, files[key])
            shape = tuple(f.get_slice(key).get_shape())
            if shape != tuple(full):
                misshaped.append(f"{key} {shape} (the model's {name} is {tuple(full)})")
        if missing or unexpected or misshaped:
            parts = []
            if missing:
                parts.append(f"missing {len(missing)}: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))
            if unexpected:
                parts.append(f"unexpected {len(unexpected)}: {', '.join(unexpected[:8])}"
                             + (" ..." if len(unexpected) > 8 else ""))
            if misshaped:
                parts.append(f"mis-shaped {len(misshaped)}: {'; '.join(misshaped[:8])}")
            raise ParallelizeError(
                f"the pretrained weights at {path} do not fit this model ({'; '.join(parts)})"
                + (f", keys read with the prefix {prefix!r}" if prefix else "")
                + "; load the checkpoint of this architecture and configuration, or give prefix= for a wrapper's "
                  "module names")
        params = dict(prog.named_parameters())
        buffers = dict(prog.named_buffers())
        with torch.no_grad():
            for name, key, full, shards in plan:
                f = _open(handles, files[key])
                target = params.get(name, buffers.get(name))
                value = f.get_tensor(key) if full is None or not full else read_local(
                    f.get_slice(key), tuple(full), shards, sizes, coords)
                target.copy_(value.to(device=target.device, dtype=target.dtype))
    finally:
        handles.clear()


__all__ = ["checkpoint_files", "load_pretrained", "read_local"]
