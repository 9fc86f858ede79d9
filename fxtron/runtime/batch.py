"""Runtime: a rank's share of a global batch -- the data-parallel slice of every input along its
batch dim, cut into microbatches, checked against the traced input structure and moved to the
rank's device."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from fxtron.core.meta import SEQ, TraceInfo
from fxtron.errors import ParallelizeError, warn_or_raise
from fxtron.ops import transport
from fxtron.ops.statistics import BatchContext
from fxtron.ops.cp.layout import document_positions, positions


def _take_rows(x: torch.Tensor, dims: tuple, pick: torch.Tensor) -> torch.Tensor:
    """x's tokens at `pick` (B, n): row b's positions pick[b] along x's sequence dim."""
    d, b = dims.index("seq"), dims.index("batch")
    shape = [1] * x.dim()
    shape[b], shape[d] = pick.shape
    idx = (pick if b < d else pick.t()).reshape(shape)
    return torch.take_along_dim(x, idx.to(x.device), dim=d)


def dp_share(x: torch.Tensor, dim: int, dp: int, index: int) -> torch.Tensor:
    """Data-parallel rank `index`'s share of the global batch `x` along `dim`: its contiguous
    1/dp of the samples."""
    return x.chunk(dp, dim=dim)[index]


def microbatch_pieces(x: torch.Tensor, dim: int, m: int) -> tuple[torch.Tensor, ...]:
    """A rank's batch `x` cut into its `m` microbatches along `dim`."""
    return x.chunk(m, dim=dim)


def split_batch(x: torch.Tensor, dp: int, m: int, dim: int = 0) -> list[list[torch.Tensor]]:
    """The global batch `x`'s dp x m pieces along `dim`: [r][i] is data-parallel rank r's
    microbatch i, as BatchSlicer cuts it for that rank (the one-process reference trains the
    same pieces)."""
    return [list(microbatch_pieces(dp_share(x, dim, dp, r), dim, m)) for r in range(dp)]


class Microbatches(list):
    """A global batch given as its microbatches: a list of (args, kwargs) pairs, one per
    microbatch, each with the whole batch dim for data parallel to split. Microbatches may
    differ in sequence length; the loss is the mean of their losses."""


def sequence_unit(cp: int, seq_split: int) -> int:
    """What a sequence's length must be a multiple of: 2 x cp chunks under context parallel (two
    a rank, load-balanced), each cp rank's tokens in `seq_split` (tp under sequence parallel) parts."""
    return math.lcm(2 * cp if cp > 1 else 1, cp * seq_split)


