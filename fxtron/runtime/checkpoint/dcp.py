"""Runtime: checkpoints with torch.distributed.checkpoint (DCP), resharded on load.

Each rank writes only what it holds: its tensor-parallel shard of each of its pipeline
stages' parameters, and the optimizer state of those parameters (under zero=1 first gathered
over data parallel into the same per-parameter shards). A tp-sharded tensor is stored as a
DTensor over the rank's tp group, Shard(dim) (an expert weight split over ep: over the ep group); a fused projection split with interleave k (a
[q|k|v] weight) is stored as its k parts, each Shard(dim), under "<name>/part<j>", so the
checkpoint does not depend on tp. Replicated tensors (norms at any tp, everything at tp=1)
are plain tensors that DCP writes once. Loading builds the same keys for the loading
program's own mesh and lets DCP read the overlapping pieces: a checkpoint saved at
tp=2 x pp=2 loads at tp=4, at pp=1, or in one process (`load_full_state_dict`).

Keys: "model/<param>", "model/<param>/part<j>", "optim/<param>/<state key>" (AdamW's exp_avg,
exp_avg_sq, step), "optim_whole/<param>/<state key>" (a whole-matrix optimizer's state -- an
Adafactor's factored moments, a Muon's momentum -- of the whole parameter, written by the rank
that steps it and read by whichever rank steps it on the loading mesh), "optim_group/<param>"
(the hyperparameters of the group that holds the parameter), buffers "buffer/<name>". The
optimizer may be a list (Muon on the matrices and AdamW on the rest). The hyperparameters are kept per parameter because the
ranks' groups differ (a pipeline stage may hold none of a group's parameters, and torch's
groups are a list by position): a group loaded takes the values its parameters were saved with,
whatever the saving and loading meshes. (A checkpoint written before kept one rank's list under
"optim/param_groups", applied by position.)

Saves are atomic: every rank writes into a temporary directory beside the target
("<path>.saving"); only when every rank has written its part does rank 0 write the commit
marker (COMMIT, last) and rename the directory into place, moving a previous checkpoint at
`path` aside first ("<path>.replaced", removed once the new one is in). A save that fails on
any rank -- a full disk, a writer that raises -- raises ParallelizeError on every rank naming
each failed rank, the path and the error, and leaves `path` as it was; a rank killed mid-save
leaves only the temporary directory, which the next save clears. `load` refuses a directory
without the marker, saying the save did not complete.

In memory: `full_state_dict(prog)` (Program.full_state_dict) gathers the whole model's
parameters and persistent buffers, under the original names, on every rank.
"""
from __future__ import annotations

import contextlib
import errno
import io
import os
import pickle
import shutil
import warnings
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DeviceMesh, DTensor, Shard

from fxtron.core import layout as shard_math
from fxtron.core.params import AxisShard
from fxtron.errors import ParallelizeError, ParallelizeWarning, warn_or_raise
from fxtron.ops import ledger
from fxtron.runtime import optim
from fxtron.runtime.grads import across_stages


#: the order of a device mesh's dims when a parameter is split over several axes (an expert
#: weight's experts over ep, its features over tp: Megatron's expert-tp within each ep rank)
_MESH_DIMS = ("ep", "tp")


def _fused(spec) -> AxisShard | None:
    """The shard of a fused projection (interleave != 1), whose parts are stored apart so the
    checkpoint reshards to any size of that axis."""
    fused = [s for s in spec.shards if s.interleave != 1]
    if len(fused) > 1:
        raise ParallelizeError(f"parameter {spec.name} is a fused projection over {len(fused)} axes; "
                               "fxtron's checkpoints store one axis's fused parts")
    return fused[0] if fused else None


def _axes(prog, spec) -> tuple[str, ...]:
    """The axes of more than one rank the parameter is split over, in device-mesh order."""
    groups = prog.groups
    axes = tuple(s.axis for s in spec.shards if groups is not None and groups.size(s.axis) > 1)
    if len(axes) > 1 and not set(axes) <= set(_MESH_DIMS):
        raise ParallelizeError(f"parameter {spec.name} is sharded over {', '.join(axes)}; fxtron's checkpoints "
                               f"store shards over one axis, or over {' and '.join(_MESH_DIMS)}")
    return tuple(sorted(axes, key=lambda a: _MESH_DIMS.index(a) if a in _MESH_DIMS else -1))


def _meshes(prog) -> dict:
    """The device mesh of every set of axes a parameter is split over: one axis's group, or
    the ep x tp grid of this rank's tp-ep group."""
    groups, out = prog.groups, {}
    for spec in prog.local.values():
        axes = _axes(prog, spec)
        if not axes or axes in out:
            continue
        if len(axes) == 1:
            out[axes] = DeviceMesh.from_group(groups.group(axes[0]), device_type=groups.device.type)
        else:
            grid = torch.tensor(groups.ranks("tp-ep")).view(groups.size("ep"), groups.size("tp"))  # tp fastest
            out[axes] = DeviceMesh.from_group([groups.group(a) for a in axes], groups.device.type, mesh=grid,
                                              mesh_dim_names=axes)
    return out


