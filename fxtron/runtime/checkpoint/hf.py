"""Runtime: pretrained weights in and out of a rank's shards, as transformers reads and writes
them, slice by slice and tensor by tensor.

In: `load_pretrained(prog, path, prefix="")` (Program.load_pretrained; every rank calls it):
`path` is a directory written by transformers' save_pretrained (model.safetensors, or shards
listed in model.safetensors.index.json) or one .safetensors file. fxtron keeps the model's own
parameter names, so a checkpoint's keys are the program's names; where transformers stores a
tensor in another layout than the module's (a fused expert weight as one key per expert and
projection: Mixtral's `block_sparse_moe.experts.3.w1.weight`), its own conversion table
(transformers.conversion_mapping, for the model's class) says how, and the rank reads the
pieces of its slice from those keys. `prefix` is a wrapper's prefix: what the checkpoint's keys
carry in front of the model's names, or the model's in front of the checkpoint's (a
transformers base model's `model.` is found without it). Each rank reads from the
memory-mapped files only the rows and columns of its own shards (safetensors' get_slice), for
every layout fxtron cuts: column, row and vocabulary splits, fused projections' interleaved
blocks and blocks held whole, experts over ep and tp; a pipeline rank reads its stages'
parameters only, a tied weight from whichever of its names the file holds. Missing, unexpected
and mis-shaped tensors are one ParallelizeError naming them all, before anything is written.

Out: `save_pretrained(prog, path)` (Program.save_pretrained; every rank calls it) writes what
transformers' save_pretrained writes -- safetensors files sharded by size with an index, the
model's keys reverted to its checkpoint layout by transformers' own revert_weight_conversion,
tied weights once, config.json and generation_config.json (the trainer's --export-hf and
`fxtron export` add the model directory's tokenizer files: `copy_tokenizer`) -- tensor by tensor: each tensor is
gathered once over the axes it is split on (by the first of its data-parallel replicas in
the pipeline stage holding it) and streamed into its file by that stage's first rank; no rank holds more than one
tensor beyond its shards. `write_pretrained` does the same in one process from any source of
whole tensors (`python -m fxtron export`).
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math
import os
import re
import shutil
import struct
from typing import Iterable

import torch

from fxtron.core import layout
from fxtron.errors import ParallelizeError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DEFAULT_SHARD = "5GB"


# ----------------------------------------------------------------------------- the model's origin
@dataclasses.dataclass
class Origin:
    """What a program keeps of the model it was built from, to read and write its weights as
    transformers does: for a transformers model a storage-free (meta) replica, for its config,
    generation config and conversion tables; None for another model."""

    skeleton: torch.nn.Module | None = None

    @property
    def config(self):
        return getattr(self.skeleton, "config", None)

    @property
    def generation_config(self):
        return getattr(self.skeleton, "generation_config", None)

    @property
    def base_prefix(self) -> str:
        return getattr(self.skeleton, "base_model_prefix", "") or ""

    def ignored_unexpected(self) -> list[str]:
        """The patterns (regular expressions) of checkpoint keys the model's class declares it does
        not load (transformers' `_keys_to_ignore_on_load_unexpected`: GPT-2's stored attention
        masks, older rotary buffers), skipped as transformers skips them."""
        return list(getattr(self.skeleton, "_keys_to_ignore_on_load_unexpected", None) or [])

    def conversions(self) -> list:
        """transformers' conversions from checkpoint keys to the module's (with legacy renames)."""
        if self.skeleton is None:
            return []
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
        except ImportError:
            return []
        return list(get_model_conversion_mapping(self.skeleton))

    def revert(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint keys and tensors transformers' save_pretrained writes for these
        module tensors (one fused tensor may become several keys)."""
        if self.skeleton is None:
            return tensors
        from transformers.core_model_loading import revert_weight_conversion
        return dict(revert_weight_conversion(self.skeleton, dict(tensors)))


