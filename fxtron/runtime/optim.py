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

What an update reads decides where it can run, and fxtron cannot see it in a class it does not
know: `optimizer_reads(opt, reads)` (or a class attribute `fxtron_reads`) says it. "element"
steps the rank's pieces (a user's Lion); "parameter" (Adafactor, Muon: known) steps each
parameter whole on its owner; "all" -- an update that reads several parameters at once (a norm
over every gradient, Prodigy's and D-Adaptation's sums) -- steps every parameter on one rank of
the stage, and is refused under pp (each stage's ranks hold only their stage's parameters). A
class not declared is stepped per parameter with a ParallelizeWarning (strict: an error) where
more than one rank steps: per parameter would silently change an update that reads several.

The user's optimizer stays the one to save and load: under zero=1/2 and for whole-matrix
optimizers its state lives in fxtron's optimizer over the shards or the owned tensors, and
`opt.state_dict()` reports that state (zero=1/2: each parameter's, shaped like the rank's
parameter, gathered over data parallel -- a collective every rank of the group calls;
whole matrices: the whole tensors' state of the parameters this rank steps), and
`opt.load_state_dict(sd)` gives it back at the next step (`speak_for`, `loaded_state`).
"""
from __future__ import annotations

import inspect
import math
import warnings

import torch
import torch.distributed as dist

from fxtron.errors import CompileError, ParallelizeError, ParallelizeWarning, warn_or_raise
from fxtron.ops import ledger

#: the torch optimizers whose update of each element reads only that element (its gradient, its
#: value, its state) and scalars of the step: they step the rank's pieces of a parameter exactly
#: as the whole one (Adam's amsgrad, NAdam's and RAdam's per-step scalars, ASGD's averages
#: included). Exact classes: a subclass may change the update.
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
               torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop,
               torch.optim.Rprop, torch.optim.ASGD)

#: torch's optimizers that read the whole of a parameter, and only that parameter, to update it
PER_PARAMETER = (torch.optim.Adafactor, torch.optim.Muon)

#: what an optimizer's update of a parameter reads (optimizer_reads)
READS = {"element": "each element's update reads only that element's gradient, value and state (SGD, AdamW, Lion): "
                    "stepped on the rank's pieces",
         "parameter": "each parameter's update reads the whole parameter and no other (Adafactor, Muon, Shampoo): "
                      "stepped whole on an owner rank, owners spread",
         "all": "an update reads several parameters (a norm over every gradient; Prodigy's and D-Adaptation's sums): "
                "every parameter stepped on one rank"}

#: optimizers fxtron cannot place, and why
REFUSED = {torch.optim.LBFGS: "its step re-evaluates the model through a closure and treats every parameter "
                              "as one flat vector (line search over all of them), which no per-rank step reproduces"}


def optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers of a train_step: one, or a list or tuple of them (Muon's 2-d weights and
    AdamW's others, say)."""
    return list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]


def optimizer_reads(optimizer: torch.optim.Optimizer, reads: str) -> torch.optim.Optimizer:
    """Declare what `optimizer`'s update of a parameter reads -- "element", "parameter" or "all"
    (READS) -- for a class fxtron does not know; returns the optimizer. A class may say it
    itself: `fxtron_reads = "all"`."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ParallelizeError(f"optimizer_reads takes a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if reads not in READS:
        raise ParallelizeError(f"optimizer_reads(..., {reads!r}): reads is one of " + "; ".join(
            f"{k!r}: {v}" for k, v in READS.items()))
    optimizer.fxtron_reads = reads
    return optimizer


def reads(optimizer: torch.optim.Optimizer) -> str | None:
    """What `optimizer`'s update reads (READS): declared, known, or None (a class fxtron does
    not know, not declared)."""
    declared = getattr(optimizer, "fxtron_reads", None)
    if declared is not None:
        if declared not in READS:
            raise ParallelizeError(f"{type(optimizer).__name__}.fxtron_reads = {declared!r}: it is one of "
                                   f"{', '.join(map(repr, READS))}")
        return declared
    if type(optimizer) in ELEMENTWISE:
        return "element"
    if type(optimizer) in PER_PARAMETER:
        return "parameter"
    return None


def elementwise(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` steps the rank's pieces as they are (module docstring)."""
    return reads(optimizer) == "element"


