"""Runtime: real values for the parameters and buffers of a model built on the meta device,
made shard by shard: no rank ever holds a whole weight it does not keep (a 70B model's
embedding, 128k x 8k, is never made on a rank that holds 1/8 of it).

The model's own initialization is run once, over a *shell* of the whole model: a shallow copy
of every module whose parameters are *recorders* -- tensors of the parameters' shapes and
dtypes with no storage that write down the in-place, elementwise operations done to them or to
a slice of them (uniform_, normal_, fill_, zero_, mul_, add_, clamp_, erfinv_, copy_ of a
constant, ...: torch.nn.init's and transformers.initialization's uniform, normal, constant,
kaiming, xavier and trunc_normal inits, which read only the shape for their fans) -- and whose
meta buffers are real CPU tensors (they are small) that the init computes. The initialization
is what building the model on the CPU would have run:

1. every module's own `reset_parameters()` (what torch's layers run in their constructors);
2. then the model's: transformers' `initialize_weights()` for a PreTrainedModel (its
   `_init_weights` over every module: normal(0, initializer_range) for linears and
   embeddings, ones for norms, zeros for biases, the rotary tables computed), or the model's
   own `init_weights()` (fxtron's models, torchtitan's convention) when it has one;
3. a parameter nothing wrote gets normal(0, 0.02) (>= 2-d), zeros (a bias) or ones, and says so.

`init_of` names, per parameter, what initialized it (for `pm.summary()`). The values are then
made in fixed blocks of rows (dim 0, at most `BLOCK` elements a block), each block drawing
from its own generator seeded by (seed, parameter name, block index): so any slice of the
parameter -- whatever the mesh, the shard's dims and interleave -- has the same values, made
block by block from the blocks it overlaps. An initialization that does more than elementwise
writes to a parameter (orthogonal_ reads and factors it; a write through a transposed view)
cannot be recorded: that parameter is made whole on the CPU by a second run of the same
initialization under a seed, `whole` names it and the program's build warns. A meta buffer no
initialization computes is a ParallelizeError naming it.
"""
from __future__ import annotations

import copy
import inspect
import math
import zlib

import torch
from torch.utils._pytree import tree_leaves, tree_map

from fxtron.core import layout, opsets
from fxtron.errors import ParallelizeError

#: elements per generated block of rows (the peak a rank holds beyond its shards)
BLOCK = 1 << 22

_aten = torch.ops.aten
_RANDOM = {_aten.uniform_.default, _aten.normal_.default, _aten.bernoulli_.float, _aten.random_.default,
           getattr(_aten.random_, "from"), _aten.random_.to, _aten.exponential_.default, _aten.log_normal_.default,
           _aten.cauchy_.default, _aten.geometric_.default}
#: writes that leave no trace of what the tensor held before (earlier ops need no replay)
_OVERWRITE = _RANDOM | {_aten.fill_.Scalar, _aten.fill_.Tensor, _aten.zero_.default, _aten.copy_.default}
_ELEMENTWISE = _OVERWRITE | {
    _aten.mul_.Scalar, _aten.mul_.Tensor, _aten.add_.Scalar, _aten.add_.Tensor, _aten.sub_.Tensor, _aten.div_.Scalar,
    _aten.div_.Tensor, _aten.clamp_.default, _aten.erfinv_.default, _aten.abs_.default, _aten.neg_.default,
    _aten.sqrt_.default, _aten.exp_.default}
#: views whose elements are a box of the base's (a write through them is recorded with the box)
_BOX_VIEWS = {_aten.select.int, _aten.slice.Tensor, _aten.alias.default, _aten.detach.default}
#: views an initialization may use to read a shape (a fan's receptive field: w[0][0].numel())
_SHAPE_VIEWS = opsets.RESHAPES | opsets.TRANSPOSES | opsets.EXPANDS | opsets.UNSQUEEZES


class NotRecordable(Exception):
    """An initialization that is not a sequence of elementwise writes."""


class _Context:
    """What the recorders of one run share: the init now running (its label)."""

    def __init__(self) -> None:
        self.phase = ""