class BatchSlicer:
    """Slices global batches for one rank: `dp` data-parallel ranks of which this is `dp_index`,
    `cp` context-parallel ranks of which this is `cp_index` (each input's sequence dim split
    load-balanced: chunks cp_index and 2cp-1-cp_index of 2cp, Megatron's
    get_batch_on_this_cp_rank; with the trace's `documents`, each row reordered by its documents
    first, Megatron's THD), `microbatches` per step, inputs moved to `device`;
    `seq_split`: the parts each rank's tokens are cut into in the graph (tp under sequence
    parallel), checked with the sequence at the step's entry, as is `max_seq` (the longest
    sequence the model takes, and why)."""

    def __init__(self, info: TraceInfo, *, dp: int, dp_index: int, microbatches: int, device: torch.device | None,
                 cp: int = 1, cp_index: int = 0, seq_split: int = 1, max_seq: tuple[int | None, str] = (None, ""),
                 strict: bool = False, buffer=None):
        self.info, self.dp, self.dp_index, self.m, self.device = info, dp, dp_index, microbatches, device
        # name -> the buffer as the rank's graphs read it, None where the rank holds none of that
        # name (another pipeline stage's): what an input statistic reads besides the batch
        self.buffer = buffer
        self.strict = strict
        self._outside: set = set()     # the (symbol, side) of the narrowed ranges a step was warned of
        self.cp, self.cp_index, self.seq_split = cp, cp_index, seq_split
        self.max_seq, self.max_seq_why = max_seq
        self._checked = None     # the inputs' (shape, dtype)s that passed check_inputs last

    def flat(self, inputs: tuple, kwargs: dict | None) -> list:
        """The tensor leaves of (inputs, kwargs), checked against the traced structure."""
        if not isinstance(inputs, (tuple, list)) or not isinstance(kwargs or {}, dict):
            got = (f"inputs as {type(inputs).__name__}" if not isinstance(inputs, (tuple, list)) else
                   f"kwargs as {type(kwargs).__name__}")
            raise ParallelizeError(f"the step takes its positional inputs as a tuple and its keyword inputs as a dict "
                                   f"(kwargs=...), as example_inputs and example_kwargs; got {got}"
                                   + ("; pass (x,) for one input" if isinstance(inputs, torch.Tensor) else "")
                                   + ("; pass keyword inputs as kwargs={...}" if isinstance(inputs, dict) else ""))
        flat, spec = pytree.tree_flatten((tuple(inputs), dict(kwargs or {})))
        if spec != self.info.in_spec:
            raise ParallelizeError(f"inputs are {_structure(spec)}, but the model was traced with "
                                   f"{_structure(self.info.in_spec)}; pass the same positional and keyword inputs as "
                                   "example_inputs and example_kwargs")
        for i, (x, traced) in enumerate(zip(flat, self.info.statics)):
            tensor = isinstance(x, torch.Tensor)
            if (traced is None) != tensor or (traced is not None and _differs(x, traced)):
                raise ParallelizeError(_static_changed(i, x, traced, self.info.in_spec))
        return [x for x in flat if isinstance(x, torch.Tensor)]

    def local(self, inputs: tuple, kwargs: dict | None = None) -> tuple[tuple, dict]:
        """This rank's data-parallel slice of a global batch (dim 'batch' of every input), on
        the rank's device (a batch from a CPU data loader moves to the rank's GPU here)."""
        flat = self.flat(inputs, kwargs)
        self.check_devices(flat)
        self.check_inputs(flat)
        self.check_sequence(flat)
        self.check_ranges(flat)
        if self.dp == 1 and self.cp == 1:
            return self.on_device(tuple(inputs), dict(kwargs or {}))
        out = []
        pick = None
        if self.cp > 1 and self.info.documents is not None:     # (B, S/cp): THD, each row by its documents
            pick = document_positions(flat[self.info.documents], self.cp, self.cp_index)
        for i, (x, dims) in enumerate(zip(flat, self.info.user_dims)):
            if self.cp > 1 and "seq" in dims:
                d = dims.index("seq")
                if pick is None:
                    x = x.index_select(d, positions(x.shape[d], self.cp, self.cp_index).to(x.device))
                else:
                    x = _take_rows(x, dims, pick)
            if self.dp > 1 and isinstance(x, torch.Tensor) and "batch" in dims and not self.broadcast(i, x):
                d = dims.index("batch")
                if x.shape[d] % self.dp:
                    raise ParallelizeError(f"global batch {x.shape[d]} (dim {d} of an input of shape "
                                           f"{tuple(x.shape)}) is not divisible by dp={self.dp}; use a batch "
                                           f"that is a multiple of {self.dp}")
                x = dp_share(x, d, self.dp, self.dp_index)
            out.append(x)
        it = iter(out)
        leaves = [next(it) if s is None else s for s in self.info.statics]
        args, kw = pytree.tree_unflatten(leaves, self.info.in_spec)
        return self.on_device(args, kw)

    def broadcast(self, i: int, x: torch.Tensor) -> bool:
        """Whether input `i` is whole on every rank although it has a dim at batch_dim: that dim
        was 1 in the trace, where other inputs had the batch (transformers' position_ids of shape
        (1, S)), and is 1 now; or the trace found it is not the batch but the sequence (a (S, S)
        attention mask given as an input: torch.export equates its first dim with S). Each
        rank's slice of the batch uses it as the whole batch does: it is not split."""
        sig = self.info.signature[i] if i < len(self.info.signature) else None
        dims = self.info.user_dims[i]
        if sig is None or "batch" not in dims:
            return False
        d = dims.index("batch")
        return (sig[1][d] == 1 and x.shape[d] == 1) or sig[1][d] == SEQ

    def check_inputs(self, flat: list) -> None:
        """Raise ParallelizeError, before anything runs, for inputs the traced program cannot
        take: another number of dims or dtype than traced, a static dim of another size, batch
        (or sequence) dims that disagree between inputs, or token ids outside the table or
        classes they index (passes/limits.py; split over tp, a vocab-parallel lookup would read
        zeros for them without a word). The shapes and dtypes that passed last are remembered
        (a training loop's batches repeat them); the ids are checked every batch, by one
        reduction each where all are in range."""
        seen = tuple((x.shape, x.dtype) if want is not None else None for x, want in zip(flat, self.info.signature))
        if seen != self._checked:
            self._check_shapes(flat)
            self._checked = seen
        for r in self.info.token_ranges:
            x = flat[r.index]
            if x.numel() == 0:
                continue
            lo, hi = torch.stack(torch.aminmax(x)).tolist()   # (one host read; a NaN takes the full check)
            if lo >= 0 and hi < r.classes:
                continue
            bad = (x < 0) | (x >= r.classes)
            if r.ignore is not None:
                bad &= x != r.ignore
            if bool(bad.any()):
                where = tuple(int(v) for v in bad.nonzero()[0])
                ok = f"[0, {r.classes})" + (f" or {r.ignore} (ignored)" if r.ignore is not None else "")
                raise ParallelizeError(f"input {r.index} of shape {tuple(x.shape)} holds the id {int(x[where])} at "
                                       f"{where}: {r.why}, so its ids must be in {ok}")

    def _check_shapes(self, flat: list) -> None:
        bound: dict = {}
        for i, (x, want) in enumerate(zip(flat, self.info.signature)):
            if want is None:
                continue
            dtype, shape = want
            what = f"input {i} of shape {tuple(x.shape)}"

            def traced() -> str:
                return "(" + ", ".join(str(d) for d in shape) + ")"
            if x.dim() != len(shape):
                raise ParallelizeError(f"{what} has {x.dim()} dims, but the model was traced with {len(shape)}: "
                                       f"{traced()} {dtype}; pass inputs shaped like example_inputs")
            if x.dtype != dtype:
                raise ParallelizeError(f"{what} is {x.dtype}, but the model was traced with {dtype} there; "
                                       f"pass {dtype} (x.to({dtype}))")
            for d, (n, e) in enumerate(zip(x.shape, shape)):
                if e.is_Integer and n != int(e):
                    role = self.info.user_dims[i][d] if d < len(self.info.user_dims[i]) else None
                    if role in ("batch", "seq"):
                        size = "batch size" if role == "batch" else "sequence length"
                        raise ParallelizeError(
                            f"dim {d} of {what} is {n}, but the trace fixed the {size} at the example's {int(e)} "
                            f"{traced()}: the model's code reads it as a Python number or equates it with a constant "
                            f"(a loop over the {'rows' if role == 'batch' else 'positions'}, float(x.shape[{d}]), a "
                            f"buffer of that size), so the program takes only {int(e)}; pass {int(e)}, or trace with an "
                            f"example of the {size} you train with")
                    raise ParallelizeError(f"dim {d} of {what} is {n}, but {int(e)} in the traced model {traced()}: "
                                           "only the batch and sequence dims may change between steps")
                if e.is_Symbol:
                    if bound.setdefault(e, (n, i, d))[0] != n:
                        m, j, dj = bound[e]
                        raise ParallelizeError(
                            f"dim {d} of {what} is {n}, but dim {dj} of input {j} is {m}: the traced model has {e} "
                            f"in both places (the {'batch' if str(e) == 'B' else 'sequence' if str(e) == 'S' else 'same size'}); "
                            "give every input the same one")

    def check_sequence(self, flat: list) -> None:
        """Raise ParallelizeError, before anything runs, for a sequence the ranks cannot split:
        under cp its length must be a multiple of 2 x cp (two chunks a rank), and under
        sequence parallel each rank's tokens must divide into tp parts."""
        cp_unit = 2 * self.cp if self.cp > 1 else 1
        unit = sequence_unit(self.cp, self.seq_split)
        for x, dims in zip(flat, self.info.user_dims):
            if "seq" not in dims:
                continue
            n = x.shape[dims.index("seq")]
            if self.max_seq is not None and n > self.max_seq:
                raise ParallelizeError(
                    f"a sequence of {n} tokens (dim {dims.index('seq')} of an input of shape {tuple(x.shape)}) is longer "
                    f"than the model takes: {self.max_seq_why}; use at most {self.max_seq} tokens (or a model "
                    f"built for longer sequences)")
            if n % unit:
                lower, upper = n // unit * unit, (n // unit + 1) * unit
                near = f"{lower} or {upper}" if lower else f"{upper}"
                why = []
                if self.cp > 1:
                    why.append(f"context parallel cuts it into 2 x cp = {cp_unit} equal chunks (load balancing)")
                if self.seq_split > 1:
                    why.append(f"sequence parallel cuts {'each cp rank' + chr(39) + 's' if self.cp > 1 else 'its'} "
                               f"tokens into tp = {self.seq_split} parts")
                raise ParallelizeError(
                    f"a sequence of {n} tokens (dim {dims.index('seq')} of an input of shape {tuple(x.shape)}) cannot "
                    f"be split over this mesh: {' and '.join(why)}, so its length must be a multiple of {unit}; "
                    f"the nearest are {near} (pad the sequence, e.g. with ignore_index labels)")

    def check_ranges(self, flat: list) -> None:
        """A batch or sequence size outside the range the trace narrowed (TraceInfo.ranges): the
        model's code branched on it and torch.export guarded the branch the example took, which
        is the one the program holds. Where the other branch computes another thing (a long-
        context path) the step would compute the traced one; where it computes the same (a
        sliding-window mask built one way or another, transformers' Mistral and Gemma) it is
        right. fxtron cannot tell which: a ParallelizeWarning, once per side of each range
        (strict: a ParallelizeError)."""
        if not self.info.ranges:
            return
        for i, (x, sig) in enumerate(zip(flat, self.info.signature)):
            if sig is None:
                continue
            for d, (size, expr) in enumerate(zip(x.shape, sig[1])):
                lo, hi = self.info.ranges.get(expr, (0, None))
                if lo <= size and (hi is None or size <= hi):
                    continue
                side = (str(expr), size < lo)
                if side in self._outside and not self.strict:
                    continue
                self._outside.add(side)
                what = {"B": "batch", "S": "sequence"}.get(str(expr), str(expr))
                span = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
                warn_or_raise(
                    f"dim {d} of input {i} of shape {tuple(x.shape)} is {size}, but the program holds the model "
                    f"traced for a {what} length {span}: the model's code branches on that length (torch.export "
                    f"guarded {expr} {span} on the example), and the program computes the branch the example "
                    f"took, which is the model's own at {size} only where both branches compute the same",
                    strict=self.strict,
                    fix=f"; step with a {what} length {span}, or parallelize with an example of length {size}",
                    advice=f"; parallelize with an example of length {size} (or strict=True) to be sure",
                    stacklevel=4)

    def check_devices(self, flat: list) -> None:
        """ParallelizeError for an input without data (meta) or, for a CPU program, on another
        device: the program does not move a GPU batch back to the CPU."""
        cpu = self.device is None or self.device.type == "cpu"
        away = next((x for x in flat if x.device.type == "meta" or (cpu and x.device.type != "cpu")), None)
        if away is not None:
            raise ParallelizeError(f"an input of shape {tuple(away.shape)} is on {away.device}, but this program "
                                   f"runs on the {'CPU' if cpu else self.device} (its parameters are there); pass "
                                   f"{'CPU tensors' if cpu else 'tensors with data'}, or build the program on that "
                                   f"device (parallelize(..., device=...) and a mesh launched with its backend)")

    def on_device(self, args: tuple, kw: dict) -> tuple[tuple, dict]:
        device = self.device
        if device is None or device.type == "cpu":
            return args, kw

        def move(x):
            return x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) and x.device != device else x
        return pytree.tree_map(move, (args, kw))

    def context(self, inputs, kwargs: dict | None = None, statistics: dict | None = None,
                microbatches: int | None = None) -> BatchContext:
        """The step's view of the global batch (ops/statistics.py): its pieces (dp x microbatches)
        and every input statistic of the trace (passes/statistics.py) summed over the global
        batch -- every rank has all of it -- and divided by the pieces, on the rank's device.
        `statistics`: those of the graph the step runs where it is not the training graph (the
        eval-mode graph's: its statistics are its own, keyed by its own nodes' names).
        `microbatches`: the step's count where it is not the program's (an evaluation's,
        `fitting_microbatches`)."""
        pieces = self.dp * (self.m if microbatches is None else microbatches)
        values = {}
        statistics = self.info.statistics if statistics is None else statistics
        if statistics:
            items = list(inputs) if isinstance(inputs, Microbatches) else [(inputs, kwargs)]
            flats = [self.flat(a, kw) for a, kw in items]
            for key, stat in statistics.items():
                buffers = self._statistic_buffers(stat)
                if buffers is None:
                    continue      # a statistic of another pipeline stage's buffers: that stage's
                total = sum(stat.value(flat, self.info.user_dims, buffers) for flat in flats)
                values[key] = total / pieces
                if self.device is not None and self.device.type != "cpu":
                    values[key] = values[key].to(self.device, non_blocking=True)
        return BatchContext(pieces, values)

    def _statistic_buffers(self, stat) -> list[torch.Tensor] | None:
        """The buffers input statistic `stat` reads (class weights), as the step's graph reads
        them; None where this rank holds them not (a pipeline stage without its loss)."""
        out = []
        for name, shape in stat.buffers:
            b = self.buffer(name) if self.buffer is not None else None
            if b is None:
                return None
            if tuple(b.shape) != shape:
                raise ParallelizeError(
                    f"the global batch's statistic {stat.what} reads buffer {name}, which this rank holds as a "
                    f"{tuple(b.shape)} piece of {shape}: fxtron computes such a statistic from the whole buffer "
                    f"only. Keep the buffer whole (a plan that leaves its module unsplit), or run with "
                    f"data_parallel=1 and microbatches=1, where no statistic is made global")
            out.append(b)
        return out

    def fitting_microbatches(self, inputs, kwargs: dict | None = None) -> int:
        """The most microbatches, up to the program's, into which this rank's share of the
        global batch divides: an evaluation on one stage needs no fixed count (a batch of 2 at
        dp=2 under microbatches=2 evaluates as one microbatch a rank)."""
        if isinstance(inputs, Microbatches):
            return self.m
        flat = self.flat(inputs, kwargs)
        sizes = [x.shape[dims.index("batch")] // self.dp for i, (x, dims) in enumerate(zip(flat, self.info.user_dims))
                 if "batch" in dims and not self.broadcast(i, x)]
        if not sizes or sizes[0] < 1:
            return self.m
        return max(k for k in range(1, self.m + 1) if sizes[0] % k == 0)

    def microbatches(self, inputs, kwargs: dict | None = None, m: int | None = None) -> list[list[torch.Tensor]]:
        """This rank's microbatches of a global batch: flat tensor inputs of each (`m` of them:
        the program's count unless given)."""
        m = self.m if m is None else m
        if isinstance(inputs, Microbatches):
            if len(inputs) != m:
                raise ParallelizeError(f"{len(inputs)} microbatches given, but the program was compiled for "
                                       f"microbatches={m}")
            return [self.flat(*self.local(a, kw)) for a, kw in inputs]
        flat = self.flat(*self.local(inputs, kwargs))
        out = [[] for _ in range(m)]
        for i, (x, dims) in enumerate(zip(flat, self.info.user_dims)):
            if "batch" in dims and not self.broadcast(i, x):
                d = dims.index("batch")
                if x.shape[d] % m:
                    raise ParallelizeError(
                        f"this rank's batch of {x.shape[d]} samples (dim {d} of an input of shape {tuple(x.shape)}, "
                        f"after the data-parallel split) does not divide into microbatches={m}; use a global batch "
                        f"that is a multiple of dp x microbatches = {self.dp * m}")
                pieces = microbatch_pieces(x, d, m)
            else:
                pieces = [x] * m
            for i in range(m):
                out[i].append(pieces[i])
        return out