def origin_of(model: torch.nn.Module) -> Origin:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return Origin()
    if not isinstance(model, PreTrainedModel):
        return Origin()
    from fxtron.runtime.materialize import meta_replica
    return Origin(meta_replica(model))


# ----------------------------------------------------------------------------- reading
def checkpoint_files(path: str) -> dict[str, str]:
    """Every tensor key of the safetensors checkpoint at `path` -> the file holding it."""
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
    with _opened(path) as f:
        return {k: path for k in f.keys()}


def _opened(path: str):
    """safetensors' handle of `path`, or a ParallelizeError naming the file where it is not a
    readable safetensors file (cut short, a damaged header, empty)."""
    from safetensors import safe_open
    try:
        return safe_open(path, framework="pt")
    except Exception as e:  # noqa: BLE001 - SafetensorError, OSError: the file is what is wrong
        raise ParallelizeError(f"pretrained weights {path} cannot be read as safetensors ({type(e).__name__}: "
                               f"{str(e)[:200]}): the file is damaged or cut short; write it again "
                               "(save_pretrained) or give another copy; nothing was loaded") from e


def _runs(index: torch.Tensor) -> list[tuple[int, int]]:
    """Consecutive runs [start, stop) of an increasing index."""
    out, values = [], index.tolist()
    if not values:
        return out
    start = prev = values[0]
    for v in values[1:]:
        if v != prev + 1:
            out.append((start, prev + 1))
            start = v
        prev = v
    out.append((start, prev + 1))
    return out


def _read_piece(target: torch.Tensor, src, index: list[torch.Tensor], local_shape, flat) -> None:
    """Read into `target` the rank's flat piece (core.params.FlatShard) of the local tensor
    that `index` selects of `src`: the rows it spans, then the piece's elements of them."""
    row = math.prod(local_shape[1:])
    numel = math.prod(local_shape)
    lo, hi = min(flat.index * flat.chunk, numel), min((flat.index + 1) * flat.chunk, numel)
    target.zero_()
    if lo == hi:
        return
    r0, r1 = lo // row, -(-hi // row)
    index = [index[0][r0:r1], *index[1:]]
    part = src.read(index).reshape(-1)[lo - r0 * row:hi - r0 * row]
    target[:hi - lo].copy_(part.to(device=target.device, dtype=target.dtype))


def _index(full_shape: tuple[int, ...], shards, sizes: dict, coords: dict) -> list[torch.Tensor]:
    """Per dim, the full tensor's indices a rank holds under `shards` (increasing)."""
    index = [torch.arange(n) for n in full_shape]
    for s in shards:
        index[s.dim] = layout.shard(index[s.dim], 0, sizes[s.axis], coords[s.axis], s.interleave, s.whole)
    return index


class _Key:
    """One tensor of the checkpoint, read run by run."""

    def __init__(self, handles: dict, file: str, key: str):
        self.handles, self.file, self.key = handles, file, key

    @property
    def slice(self):
        if self.file not in self.handles:
            self.handles[self.file] = _opened(self.file)
        return self.handles[self.file].get_slice(self.key)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.slice.get_shape())

    @property
    def keys(self) -> list[str]:
        return [self.key]

    def read(self, index: list[torch.Tensor]) -> torch.Tensor:
        sl = self.slice
        if not index:
            return self.handles[self.file].get_tensor(self.key)
        runs = []                                       # per dim: (source slice, where in the output)
        for ix in index:
            at, dim_runs = 0, []
            for a, b in _runs(ix):
                dim_runs.append((slice(a, b), slice(at, at + b - a)))
                at += b - a
            runs.append(dim_runs)
        out = None
        for box in itertools.product(*runs):           # each box of consecutive elements, copied into place
            piece = sl[tuple(src for src, _ in box)]
            if out is None:
                out = torch.empty([len(ix) for ix in index], dtype=piece.dtype)
            out[tuple(dst for _, dst in box)] = piece
            del piece
        return out