def mode(optimizer: torch.optim.Optimizer) -> str:
    """A line: how fxtron steps `optimizer`."""
    name = type(optimizer).__name__
    how = reads(optimizer)
    if how == "element":
        return f"{name}: elementwise, each rank steps its own pieces"
    if how == "all":
        return f"{name}: whole model, every parameter gathered to one rank that steps them all and sends them back"
    line = f"{name}: whole matrices, each parameter gathered to an owner rank that steps it and sends it back"
    return line if how else line + (" (not declared: right if each parameter's update reads that parameter alone; "
                                    "fxtron.optimizer_reads)")


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


#: what torch.optim.Optimizer itself keeps on an instance (its groups, state and hooks)
_BOOKKEEPING = frozenset(vars(torch.optim.Optimizer([torch.nn.Parameter(torch.zeros(1))], {})))


def rebuild(template: torch.optim.Optimizer, groups: list[dict]) -> torch.optim.Optimizer:
    """An optimizer of `template`'s class over `groups` (each with every hyperparameter), built
    with the template's constructor settings: its `defaults`, which torch's optimizers fill from
    every constructor argument (a user's class from those it passes to Optimizer.__init__),
    those its constructor takes. Some settings act only in the constructor (Adagrad's
    initial_accumulator_value fills its state there), and a class may require them (an `lr`
    without a default). Then every attribute of the template's own that is not torch's
    bookkeeping (groups, state, hooks) is the template's: a setting a user's constructor keeps
    outside `defaults` (`self.scale = scale`) is the one the user gave, not the default. An
    attribute that shadows a method of the class is not: torch's lr schedulers wrap the
    template's own `step` in one, which would step the template."""
    cls = type(template)
    try:
        takes = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):         # (a constructor without a signature Python can read)
        takes = {}
    anything = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in takes.values())
    kwargs = {k: v for k, v in template.defaults.items() if k != "params" and (anything or k in takes)}
    made = cls(groups, **kwargs)
    for k, v in vars(template).items():
        # (not what shadows a method -- an lr scheduler's wrapper of the template's own step --, nor
        # the scheduler's mark that the template stepped, nor fxtron's own records)
        if k in _BOOKKEEPING or k.startswith("_fxtron") or k == "_opt_called" or callable(getattr(cls, k, None)):
            continue
        setattr(made, k, v)
    return made


# ---------------------------------------------------------------------- the user's optimizer's state
def speak_for(template: torch.optim.Optimizer, holder) -> None:
    """`template.state_dict()` reports the state `holder` keeps for it -- the distributed
    optimizer (runtime/zero.py) or a WholeMatrices -- (`holder.template_state()`: its
    parameters' state, by parameter), and `template.load_state_dict` marks what it loads for
    `holder` to take at the next step (loaded_state). torch's own hooks on the instance."""
    vars(template)["_fxtron_holder"] = holder
    if not vars(template).get("_fxtron_hooked"):
        template.register_state_dict_post_hook(_report_state)
        template.register_load_state_dict_post_hook(_mark_loaded)
        vars(template)["_fxtron_hooked"] = True


def _report_state(optimizer: torch.optim.Optimizer, sd: dict) -> dict:
    holder = vars(optimizer).get("_fxtron_holder")
    if vars(optimizer).get("_fxtron_loaded"):
        return sd                          # loaded and not yet taken: what was loaded
    if holder.template is not optimizer:
        raise ParallelizeError(f"this {type(optimizer).__name__}'s state was dropped when another optimizer stepped "
                               "the same program (fxtron keeps one optimizer's state per program under zero=1/2): "
                               "save the state before switching optimizers")
    index = {id(p): i for g, packed in zip(optimizer.param_groups, sd["param_groups"])
             for p, i in zip(g["params"], packed["params"])}
    sd["state"] = {index[id(p)]: st for p, st in holder.template_state().items()}
    return sd


def _mark_loaded(optimizer: torch.optim.Optimizer) -> None:
    vars(optimizer)["_fxtron_loaded"] = True