def _differs(value, traced) -> bool:
    """Whether a non-tensor input differs from the value it was traced with (a NaN is itself)."""
    if value is traced or (isinstance(value, float) and isinstance(traced, float) and value != value and traced != traced):
        return False
    try:
        return bool(value != traced)
    except Exception:  # noqa: BLE001 - a value that cannot be compared: not the traced one
        return value is not traced


def _static_changed(index: int, value, traced, spec) -> str:
    """Why input leaf `index` cannot be taken: a Python value that differs from the one the model
    was traced with (torch.export made it a constant of the graph), or a tensor where the trace
    had a Python value, or the reverse."""
    try:
        args, kwargs = pytree.tree_unflatten(list(range(spec.num_leaves)), spec)
        paths = {leaf: f"positional input {i}" for i, a in enumerate(args) for leaf in pytree.tree_leaves(a)}
        paths.update({leaf: f"keyword {k}" for k, v in kwargs.items() for leaf in pytree.tree_leaves(v)})
        where = paths.get(index, f"input leaf {index}")
    except (TypeError, ValueError):
        where = f"input leaf {index}"
    if traced is None:
        return (f"{where} is {type(value).__name__} {value!r}, but the model was traced with a tensor there; pass a "
                "tensor, as example_inputs / example_kwargs did")
    if isinstance(value, torch.Tensor):
        return (f"{where} is a tensor, but the model was traced with the Python value {traced!r} there, which the "
                "trace made a constant of the program; pass the same kind of value as example_inputs / "
                "example_kwargs did (a tensor in both, to let it change between steps)")
    why = (f"{where} is {value!r}, but the model was traced with {traced!r}: torch.export makes a Python value (an "
           f"int, float, bool or string) a constant of the program, which would compute with {traced!r} and ignore "
           f"{value!r}; ")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return why + (f"where the model computes with it as a number, pass it as a tensor (torch.tensor({value!r})) "
                      "in example_inputs / example_kwargs and at every step, so that it may change; else parallelize "
                      f"the model again with {value!r} in its example inputs")
    return why + f"parallelize the model again with {value!r} in its example inputs for the steps that pass it"