class _Stacked:
    """A module tensor transformers stores as one key per expert and projection: target[e] is
    the concatenation over `parts` (along `dim` of the per-expert tensors) of parts[i][e]
    (MergeModulelist(0), then Concatenate(dim + 1))."""

    def __init__(self, parts: list[dict[int, _Key]], dim: int | None):
        self.parts, self.dim = parts, dim

    @property
    def keys(self) -> list[str]:
        return [k.key for part in self.parts for e in sorted(part) for k in [part[e]]]

    def check(self, name: str) -> str | None:
        experts = [sorted(p) for p in self.parts]
        n = len(experts[0])
        if any(e != list(range(n)) for e in experts):
            return f"{name}: the experts' keys are not 0..{n - 1} for every projection"
        shapes = {k.shape for p in self.parts for k in p.values()}
        first = [p[0].shape for p in self.parts]
        if any(p[e].shape != first[i] for i, p in enumerate(self.parts) for e in p):
            return f"{name}: the experts' keys have different shapes ({sorted(shapes)})"
        return None

    @property
    def shape(self) -> tuple[int, ...]:
        first = [p[0].shape for p in self.parts]
        each = list(first[0])
        if self.dim is not None:
            each[self.dim] = sum(s[self.dim] for s in first)
        return (len(self.parts[0]), *each)

    def read(self, index: list[torch.Tensor]) -> torch.Tensor:
        rest = index[1:]
        out = []
        for e in index[0].tolist():
            if self.dim is None:
                out.append(self.parts[0][e].read(rest))
                continue
            pieces, off = [], 0
            sel = rest[self.dim]
            for part in self.parts:
                key = part[e]
                size = key.shape[self.dim]
                mine = sel[(sel >= off) & (sel < off + size)] - off
                if len(mine):
                    pieces.append(key.read([mine if d == self.dim else ix for d, ix in enumerate(rest)]))
                off += size
            out.append(torch.cat(pieces, dim=self.dim))
        return torch.stack(out)


def _glob(pattern: str) -> re.Pattern:
    return re.compile(re.escape(pattern).replace(r"\*", r"(\d+)") + "$")


def _sources(files: dict[str, str], handles: dict, conversions: list) -> tuple[dict[str, object], list[str]]:
    """The checkpoint's tensors under the module's names: {name: _Key | _Stacked}, and what
    cannot be read (keys a conversion fxtron does not read slice by slice would need)."""
    renamed: dict[str, str] = {}                     # module-side key -> checkpoint key
    renames = [c for c in conversions if type(c).__name__ == "WeightRenaming"]
    converters = [c for c in conversions if type(c).__name__ != "WeightRenaming"]
    for key in files:
        new = key
        for r in renames:
            for src in r.source_patterns:
                new = re.sub(src, r.target_patterns[0], new)
        renamed[new] = key
    out: dict[str, object] = {}
    refused: list[str] = []
    used: set[str] = set()
    for c in converters:
        ops = [type(o).__name__ for o in getattr(c, "operations", [])]
        patterns = [_glob(p) for p in c.source_patterns]
        matched: dict[str, list[dict[int, _Key]]] = {}
        for new, key in renamed.items():
            for i, rx in enumerate(patterns):
                m = rx.search(new)
                if m:
                    prefix = new[:m.start()]
                    parts = matched.setdefault(prefix, [{} for _ in patterns])
                    parts[i][int(m.group(1)) if rx.groups else 0] = _Key(handles, files[key], key)
                    used.add(new)
                    break
        if not matched:
            continue
        simple = ops in (["MergeModulelist"], ["MergeModulelist", "Concatenate"]) and len(c.target_patterns) == 1 \
            and c.operations[0].dim == 0 and all(p.groups == 1 for p in patterns)
        for prefix, parts in matched.items():
            target = prefix + c.target_patterns[0]
            if not simple:
                refused.append(f"{target} from {', '.join(k.key for p in parts for k in list(p.values())[:1])} ... "
                               f"(transformers' {' + '.join(ops) or type(c).__name__})")
                continue
            out[target] = _Stacked(parts, c.operations[1].dim - 1 if len(ops) == 2 else None)
    for new, key in renamed.items():
        if new not in used:
            out[new] = _Key(handles, files[key], key)
    return out, refused