def _entries(prog, name: str, local: torch.Tensor, meshes: dict, prefix: str) -> dict:
    """The checkpoint entries of one local tensor shaped like parameter `name`."""
    spec = prog.local[name]
    fused, axes = _fused(spec), _axes(prog, spec)
    if not axes:
        if fused is not None:     # whole here: store the parts all the same
            return {f"{prefix}/part{j}": t.contiguous() for j, t in enumerate(_parts(local, fused))}
        return {prefix: local}
    placements = [Shard(spec.shard_on(a).dim) for a in axes]
    out = {}
    world = prog.groups.size(fused.axis) if fused is not None else 1
    for j, block in enumerate(_parts(local, fused, world) if fused is not None else (local,)):
        key = prefix if fused is None else f"{prefix}/part{j}"
        if fused is not None and j in fused.whole:      # a block every rank holds whole: one copy
            out[key] = block.contiguous()
            continue
        out[key] = DTensor.from_local(block.contiguous(), meshes[axes], placements, run_check=False)
    return out


def _parts(local: torch.Tensor, spec: AxisShard, world: int = 1) -> tuple[torch.Tensor, ...]:
    """A local tensor's blocks of a fused projection: each saved as its own entry, so a
    checkpoint reshards to any tp."""
    return local.split(shard_math.blocks_of_piece(local.shape[spec.dim], world, spec.interleave, spec.whole), spec.dim)


def _unpack(prog, name: str, entries: dict, prefix: str) -> torch.Tensor:
    fused = _fused(prog.local[name])
    if fused is not None:
        blocks = [entries[f"{prefix}/part{j}"] for j in range(shard_math.n_blocks(fused.interleave))]
        blocks = [b.to_local() if isinstance(b, DTensor) else b for b in blocks]
        return torch.cat(blocks, dim=fused.dim)
    t = entries[prefix]
    return t.to_local() if isinstance(t, DTensor) else t


