"""Runtime, optimizer step: the checks on the optimizer(s) a program is given, and its step --
skipped when the global gradient norm is not finite (`prog.skip_nonfinite`), under fp16 after
the loss scaler (runtime/precision.py) unscales and checks the gradients, through the
distributed optimizer (runtime/zero.py) under zero=1/2.

Where an optimizer steps. One whose update of an element reads only that element's gradient,
value and state (`ELEMENTWISE`: SGD, Adam, AdamW, ...) steps the rank's pieces as they are --
a tp shard, a zero=1/2 shard of the flat buffer, a zero=3 flat piece -- and equals the step
of the whole model. Any other (`torch.optim.Adafactor`: a factored second moment and a step
relative to the parameter's RMS; `torch.optim.Muon`: an orthogonalized matrix; any class not
known here, subclasses of the elementwise ones included) steps whole matrices: each
parameter's gradient and value are gathered from the ranks that hold its pieces (over the
axes it is split on and over its data-parallel group), one of those ranks -- its owner,
spread over them by size -- steps the whole tensor with a private optimizer of the user's
class and hyperparameters (copied from the user's groups before every step: a schedule's lr
is followed), and the new value is broadcast back, each rank keeping its piece. Its state
lives on the owner alone. `LBFGS` (a closure, all parameters one vector) is refused.
"""
from __future__ import annotations

import inspect
import math

import torch
import torch.distributed as dist

from fxtron.errors import ParallelizeError, warn_or_raise
from fxtron.ops import ledger

#: the torch optimizers whose update of each element reads only that element (its gradient, its
#: value, its state) and scalars of the step: they step the rank's pieces of a parameter exactly
#: as the whole one (Adam's amsgrad, NAdam's and RAdam's per-step scalars, ASGD's averages
#: included). Exact classes: a subclass may change the update.
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
               torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop,
               torch.optim.Rprop, torch.optim.ASGD)

#: optimizers fxtron cannot place, and why
REFUSED = {torch.optim.LBFGS: "its step re-evaluates the model through a closure and treats every parameter "
                              "as one flat vector (line search over all of them), which no per-rank step reproduces"}


def optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers of a train_step: one, or a list or tuple of them (Muon's 2-d weights and
    AdamW's others, say)."""
    return list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]