def _equal(a, b) -> bool:
    """Whether two stored tensors hold the same values (read whole)."""
    if tuple(a.shape) != tuple(b.shape):
        return False
    every = [torch.arange(n) for n in a.shape]
    return torch.equal(a.read(every), b.read(every))


def load_pretrained(prog, path: str, prefix: str = "") -> None:
    """See the module docstring."""
    prog._settle_params()      # (overlap_param_gather: no gather still in flight lands over the weights read)
    files = checkpoint_files(path)
    info = prog.info
    groups = prog.groups
    origin: Origin = getattr(prog, "origin", None) or Origin()
    axes = {s.axis for spec in prog.local.values() for s in spec.shards}
    sizes = {a: groups.size(a) if groups is not None else 1 for a in axes}
    coords = {a: groups.index(a) if groups is not None else 0 for a in axes}
    names_of: dict[str, list[str]] = {}          # canonical name -> every name it goes by
    for alias, name in info.aliases.items():
        names_of.setdefault(name, [name]).append(alias)
    persistent = set(prog.state_dict(keep_vars=True)) - set(dict(prog.named_parameters()))
    known = set(info.params) | set(info.buffers) | set(info.aliases)
    # every file opened (its header read) before any weight is: a damaged shard refused, nothing loaded
    handles: dict = {f: _opened(f) for f in sorted(set(files.values()))}
    try:
        sources, refused = _sources(files, handles, origin.conversions())
        base = origin.base_prefix + "." if origin.base_prefix else ""

        def module_name(key: str) -> str | None:
            candidates = [key]
            if prefix:
                candidates = ([key[len(prefix):]] if key.startswith(prefix) else []) + [prefix + key]
            for c in list(candidates):
                if base:
                    candidates += [base + c] + ([c[len(base):]] if c.startswith(base) else [])
            return next((c for c in candidates if c in known), None)
        by_name: dict[str, tuple[str, object]] = {}
        unexpected = []
        ignored = [re.compile(p) for p in origin.ignored_unexpected()]
        for key, src in sources.items():
            name = module_name(key)
            if name is None:
                if not any(rx.search(key) for rx in ignored):
                    unexpected.append(key)
            else:
                by_name[name] = (key, src)
        plan, missing, misshaped = [], [], []
        buffers = dict(prog.named_buffers())
        for name, spec in prog.local.items():
            present = [by_name[n] for n in names_of.get(name, [name]) if n in by_name]
            if not present:
                missing.append(name)
                continue
            # a tied weight stored under several keys: one value, or the model cannot hold them
            # (transformers then unties them; fxtron's program shares the one parameter)
            for key, other in present[1:]:
                if not _equal(present[0][1], other):
                    raise ParallelizeError(
                        f"the pretrained weights at {path} hold {present[0][0]} and {key} with different values, "
                        f"which this model ties (one parameter, {name}); build the model with its weights untied "
                        "(tie_word_embeddings=False in its config) to load both")
            plan.append((name, present[0][1], spec.full_shape, spec.shards))
        for name in sorted(persistent):
            if name in by_name:       # (buffers are whole on every rank: the model's shape is the file's)
                plan.append((name, by_name[name][1], tuple(buffers[name].shape) if name in buffers else None, ()))
            elif name in set(info.buffers):
                missing.append(name)
        for name, src, full, _ in plan:
            why = src.check(name) if isinstance(src, _Stacked) else None
            if why:
                misshaped.append(why)
            elif full is not None and tuple(src.shape) != tuple(full):
                misshaped.append(f"{'+'.join(src.keys[:2])}{' ...' if len(src.keys) > 2 else ''} {tuple(src.shape)} "
                                 f"(the model's {name} is {tuple(full)})")
        if missing or unexpected or misshaped or refused:
            parts = []
            if missing:
                parts.append(f"missing {len(missing)}: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))
            if unexpected:
                parts.append(f"unexpected {len(unexpected)}: {', '.join(unexpected[:8])}"
                             + (" ..." if len(unexpected) > 8 else ""))
            if misshaped:
                parts.append(f"mis-shaped {len(misshaped)}: {'; '.join(misshaped[:8])}")
            if refused:
                parts.append(f"stored in a layout fxtron does not read slice by slice {len(refused)}: "
                             f"{'; '.join(refused[:4])}")
            raise ParallelizeError(
                f"the pretrained weights at {path} do not fit this model ({'; '.join(parts)})"
                + (f", keys read with the prefix {prefix!r}" if prefix else "")
                + "; load the checkpoint of this architecture and configuration, or give prefix= for a wrapper's "
                  "module names")
        params = dict(prog.named_parameters())
        with torch.no_grad():
            for name, src, full, shards in plan:
                target = params.get(name, buffers.get(name))
                index = _index(tuple(full), shards, sizes, coords) if full is not None else \
                    [torch.arange(n) for n in src.shape]
                flat = prog.local[name].flat if name in prog.local else None
                if flat is None:
                    target.copy_(src.read(index).to(device=target.device, dtype=target.dtype))
                else:        # zero=3: only the rows holding the rank's flat piece are read
                    _read_piece(target, src, index, prog.local[name].local_shape, flat)
                handles.clear()     # unmap: the pages read leave the rank's resident memory
    finally:
        handles.clear()


# ----------------------------------------------------------------------------- writing
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", getattr(torch, "float8_e4m3fn", None): "F8_E4M3", getattr(torch, "float8_e5m2", None): "F8_E5M2"}


def parse_size(size: int | str) -> int:
    """'5GB' / '500MB' / '60KB' / bytes -> bytes (transformers' units: GB = 10^9, GiB = 2^30)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", size.upper())
    if not m:
        raise ParallelizeError(f"max_shard_size={size!r}: give bytes or a size like '5GB', '500MB'")
    unit = m.group(2) or "B"
    power = " KMGT".index(unit[0]) if unit != "B" else 0
    return int(float(m.group(1)) * ((1024 if "I" in unit else 1000) ** power))


@dataclasses.dataclass
class _Entry:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    group: int              # the writer's group (a pipeline stage): a file holds one group's keys

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def plan_files(entries: list[_Entry], max_shard_size: int) -> list[list[_Entry]]:
    """Entries in order into files of at most `max_shard_size` bytes (a larger tensor alone),
    a file holding one group's entries."""
    files: list[list[_Entry]] = []
    size = 0
    for e in entries:
        if not files or files[-1][0].group != e.group or (size + e.nbytes > max_shard_size and files[-1]):
            files.append([])
            size = 0
        files[-1].append(e)
        size += e.nbytes
    return files


def file_names(n: int) -> list[str]:
    return [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


class StreamingFile:
    """A safetensors file written tensor by tensor: the header (every key's dtype, shape and
    offsets) first, then each tensor's bytes at its offset as it comes."""

    def __init__(self, path: str, entries: list[_Entry]):
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        self.offsets = {}
        for e in entries:
            header[e.key] = {"dtype": _DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
            self.offsets[e.key] = (offset, e)
            offset += e.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.start = 8 + len(text)
        self.path = path
        self.file = open(path, "wb")
        self.file.write(struct.pack("<Q", len(text)))
        self.file.write(text)
        self.file.truncate(self.start + offset)
        self.written: set[str] = set()

    def write(self, key: str, tensor: torch.Tensor) -> None:
        offset, e = self.offsets[key]
        if tuple(tensor.shape) != e.shape or tensor.dtype != e.dtype:
            raise ParallelizeError(f"{key}: got {tuple(tensor.shape)} {tensor.dtype}, the header says {e.shape} {e.dtype}")
        self.file.seek(self.start + offset)
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        if data.numel():
            self.file.write(data.view(torch.uint8).numpy().tobytes())
        self.written.add(key)

    def close(self) -> None:
        self.file.close()
        missing = set(self.offsets) - self.written
        if missing:
            raise ParallelizeError(f"{self.path}: {len(missing)} tensor(s) never written: {sorted(missing)[:4]}")


def _entries_of(origin: Origin, name: str, shape: tuple[int, ...], dtype: torch.dtype, group: int) -> list[_Entry]:
    """The checkpoint keys a module tensor becomes (transformers' reverted layout), on meta."""
    out = origin.revert({name: torch.empty(shape, dtype=dtype, device="meta")})
    return [_Entry(k, tuple(v.shape), v.dtype, group) for k, v in out.items()]


def write_index(path: str, files: list[list[_Entry]], names: list[str]) -> None:
    total = sum(e.nbytes for f in files for e in f)
    index = {"metadata": {"total_size": total},
             "weight_map": {e.key: name for f, name in zip(files, names) for e in f}}
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)


def write_configs(path: str, origin: Origin, config=None, dtype: torch.dtype | None = None) -> None:
    """config.json (with `dtype`, that of the weights written, as transformers' save_pretrained
    records its model's: from_pretrained loads in it) and generation_config.json."""
    config = config if config is not None else origin.config
    if config is not None:
        if dtype is not None:
            config = copy.deepcopy(config)
            config.dtype = str(dtype).split(".")[1]
        config.save_pretrained(path)
    gen = origin.generation_config
    if gen is not None:
        gen.save_pretrained(path)


#: what a model directory holds besides its weights and config that a user of the export loads:
#: the tokenizer's files (fast and slow: transformers' save_pretrained names, vocabularies and
#: merges, sentencepiece and tiktoken models), chat templates, the generation defaults
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model", "tokenizer.tiktoken", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")


def copy_tokenizer(source: str, out: str) -> list[str]:
    """Copy the tokenizer files and generation_config.json the model directory `source` has
    (TOKENIZER_FILES) into the export `out`, so AutoTokenizer.from_pretrained(out) works as on
    `source`. Returns the names copied (none for a source that is not a directory)."""
    if not os.path.isdir(source) or os.path.abspath(source) == os.path.abspath(out):
        return []
    copied = []
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(out, name))
            copied.append(name)
    return copied