def loaded_state(template: torch.optim.Optimizer, *, first: bool = False) -> dict | None:
    """The state a `load_state_dict` put into `template` since fxtron last took it (the hook's
    mark), by parameter -- taken out of the template, whose own state stays empty -- or None.
    `first`, when fxtron builds its optimizer for the template (no hook yet): any state the
    template holds -- loaded before the first step, or made by its constructor (Adagrad's). An
    entry that is empty is not state (reading `opt.state[p]` makes one)."""
    flagged = vars(template).pop("_fxtron_loaded", False)
    state = {p: st for p, st in template.state.items() if st}
    if not flagged and not (first and state):
        return None
    template.state.clear()
    return state


def stepped_for(prog, template: torch.optim.Optimizer, step) -> None:
    """`step()`, fxtron's step in place of the user's optimizer `template` (its shards under
    zero=1/2, its whole matrices on their owners), between `template`'s own step pre- and post-
    hooks, as `template.step()` would run them (torch's global hooks run around fxtron's own
    optimizer's step); then `template` is marked stepped. Once per optimizer, where more than one
    rank steps, a ParallelizeWarning says that a pre-hook sees this rank's pieces (`said_hooks`)."""
    pre, post = template._optimizer_step_pre_hooks, template._optimizer_step_post_hooks
    said_hooks(prog, template, stacklevel=5)
    args, kwargs = (template,), {}
    for hook in list(pre.values()):
        result = hook(template, args, kwargs)
        if result is not None:
            args, kwargs = result
    step()
    mark_stepped(template)
    if post:        # the hooks read or write the updated parameters: the gathers land first
        prog._settle_params()
    for hook in list(post.values()):
        hook(template, args, kwargs)


def said_hooks(prog, optimizer: torch.optim.Optimizer, stacklevel: int = 4) -> None:
    """Once per optimizer, where more than one rank steps and it has step pre-hooks: a
    ParallelizeWarning that they run on this rank's pieces of the gradients (under zero=1/2, on
    none: the gradients are the buffer's shards, not the parameters' .grad)."""
    if (not optimizer._optimizer_step_pre_hooks or prog.groups is None or prog.groups.mesh.world_size == 1
            or vars(optimizer).get("_fxtron_hooks_said")):
        return
    vars(optimizer)["_fxtron_hooks_said"] = True
    if prog.zero is not None:
        where = ("under the distributed optimizer (zero=1/2) the gradients are reduce-scattered into fxtron's buffer "
                 "and sharded there: prog.parameters() have no .grad in the hook, and what it changes of gradients "
                 "does not reach the step")
    else:
        where = ("on this rank's pieces of the gradients: what they compute over prog.parameters() is this rank's "
                 "(torch.nn.utils.clip_grad_norm_ gives this rank's norm, not the model's)")
    warnings.warn(f"{type(optimizer).__name__}'s step pre-hooks run on each rank before the step, {where}. Clip with "
                  "parallelize(..., clip_grad=) or prog.clip_grad_norm_(max_norm) in the hook, and read the norm "
                  "with prog.grad_norm()", ParallelizeWarning, stacklevel=stacklevel)


