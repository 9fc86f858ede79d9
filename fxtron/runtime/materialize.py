"""Runtime: real values for the parameters of a model built on the meta device, made shard by
shard: no rank ever holds a whole weight it does not keep (a 70B model's embedding, 128k x 8k,
is never made on a rank that holds 1/8 of it).

A parameter's initialization is its module's own `reset_parameters()` (or GPT-2's: normal(0,
0.02) matrices, ones for 1-d weights, zeros for biases), run once on a *recorder*: a tensor of
the parameter's full shape and dtype with no storage that writes down the in-place,
elementwise operations done to it (uniform_, normal_, fill_, zero_, mul_, add_, clamp_, ...:
torch.nn.init's uniform, normal, constant, kaiming and xavier inits, which read only the shape
for their fans). The values
are then made in fixed blocks of rows (dim 0, at most `BLOCK` elements a block), each block
drawing from its own generator seeded by (seed, parameter name, block index): so any slice of
the parameter -- whatever the mesh, the shard's dims and interleave -- has the same values,
made block by block from the blocks it overlaps. An initialization that does more than
elementwise writes (orthogonal_, trunc_normal_ -- which reads values --, one that writes a
slice, assigns .data or a new Parameter, or leaves a parameter untouched) cannot be recorded;
that module's parameters are made whole (module by module, as before), `whole` names them and
the program's build warns.
"""
from __future__ import annotations

import copy
import math
import zlib

import torch
from torch.utils._pytree import tree_map

from fxtron.core import layout

#: elements per generated block of rows (the peak a rank holds beyond its shards)
BLOCK = 1 << 22

_aten = torch.ops.aten
_RANDOM = {_aten.uniform_.default, _aten.normal_.default, _aten.bernoulli_.float, _aten.random_.default,
           getattr(_aten.random_, "from"), _aten.random_.to, _aten.exponential_.default, _aten.log_normal_.default,
           _aten.cauchy_.default, _aten.geometric_.default}
_ELEMENTWISE = _RANDOM | {
    _aten.fill_.Scalar, _aten.zero_.default, _aten.mul_.Scalar, _aten.mul_.Tensor, _aten.add_.Scalar,
    _aten.add_.Tensor, _aten.sub_.Tensor, _aten.div_.Scalar, _aten.div_.Tensor, _aten.clamp_.default,
    _aten.erfinv_.default, _aten.abs_.default, _aten.neg_.default, _aten.sqrt_.default, _aten.exp_.default,
    _aten.fill_.Tensor}
#: ops an initialization may use to read a shape (a fan's receptive field: w[0][0].numel())
_VIEWS = {_aten.select.int, _aten.slice.Tensor, _aten.view.default, _aten.alias.default, _aten.detach.default,
          _aten.t.default, _aten.transpose.int}


class NotRecordable(Exception):
    """An initialization that is not a sequence of elementwise writes."""


class _Recorder(torch.Tensor):
    """A tensor of a shape and dtype with no storage that records the elementwise in-place ops
    done to it (`ops`); a view of it only answers for its shape."""

    @staticmethod
    def __new__(cls, shape, dtype, view: bool = False):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device="cpu")

    def __init__(self, shape, dtype, view: bool = False):
        self.ops: list = []
        self.view = view

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else None
        if func in _VIEWS and isinstance(target, _Recorder):
            meta = tree_map(lambda a: torch.empty(a.shape, dtype=a.dtype, device="meta")
                            if isinstance(a, _Recorder) else a, (args, kwargs))
            out = func(*meta[0], **meta[1])
            return _Recorder(out.shape, out.dtype, view=True)
        if func in _ELEMENTWISE and isinstance(target, _Recorder) and not target.view:
            rest = (args[1:], kwargs)
            for a in torch.utils._pytree.tree_leaves(rest):
                if isinstance(a, torch.Tensor) and (isinstance(a, _Recorder) or a.numel() != 1):
                    raise NotRecordable(f"{func} reads a tensor")
            target.ops.append((func, args[1:], {k: v for k, v in kwargs.items() if k != "generator"}))
            return target
        raise NotRecordable(f"{func} on {'a view of ' if getattr(target, 'view', False) else ''}the weight")