def _fresh(path: str) -> None:
    """Remove what an earlier save_pretrained wrote at `path` (its safetensors files and
    index), so no stale shard stays listed."""
    os.makedirs(path, exist_ok=True)
    for f in os.listdir(path):
        if f.endswith(".safetensors") or f == INDEX or f.endswith(".safetensors.partial"):
            os.remove(os.path.join(path, f))


def write_pretrained(path: str, tensors: Iterable[tuple[str, torch.Tensor]], layout_of: list[tuple[str, tuple, torch.dtype]],
                     origin: Origin, *, max_shard_size: int | str = DEFAULT_SHARD, dtype: torch.dtype | None = None,
                     config=None) -> list[str]:
    """One process: stream (name, whole tensor) pairs (in the order of `layout_of`: (name,
    shape, dtype)) into a save_pretrained directory. Returns the files written."""
    cast = (lambda d: dtype if dtype is not None and d.is_floating_point else d)
    entries = [e for n, s, d in layout_of for e in _entries_of(origin, n, tuple(s), cast(d), 0)]
    files = plan_files(entries, parse_size(max_shard_size))
    names = file_names(len(files))
    _fresh(path)
    where = {e.key: i for i, f in enumerate(files) for e in f}
    writers = [StreamingFile(os.path.join(path, n + ".partial"), f) for f, n in zip(files, names)]
    try:
        for name, t in tensors:
            t = t.to(cast(t.dtype))
            for key, v in origin.revert({name: t}).items():
                writers[where[key]].write(key, v)
    finally:
        for w in writers:
            w.file.close()
    for w, n in zip(writers, names):
        w.close()
        os.replace(w.path, os.path.join(path, n))
    if len(files) > 1:
        write_index(path, files, names)
    write_configs(path, origin, config, _first_float(cast(d) for _, _, d in layout_of))
    return names


