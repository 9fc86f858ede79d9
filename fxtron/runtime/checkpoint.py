"""Runtime: checkpoints with torch.distributed.checkpoint (DCP), resharded on load.

Each rank writes only what it holds: its tensor-parallel shard of each of its pipeline
stages' parameters, and the optimizer state of those parameters (under zero=1 first gathered
over data parallel into the same per-parameter shards). A tp-sharded tensor is stored as a
DTensor over the rank's tp group, Shard(dim); a fused projection split with interleave k (a
[q|k|v] weight) is stored as its k parts, each Shard(dim), under "<name>/part<j>", so the
checkpoint does not depend on tp. Replicated tensors (norms at any tp, everything at tp=1)
are plain tensors that DCP writes once. Loading builds the same keys for the loading
program's own mesh and lets DCP read the overlapping pieces: a checkpoint saved at
tp=2 x pp=2 loads at tp=4, at pp=1, or in one process (`load_full_state_dict`).

Keys: "model/<param>", "model/<param>/part<j>", "optim/<param>/<state key>" (AdamW's exp_avg,
exp_avg_sq, step), "optim/param_groups" (hyperparameters), buffers "buffer/<name>".
"""
from __future__ import annotations

import io
import os
import pickle

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DeviceMesh, DTensor, Shard

from fxtron.core import layout as shard_math
from fxtron.core.params import AxisShard
from fxtron.errors import ParallelizeError


def _tp_shard(spec) -> AxisShard | None:
    """The parameter's shard over tp (None: whole on every tp rank). Checkpoints store tp
    shards as DTensors; a parameter sharded over any other axis has no layout here yet."""
    other = [s.axis for s in spec.shards if s.axis != "tp"]
    if other:
        raise ParallelizeError(f"parameter {spec.name} is sharded over {', '.join(other)}; fxtron's checkpoints "
                               "store shards over tp only")
    return spec.shard_on("tp")


def _tp_mesh(prog):
    groups = prog.groups
    if groups is None or groups.size("tp") == 1:
        return None
    return DeviceMesh.from_group(groups.group("tp"), device_type=groups.device.type)


def _entries(prog, name: str, local: torch.Tensor, mesh, prefix: str) -> dict:
    """The checkpoint entries of one local tensor shaped like parameter `name`."""
    spec = _tp_shard(prog._local[name])
    if mesh is None or spec is None:
        if spec is not None and spec.interleave != 1:     # tp=1: store the parts all the same
            return {f"{prefix}/part{j}": t.contiguous() for j, t in enumerate(_parts(local, spec))}
        return {prefix: local}
    out = {}
    for j, block in enumerate(_parts(local, spec)):
        key = prefix if spec.interleave == 1 else f"{prefix}/part{j}"
        out[key] = DTensor.from_local(block.contiguous(), mesh, [Shard(spec.dim)], run_check=False)
    return out


def _parts(local: torch.Tensor, spec: AxisShard) -> tuple[torch.Tensor, ...]:
    """A local tensor's blocks of a fused projection (one, unfused): each saved as its own
    Shard(dim) entry, so a checkpoint reshards to any tp."""
    return local.split(shard_math.block_sizes(local.shape[spec.dim], spec.interleave), spec.dim)


def _unpack(prog, name: str, entries: dict, prefix: str) -> torch.Tensor:
    spec = _tp_shard(prog._local[name])
    if spec is not None and spec.interleave != 1:
        blocks = [entries[f"{prefix}/part{j}"] for j in range(shard_math.n_blocks(spec.interleave))]
        blocks = [b.to_local() if isinstance(b, DTensor) else b for b in blocks]
        return torch.cat(blocks, dim=spec.dim)
    t = entries[prefix]
    return t.to_local() if isinstance(t, DTensor) else t