class _Recorder(torch.Tensor):
    """A tensor of a shape and dtype with no storage. The base records the elementwise in-place
    ops done to it or to a box of it (`ops`: (func, args, kwargs, box, phase)); a box view is a
    recorder whose writes go to its base with the box (per base dim an index or a (start, stop)
    range); any other view only answers for its shape, and a write through it marks the base
    unrecordable (`poisoned`)."""

    @staticmethod
    def __new__(cls, shape, dtype, ctx=None, base=None, box=None, dims=None):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device="cpu")

    def __init__(self, shape, dtype, ctx=None, base=None, box=None, dims=None):
        self.ctx = ctx if ctx is not None else _Context()
        self.base = base                     # None: this is a parameter's recorder
        self.box = box if box is not None else (tuple((0, n) for n in shape) if base is None else None)
        self.dims = dims if dims is not None else list(range(len(shape)))   # view dim -> base dim
        self.ops: list = []
        self.poisoned: str | None = None

    @property
    def root(self) -> "_Recorder":
        return self.base if self.base is not None else self

    def _view(self, func, args, kwargs, shape) -> "_Recorder":
        root = self.root
        if self.box is None or func not in _BOX_VIEWS:
            return _Recorder(shape, self.dtype, self.ctx, root, None, [])
        box, dims = list(self.box), list(self.dims)
        if func == _aten.select.int:
            dim, index = args[1], args[2]
            d = dims[dim % len(dims)]
            start, stop = box[d]
            box[d] = start + index % (stop - start)
            dims.remove(d)
        elif func == _aten.slice.Tensor:
            dim, start, end, step = (list(args[1:]) + [0, None, None, 1][len(args) - 1:])[:4]
            if step != 1:
                return _Recorder(shape, self.dtype, self.ctx, root, None, [])
            d = dims[dim % len(dims)]
            lo, hi = box[d]
            s, e, _ = slice(start, end).indices(hi - lo)
            box[d] = (lo + s, lo + max(s, e))
        return _Recorder(shape, self.dtype, self.ctx, root, tuple(box), dims)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else None
        if isinstance(target, _Recorder) and (func in _BOX_VIEWS or func in _SHAPE_VIEWS):
            meta = tree_map(lambda a: torch.empty(a.shape, dtype=a.dtype, device="meta")
                            if isinstance(a, _Recorder) else a, (args, kwargs))
            return target._view(func, args, kwargs, func(*meta[0], **meta[1]).shape)
        if isinstance(target, _Recorder) and func in _ELEMENTWISE:
            root = target.root
            rest = tree_leaves((args[1:], kwargs))
            others = [a for a in rest if isinstance(a, torch.Tensor) and (isinstance(a, _Recorder) or a.numel() != 1)]
            if target.box is None:
                root.poisoned = root.poisoned or f"{func} through a view that is not a slice"
            elif func == _aten.copy_.default and len(others) == 1 and not isinstance(others[0], _Recorder) \
                    and tuple(others[0].shape) == tuple(target.shape):
                pass
            elif others:
                root.poisoned = root.poisoned or f"{func} reads a tensor"
            if not root.poisoned:
                box = None if target.base is None else target.box
                root.ops.append((func, args[1:], {k: v for k, v in kwargs.items() if k != "generator"}, box,
                                 target.ctx.phase))
            return target
        recorders = [a for a in tree_leaves((args, kwargs)) if isinstance(a, _Recorder)]
        for r in recorders:
            r.root.poisoned = r.root.poisoned or f"{func} reads it"
        meta = tree_map(lambda a: torch.empty(a.shape, dtype=a.dtype, device="meta")
                        if isinstance(a, _Recorder) else a, (args, kwargs))
        try:
            out = func(*meta[0], **meta[1])
        except Exception as e:                     # a value read out (item()): nothing to stand in for it
            raise NotRecordable(f"{func} reads a parameter's values") from e
        ctx = recorders[0].ctx if recorders else None
        return tree_map(lambda o: _Recorder(o.shape, o.dtype, ctx, recorders[0].root, None, [])
                        if isinstance(o, torch.Tensor) else o, out)


def _live(ops: list) -> list:
    """The ops from the last one that overwrites the whole parameter on."""
    for i in range(len(ops) - 1, -1, -1):
        if ops[i][0] in _OVERWRITE and ops[i][3] is None:
            return ops[i:]
    return ops


def _replay(ops: list, block: torch.Tensor, generator: torch.Generator, first: int = 0) -> torch.Tensor:
    """Run `ops` on `block`, the rows [first, first + len(block)) of the parameter."""
    for func, args, kwargs, box, _ in ops:
        target, src_rows = block, None
        if box is not None:
            index = []
            for d, b in enumerate(box):
                if d == 0 and block.dim():
                    lo, hi = (b, b + 1) if isinstance(b, int) else b
                    lo, hi = max(lo, first), min(hi, first + len(block))
                    if lo >= hi:
                        break
                    if isinstance(b, int):
                        index.append(b - first)
                    else:
                        index.append(slice(lo - first, hi - first))
                        src_rows = slice(lo - b[0], hi - b[0])
                else:
                    index.append(b if isinstance(b, int) else slice(*b))
            else:
                target = block[tuple(index)]
            if target is block:
                continue                              # the box is in other rows
        if func in _RANDOM:
            kwargs = {**kwargs, "generator": generator}
        if func == _aten.copy_.default:
            src = args[0]
            if box is None and block.dim() and src.dim():
                src = src[first:first + len(block)]
            elif src_rows is not None and src.dim():
                src = src[src_rows]
            args = (src, *args[1:])
        func(target, *args, **kwargs)
    return block