def _optimizer_state(prog, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Per parameter name, an elementwise optimizer's state shaped like the rank's local
    parameter (under zero=1/2 the distributed optimizer's, gathered over data parallel)."""
    if prog.zero is not None and prog.zero.template is optimizer:
        return prog.zero.gathered_state()
    names = {id(p): n for n, p in prog.named_parameters()}
    return {names[id(p)]: dict(st) for p, st in optimizer.state.items() if id(p) in names}


def _check_optimizer(optimizer) -> None:
    """ParallelizeError for what is not an optimizer or a list of them."""
    if optimizer is None:
        return
    opts = optim.optimizers(optimizer)
    bad = [type(o).__name__ for o in opts if not isinstance(o, torch.optim.Optimizer)]
    if bad or not opts:
        raise ParallelizeError(f"a checkpoint's optimizer is a torch.optim.Optimizer or a list of them, got "
                               f"{bad[0] if bad else 'an empty list'}")


WHOLE = "optim_whole"           # "optim_whole/<param>/<key>": a whole-matrix optimizer's state of the whole parameter


COMMIT = ".fxtron-complete"     # written last, by rank 0, once every rank's files are in
#: where a save writes before its commit, and where it moves the checkpoint it replaces, beside
#: the target path (the trainer resumes from either where a save died between its renames)
STAGING, REPLACED = ".saving", ".replaced"
GROUP = "optim_group"           # "optim_group/<param>": the hyperparameters of the parameter's group
OPTIMIZER = "__optimizer__"     # in a group's record: the class of the optimizer that held it


def _class_name(o) -> str:
    """The optimizer's class by its qualified name without the module: the same class saved by
    a script and loaded under fxtron.launch (`__main__` there, `__mp_main__` here), or imported
    from elsewhere, is the same. A subclass is another class (AdamW is one of Adam's, with other
    hyperparameters: Adam's decoupled_weight_decay=False taken by AdamW would make it Adam)."""
    return type(o).__qualname__


def save(prog, path: str, optimizer: torch.optim.Optimizer | None = None, storage_writer=None,
         extra: dict | None = None) -> None:
    """Write `prog`'s parameters, persistent buffers and (given) optimizer state to directory
    `path`, atomically (module docstring); every rank of the job calls it. `storage_writer`:
    a function of the directory giving DCP's StorageWriter (default FileSystemWriter).
    `extra`: a picklable object saved with them, the same on every rank (a trainer's state:
    step, data position, schedule), read back by `read_extra`."""
    _check_optimizer(optimizer)
    path = os.path.abspath(path)
    staging = path + STAGING
    _on_rank0(prog, lambda: _remove(staging))     # a killed save's leftovers
    errors: list[tuple[int, str]] = []
    try:
        _write(prog, staging, optimizer, storage_writer, extra)
    except CheckpointException as e:           # DCP's: every rank's failure, known to every rank
        errors = [(r, _why(exc, path)) for r, (exc, _) in sorted(e.failures.items())]
    except Exception as e:                     # noqa: BLE001 - every rank must hear of it, then raise
        errors = [(0 if _alone(prog) else dist.get_rank(), _why(e, path))]
    failures = _gather_errors(prog, errors)
    if failures:
        _on_rank0(prog, lambda: shutil.rmtree(staging, ignore_errors=True))
        raise ParallelizeError(
            f"saving the checkpoint {path} failed on rank(s) {', '.join(str(r) for r, _ in failures)}: "
            + "; ".join(f"rank {r}: {msg}" for r, msg in failures)
            + (". The checkpoint that was there is unchanged." if os.path.isdir(path) else
               ". Nothing was written at that path."))

    def commit():
        # every file's size, checked at each load: a file cut short or removed since is refused,
        # never read as far as it goes
        sizes = sorted((os.path.relpath(os.path.join(d, f), staging), os.path.getsize(os.path.join(d, f)))
                       for d, _, fs in os.walk(staging) for f in fs if f != COMMIT)
        with open(os.path.join(staging, COMMIT), "w") as f:
            f.write(f"saved by {_world(prog)} rank(s)\n")
            f.writelines(f"size\t{n}\t{rel}\n" for rel, n in sizes)
            f.flush()
            os.fsync(f.fileno())
        replaced = path + REPLACED
        if os.path.exists(path):
            _remove(replaced)
            os.rename(path, replaced)
        os.rename(staging, path)
        _remove(replaced)
    _on_rank0(prog, commit)


def _remove(path: str) -> None:
    """Remove what is at `path` -- a directory, a file or a link -- if anything."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def _why(exc: BaseException, path: str) -> str:
    """A failed save's exception as a line, with the state of the disk where it says less than
    the OS knew: torch's serializer reports a write cut short by a full filesystem as
    "[enforce fail at inline_container.cc] unexpected pos", not as ENOSPC."""
    text = f"{type(exc).__name__}: {exc}"
    short = "unexpected pos" in str(exc)
    if not short and getattr(exc, "errno", None) != errno.ENOSPC:
        return text
    try:
        st = os.statvfs(os.path.dirname(path) or ".")
        free = st.f_bavail * st.f_frsize
    except OSError:
        return text
    if free < 1 << 20 or getattr(exc, "errno", None) == errno.ENOSPC:
        return f"{text} (No space left on device: {free} bytes free on the filesystem of {os.path.dirname(path)})"
    return f"{text} (a write came up short; {free} bytes free on the filesystem of {os.path.dirname(path)})"


def _write(prog, path: str, optimizer, storage_writer, extra=None) -> None:
    mesh = _meshes(prog)
    if prog.zero is not None:
        prog.zero.wait_params()
    sd: dict = {}
    for name, p in prog.named_parameters():     # (zero=3: each gathered over dp into the rank's local tensor)
        sd.update(_entries(prog, name, prog.grads.local_of(name, p.detach()), mesh, f"model/{name}"))
    persistent = set(prog.state_dict(keep_vars=True))
    for name, b in prog.named_buffers():
        if name in persistent:
            sd[f"buffer/{name}"] = b.detach()
    names = {id(p): n for n, p in prog.named_parameters()}
    for o in optim.optimizers(optimizer) if optimizer is not None else ():
        if not optim.elementwise(o):
            for name, st in optim.whole_matrices(prog, o).owned_state().items():
                for key, value in st.items():
                    sd[f"{WHOLE}/{name}/{key}"] = value if isinstance(value, torch.Tensor) else _pack(value)
        else:
            for name, st in _optimizer_state(prog, o).items():
                p = dict(prog.named_parameters())[name]
                for key, value in st.items():
                    if isinstance(value, torch.Tensor) and value.shape == p.shape and value.dim() > 0:
                        sd.update(_entries(prog, name, prog.grads.local_of(name, value), mesh, f"optim/{name}/{key}"))
                    elif isinstance(value, torch.Tensor):
                        sd[f"optim/{name}/{key}"] = value
                    else:
                        sd[f"optim/{name}/{key}"] = _pack(value)
        for g in o.param_groups:
            hyper = {k: v for k, v in g.items() if k != "params"} | {OPTIMIZER: _class_name(o)}
            for p in g["params"]:
                if id(p) in names:
                    sd[f"{GROUP}/{names[id(p)]}"] = _pack(hyper)
    # the rank's random streams (dropout): a run resumed on the same mesh draws what it would have
    if prog.rng is not None:
        sd[f"rng/{_rank(prog)}"] = _pack(_rng_record(prog))
    # fp16's loss scale, its growth count and skips (the same on every rank): a resumed run goes on
    # at the scale the run had reached (Megatron saves its grad scaler too)
    if prog.scaler is not None:
        sd["scaler"] = _pack(prog.scaler.state_dict())
    # how interleaved parts join back (load_full_state_dict): name -> (dim, parts)
    # how interleaved parts join back: one object per parameter (every holder writes the same)
    for n, lp in prog.local.items():
        spec = _fused(lp)
        if spec is not None:
            sd[f"layout/{n}"] = _pack((spec.dim, shard_math.n_blocks(spec.interleave)))
    if extra is not None:
        sd["extra"] = _pack(extra)
    os.makedirs(path, exist_ok=True)
    writer = storage_writer(path) if storage_writer is not None else None
    _save(sd, checkpoint_id=path, storage_writer=writer, no_dist=_alone(prog))


@contextlib.contextmanager
def _one_process():
    """torch's warning that a load or save with no_dist (or without a process group) is "in a
    single process" filtered, here only: fxtron asks for it on purpose (one process reading a
    checkpoint's metadata, the trainer's state, or a whole checkpoint)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is .*assuming the intent is to (load|save) in "
                                                  r"a single process")
        yield