def _optimizer_state(prog, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Per parameter name, its optimizer state shaped like the rank's local parameter."""
    if prog._zero is not None:
        return prog._zero.gathered_state()
    names = {id(p): n for n, p in prog.named_parameters()}
    return {names[id(p)]: dict(st) for p, st in optimizer.state.items() if id(p) in names}


def save(prog, path: str, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Write `prog`'s parameters, persistent buffers and (given) optimizer state to directory
    `path`; every rank of the job calls it."""
    mesh = _tp_mesh(prog)
    if prog._zero is not None:
        prog._zero.wait_params()
    sd: dict = {}
    for name, p in prog.named_parameters():
        sd.update(_entries(prog, name, p.detach(), mesh, f"model/{name}"))
    persistent = set(prog.state_dict(keep_vars=True))
    for name, b in prog.named_buffers():
        if name in persistent:
            sd[f"buffer/{name}"] = b.detach()
    if optimizer is not None:
        for name, st in _optimizer_state(prog, optimizer).items():
            p = dict(prog.named_parameters())[name]
            for key, value in st.items():
                if isinstance(value, torch.Tensor) and value.shape == p.shape and value.dim() > 0:
                    sd.update(_entries(prog, name, value, mesh, f"optim/{name}/{key}"))
                elif isinstance(value, torch.Tensor):
                    sd[f"optim/{name}/{key}"] = value
                else:
                    sd[f"optim/{name}/{key}"] = _pack(value)
        sd["optim/param_groups"] = _pack([{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups])
    # how interleaved parts join back (load_full_state_dict): name -> (dim, parts)
    # how interleaved parts join back: one object per parameter (every holder writes the same)
    for n, lp in prog._local.items():
        spec = _tp_shard(lp)
        if spec is not None and spec.interleave != 1:
            sd[f"layout/{n}"] = _pack((spec.dim, shard_math.n_blocks(spec.interleave)))
    os.makedirs(path, exist_ok=True)
    dcp.save(sd, checkpoint_id=path, no_dist=_alone(prog))


def _request(prog, name: str, like: torch.Tensor, mesh, prefix: str, meta, layout: dict):
    """The entries to ask DCP for so that `finish(sd)` can build the local tensor `like`
    (shaped like this rank's shard of parameter `name`) from the checkpoint at `prefix`,
    whatever tp it was saved at: DCP reshards Shard(dim) pieces itself; a fused projection
    saved whole (at tp=1) and wanted interleaved, or saved in parts and wanted whole, is read
    whole (per part) and cut or joined here."""
    spec = _tp_shard(prog._local[name])
    sharded = mesh is not None and spec is not None
    if f"{prefix}/part0" in meta:                  # saved in parts
        dim, k = layout[name]
        if sharded and shard_math.n_blocks(spec.interleave) == k and spec.dim == dim:
            entries = _entries(prog, name, like, mesh, prefix)
            return entries, lambda sd: _unpack(prog, name, sd, prefix)
        entries = {f"{prefix}/part{j}": torch.empty(meta[f"{prefix}/part{j}"].size, dtype=like.dtype) for j in range(k)}
        def join(sd):
            full = torch.cat([sd[f"{prefix}/part{j}"] for j in range(k)], dim=dim)
            return _slice(prog, name, full)
        return entries, join
    if sharded and spec.interleave == 1:
        entries = _entries(prog, name, like, mesh, prefix)
        return entries, lambda sd: _unpack(prog, name, sd, prefix)
    entries = {prefix: torch.empty(meta[prefix].size, dtype=like.dtype)}
    return entries, lambda sd: _slice(prog, name, sd[prefix])


def _slice(prog, name: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's tp shard of a full tensor shaped like parameter `name`."""
    spec = _tp_shard(prog._local[name])
    if spec is None or prog.groups is None or prog.groups.size("tp") == 1:
        return full
    return shard_math.shard(full, spec.dim, prog.groups.size("tp"), prog.groups.index("tp"), spec.interleave)


def load(prog, path: str, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Read a checkpoint written by `save` (on any mesh) into `prog` and, given, `optimizer`
    (built over prog's parameters, as for train_step)."""
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    mesh = _tp_mesh(prog)
    if prog._zero is not None:
        prog._zero.wait_params()
    layout = _read_layout(path, meta, no_dist=_alone(prog))
    params = dict(prog.named_parameters())
    sd: dict = {}
    finish: dict[str, object] = {}
    for name, p in params.items():
        if f"model/{name}" not in meta and f"model/{name}/part0" not in meta:
            raise ParallelizeError(f"checkpoint {path} has no parameter {name}: it was saved from another model")
        entries, finish[f"model/{name}"] = _request(prog, name, torch.empty_like(p), mesh, f"model/{name}", meta, layout)
        sd.update(entries)
    persistent = set(prog.state_dict(keep_vars=True))
    for name, b in prog.named_buffers():
        if name in persistent and f"buffer/{name}" in meta:
            sd[f"buffer/{name}"] = torch.empty_like(b)
    keys: dict[str, list[str]] = {}
    if optimizer is not None:
        for key in meta:
            if key.startswith("optim/") and key != "optim/param_groups":
                name, _, rest = key[len("optim/"):].rpartition("/")
                if rest.startswith("part") and rest[4:].isdigit():
                    name, _, rest = name.rpartition("/")
                if name in params and rest not in keys.setdefault(name, []):
                    keys[name].append(rest)
        for name, stkeys in keys.items():
            p = params[name]
            for k in stkeys:
                key = f"optim/{name}/{k}"
                m = meta.get(key)
                if m is not None and not _is_tensor_meta(m):
                    sd[key] = io.BytesIO()
                elif m is not None and m.size == torch.Size([]):
                    sd[key] = torch.zeros((), dtype=m.properties.dtype)
                else:
                    entries, finish[key] = _request(prog, name, torch.zeros_like(p, dtype=torch.float32), mesh, key,
                                                    meta, layout)
                    sd.update(entries)
        if "optim/param_groups" in meta:
            sd["optim/param_groups"] = io.BytesIO()
    dcp.load(sd, checkpoint_id=path, no_dist=_alone(prog))
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(finish[f"model/{name}"](sd))
        for name, b in prog.named_buffers():
            if f"buffer/{name}" in sd:
                b.copy_(sd[f"buffer/{name}"])
    if optimizer is None:
        return
    state = {}
    for name, stkeys in keys.items():
        st = {}
        for k in stkeys:
            key = f"optim/{name}/{k}"
            if key in finish:
                st[k] = finish[key](sd)
            elif isinstance(sd[key], io.BytesIO):
                st[k] = _unpack_obj(sd[key])
            else:
                st[k] = sd[key]
        state[name] = st
    groups = _unpack_obj(sd["optim/param_groups"]) if "optim/param_groups" in sd else None
    if groups is not None:
        for mine, theirs in zip(optimizer.param_groups, groups):
            mine.update(theirs)
    if prog._zero is not None:
        prog._zero.load_state(optimizer, state)
    else:
        for name, st in state.items():
            optimizer.state[params[name]] = st


def _read_layout(path: str, meta, *, no_dist: bool) -> dict[str, tuple[int, int]]:
    """name -> (dim, parts) of every parameter saved in parts."""
    sd = {k: io.BytesIO() for k in meta if k.startswith("layout/")}
    if sd:
        dcp.load(sd, checkpoint_id=path, no_dist=no_dist)
    return {k[len("layout/"):]: _unpack_obj(v) for k, v in sd.items()}


def _alone(prog) -> bool:
    """A program of a one-rank mesh reads and writes without a process group, even inside a
    job that has one."""
    return prog.groups is None or prog.groups.mesh.world_size == 1 or not dist.is_initialized()


def _pack(obj) -> io.BytesIO:
    """A Python object as bytes DCP stores whole (it would flatten a dict or list)."""
    return io.BytesIO(pickle.dumps(obj))


def _unpack_obj(buf: io.BytesIO):
    buf.seek(0)
    return pickle.loads(buf.read())


def _is_tensor_meta(m) -> bool:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    return isinstance(m, TensorStorageMetadata)


def load_full_state_dict(path: str, optimizer: bool = False) -> dict[str, torch.Tensor]:
    """The whole model's parameters and persistent buffers from a checkpoint, in this one
    process and without any process group, keyed as the original model names them (fused
    parts joined): `model.load_state_dict(fxtron.load_full_state_dict(path), strict=False)`
    (tied aliases are not in the checkpoint)."""
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
          if _is_tensor_meta(m) and (k.startswith("model/") or k.startswith("buffer/") or optimizer)}
    dcp.load(sd, checkpoint_id=path, no_dist=True)
    layout = {}
    for name, (dim, _) in _read_layout(path, meta, no_dist=True).items():
        layout[f"model/{name}"] = dim
        for k in sd:
            if k.startswith(f"optim/{name}/"):
                layout[k.rsplit("/", 1)[0]] = dim
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for k, v in sd.items():
        base, _, last = k.rpartition("/")
        if last.startswith("part") and last[4:].isdigit():
            parts.setdefault(base, {})[int(last[4:])] = v
        else:
            out[k] = v
    for base, ps in parts.items():
        out[base] = torch.cat([ps[j] for j in sorted(ps)], dim=layout.get(base, 0))
    return {k.split("/", 1)[1]: v for k, v in out.items() if k.startswith(("model/", "buffer/"))} | (
        {k: v for k, v in out.items() if k.startswith("optim/")} if optimizer else {})