def mark_stepped(template: torch.optim.Optimizer) -> None:
    """Mark `template` as stepped (fxtron stepped it by its own optimizer): the mark torch's lr
    schedulers read to warn of a scheduler stepped before its optimizer."""
    vars(template)["_opt_called"] = True


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
    elif prog.skip_nonfinite and prog.grads.config.clip_grad is None:    # fp16: the model's norm, reported
        prog.grads.last_norm = float(prog.grads.norm()) / prog.scaler.scale
    opts = optimizers(optimizer)
    whole = [o for o in opts if not elementwise(o)]
    shards = [o for o in opts if elementwise(o)]
    if prog.zero is not None:
        params = prog.zero.optimizer_for(shards[0]) if shards else prog.zero.shards
        if prog.scaler is None or _unscaled(prog, params, sharded_over_dp=True):
            for o in whole:
                stepped_for(prog, o, whole_matrices(prog, o).step)
            if shards:
                stepped_for(prog, shards[0], lambda: prog.zero.step(shards[0]))
            else:                        # every rank wrote its whole local values: nothing to gather
                prog.zero.last_waited, prog.zero.waited = prog.zero.waited, []
        return
    if prog.scaler is None or _unscaled(prog, list(prog.parameters()), sharded_over_dp=prog.fsdp is not None):
        for o in whole:
            stepped_for(prog, o, whole_matrices(prog, o).step)
        for o in shards:
            said_hooks(prog, o)
            o.step()            # (its hooks run in it)


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
        self.reads = reads(template) or "parameter"
        groups = prog.groups
        name = type(template).__name__
        if groups is not None and self.reads == "all" and groups.mesh.pp > 1:
            raise ParallelizeError(
                f"{name} reads every parameter to update each (declared 'all'), and under pp={groups.mesh.pp} each "
                "stage's ranks hold only their stage's parameters: no rank can step them all; train with pp=1, or "
                "with an optimizer whose update reads one parameter at a time")
        if groups is not None and reads(template) is None and groups.mesh.world_size > 1:
            warn_or_raise(
                f"{name} is an optimizer fxtron does not know: it steps each parameter whole on an owner rank, as "
                "in one process only if each parameter's update reads that parameter alone; an update that reads "
                "several (a norm over every gradient, Prodigy's sums) would silently differ",
                strict=prog.config.debug.strict,
                fix="; declare what it reads: fxtron.optimizer_reads(opt, 'parameter' | 'all' | 'element')",
                advice=" (fxtron.optimizer_reads(opt, 'parameter' | 'all' | 'element') says it)", stacklevel=4)
        self._zero_kind = {}
        if prog.zero is not None:
            self._zero_kind = {n: kind for kind, buf in prog.grads.buffers.items() for n in buf.offsets}
        self._load: dict[tuple, list[int]] = {}      # bytes owned so far by each rank of each set of axes
        self.pieces: list[list[_Piece]] = []
        self.inner: torch.optim.Optimizer | None = None
        self._add(template.param_groups)
        self._take_loaded(first=True)
        speak_for(template, self)

    def _add(self, param_groups: list[dict]) -> None:
        """Place the parameters of `param_groups` (the template's, at the first step or added
        since) on owner ranks, and add their groups to the inner optimizer."""
        prog, groups = self.prog, self.prog.groups
        names = {id(p): n for n, p in prog.named_parameters()}
        rows = []
        for g in param_groups:
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
                        dp = self._zero_kind.get(n) or (spec.grad_group if spec is not None else "dp")
                    if groups.size(dp) > 1:
                        axes.append(dp)
                row.append(_Piece(n, p, spec, axes))
            rows.append(row)
        if self.reads == "all":
            self._one_owner([x for row in rows for x in row])
        else:       # the largest tensors first, each to the least loaded of the ranks holding it
            for piece in sorted((x for row in rows for x in row), key=lambda x: -x.numel):
                sizes = [groups.size(a) for a in piece.axes]
                counts = self._load.setdefault(tuple(piece.axes), [0] * math.prod(sizes))
                k = min(range(len(counts)), key=lambda i: counts[i])
                counts[k] += piece.numel
                coords = []
                for size in reversed(sizes):
                    coords.append(k % size)
                    k //= size
                piece.owner = tuple(reversed(coords))
        inner_groups = []
        for g, row in zip(param_groups, rows):
            mine = []
            for piece in row:
                if self._mine(piece):
                    shape = piece.spec.full_shape if piece.spec is not None else tuple(piece.param.shape)
                    piece.full = torch.zeros(shape, dtype=piece.param.dtype, device=piece.param.device)
                    mine.append(piece.full)
            inner_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": mine})
        if self.inner is None:
            self.inner = rebuild(self.template, inner_groups)
        else:
            for g in inner_groups:
                self.inner.add_param_group(g)
        self.pieces += rows

    def _one_owner(self, pieces: list[_Piece]) -> None:
        """reads="all": every parameter owned by the stage's first rank (index 0 of each of
        its groups), which must then hold each parameter or receive it whole."""
        groups = self.prog.groups
        if groups is None:
            return
        ranks = groups.mesh.world_size // groups.mesh.pp
        for piece in pieces:
            held = math.prod(groups.size(a) for a in piece.axes)
            if held != ranks:
                raise ParallelizeError(
                    f"{type(self.template).__name__} steps every parameter on one rank (declared 'all'), but "
                    f"{piece.name} is held by {held} of the stage's {ranks} ranks in a way fxtron cannot gather to "
                    "one: declare 'parameter' if each update reads one parameter, or train on a smaller mesh")
            piece.owner = (0,) * len(piece.axes)
        mine = {self._mine(x) for x in pieces + [x for row in self.pieces for x in row]}
        if len(mine) > 1:
            raise CompileError(f"rank {groups.rank}: the one owner of {type(self.template).__name__}'s parameters "
                               "is not the same rank for all of them (a group layout fxtron does not expect)")

    def template_state(self) -> dict:
        """The state of the parameters this rank steps, whole, by the template's parameter."""
        return {x.param: dict(self.inner.state[x.full]) for x in self.owned() if x.full in self.inner.state}

    def owned(self) -> list[_Piece]:
        """The parameters this rank steps."""
        return [x for row in self.pieces for x in row if x.full is not None]

    def owned_state(self) -> dict[str, dict]:
        """The state of the parameters this rank steps, whole, by name (for checkpoints); a state
        loaded into the template and not yet taken in is taken first."""
        self._take_loaded()
        return {x.name: dict(self.inner.state[x.full]) for x in self.owned() if x.full in self.inner.state}

    def load_owned(self, state: dict[str, dict]) -> None:
        """The owned parameters' state from a checkpoint (whole tensors by name), replacing theirs."""
        loaded_state(self.template, first=True)     # (anything loaded into the template before is superseded)
        self.inner.state.clear()
        for x in self.owned():
            if x.name in state:
                self.inner.state[x.full] = {k: v.to(x.full.device) if isinstance(v, torch.Tensor) else v
                                            for k, v in state[x.name].items()}

    def _take_loaded(self, first: bool = False) -> None:
        """A state the user loaded into the template (its load_state_dict; `first`: whatever it
        holds when fxtron takes it, loaded or made by its constructor) replaces the owned tensors'
        state. A state of every parameter (one process's, or a constructor's) gives each owner its
        parameters'; a state of some (a rank's own state_dict) must be the owned ones'."""
        loaded = loaded_state(self.template, first=first)
        if loaded is None:
            return
        by_param = {id(x.param): x for row in self.pieces for x in row}
        every = {id(p) for p in loaded} >= set(by_param)
        self.inner.state.clear()
        for p, st in loaded.items():
            piece = by_param.get(id(p))
            if piece is None or (piece.full is None and every):
                continue
            if piece.full is None:
                raise ParallelizeError(
                    f"the state loaded into {type(self.template).__name__} holds {piece.name}'s, which rank "
                    f"{self.prog.groups.rank} does not step (each rank's state_dict holds the whole state of the "
                    "parameters it steps): load each rank's own state_dict, saved on the same mesh")
            self.inner.state[piece.full] = dict(st)

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
        now = [[id(p) for p in g["params"]] for g in self.template.param_groups]
        if now[:len(self.pieces)] != [[id(x.param) for x in row] for row in self.pieces]:
            raise ParallelizeError(f"the param groups of {type(self.template).__name__} changed after its first "
                                   "step (other than add_param_group); fxtron placed its parameters on owner ranks "
                                   "then: build a new optimizer")
        if len(now) > len(self.pieces):        # add_param_group: unfreezing in stages
            self._add(self.template.param_groups[len(self.pieces):])
        self._take_loaded()
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
        type(self.inner).step(self.inner)      # (the class's step: nothing an instance wraps it in)
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


__all__ = ["ELEMENTWISE", "PER_PARAMETER", "READS", "REFUSED", "WholeMatrices", "build_optimizer", "check_optimizer",
           "elementwise", "held_state", "loaded_state", "mark_stepped", "mode", "optimizer_reads", "optimizer_step", "optimizers", "reads",
           "speak_for", "whole_matrices", "zero_grad"]