def _load(*args, checkpoint_id: str, **kwargs):
    """dcp.load without torch's single-process warning (_one_process); a file it cannot read
    (damaged since the save, where its size still matches) a ParallelizeError naming the
    checkpoint, whichever rank met it (DCP's exception, a BaseException, tells every rank)."""
    try:
        with _one_process():
            return dcp.load(*args, checkpoint_id=checkpoint_id, **kwargs)
    except CheckpointException as e:
        why = "; ".join(f"rank {r}: {_first_line(exc)}" for r, (exc, _) in sorted(e.failures.items()))
        raise ParallelizeError(f"{checkpoint_id} could not be read ({why}): a file of it is damaged, or a rank "
                               "failed while reading (its own error says why)") from None
    except Exception as e:  # noqa: BLE001 - whatever the reader met, said with the checkpoint's name
        raise ParallelizeError(f"{checkpoint_id} could not be read ({_first_line(e)}): a file of it is damaged, or "
                               "a rank failed while reading (its own error says why)") from e


def _first_line(exc: BaseException) -> str:
    """An exception in one line (torch.load's unpickling errors run to a page of advice)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


def _metadata(path: str):
    """The complete checkpoint's DCP index (its state dict's metadata), or a ParallelizeError."""
    _check_complete(os.path.abspath(path))
    try:
        return dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001 - a damaged or missing .metadata
        raise ParallelizeError(f"{path} could not be read: its index .metadata is damaged or missing "
                               f"({_first_line(e)}); load an earlier checkpoint") from e


def _save(*args, **kwargs):
    """dcp.save without torch's single-process warning (_one_process)."""
    with _one_process():
        return dcp.save(*args, **kwargs)


def _rank(prog) -> int:
    return 0 if _alone(prog) else dist.get_rank()


def _rng_record(prog) -> dict:
    """The rank's random streams with the mesh and seed they belong to."""
    return {"mesh": str(prog.groups.mesh) if prog.groups is not None else "", "seed": prog.rng.seed,
            "states": {k: v.clone() for k, v in prog.rng.states.items()}}


def _world(prog) -> int:
    return 1 if _alone(prog) else dist.get_world_size()


def _on_rank0(prog, fn) -> None:
    """Run fn on rank 0 of the job, then let every rank pass (a barrier)."""
    alone = _alone(prog)
    if alone or dist.get_rank() == 0:
        fn()
    if not alone:
        with ledger.collective(dist.group.WORLD, "barrier"):
            dist.barrier()