def _replay(ops: list, block: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    for func, args, kwargs in ops:
        if func in _RANDOM:
            kwargs = {**kwargs, "generator": generator}
        func(block, *args, **kwargs)
    return block


def _shell(module: torch.nn.Module, params: dict) -> torch.nn.Module:
    """A shallow copy of `module` holding `params` as its own parameters (its children stay
    shared and untouched), for its reset_parameters() to write."""
    shell = copy.copy(module)
    shell._parameters = dict(params)
    return shell


def _default_init(name: str, t: torch.Tensor) -> None:
    if t.dim() >= 2:
        t.normal_(0.0, 0.02)
    elif name.endswith("bias"):
        t.zero_()
    else:
        t.fill_(1.0)


class MetaMaterializer:
    """Real values for the parameters of a model built on the meta device: `local(name, ...)`
    makes a rank's shard block by block (see the module docstring); a parameter whose init
    cannot be recorded is made whole with its module (`whole` lists it)."""

    def __init__(self, model: torch.nn.Module, seed: int):
        self.model, self.seed = model, seed
        self._recorded: dict[str, list | None] = {}       # parameter -> its init's ops (None: not recordable)
        self.whole: dict[str, str] = {}                    # parameter -> why it was made whole
        self._owner: str | None = None
        self._values: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ recording
    def _record(self, owner: str) -> None:
        module = self.model.get_submodule(owner)
        local = dict(module.named_parameters(recurse=False))
        names = {n: f"{owner}.{n}" if owner else n for n in local}
        recorders = {n: _Recorder(p.shape, p.dtype) for n, p in local.items()}
        try:
            if hasattr(module, "reset_parameters"):
                # every slot the module has, None where it holds none (a linear without bias)
                shell = _shell(module, {n: recorders.get(n) for n in module._parameters})
                with torch.no_grad():
                    shell.reset_parameters()
            else:
                with torch.no_grad():
                    for n, r in recorders.items():
                        _default_init(n, r)
            for n, r in recorders.items():
                got = (shell._parameters if hasattr(module, "reset_parameters") else recorders).get(n)
                if got is not r:
                    raise NotRecordable(f"it replaces {n} (a new Parameter, or .data assigned)")
                if not r.ops:
                    raise NotRecordable(f"it writes nothing to {n} that can be recorded")
        except NotRecordable as e:
            for n in local:
                self._recorded[names[n]] = None
                self.whole[names[n]] = f"{type(module).__name__}.reset_parameters: {e}"
            return
        for n, r in recorders.items():
            self._recorded[names[n]] = r.ops

    # ------------------------------------------------------------------ values
    def local(self, name: str, shards, sizes, coords) -> torch.Tensor:
        """This rank's piece of parameter `name` (layout of `shards`: core.params.AxisShard in
        order, at mesh `sizes` and `coords`), a new tensor made without the whole."""
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        if name not in self._recorded:
            self._record(owner)
        ops = self._recorded[name]
        param = self.model.get_parameter(name)
        shape, dtype = tuple(param.shape), param.dtype
        if ops is None:                              # made whole with its module, then sliced
            out = self._whole(name)
            for s in shards:
                out = layout.shard(out, s.dim, sizes[s.axis], coords[s.axis], s.interleave, s.whole)
            return out if shards else out.clone()
        index = [torch.arange(n) for n in shape]     # per dim, the full indices this rank holds
        for s in shards:
            index[s.dim] = layout.shard(index[s.dim], 0, sizes[s.axis], coords[s.axis], s.interleave, s.whole)
        out = torch.empty([len(i) for i in index], dtype=dtype)
        if not shape:
            return _replay(ops, out, self._generator(name, 0))
        rows = max(1, BLOCK // max(1, math.prod(shape[1:])))
        wanted = index[0]
        for b in range(0, shape[0], rows):
            hit = ((wanted >= b) & (wanted < b + rows)).nonzero().flatten()
            if not len(hit):
                continue
            block = _replay(ops, torch.empty((min(rows, shape[0] - b), *shape[1:]), dtype=dtype),
                            self._generator(name, b // rows))
            piece = block.index_select(0, wanted[hit] - b)
            for d in range(1, len(shape)):
                if len(index[d]) != shape[d]:
                    piece = piece.index_select(d, index[d])
            out.index_copy_(0, hit, piece)
        return out

    def _generator(self, name: str, block: int) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed((self.seed * 1_000_003 + zlib.crc32(name.encode()) * 65_537 + block) % 2**63)
        return g

    def _whole(self, name: str) -> torch.Tensor:
        owner, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        if owner != self._owner:
            self._values, self._owner = self._materialize(owner), owner
        return self._values[leaf]

    def _materialize(self, owner: str) -> dict[str, torch.Tensor]:
        """A module whose init is not recordable, made whole on the CPU with its own
        reset_parameters under a seed of (seed, module path)."""
        module = self.model.get_submodule(owner)
        local = dict(module.named_parameters(recurse=False))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed((self.seed * 1_000_003 + zlib.crc32(owner.encode())) % 2**63)
            shell = _shell(module, {n: torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype), p.requires_grad)
                                    for n, p in local.items()})
            shell.reset_parameters()
            return {n: p.detach() for n, p in shell._parameters.items()}


__all__ = ["BLOCK", "MetaMaterializer", "NotRecordable"]