def _first_float(dtypes) -> torch.dtype | None:
    """The dtype transformers records for a model (its first floating-point parameter's)."""
    return next((d for d in dtypes if d.is_floating_point), None)


def save_pretrained(prog, path: str, max_shard_size: int | str = DEFAULT_SHARD, dtype: torch.dtype | None = None) -> None:
    """See the module docstring (Program.save_pretrained)."""
    import torch.distributed as dist

    from fxtron.ops import ledger
    groups = prog.groups
    origin: Origin = getattr(prog, "origin", None) or Origin()
    limit = parse_size(max_shard_size)
    held_in = prog.held_in      # (a model held in 16 bits: its fp32 masters written back in it)

    def cast(n: str, d: torch.dtype) -> torch.dtype:
        if not d.is_floating_point:
            return d
        return dtype if dtype is not None else held_in.get(n, d)
    if prog.zero is not None:
        prog.zero.wait_params()
    idx = (lambda a: groups.index(a) if groups is not None else 0)
    pp, stage = (groups.size("pp"), idx("pp")) if groups is not None else (1, 0)
    params = dict(prog.named_parameters())
    persistent = set(prog.state_dict(keep_vars=True))
    buffers = {n: b for n, b in prog.named_buffers() if n in persistent}
    order = [n for n in prog.info.params if n in params] + [n for n in prog.info.buffers if n in buffers]
    order += [n for n in list(params) + list(buffers) if n not in order]
    # each tensor with the dtype it is written in, decided by the rank that holds it (held_in is
    # the rank's own): every rank plans every stage's files alike
    mine = [(n, tuple(prog.local[n].full_shape) if n in prog.local else tuple((params.get(n, buffers.get(n))).shape),
             cast(n, (params.get(n, buffers.get(n))).dtype)) for n in order]
    stages = [mine]
    if pp > 1:
        stages = [None] * pp
        with ledger.collective(groups.group("pp"), "all_gather_object"):
            dist.all_gather_object(stages, mine, group=groups.group("pp"))
    held, seen = [], set()                      # (stage, name, shape, dtype): each tensor by its first stage
    for s, listed in enumerate(stages):
        for n, shape, d in listed:
            if n not in seen:
                seen.add(n)
                held.append((s, n, shape, d))
    entries = [e for s, n, shape, d in held for e in _entries_of(origin, n, shape, cast(n, d), s)]
    files = plan_files(entries, limit)
    names = file_names(len(files))
    where = {e.key: i for i, f in enumerate(files) for e in f}
    lead = all(idx(a) == 0 for a in ("tp", "cp", "ep", "dp")) if groups is not None else True

    def gathers(n: str) -> bool:
        """Whether this rank takes part in gathering `n`: the first of its replicas (the group
        reducing its gradient: dp, dp-cp, or expert-dp for an expert weight over ep)."""
        spec = prog.local.get(n)
        return spec is None or not spec.sharded or groups is None or groups.index(spec.grad_group) == 0
    rank0 = groups is None or groups.rank == 0
    if rank0:
        _fresh(path)
    if groups is not None:
        dist.barrier()
    writers = {i: StreamingFile(os.path.join(path, names[i] + ".partial"), f)
               for i, f in enumerate(files) if f[0].group == stage and lead}
    try:
        for s, n, shape, d in held:
            if s != stage:
                continue
            t = params.get(n, buffers.get(n)).detach()
            if n in params:
                t = prog.grads.local_of(n, t)      # (zero=3: every rank of its group gathers the pieces)
            if not gathers(n):
                continue
            full = prog.grads.full(n, t) if n in params else t
            if lead:
                for key, v in origin.revert({n: full.to(cast(n, full.dtype))}).items():
                    writers[where[key]].write(key, v)
            del full
    finally:
        for w in writers.values():
            w.file.close()
    for i, w in writers.items():
        w.close()
        os.replace(w.path, os.path.join(path, names[i]))
    if groups is not None:
        dist.barrier()
    if rank0:
        if len(files) > 1:
            write_index(path, files, names)
        write_configs(path, origin, dtype=_first_float(cast(n, d) for _, n, _, d in held))
    if groups is not None:
        dist.barrier()