def _structure(spec) -> str:
    """A (positional, keyword) inputs' pytree spec in words: '2 positional inputs and the
    keywords labels, mask' (where an input is a container, the structure as Python writes it)."""
    try:
        args, kwargs = pytree.tree_unflatten(list(range(spec.num_leaves)), spec)
    except (TypeError, ValueError):
        return str(spec)
    out = f"{len(args)} positional input{'s' * (len(args) != 1)}"
    if any(isinstance(a, (tuple, list, dict)) for a in args):
        out += f" {tuple(args)}"
    return out + (f" and the keywords {', '.join(map(str, kwargs))}" if kwargs else " and no keywords")


def tensors_of(obj) -> list[torch.Tensor]:
    """The tensors of a batch: (inputs, kwargs), a Microbatches list (which torch's pytree takes
    for one leaf, a list subclass), nested tuples, lists, dicts."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_of(v)]
    if isinstance(obj, (tuple, list)):
        return [t for v in obj for t in tensors_of(v)]
    return []


def fingerprint(batch) -> torch.Tensor:
    """Two int64s of a batch's tensors: their shapes', and their contents' (each element's bits
    times a weight of its place, summed with wrap-around: exact and the same in any summation
    order, so equal batches give equal prints on any device)."""
    shapes, contents = 0, 0
    for i, t in enumerate(tensors_of(batch)):
        for d in (*t.shape, t.dim(), t.element_size()):
            shapes = (shapes * 1_000_003 + d + i) % (1 << 61)
        if t.device.type == "meta":
            continue                       # (no contents: the step's own check refuses it)
        flat = t.detach().reshape(-1)
        if flat.is_floating_point() or flat.is_complex():
            flat = flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64,
                              16: torch.int64}[flat.element_size()])
        elif flat.dtype == torch.bool:
            flat = flat.to(torch.uint8)
        weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64) % 65521 + 1 + i
        contents += int((flat.to(torch.int64) * weights).sum())
    return torch.tensor([shapes, (contents + (1 << 63)) % (1 << 64) - (1 << 63)], dtype=torch.int64)


def check_same_batch(groups, batch) -> None:
    """ParallelizeError on every rank, naming the groups, where the ranks were not given the
    same global batch: fxtron takes each rank's piece of it (dp, cp) or all of it (tp, pp), so
    per-rank batches (a DistributedSampler's habit) would train on pieces of several -- a loss
    that is no batch's, silently. One all-reduce of four int64s per group this rank is in (the
    mesh's groups connect every rank, so agreeing in each is agreeing in all)."""
    mine = fingerprint(batch)
    differ = []
    for kind, ranks, pg in groups.distinct():
        if len(ranks) == 1:
            continue
        both = torch.cat([mine, -mine]).to(groups.device)
        transport.all_reduce(both, pg, op=dist.ReduceOp.MAX)     # (recorded and order-checked, as fxtron's own)
        if not torch.equal(both[:2].cpu(), -both[2:].cpu()):
            differ.append(f"{kind} (ranks {', '.join(map(str, ranks))})")
    if differ:
        raise ParallelizeError(
            f"the ranks of group{'s' * (len(differ) > 1)} {'; '.join(differ)} were given different batches: every rank "
            "passes the same global batch to train_step / eval_step, and fxtron takes each rank's piece of it (not a "
            "DistributedSampler's batch per rank, which would train on pieces of several, a loss that is no batch's); "
            "load the global batch on every rank, with the same seed")


__all__ = ["BatchSlicer", "Microbatches", "check_same_batch", "dp_share", "fingerprint", "microbatch_pieces",
           "sequence_unit", "split_batch", "tensors_of"]