def _fmt(v) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def describe(ops: list) -> str:
    """A short account of a parameter's recorded init: 'normal(0, 0.02)', 'ones', ..."""
    words = []
    for func, args, kwargs, box, _ in _live(ops):
        name = func.__name__.split(".")[0].rstrip("_")
        values = [a for a in args if not isinstance(a, torch.Tensor)] + [v for k, v in kwargs.items()]
        if func in (_aten.fill_.Scalar, _aten.fill_.Tensor):
            v = float(args[0])
            word = "ones" if v == 1 else "zeros" if v == 0 else f"constant({_fmt(v)})"
        elif func == _aten.zero_.default:
            word = "zeros"
        elif func == _aten.copy_.default:
            word = "computed"
        else:
            word = f"{name}({', '.join(_fmt(v) for v in values)})"
        words.append(word + (" on a slice" if box is not None else ""))
    return " then ".join(words) if len(words) <= 3 else " then ".join(words[:2]) + f" then ... ({len(words)} ops)"


def _default_init(name: str, t: torch.Tensor) -> None:
    if t.dim() >= 2:
        t.normal_(0.0, 0.02)
    elif name.endswith("bias"):
        t.zero_()
    else:
        t.fill_(1.0)


def _takes_no_arguments(fn) -> bool:
    try:
        return all(p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                   for p in inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False


def _is_pretrained(model: torch.nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def model_init_name(model: torch.nn.Module) -> str | None:
    """The model-wide initialization the model carries (step 2 of the module docstring)."""
    if _is_pretrained(model):
        return f"{type(model).__name__}._init_weights"
    fn = getattr(model, "init_weights", None)
    if callable(fn) and _takes_no_arguments(fn):
        return f"{type(model).__name__}.init_weights"
    return None


class MetaMaterializer:
    """Real values for the parameters and buffers of a model built on the meta device:
    `local(name, ...)` makes a rank's shard block by block, `buffer(name)` a computed buffer
    (see the module docstring); `init_of[name]` says how each parameter was initialized and
    `whole` which were made whole first (and why)."""

    def __init__(self, model: torch.nn.Module, seed: int):
        self.model, self.seed = model, seed
        self._ops: dict[str, list] | None = None            # parameter -> its init's ops (recorded once)
        self.whole: dict[str, str] = {}                    # parameter -> why it was made whole
        self.init_of: dict[str, str] = {}                  # parameter -> "what: how"
        self.defaulted: list[str] = []                     # parameters no init wrote
        self.buffers: dict[str, torch.Tensor] = {}         # meta buffer -> its computed value
        self.uncomputed: list[str] = []                    # meta buffers no init computed
        self._whole_values: dict[str, torch.Tensor] | None = None

    # ------------------------------------------------------------------ the shell and its run
    def _shell(self, make_param) -> tuple[torch.nn.Module, dict, dict]:
        """A shallow copy of the whole module tree with `make_param(name, p)` as every
        parameter and real CPU tensors as its meta buffers; returns (shell, {name: param
        stand-in}, {name: (buffer stand-in, its version)})."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        bnames = {id(b): n for n, b in self.model.named_buffers()}
        made, modules, buffers = {}, {}, {}

        def stand_in_buffer(b):
            if id(b) not in made:
                if b.device.type == "meta":
                    t = torch.full(b.shape, float("nan"), dtype=b.dtype) if b.is_floating_point() \
                        else torch.zeros(b.shape, dtype=b.dtype)
                else:
                    t = b.detach().clone()
                made[id(b)] = t
                if id(b) in bnames:
                    buffers[bnames[id(b)]] = (t, t._version)
            return made[id(b)]

        def shell(module):
            if id(module) in modules:
                return modules[id(module)]
            s = copy.copy(module)
            modules[id(module)] = s
            s.__dict__.pop("_is_hf_initialized", None)
            s._parameters = {n: None if p is None else made.setdefault(id(p), make_param(names[id(p)], p))
                             for n, p in module._parameters.items()}
            s._buffers = {n: None if b is None else stand_in_buffer(b) for n, b in module._buffers.items()}
            s._modules = {n: None if c is None else shell(c) for n, c in module._modules.items()}
            return s
        root = shell(self.model)
        params = {n: made[id(p)] for n, p in self.model.named_parameters()}
        return root, params, buffers

    def _run_init(self, root: torch.nn.Module, ctx: _Context, on_error) -> None:
        """Steps 1 and 2 of the module docstring over the shell `root`."""
        with torch.no_grad():
            for path, module in reversed(list(root.named_modules())):
                if callable(getattr(type(module), "reset_parameters", None)):
                    ctx.phase = f"{type(module).__name__}.reset_parameters"
                    try:
                        module.reset_parameters()
                    except NotRecordable as e:
                        on_error(module, e)
            label = model_init_name(self.model)
            if label is None:
                return
            ctx.phase = label
            try:
                if _is_pretrained(self.model):
                    root.initialize_weights()
                else:
                    root.init_weights()
            except NotRecordable as e:
                raise ParallelizeError(
                    f"{label} cannot be run on the meta model's parameters shard by shard ({e}); build the model on "
                    "the CPU, or give it an init of elementwise writes (torch.nn.init's)") from e

    def _record(self) -> None:
        ctx = _Context()

        def poison(module, e):
            for p in module._parameters.values():
                if isinstance(p, _Recorder):
                    p.poisoned = p.poisoned or str(e)
        root, params, buffers = self._shell(lambda name, p: _Recorder(p.shape, p.dtype, ctx))
        self._run_init(root, ctx, poison)
        self._ops = {}
        for name, r in params.items():
            if r.poisoned:
                self.whole[name] = r.poisoned
                self.init_of[name] = f"{r.ops[-1][4] if r.ops else 'its init'}: made whole ({r.poisoned})"
                self._ops[name] = None
                continue
            if not r.ops:
                ctx.phase = "no init of its own: fxtron's default"
                _default_init(name, r)
                self.defaulted.append(name)
            self._ops[name] = _live(r.ops)
            self.init_of[name] = f"{self._ops[name][-1][4]}: {describe(self._ops[name])}"
        for name, (t, version) in buffers.items():
            owner = root.get_submodule(name.rsplit(".", 1)[0]) if "." in name else root
            now = owner._buffers.get(name.rsplit(".", 1)[-1])
            if self.model.get_buffer(name).device.type != "meta":
                continue
            if now is not t or t._version != version:
                self.buffers[name] = now.detach().clone() if isinstance(now, torch.Tensor) else t
            else:
                self.uncomputed.append(name)

    def _ensure(self) -> None:
        if self._ops is None:
            self._record()

    def buffer(self, name: str) -> torch.Tensor:
        """The value of meta buffer `name` as the model's init computes it."""
        self._ensure()
        if name not in self.buffers:
            b = self.model.get_buffer(name)
            raise ParallelizeError(
                f"buffer {name} {tuple(b.shape)} is on the meta device and no initialization computes it (neither a "
                "module's reset_parameters() nor the model's init_weights()/_init_weights); compute it in one of them "
                "(a rotary table: see fxtron.models.Llama.init_weights), or create the buffer on the CPU when building "
                "the model on meta (buffers are small)")
        return self.buffers[name]

    # ------------------------------------------------------------------ values
    def local(self, name: str, shards, sizes, coords) -> torch.Tensor:
        """This rank's piece of parameter `name` (layout of `shards`: core.params.AxisShard in
        order, at mesh `sizes` and `coords`), a new tensor made without the whole."""
        self._ensure()
        ops = self._ops[name]
        param = self.model.get_parameter(name)
        shape, dtype = tuple(param.shape), param.dtype
        if ops is None:                              # made whole, then sliced
            out = self._whole(name)
            for s in shards:
                out = layout.shard(out, s.dim, sizes[s.axis], coords[s.axis], s.interleave, s.whole)
            return out.clone()
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
                            self._generator(name, b // rows), b)
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
        """The parameters whose init could not be recorded, made whole by a second run of the
        initialization on the CPU (the others stay recorders) under a seed of (seed)."""
        if self._whole_values is None:
            ctx = _Context()
            real = set(self.whole)
            root, params, _ = self._shell(lambda n, p: torch.empty(p.shape, dtype=p.dtype) if n in real
                                          else _Recorder(p.shape, p.dtype, ctx))
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed((self.seed * 1_000_003 + 17) % 2**63)

                def fail(module, e):
                    raise ParallelizeError(f"{type(module).__name__}.reset_parameters fails on the CPU too: {e}") from e
                self._run_init(root, ctx, fail)
            self._whole_values = {n: params[n] for n in real}
        return self._whole_values[name]


def meta_replica(model: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The model's structure on the meta device (floating parameters and buffers in `dtype`
    when given): deepcopy with every tensor pre-mapped in the memo, so no data is copied (tied
    weights stay tied: one id, one replica)."""
    memo: dict[int, torch.Tensor] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in memo:
            e = torch.empty_like(t, device="meta", dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype)
            memo[id(t)] = torch.nn.Parameter(e, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else e
    return copy.deepcopy(model, memo)


__all__ = ["BLOCK", "MetaMaterializer", "meta_replica", "NotRecordable", "describe", "model_init_name"]