def _like(like: str):
    """(transformers config, generation_config.json path or None) of the directory `like` (or
    its config.json)."""
    directory = os.path.dirname(like) if os.path.isfile(like) else like
    if not os.path.exists(os.path.join(directory, "config.json")):
        raise ParallelizeError(f"--like {like}: no config.json there; give the transformers directory (or its "
                               "config.json) of the model the checkpoint was trained from")
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(directory)
    gen = os.path.join(directory, "generation_config.json")
    return config, gen if os.path.exists(gen) else None


def _skeleton(config) -> torch.nn.Module:
    """The transformers model of `config` on the meta device (its class by config.architectures)."""
    import transformers
    cls = next((getattr(transformers, a) for a in (config.architectures or []) if hasattr(transformers, a)), None)
    with torch.device("meta"):
        if cls is not None:
            return cls(config)
        return transformers.AutoModelForCausalLM.from_config(config)


def export(checkpoint: str, out: str, *, like: str, max_shard_size: int | str = DEFAULT_SHARD,
           dtype: torch.dtype | str | None = None) -> list[str]:
    """An fxtron checkpoint of any mesh (prog.save) written as transformers' save_pretrained
    directory in one process, tensor by tensor (`python -m fxtron export`); `like` names the
    directory whose config.json (and generation_config.json) the model has; its tokenizer files
    are copied along (copy_tokenizer). Returns the files."""
    from fxtron.runtime.checkpoint.dcp import full_tensors
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    config, gen = _like(like)
    origin = Origin(_skeleton(config))
    listed, read = full_tensors(checkpoint)
    state = origin.skeleton.state_dict()
    tied = set(state) - {n for n, _ in origin.skeleton.named_parameters()} - \
        {n for n, _ in origin.skeleton.named_buffers()}
    have = {n for n, _, _ in listed}
    missing = sorted(set(state) - have - tied)
    extra = sorted(have - set(state))
    shapes = sorted(f"{n} {tuple(s)} (the model's {tuple(state[n].shape)})" for n, s, _ in listed
                    if n in state and tuple(s) != tuple(state[n].shape))
    if missing or extra or shapes:
        raise ParallelizeError(
            f"checkpoint {checkpoint} does not fit the model of {like}: "
            + "; ".join(x for x in [f"missing {', '.join(missing[:8])}" if missing else "",
                                    f"not in the model {', '.join(extra[:8])}" if extra else "",
                                    f"shapes differ {', '.join(shapes[:8])}" if shapes else ""] if x))
    order = [n for n in state if n in have]
    layout_of = [(n, s, d) for n in order for m, s, d in listed if m == n]
    names = write_pretrained(out, ((n, read(n)) for n in order), layout_of, origin, max_shard_size=max_shard_size,
                             dtype=dtype, config=config)
    if gen is not None:
        shutil.copyfile(gen, os.path.join(out, "generation_config.json"))
    copy_tokenizer(os.path.dirname(like) if os.path.isfile(like) else like, out)
    return names


__all__ = ["Origin", "StreamingFile", "TOKENIZER_FILES", "checkpoint_files", "copy_tokenizer", "export",
           "load_pretrained", "origin_of", "parse_size", "save_pretrained", "write_pretrained"]