def elementwise(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` steps the rank's pieces as they are (module docstring)."""
    return type(optimizer) in ELEMENTWISE


def mode(optimizer: torch.optim.Optimizer) -> str:
    """A line: how fxtron steps `optimizer`."""
    name = type(optimizer).__name__
    if elementwise(optimizer):
        return f"{name}: elementwise, each rank steps its own pieces"
    return f"{name}: whole matrices, each parameter gathered to an owner rank that steps it and sends it back"


def zero_grad(optimizer) -> None:
    """Every optimizer's zero_grad(set_to_none=True)."""
    for o in optimizers(optimizer):
        o.zero_grad(set_to_none=True)


def held_state(prog, optimizer) -> list[dict]:
    """The per-parameter state dicts this rank holds for `optimizer` (one or a list) as fxtron
    steps it: the distributed optimizer's shards' under zero=1/2, a whole-matrix optimizer's
    owned tensors', else the optimizer's own."""
    out = []
    made = prog.__dict__.get("_whole_matrices", {})
    for o in optimizers(optimizer):
        if not elementwise(o):
            entry = made.get(id(o))
            out += list(entry.inner.state.values()) if entry is not None and entry.template is o else []
        elif prog.zero is not None and prog.zero._template is o and prog.zero.optimizer is not None:
            out += list(prog.zero.optimizer.state.values())
        else:
            out += list(o.state.values())
    return out


def check_frozen(prog) -> None:
    """ParallelizeError where a parameter's requires_grad differs from the model's when the
    program was built (`prog.frozen`): which parameters take gradients is compiled into the
    program's gradient buffers, so it is set on the model before parallelize."""
    changed = [n for n, p in prog.param_items() if (not p.requires_grad) != (n in prog.frozen)]
    if changed:
        raise ParallelizeError(
            f"requires_grad of {len(changed)} parameter(s) changed after the program was built ({changed[0]}: now "
            f"{dict(prog.named_parameters())[changed[0]].requires_grad}): freeze or unfreeze them on the model "
            "before fxtron.parallelize and build the program again")


def check_optimizer(prog, optimizer) -> None:
    """ParallelizeError for an optimizer that would not train `prog`: not an optimizer, one
    fxtron cannot place (REFUSED), holding tensors that are not its parameters (the original
    model's, whose gradients the step never fills), or -- for several -- sharing a parameter.
    Raised before anything of the step runs; so is a parameter frozen or unfrozen after the
    program was built (check_frozen)."""
    check_frozen(prog)
    opts = optimizers(optimizer)
    if not opts or not all(isinstance(o, torch.optim.Optimizer) for o in opts):
        bad = next((o for o in opts if not isinstance(o, torch.optim.Optimizer)), None)
        raise ParallelizeError(f"train_step needs a torch.optim.Optimizer over prog.parameters() (or a list of "
                               f"them), got {type(bad).__name__ if opts else 'an empty list'}")
    mine = {id(p) for _, p in prog.param_items()}
    seen: dict[int, str] = {}
    for o in opts:
        for cls, why in REFUSED.items():
            if isinstance(o, cls):
                raise ParallelizeError(f"fxtron cannot step {type(o).__module__}.{type(o).__name__}: {why}; use an "
                                       "optimizer without a closure (AdamW, Adafactor, Muon, ...)")
        foreign = [tuple(p.shape) for g in o.param_groups for p in g["params"] if id(p) not in mine]
        if foreign:
            raise ParallelizeError(
                f"the optimizer holds {len(foreign)} tensor(s) that are not this program's parameters (the first "
                f"of shape {foreign[0]}): build it over prog.parameters() -- the rank's shards -- not over the "
                "original model's")
        for g in o.param_groups:
            for p in g["params"]:
                if id(p) in seen and seen[id(p)] is not o:
                    raise ParallelizeError(f"a parameter is in two optimizers ({type(seen[id(p)]).__name__} and "
                                           f"{type(o).__name__}): each parameter belongs to one")
                seen[id(p)] = o
    if prog.data_parallel.zero == 3 and any(len(prog.original_shape(n)) > 1 for n, _ in prog.param_items()):
        empty = [(type(o).__name__, i) for o in opts for i, g in enumerate(o.param_groups) if not g["params"]]
        if empty:
            warn_or_raise(
                f"zero=3: param group {empty[0][1]} of {empty[0][0]} is empty, and every parameter is a flat 1-d "
                "piece of its unit: a grouping by p.dim() or p.ndim (no weight decay on 1-d parameters) finds no "
                "matrix and puts every parameter in the 1-d group", strict=prog.config.debug.strict,
                fix="; group by len(prog.original_shape(name)), the shape in the model",
                advice=" (group by len(prog.original_shape(name)), the shape in the model)", stacklevel=3)
    if prog.zero is not None and sum(elementwise(o) for o in opts) > 1:
        raise ParallelizeError(
            f"under zero={prog.data_parallel.zero} fxtron shards one elementwise optimizer over data parallel, got "
            f"{', '.join(type(o).__name__ for o in opts if elementwise(o))}: make them one optimizer with param "
            "groups")


def rebuild(template: torch.optim.Optimizer, groups: list[dict]) -> torch.optim.Optimizer:
    """An optimizer of `template`'s class over `groups` (each with every hyperparameter), built
    with the template's constructor settings: its `defaults`, which torch's optimizers fill from
    every constructor argument (a user's class from those it passes to Optimizer.__init__),
    those its constructor takes. Some settings act only in the constructor (Adagrad's
    initial_accumulator_value fills its state there), and a class may require them (an `lr`
    without a default)."""
    cls = type(template)
    try:
        takes = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):         # (a constructor without a signature Python can read)
        takes = {}
    anything = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in takes.values())
    kwargs = {k: v for k, v in template.defaults.items() if k != "params" and (anything or k in takes)}
    return cls(groups, **kwargs)


def build_optimizer(prog, cls: type, params, **kwargs) -> torch.optim.Optimizer:
    """`cls(params, **kwargs)` over `prog`'s parameters, its constructor's checks made on the
    shapes the parameters have in the model (`prog.original_shape`), not on the rank's pieces:
    torch.optim.Muon, which takes only 2-d parameters, over a zero=3 program's flat pieces.
    `params`: parameters of prog, or param groups of them."""
    groups = list(params)
    groups = [dict(g) for g in groups] if groups and isinstance(groups[0], dict) else [{"params": groups}]
    names = {id(p): n for n, p in prog.named_parameters()}
    held = []
    for g in groups:
        # (as torch's optimizers take them: a lone tensor, or (name, tensor) pairs)
        entries = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        tensors = [e[1] if isinstance(e, tuple) else e for e in entries]
        missing = [tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
                   for p in tensors if id(p) not in names]
        if missing:
            raise ParallelizeError(f"build_optimizer takes the program's parameters; {len(missing)} are not (the "
                                   f"first: {missing[0]})")
        held.append(tensors)
        stand_ins = [torch.empty(prog.original_shape(names[id(p)]), device="meta") for p in tensors]
        g["params"] = [(e[0], t) if isinstance(e, tuple) else t for e, t in zip(entries, stand_ins)]
    opt = cls(groups, **kwargs)
    if opt.state:
        raise ParallelizeError(f"{cls.__name__} makes state when it is built; build it over prog.parameters() "
                               "directly")
    for g, ps in zip(opt.param_groups, held):
        g["params"] = ps
    return opt


def optimizer_step(prog, optimizer) -> None:
    """The optimizer(s)' step on `prog`'s finalized gradients, or none: a non-finite norm under
    skip_nonfinite (`prog.last_step_skipped`), an fp16 overflow (the scaler's). Whole-matrix
    optimizers step first: under zero=1/2 the elementwise one's all-gather then carries their
    new values too."""
    if prog.skip_nonfinite and prog.scaler is None:      # (fp16's scaler skips such steps itself)
        norm = prog.grads.last_norm if prog.grads.config.clip_grad is not None else float(prog.grads.norm())
        prog.grads.last_norm = norm
        prog.last_step_skipped = not math.isfinite(norm)
        if prog.last_step_skipped:
            return
    opts = optimizers(optimizer)
    whole = [o for o in opts if not elementwise(o)]
    shards = [o for o in opts if elementwise(o)]
    if prog.zero is not None:
        params = prog.zero.optimizer_for(shards[0]) if shards else prog.zero.shards
        if prog.scaler is None or _unscaled(prog, params, sharded_over_dp=True):
            for o in whole:
                whole_matrices(prog, o).step()
            if shards:
                prog.zero.step(shards[0])
            else:                        # every rank wrote its whole local values: nothing to gather
                prog.zero.last_waited, prog.zero.waited = prog.zero.waited, []
        return
    if prog.scaler is None or _unscaled(prog, list(prog.parameters()), sharded_over_dp=prog.fsdp is not None):
        for o in whole:
            whole_matrices(prog, o).step()
        for o in shards:
            o.step()


def _unscaled(prog, params: list, *, sharded_over_dp: bool) -> bool:
    """fp16's gradients unscaled and checked; False (the step skipped, and said so in
    `prog.last_step_skipped`, as a non-finite norm's is) where they overflowed anywhere."""
    ok = prog.scaler.unscale_and_check(params, prog.groups, sharded_over_dp=sharded_over_dp,
                                       dp_kind=prog.grads.dense_group)
    prog.last_step_skipped = not ok
    return ok


# ---------------------------------------------------------------------- whole matrices
def whole_matrices(prog, template: torch.optim.Optimizer) -> "WholeMatrices":
    """The whole-matrix stepping of `template` on `prog` (made at its first step, kept)."""
    made = prog.__dict__.setdefault("_whole_matrices", {})
    entry = made.get(id(template))
    if entry is None or entry.template is not template:
        entry = made[id(template)] = WholeMatrices(prog, template)
    return entry


class _Piece:
    """One parameter of a whole-matrix optimizer: the axes over which ranks hold its pieces or
    copies (`axes`, in the order the new value is broadcast over them), and who steps it."""

    def __init__(self, name: str, param, spec, axes: list[str]):
        self.name, self.param, self.spec = name, param, spec
        self.axes = axes
        self.owner: tuple[int, ...] = ()          # the owner's index on each of `axes`
        self.full: torch.Tensor | None = None     # the owner's whole tensor, which its optimizer steps

    @property
    def numel(self) -> int:
        return math.prod(self.spec.full_shape if self.spec is not None else self.param.shape)


class WholeMatrices:
    """A whole-matrix optimizer's step on a program (module docstring): `template`, the user's
    optimizer over the program's parameters, gives the class, the groups and their
    hyperparameters; `inner`, this rank's optimizer of that class over the whole tensors it
    owns, steps them."""

    def __init__(self, prog, template: torch.optim.Optimizer):
        self.prog, self.template = prog, template
        groups = prog.groups
        names = {id(p): n for n, p in prog.named_parameters()}
        zero_kind = {}
        if prog.zero is not None:
            zero_kind = {n: kind for kind, buf in prog.grads.buffers.items() for n in buf.offsets}
        self.pieces: list[list[_Piece]] = []
        load: dict[tuple, list[int]] = {}
        order = []
        for g in template.param_groups:
            row = []
            for p in g["params"]:
                n = names[id(p)]
                spec = prog.local.get(n)
                axes = [] if spec is None or groups is None else [s.axis for s in spec.shards if groups.size(s.axis) > 1]
                if groups is not None:
                    if groups.size("tp") > 1 and "tp" not in axes:
                        axes.append("tp")            # whole on every tp rank: one of them steps it
                    if spec is not None and spec.flat is not None:
                        dp = spec.flat.group or spec.grad_group      # zero=3: its flat pieces
                    else:       # zero=1/2: its buffer's shards; without: copies, one of which steps it
                        dp = zero_kind.get(n) or (spec.grad_group if spec is not None else "dp")
                    if groups.size(dp) > 1:
                        axes.append(dp)
                row.append(_Piece(n, p, spec, axes))
                order.append(row[-1])
            self.pieces.append(row)
        # owners: the largest tensors first, each to the least loaded of the ranks holding it
        for piece in sorted(order, key=lambda x: -x.numel):
            sizes = [groups.size(a) for a in piece.axes]
            counts = load.setdefault(tuple(piece.axes), [0] * math.prod(sizes))
            k = min(range(len(counts)), key=lambda i: counts[i])
            counts[k] += piece.numel
            coords = []
            for size in reversed(sizes):
                coords.append(k % size)
                k //= size
            piece.owner = tuple(reversed(coords))
        inner_groups = []
        for g, row in zip(template.param_groups, self.pieces):
            mine = []
            for piece in row:
                if self._mine(piece):
                    shape = piece.spec.full_shape if piece.spec is not None else tuple(piece.param.shape)
                    piece.full = torch.zeros(shape, dtype=piece.param.dtype, device=piece.param.device)
                    mine.append(piece.full)
            inner_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": mine})
        self.inner = rebuild(template, inner_groups)

    def _mine(self, piece: _Piece) -> bool:
        groups = self.prog.groups
        return all(groups.index(a) == c for a, c in zip(piece.axes, piece.owner))

    def _local(self, held: torch.Tensor, name: str) -> torch.Tensor:
        """The rank's local tensor (its tp / ep shard, whole over data parallel) of what it holds
        (a zero=3 flat piece: gathered over its group)."""
        return held if self.prog.zero is not None else self.prog.grads.local_of(name, held)

    @torch.no_grad()
    def step(self) -> None:
        """Gather each parameter's whole gradient and value, step the owned ones, send each
        back from its owner; every rank keeps its piece."""
        prog, groups = self.prog, self.prog.groups
        if [[id(p) for p in g["params"]] for g in self.template.param_groups] != \
                [[id(x.param) for x in row] for row in self.pieces]:
            raise ParallelizeError(f"the param groups of {type(self.template).__name__} changed after its first "
                                   "step; fxtron placed its parameters on owner ranks then: build a new optimizer")
        for mine, theirs in zip(self.inner.param_groups, self.template.param_groups):
            for k, v in theirs.items():
                if k != "params":
                    mine[k] = v
        zgrads = None
        if prog.zero is not None:
            prog.zero.wait_params()          # (the last step's all-gathers of param_data)
            zgrads = prog.zero.full_grad_data()
        stepped = []
        for piece in (x for row in self.pieces for x in row):
            p = piece.param
            if piece.name in prog.grads.gradless:   # frozen, or no gradient reaches it: not stepped, as in one process
                if piece.full is not None:
                    piece.full.grad = None
                continue
            if zgrads is not None:
                grad = zgrads[piece.name].view_as(p).to(p.dtype)
            elif p.grad is None:             # unused this step on every rank holding it: not stepped, as in one process
                if piece.full is not None:
                    piece.full.grad = None
                continue
            else:
                grad = self._local(p.grad, piece.name)
            grad = prog.grads.full(piece.name, grad)
            value = prog.grads.full(piece.name, self._local(p.detach(), piece.name))
            if piece.full is not None:
                piece.full.copy_(value)
                piece.full.grad = grad.clone()     # (a whole gradient may be the parameter's own .grad)
            stepped.append(piece)
        self.inner.step()
        for piece in stepped:
            full = piece.full.detach() if piece.full is not None else torch.empty(
                piece.spec.full_shape if piece.spec is not None else piece.param.shape,
                dtype=piece.param.dtype, device=piece.param.device)
            for axis, c in zip(piece.axes, piece.owner):      # owner's row of each axis in turn: all of them
                src = groups.ranks(axis)[c]
                with ledger.collective(groups.group(axis), "broadcast", full):
                    dist.broadcast(full, src, group=groups.group(axis))
            self._keep(piece, full)
        for piece in stepped:
            if piece.full is not None:
                piece.full.grad = None

    def _keep(self, piece: _Piece, full: torch.Tensor) -> None:
        """The rank's piece of the new whole value into the parameter (under zero=1/2 its whole
        local tensor, a view of the parameter buffer)."""
        spec = piece.spec
        local = self.prog.grads.piece_of(piece.name, full)
        if spec is not None and spec.flat is not None:
            local = spec.held_of(local)
        piece.param.data.copy_(local.view_as(piece.param))

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (its owned tensors' state)."""
        return sum(t.numel() * t.element_size() for st in self.inner.state.values()
                   for t in st.values() if isinstance(t, torch.Tensor))


__all__ = ["ELEMENTWISE", "REFUSED", "WholeMatrices", "build_optimizer", "check_optimizer", "elementwise", "held_state",
           "mode", "optimizer_step", "optimizers", "whole_matrices", "zero_grad"]