def _gather_errors(prog, errors: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The (rank, error) pairs every rank knows of, known to every rank, by rank."""
    if _alone(prog):
        return errors
    every: list = [None] * dist.get_world_size()
    with ledger.collective(dist.group.WORLD, "all_gather_object"):
        dist.all_gather_object(every, errors)
    return sorted({r: msg for pairs in every for r, msg in pairs}.items())


def _check_complete(path: str) -> None:
    """Raise ParallelizeError unless `path` holds a checkpoint whose save completed, each of its
    files as large as the save wrote it (the commit marker lists them; an older marker does not)."""
    if os.path.isfile(os.path.join(path, COMMIT)):
        with open(os.path.join(path, COMMIT)) as f:
            listed = [line.rstrip("\n").split("\t", 2) for line in f if line.startswith("size\t")]
        for _, n, rel in listed:
            file = os.path.join(path, rel)
            now = os.path.getsize(file) if os.path.isfile(file) else None
            if now != int(n):
                raise ParallelizeError(
                    f"{path} is damaged: its file {rel} " + ("is missing" if now is None else f"holds {now} bytes")
                    + f" where the save wrote {n}; load an earlier checkpoint (nothing was read)")
        return
    if not os.path.isdir(path):
        aside = path + REPLACED
        hint = (f"; a save was interrupted while putting a new checkpoint in place: the previous one is at {aside}"
                if os.path.isdir(aside) else "")
        raise ParallelizeError(f"no checkpoint at {path}{hint}")
    older = ""
    if os.path.isfile(os.path.join(path, ".metadata")) and not path.endswith(STAGING):
        # (DCP's own index is there: a save interrupted after DCP's writes, or an older fxtron's)
        older = (f". Checkpoints written by fxtron before its saves were atomic have no marker either: if this is "
                 f"one, whose save you know finished, create the empty file {os.path.join(path, COMMIT)} to load it")
    raise ParallelizeError(
        f"{path} is not a complete checkpoint: its save did not complete (no commit marker {COMMIT}; a save "
        f"writes it last, once every rank has written its part). Load an earlier checkpoint{older}")


def _request(prog, name: str, like: torch.Tensor, meshes: dict, prefix: str, meta, layout: dict):
    """The entries to ask DCP for so that `finish(sd)` can build the local tensor `like`
    (shaped like this rank's shard of parameter `name`) from the checkpoint at `prefix`,
    whatever mesh it was saved at: DCP reshards Shard(dim) pieces itself; a fused projection
    saved whole (at tp=1) and wanted interleaved, or saved in parts and wanted whole, is read
    whole (per part) and cut or joined here."""
    spec = prog.local[name]
    fused, sharded = _fused(spec), bool(_axes(prog, spec))
    if f"{prefix}/part0" in meta:                  # saved in parts
        dim, k = layout[name]
        if sharded and fused is not None and shard_math.n_blocks(fused.interleave) == k and fused.dim == dim:
            entries = _entries(prog, name, like, meshes, prefix)
            return entries, lambda sd: _unpack(prog, name, sd, prefix)
        entries = {f"{prefix}/part{j}": torch.empty(meta[f"{prefix}/part{j}"].size, dtype=like.dtype) for j in range(k)}
        def join(sd):
            full = torch.cat([sd[f"{prefix}/part{j}"] for j in range(k)], dim=dim)
            return _slice(prog, name, full)
        return entries, join
    if sharded and fused is None:
        entries = _entries(prog, name, like, meshes, prefix)
        return entries, lambda sd: _unpack(prog, name, sd, prefix)
    entries = {prefix: torch.empty(meta[prefix].size, dtype=like.dtype)}
    return entries, lambda sd: _slice(prog, name, sd[prefix])


def _slice(prog, name: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a full tensor shaped like parameter `name`."""
    return prog.grads.piece_of(name, full)


def load(prog, path: str, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Read a checkpoint written by `save` (on any mesh) into `prog` and, given, `optimizer`
    (built over prog's parameters, as for train_step)."""
    _check_optimizer(optimizer)
    path = os.path.abspath(path)
    meta = _metadata(path)
    mesh = _meshes(prog)
    if prog.zero is not None:
        prog.zero.wait_params()
    layout = _read_layout(path, meta, no_dist=_alone(prog))
    kept = _check_model(prog, path, meta, layout)
    params = {n: p for n, p in prog.named_parameters() if n not in kept}
    sd: dict = {}
    finish: dict[str, object] = {}
    for name, p in params.items():
        entries, finish[f"model/{name}"] = _request(prog, name, _local_like(prog, name, p), mesh, f"model/{name}",
                                                    meta, layout)
        sd.update(entries)
    persistent = set(prog.state_dict(keep_vars=True))
    for name, b in prog.named_buffers():
        if name in persistent and f"buffer/{name}" in meta:
            sd[f"buffer/{name}"] = torch.empty_like(b)
    rng_key = f"rng/{_rank(prog)}"
    if prog.rng is not None and rng_key in meta:
        sd[rng_key] = io.BytesIO()
    if prog.scaler is not None and "scaler" in meta:
        sd["scaler"] = io.BytesIO()
    keys: dict[str, list[str]] = {}
    opts = optim.optimizers(optimizer) if optimizer is not None else []
    names = {id(p): n for n, p in params.items()}
    kind = {names[id(p)]: o for o in opts for g in o.param_groups for p in g["params"] if id(p) in names}
    owned: dict[str, tuple] = {}       # whole-matrix optimizers' parameters this rank steps: name -> (optimizer, piece)
    for o in opts:
        if not optim.elementwise(o):
            owned.update((x.name, (o, x)) for x in optim.whole_matrices(prog, o).owned())
    whole_keys: dict[str, list[str]] = {}
    if optimizer is not None and not any(k.startswith(("optim/", f"{WHOLE}/", f"{GROUP}/")) for k in meta):
        warn_or_raise(f"{path} holds no optimizer state (it was saved without an optimizer): the weights load, and "
                      f"{', '.join(type(o).__name__ for o in opts)} keeps the state it has (none, if new) -- a resumed "
                      "run's moments start afresh", strict=prog.config.debug.strict,
                      fix="; load it without the optimizer (prog.load(path)), or a checkpoint saved with one",
                      advice="; load it without the optimizer (prog.load(path)) to say so", stacklevel=3)
    if optimizer is not None:
        for key in meta:
            if key.startswith("optim/") and key != "optim/param_groups":
                name, _, rest = key[len("optim/"):].rpartition("/")
                if rest.startswith("part") and rest[4:].isdigit():
                    name, _, rest = name.rpartition("/")
                if name in kind and not optim.elementwise(kind[name]):
                    raise ParallelizeError(_other_kind(path, name, kind[name], "an elementwise optimizer's"))
                if name in kind and rest not in keys.setdefault(name, []):
                    keys[name].append(rest)
            elif key.startswith(f"{WHOLE}/"):
                name, _, rest = key[len(WHOLE) + 1:].rpartition("/")
                if name in kind and optim.elementwise(kind[name]):
                    raise ParallelizeError(_other_kind(path, name, kind[name], "a whole-matrix optimizer's"))
                if name in owned:
                    whole_keys.setdefault(name, []).append(rest)
                    m = meta[key]
                    sd[key] = io.BytesIO() if not _is_tensor_meta(m) else torch.empty(
                        m.size, dtype=m.properties.dtype, device=owned[name][1].param.device)
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
                    # read in the dtype it was saved in (a 16-bit model's AdamW moments are 16-bit), then
                    # made the parameter's dtype (below)
                    saved = m.properties.dtype if m is not None else torch.float32
                    entries, finish[key] = _request(prog, name, _local_like(prog, name, p, saved), mesh, key,
                                                    meta, layout)
                    sd.update(entries)
        for name in params:
            if f"{GROUP}/{name}" in meta:
                sd[f"{GROUP}/{name}"] = io.BytesIO()
        if "optim/param_groups" in meta:         # (written before the per-parameter records)
            sd["optim/param_groups"] = io.BytesIO()
    _load(sd, checkpoint_id=path, no_dist=_alone(prog))
    for o in opts:          # refused before anything of the checkpoint is taken
        _check_saved_class(o, params, sd, path)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(_held(prog, name, finish[f"model/{name}"](sd)))
        for name, b in prog.named_buffers():
            if f"buffer/{name}" in sd:
                b.copy_(sd[f"buffer/{name}"])
    if "scaler" in sd:
        prog.scaler.load_state_dict(_unpack_obj(sd["scaler"]))
    prog.rng_restored = None     # (no random streams in the checkpoint or the program)
    if rng_key in sd:            # the same mesh and seed: continue the streams where they were
        saved = _unpack_obj(sd[rng_key])
        mine = _rng_record(prog)
        prog.rng_restored = (saved["mesh"], saved["seed"]) == (mine["mesh"], mine["seed"])
        if prog.rng_restored:
            prog.rng.states = dict(saved["states"])
    if optimizer is None:
        return
    state = {}
    for name, stkeys in keys.items():
        st = {}
        for k in stkeys:
            key = f"optim/{name}/{k}"
            if key in finish:
                value = _held(prog, name, finish[key](sd))
                p = params[name]
                if value.is_floating_point() and p.is_floating_point() and value.dtype != p.dtype:
                    # per-element state follows the parameter it moves: saved beside 16-bit weights and
                    # loaded onto fp32 masters (a 16-bit model under a 16-bit compute dtype), or the
                    # reverse, torch's AdamW refused the mixed dtypes and SGD's momentum rounded silently
                    value = value.to(p.dtype)
                st[k] = value
            elif isinstance(sd[key], io.BytesIO):
                st[k] = _unpack_obj(sd[key])
            else:
                st[k] = sd[key]
        state[name] = st
    for o in opts:
        _load_groups(o, params, sd, path)
        if not optim.elementwise(o):
            optim.whole_matrices(prog, o).load_owned(
                {name: {k: _unpack_obj(sd[f"{WHOLE}/{name}/{k}"]) if isinstance(sd[f"{WHOLE}/{name}/{k}"], io.BytesIO)
                        else sd[f"{WHOLE}/{name}/{k}"] for k in ks}
                 for name, ks in whole_keys.items() if owned[name][0] is o})
            continue
        mine = {name: st for name, st in state.items() if kind.get(name) is o}
        if prog.zero is not None:
            prog.zero.load_state(o, mine)
        else:
            for name, st in mine.items():
                o.state[params[name]] = st


def _other_kind(path: str, name: str, o, saved: str) -> str:
    return (f"{path} holds {saved} state of {name}, and {type(o).__name__} is not that kind of optimizer (its state "
            "has other keys and shapes): load with the optimizer the run saved with, or load without the "
            "optimizer (prog.load(path)) and start its state afresh")


def _check_saved_class(optimizer, params: dict[str, torch.Tensor], sd: dict, path: str) -> None:
    """ParallelizeError where `optimizer` holds a parameter whose state another class saved
    (AdamW's moments and hyperparameters taken by SGD would train another run; Adagrad would
    fail at its step on keys it does not have). Checkpoints of before the class was recorded
    are not checked."""
    names = {id(p): n for n, p in params.items()}
    mine = _class_name(optimizer)
    for g in optimizer.param_groups:
        for p in g["params"]:
            key = f"{GROUP}/{names.get(id(p))}"
            saved = _unpack_obj(sd[key]).get(OPTIMIZER) if key in sd else None
            if saved is not None and saved != mine:
                raise ParallelizeError(
                    f"{path} holds {saved}'s state of {names[id(p)]}, and the optimizer given is {mine}: load with "
                    "the optimizer the run saved with, or load without the optimizer (prog.load(path)) and start "
                    "its state afresh; nothing was loaded")


def _load_groups(optimizer, params: dict[str, torch.Tensor], sd: dict, path: str) -> None:
    """Each of `optimizer`'s groups takes the hyperparameters its parameters were saved with
    (torch's load_state_dict takes the saved groups' too); a group none of whose parameters the
    checkpoint has keeps its own. Parameters of one group saved in groups with other values
    are a ParallelizeError: no one value is the saved run's."""
    names = {id(p): n for n, p in params.items()}
    legacy = _unpack_obj(sd["optim/param_groups"]) if "optim/param_groups" in sd else None
    for i, group in enumerate(optimizer.param_groups):
        saved = {names[id(p)]: {k: v for k, v in _unpack_obj(sd[f"{GROUP}/{names[id(p)]}"]).items() if k != OPTIMIZER}
                 for p in group["params"] if id(p) in names and f"{GROUP}/{names[id(p)]}" in sd}
        if not saved:
            if legacy is not None and i < len(legacy):      # (a checkpoint of one list, by position)
                group.update(legacy[i])
            continue
        (first, hyper), *rest = saved.items()
        for other, theirs in rest:
            differ = sorted(k for k in hyper.keys() | theirs.keys() if not _same(hyper.get(k), theirs.get(k)))
            if differ:
                k = differ[0]
                raise ParallelizeError(
                    f"param group {i} of {type(optimizer).__name__} holds {first} and {other}, which {path} saved in "
                    f"groups with another {k} ({hyper.get(k)} and {theirs.get(k)}): build the optimizer's param groups "
                    "as the saved run did, or load the checkpoint without the optimizer (prog.load(path)) and set them")
        group.update(hyper)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and \
            bool(torch.equal(a.cpu(), b.cpu()))
    return a == b


def _local_like(prog, name: str, p: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An empty tensor shaped like the rank's local tensor of parameter `name` (what it holds,
    but whole over data parallel under zero=3)."""
    spec = prog.local.get(name)
    shape = spec.local_shape if spec is not None else p.shape
    return torch.empty(shape, dtype=dtype or p.dtype, device=p.device)


def _held(prog, name: str, local: torch.Tensor) -> torch.Tensor:
    """What the rank holds of a local tensor of parameter `name` (under zero=3 its flat piece)."""
    spec = prog.local.get(name)
    return spec.held_of(local) if spec is not None else local


def _saved_shapes(meta, layout) -> dict[str, tuple[int, ...]]:
    """name -> full shape of every parameter in a checkpoint (parts joined along their dim)."""
    out: dict[str, tuple[int, ...]] = {}
    for key, m in meta.items():
        if not key.startswith("model/") or not _is_tensor_meta(m):
            continue
        name, part = key[len("model/"):], None
        base, _, last = name.rpartition("/")
        if last.startswith("part") and last[4:].isdigit():
            name, part = base, int(last[4:])
        shape = tuple(m.size)
        if part is None:
            out[name] = shape
        else:
            dim = layout.get(name, (0, 1))[0]
            have = out.get(name)
            out[name] = shape if have is None else tuple(a + b if i == dim else a
                                                         for i, (a, b) in enumerate(zip(have, shape)))
    return out


def _check_model(prog, path: str, meta, layout) -> set[str]:
    """Raise ParallelizeError listing every difference between the checkpoint's parameters
    (names and full shapes) and the program's model's. Returns the parameters to leave as they
    are: under pipeline parallel, ones the forward never reads that the checkpoint lacks (a
    pipeline's checkpoints left them out before the first stage held them), said."""
    saved = _saved_shapes(meta, layout)
    mine = {n: tuple(spec.full_shape) for n, spec in prog.local.items()}
    kept = sorted(set(prog.spec.unread_params) - set(saved))
    if kept:
        warnings.warn(f"checkpoint {path} has no {', '.join(kept)}: parameters the model's forward never reads, which "
                      "pipeline-parallel checkpoints written before fxtron held them left out; they keep the values "
                      "they have", ParallelizeWarning, stacklevel=3)
    missing = sorted(set(mine) - set(saved) - set(kept))
    shapes = sorted(n for n in set(mine) & set(saved) if mine[n] != saved[n])
    extra = sorted(set(saved) - set(prog.info.params) - set(prog.info.aliases))
    if not (missing or shapes or extra):
        return set(kept)
    raise _another_model(path, missing, [f"{n} {saved[n]} in the checkpoint, {mine[n]} in the model" for n in shapes],
                         extra)


def _another_model(path: str, missing: list[str], differ: list[str], extra: list[str]) -> ParallelizeError:
    """The refusal of a checkpoint saved from another model, listing the differences."""
    lines = ([f"missing from the checkpoint: {', '.join(missing)}"] if missing else []) + \
            (["shapes differ: " + ", ".join(differ)] if differ else []) + \
            ([f"not in the model: {', '.join(extra)}"] if extra else [])
    return ParallelizeError(f"checkpoint {path} was saved from another model: " + "; ".join(lines))


def check_model_of(path: str, model: torch.nn.Module) -> None:
    """Before any rank starts (the trainer's preflight): ParallelizeError where the checkpoint
    at `path` was saved from another model than `model` (a meta model will do) -- parameters
    the model lacks or of other shapes. Parameters the checkpoint lacks are left to the ranks'
    load, which knows which ones the forward never reads (`_check_model`)."""
    meta = _metadata(path)
    saved = _saved_shapes(meta, _read_layout(path, meta, no_dist=True))
    names: dict[int, list[str]] = {}
    shapes: dict[int, tuple[int, ...]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):      # tied weights under each name
        names.setdefault(id(p), []).append(n)
        shapes[id(p)] = tuple(p.shape)
    every = {n for ns in names.values() for n in ns}
    extra = sorted(set(saved) - every)
    differ = sorted(f"{n} {saved[n]} in the checkpoint, {shapes[k]} in the model"
                    for k, ns in names.items() for n in ns if n in saved and saved[n] != shapes[k])
    if not (extra or differ):
        return
    raise _another_model(path, sorted(ns[0] for ns in names.values() if not any(n in saved for n in ns)), differ,
                         extra)


def _read_layout(path: str, meta, *, no_dist: bool) -> dict[str, tuple[int, int]]:
    """name -> (dim, parts) of every parameter saved in parts."""
    sd = {k: io.BytesIO() for k in meta if k.startswith("layout/")}
    if sd:
        _load(sd, checkpoint_id=path, no_dist=no_dist)
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


def full_state_dict(prog) -> dict[str, torch.Tensor]:
    """Full-shape parameters and persistent buffers of `prog` under the original names, tied
    aliases included, so `model.load_state_dict(prog.full_state_dict())` restores the model
    (Program.full_state_dict; every rank calls it: the tensors gathered over the axes they are
    split on and across the pipeline stages)."""
    out = {}
    if prog.zero is not None:
        prog.zero.wait_params()
    for name, p in prog.named_parameters():
        out[name] = prog.grads.full(name, prog.grads.local_of(name, p.detach())).clone()
    persistent = set(prog.state_dict(keep_vars=True))
    for name, b in prog.named_buffers():
        if name in persistent:
            out[name] = b.detach().clone()
    out = across_stages(prog.groups, out)
    for alias, name in prog.info.aliases.items():
        out[alias] = out[name]
    return out


def load_full_state_dict(path: str, optimizer: bool = False) -> dict[str, torch.Tensor]:
    """The whole model's parameters and persistent buffers from a checkpoint, in this one
    process and without any process group, keyed as the original model names them (fused
    parts joined): `model.load_state_dict(fxtron.load_full_state_dict(path), strict=False)`
    (tied aliases are not in the checkpoint)."""
    meta = _metadata(path)
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
          if _is_tensor_meta(m) and (k.startswith("model/") or k.startswith("buffer/") or optimizer)}
    _load(sd, checkpoint_id=path, no_dist=True)
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
    # (a whole-matrix optimizer's state is the whole parameter's already: as one process keys it)
    return {k.split("/", 1)[1]: v for k, v in out.items() if k.startswith(("model/", "buffer/"))} | (
        {k: v for k, v in out.items() if k.startswith("optim/")} |
        {"optim/" + k[len(WHOLE) + 1:]: v for k, v in out.items() if k.startswith(f"{WHOLE}/")} if optimizer else {})


def full_tensors(path: str) -> tuple[list[tuple[str, tuple[int, ...], torch.dtype]], Callable]:
    """The model tensors of a checkpoint one at a time, in one process: ([(name, full shape,
    dtype)] of every parameter and persistent buffer, read(name) -> its whole tensor, read
    from the checkpoint alone -- its fused parts joined -- so a caller holds one at a time)."""
    meta = _metadata(path)
    layout = _read_layout(path, meta, no_dist=True)
    keys: dict[str, list[tuple[int | None, str]]] = {}
    dtypes: dict[str, torch.dtype] = {}
    for k, m in meta.items():
        if not (k.startswith("model/") or k.startswith("buffer/")) or not _is_tensor_meta(m):
            continue
        name = k.split("/", 1)[1]
        base, _, last = name.rpartition("/")
        part = None
        if last.startswith("part") and last[4:].isdigit():
            name, part = base, int(last[4:])
        keys.setdefault(name, []).append((part, k))
        dtypes[name] = m.properties.dtype
    shapes = _saved_shapes(meta, layout)
    for k, m in meta.items():
        if k.startswith("buffer/") and _is_tensor_meta(m):
            shapes[k.split("/", 1)[1]] = tuple(m.size)

    def read(name: str) -> torch.Tensor:
        sd = {k: torch.empty(meta[k].size, dtype=meta[k].properties.dtype) for _, k in keys[name]}
        _load(sd, checkpoint_id=path, no_dist=True)
        parts = sorted(keys[name], key=lambda pk: pk[0] if pk[0] is not None else -1)
        if len(parts) == 1 and parts[0][0] is None:
            return sd[parts[0][1]]
        return torch.cat([sd[k] for _, k in parts], dim=layout.get(name, (0, 1))[0])
    return [(n, shapes[n], dtypes[n]) for n in keys], read


def read_extra(path: str):
    """The `extra` object saved with a checkpoint (None when it has none); in any process."""
    meta = _metadata(path)
    if "extra" not in meta:
        return None
    sd = {"extra": io.BytesIO()}
    _load(sd, checkpoint_id=path, no_dist=True)
    return _unpack_obj(sd["extra"])
