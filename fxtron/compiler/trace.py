"""Compiler, first stage: trace a model to an FX GraphModule with torch.export (training IR).

The result's placeholders are the model's parameters and buffers (lifted, in a fixed order),
then the flattened user inputs; its one output is the scalar loss. Batch and sequence dims of
every user input are symbolic (one symbol `B` for dim 0 and one `S` for dim 1 of all inputs),
so one compiled program serves any batch size and sequence length. What the graph's inputs
mean is kept in `gm.meta["fxtron_trace"]` (a core.meta.TraceInfo) and per placeholder in node.meta.
torch.no_grad blocks, which export wraps as regions of their own, are inlined (`inline_grad_regions`).
"""
from __future__ import annotations

import collections
import inspect
import operator
import re
import warnings
from typing import Any, Callable

import sympy
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.export import Dim, ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from fxtron.compiler import repeat
from fxtron.passes import limits
from fxtron.core import meta, opsets
from fxtron.core.meta import BATCH, SEQ, TRACE_INFO, TraceInfo, info
from fxtron.errors import ParallelizeError, ParallelizeWarning

aten = torch.ops.aten


def default_loss(output: Any) -> torch.Tensor:
    """The loss inside a model's output: a scalar tensor, `.loss`, or `["loss"]`."""
    if isinstance(output, torch.Tensor):
        if output.dim() != 0:
            raise ParallelizeError(
                f"the model returned a tensor of shape {tuple(output.shape)}, not a scalar loss; call "
                "it with targets or labels so it computes the loss, or pass loss_fn=lambda output: ...")
        return output
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, (tuple, list)):
        parts = ", ".join("a scalar" if isinstance(o, torch.Tensor) and o.dim() == 0 else
                          f"a {o.dim()}-d tensor" if isinstance(o, torch.Tensor) else type(o).__name__
                          for o in output)
        scalars = [i for i, o in enumerate(output) if isinstance(o, torch.Tensor) and o.dim() == 0]
        raise ParallelizeError(
            f"the model returned a {type(output).__name__} ({parts}), and fxtron takes the loss from a scalar "
            "output, its .loss or its ['loss']; " + (
                f"pass loss_fn=lambda output: output[{scalars[0]}] for the scalar it holds (transformers returns "
                "the loss first under return_dict=False)" if scalars else
                "call it with targets or labels so it computes the loss, or pass loss_fn=lambda output: ..."))
    if loss is None:
        raise ParallelizeError(
            f"the model returned {type(output).__name__}, not a scalar loss; call it with targets "
            "or labels so it computes the loss, or pass loss_fn=lambda output: ...")
    return loss


class _WithLoss(torch.nn.Module):
    """Wraps the user's model so the traced graph takes the tensor leaves of (args, kwargs)
    positionally (non-tensor leaves are baked in) and ends in the scalar loss."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable[[Any], torch.Tensor], leaves: list, spec):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self._leaves = leaves
        self._spec = spec

    def forward(self, *tensors):
        it = iter(tensors)
        flat = [next(it) if isinstance(x, torch.Tensor) else x for x in self._leaves]
        args, kwargs = pytree.tree_unflatten(flat, self._spec)
        loss = self.loss_fn(self.model(*args, **kwargs))
        if self.loss_fn is not default_loss and not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
            got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ParallelizeError(f"loss_fn returned {got}, not a scalar loss: reduce it to one value (a mean or a "
                                   "sum over the batch) in loss_fn")
        return loss


def _dynamic_shapes(tensors: list[torch.Tensor], batch_dim: int, seq_dim: int | None):
    """Dynamic batch and sequence dims of every input. Dim.AUTO lets export infer the ranges
    (a learned position table bounds the sequence) in one trace, where named Dims would fail
    and need a second; every batch symbol reads as B and every sequence symbol as S."""
    b = s = Dim.AUTO
    shapes, dims = [], []
    for x in tensors:
        roles: list[str | None] = [None] * x.dim()
        d = {}
        if x.dim() > batch_dim:
            d[batch_dim], roles[batch_dim] = b, "batch"
        if seq_dim is not None and x.dim() > seq_dim:
            d[seq_dim], roles[seq_dim] = s, "seq"
        dims.append(tuple(roles))
        shapes.append(d or None)
    return tuple(shapes), dims


def _check_examples(tensors: list[torch.Tensor], batch_dim: int, seq_dim: int | None) -> None:
    """ParallelizeError for example inputs export cannot trace with a symbolic batch: none at
    all, or no tensor with a batch dim."""
    if not tensors:
        raise ParallelizeError("parallelize needs example_inputs (or example_kwargs): a batch of the model's "
                               "inputs, e.g. example_inputs=(tokens, targets), to trace the model with")
    if not isinstance(batch_dim, int) or batch_dim < 0:
        raise ParallelizeError(f"batch_dim must be a non-negative int, got {batch_dim!r}")
    if seq_dim is not None and (not isinstance(seq_dim, int) or seq_dim < 0):
        raise ParallelizeError(f"seq_dim must be a non-negative int or None, got {seq_dim!r}")
    if not any(x.dim() > batch_dim for x in tensors):
        raise ParallelizeError(
            f"batch_dim={batch_dim} but no example input has that many dims (shapes: "
            f"{', '.join(str(tuple(x.shape)) for x in tensors)}); give the dim that holds the batch")


def check_example_sizes(example_inputs, example_kwargs, batch_dim: int, seq_dim: int | None) -> None:
    """ParallelizeError for an example batch or sequence of 0 or 1, which export would fix: a
    program to train on other sizes needs them symbolic (the planner's traces do not)."""
    tensors = [x for x in pytree.tree_leaves((example_inputs, example_kwargs or {})) if isinstance(x, torch.Tensor)]
    for role, dim in (("batch", batch_dim), ("sequence", seq_dim)):
        having = [tuple(x.shape) for x in tensors if dim is not None and x.dim() > dim]
        small = [s for s in having if s[dim] < 2]
        if having and len(small) == len(having):     # (a mask's broadcast dim of 1 beside real ones is fine)
            raise ParallelizeError(
                f"an example input of shape {small[0]} has a {role} of {small[0][dim]} (dim {dim}): torch.export "
                f"fixes dims of size 0 or 1, so the program would take no other {role} length; trace with a "
                f"{role} of at least 2")


def _check_experts_implementation(model) -> None:
    """transformers' MoE experts that loop in Python over the experts each batch's tokens hit
    (`nonzero()`: data-dependent) cannot be traced by export. Where transformers offers another
    implementation (experts_implementation="eager" chosen on a model whose experts take the
    switch) say which to set; where it offers none (DBRX), say so -- before export's guard error.
    Experts that run on every token (Llama 4's bmm) or over static splits trace as they are."""
    if "eager" not in _experts_implementations(getattr(model, "config", None)):
        return
    looping = sorted({type(m).__name__ for m in model.modules()
                      if type(m).__name__.endswith("Experts") and _loops_over_hits(type(m))})
    if not looping:
        return
    can_set = getattr(type(model), "_can_set_experts_implementation", None)
    if can_set is not None and not can_set():
        raise ParallelizeError(
            f"{type(model).__name__}'s experts ({', '.join(looping)}) loop in Python over the experts each batch's "
            "tokens pick (nonzero()), which torch.export cannot trace, and transformers offers no other "
            "experts_implementation for them (their class is not decorated with use_experts_implementation); "
            "write the experts as 3-D weights (experts, out, in) run by a grouped GEMM, as transformers' Mixtral "
            "experts are, or use the model's family that has them")
    raise ParallelizeError(
        f"{type(model).__name__} runs its experts with experts_implementation='eager', a Python loop over the "
        "experts each batch's tokens pick, which torch.export cannot trace; build it with "
        "experts_implementation='grouped_mm' (transformers' default) or 'batched_mm' (the config argument, "
        "or model.set_experts_implementation('grouped_mm'))")


def _experts_implementations(config) -> set:
    """The experts_implementation of a config and of its sub-configs (a multimodal wrapper's
    text model keeps its own, which the wrapper's does not show)."""
    if config is None:
        return set()
    found = {getattr(config, "_experts_implementation", None)}
    for key in getattr(config, "sub_configs", None) or ():
        found |= _experts_implementations(getattr(config, key, None))
    return found


def _loops_over_hits(cls) -> bool:
    """Does the experts module's forward pick its experts with nonzero() (a data-dependent loop)?"""
    try:
        return "nonzero(" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return True      # no source to read: the loop may be there; refuse as before


def _export(module, args, shapes) -> ExportedProgram:
    from torch.export.dynamic_shapes import refine_dynamic_shapes_from_suggested_fixes

    if any(t.device.type == "meta" for t in module.parameters()):
        # a model built on meta is exported as its CPU build would be: fake CPU tensors (the devices
        # they write into the graph become the program's in passes/devices.py)
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv
        mode = FakeTensorMode(shape_env=ShapeEnv())
        module = repeat.fake_twin(module, mode)
        args = tuple(repeat.fake_on_cpu(mode, a) if isinstance(a, torch.Tensor) else a for a in args)
        ep = _export(module, args, shapes)
        for k, v in list(ep.constants.items()):         # what the program builds from the model's meta buffers
            if isinstance(v, FakeTensor):
                ep.constants[k] = v.constant if v.constant is not None else \
                    torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
        return ep
    for _ in range(3):
        try:
            return _exported(module, args, shapes)
        except torch._dynamo.exc.UserError as e:  # constraint violations: take export's fix
            msg = str(e)
            if "Suggested fixes:" not in msg:
                raise
            fixes = []  # only the fix lines: export appends prose after a blank line
            for line in msg.split("Suggested fixes:", 1)[1].splitlines()[1:]:
                if not line.strip():
                    break
                fixes.append(line)
            shapes = refine_dynamic_shapes_from_suggested_fixes("Suggested fixes:\n" + "\n".join(fixes), shapes)
    return _exported(module, args, shapes)


def _exported(module, args, shapes) -> ExportedProgram:
    """torch.export(strict=False) of `module`, refusing a forward that reassigns a buffer
    (`self.ema = 0.9 * self.ema + ...`): export traces the new value and drops it -- the program
    would never update the buffer, one process does each step -- where an in-place write
    (`self.ema.mul_(0.9).add_(...)`) it keeps. Seen by torch's buffer-registration hook, which
    Module.__setattr__ calls for a buffer assigned."""
    names = {id(m): prefix for prefix, m in module.named_modules()}
    assigned: list[str] = []

    def seen(mod, name, value):
        # (the buffer itself given back -- `self.steps += 1`, `self.ema = self.ema.to(dtype)` -- loses nothing)
        if id(mod) in names and isinstance(value, torch.Tensor) and value is not mod._buffers.get(name):
            assigned.append(f"{names[id(mod)]}.{name}".lstrip("."))
    hook = torch.nn.modules.module.register_module_buffer_registration_hook(seen)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ep = torch.export.export(module, args, dynamic_shapes=shapes, strict=False)
    finally:
        hook.remove()
    plain = []        # a tensor attribute that is not a buffer, assigned: export says so in a warning
    for w in caught:
        m = re.search(r"tensor attribute (\S+) was assigned during export", str(w.message))
        if m:
            plain.append(m.group(1).removeprefix("self."))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    for name in plain:      # (a cache computed alike each step -- Phi-3's long_inv_freq -- loses nothing)
        shown, attr = _strip(name), name.rsplit(".", 1)[-1]
        warnings.warn(ParallelizeWarning(
            f"the model's forward assigns its tensor attribute {shown}, which is not a registered buffer "
            f"(`self.{attr} = ...`): torch.export reads its first value as a constant, so the program uses that value "
            f"every step. Right where the forward computes the same value each step (a cache); where it updates "
            f"state, register it as a buffer (`self.register_buffer('{attr}', ...)` in __init__) and write it in "
            f"place (`self.{attr}.copy_(new)`)"), stacklevel=2)
    lost = sorted(set(assigned) - set(ep.graph_signature.buffers_to_mutate.values()))
    if lost:
        shown = _strip(lost[0])
        raise ParallelizeError(
            f"the model's forward assigns buffer {shown} a new tensor (`self.{shown.rsplit('.', 1)[-1]} = ...`"
            + (f"; and {len(lost) - 1} more: {', '.join(_strip(n) for n in lost[1:])}" if len(lost) > 1 else "")
            + "): torch.export traces the new value and drops it, so the program would never update the buffer, "
            f"where the model does each step. Write it in place instead: `self.{shown.rsplit('.', 1)[-1]}.copy_(new)` "
            "(under torch.no_grad() where the new value carries a gradient)")
    return ep


def trace(model: torch.nn.Module, example_inputs: tuple = (), *, example_kwargs: dict | None = None,
          loss_fn: Callable[[Any], torch.Tensor] | None = None, batch_dim: int = 0,
          seq_dim: int | None = 1, layers_once: bool = True) -> fx.GraphModule:
    """Trace `model(*example_inputs, **example_kwargs)` (which must yield the loss, or pass
    `loss_fn(output) -> scalar`) into a GraphModule whose placeholders are the parameters,
    the buffers and the flattened user inputs, and whose output is the loss.

    Dim `batch_dim` of every tensor input is the batch (sliced over data parallel ranks), dim
    `seq_dim` the sequence; both stay symbolic. Example batch and sequence sizes must be >= 2
    (export specializes dims of size 0 and 1). Raises ParallelizeError with export's reason.

    `layers_once` (default): where the model's layers are one program over different weights
    (compiler/repeat.py checks), export traces two of them and the graph repeats the second
    for the others: the same graph, in a fraction of the time. TraceInfo.layers says which way
    the graph was made.
    """
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)):
        raise ParallelizeError(f"example_inputs must be a tuple of the model's positional inputs, got "
                               f"{type(example_inputs).__name__}")
    leaves, spec = pytree.tree_flatten((tuple(example_inputs), dict(example_kwargs or {})))
    _check_examples([x for x in leaves if isinstance(x, torch.Tensor)], batch_dim, seq_dim)
    params = list(model.parameters())
    if params and all(p.device.type == "meta" for p in params):
        # a model built on meta traces as its CPU build (fake CPU tensors, see _export), on
        # fake copies of the example: a meta example is made a CPU one of its shape
        leaves = [torch.zeros(x.shape, dtype=x.dtype) if isinstance(x, torch.Tensor) and x.device.type == "meta"
                  else x for x in leaves]
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    _check_experts_implementation(model)
    with _as_it_was(model):
        return _trace(model, loss_fn, leaves, spec, tensors, batch_dim, seq_dim, layers_once)


class _as_it_was:
    """The model's modules as they were before the trace, whatever its forward did to them while
    export ran it: an attribute set (transformers' longrope rotary embedding keeps the long
    factors it computes, `self.long_inv_freq`, a FakeTensor under export) or a buffer registered
    anew (its inv_freq swapped for them). Left in place, the user's model computed with the
    trace's values afterwards and the program's copy of it could not be made. Each module's
    attributes, parameters, buffers and submodules are put back as they were (the same objects)."""

    _DICTS = ("_parameters", "_buffers", "_modules")

    def __init__(self, model: torch.nn.Module):
        self.saved = [(m, dict(vars(m)), {k: dict(getattr(m, k)) for k in self._DICTS if isinstance(getattr(m, k, None), dict)},
                       set(getattr(m, "_non_persistent_buffers_set", ()))) for m in model.modules()]

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for m, attrs, dicts, non_persistent in self.saved:
            d = vars(m)
            for k in [k for k in d if k not in attrs]:
                del d[k]
            for k, v in attrs.items():
                if d.get(k, _as_it_was) is not v:
                    d[k] = v
            for k, contents in dicts.items():
                now = getattr(m, k)
                if now.keys() != contents.keys() or any(now[n] is not v for n, v in contents.items()):
                    now.clear()
                    now.update(contents)
            if isinstance(d.get("_non_persistent_buffers_set"), set) and d["_non_persistent_buffers_set"] != non_persistent:
                d["_non_persistent_buffers_set"].clear()
                d["_non_persistent_buffers_set"].update(non_persistent)


def _trace(model, loss_fn, leaves, spec, tensors, batch_dim, seq_dim, layers_once) -> fx.GraphModule:
    wrapped = _WithLoss(model, loss_fn or default_loss, leaves, spec)
    shapes, user_dims = _dynamic_shapes(tensors, batch_dim, seq_dim)
    statics = [x if not isinstance(x, torch.Tensor) else None for x in leaves]
    how = "traced whole (layers_once=False)"
    if layers_once:
        try:
            return _trace_layers_once(model, wrapped, tensors, shapes, user_dims, spec, statics)
        except repeat.NotRepeatable as e:
            how = f"traced whole: {e}"
    try:
        ep = _export(wrapped, tuple(tensors), {"tensors": shapes})  # keyed by forward(*tensors)
    except ParallelizeError:
        raise                   # (said already: the loss fxtron was given)
    except Exception as e:  # noqa: BLE001 - any export failure is the user's model's
        raise ParallelizeError(
            f"torch.export could not trace {type(model).__name__}: {type(e).__name__}: {e}\n"
            "fxtron needs a model that torch.export(strict=False) can trace with dynamic batch and "
            "sequence dims: no data-dependent Python control flow on tensor values.") from e
    gm = _to_graph_module(ep, model, user_dims, spec, statics)
    info(gm).layers = how
    return gm


def _trace_layers_once(model, wrapped: _WithLoss, tensors, shapes, user_dims, spec, statics) -> fx.GraphModule:
    """Export a twin that keeps two of the model's layers and repeat its second layer over the
    rest (compiler/repeat.py); raises repeat.NotRepeatable wherever that would not give the
    model's own graph."""
    path, layers = repeat.find_layers(model)
    short = repeat.twin(model, path)
    wrapped_short = _WithLoss(short, wrapped.loss_fn, wrapped._leaves, wrapped._spec)
    try:
        repeat.check_same_program(wrapped, wrapped_short, layers, path, tensors, inside="model")
        ep = _export(wrapped_short, tuple(tensors), {"tensors": shapes})
    except (repeat.NotRepeatable, ParallelizeError):
        raise
    except Exception as e:  # noqa: BLE001 - a model that does not run on meta, or exports only whole
        raise repeat.NotRepeatable(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    gm = _to_graph_module(ep, short, user_dims, spec, statics)
    repeat.expand(gm, path, len(layers), dict(model.named_buffers(remove_duplicate=False)))
    info(gm).layers = f"{path}: {len(layers)} layers, traced as {repeat.KEEP}"
    return gm


def _strip(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


_SET_GRAD = torch.ops.higher_order.wrap_with_set_grad_enabled


def inline_grad_regions(gm: fx.GraphModule, *, grad: bool = True, names: dict | None = None) -> None:
    """Export's grad-mode regions (`wrap_with_set_grad_enabled`: a `torch.no_grad()` block or a
    `@torch.no_grad` method, such as DeepSeek-V3.2's sparse-attention indexer) made the graph's
    own ops, so that every pass and sharding rule sees them. A no-grad region's outputs are
    detached where they leave it: no gradient flows back through them, as under no_grad (a
    view made there does not track either); an input handed back unchanged keeps its own. A
    region reads the inputs it does not write detached, so that a write there (a buffer's
    running average of an activation) records no history either; a write into what carries a
    gradient raises ParallelizeError.
    Gradients enabled again inside a no-grad region (whose outputs could then carry one) raise
    ParallelizeError. Edits gm in place; `grad` is the mode the graph runs in; `names` (placeholder
    -> the model's parameter name) names a parameter in those errors."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _SET_GRAD:
            continue
        enabled, holder, args = node.args[0], node.args[1], node.args[2:]
        if enabled and not grad:
            raise ParallelizeError(
                f"gradients enabled (torch.enable_grad) inside a torch.no_grad region, at {_where(node)}: fxtron "
                "inlines grad-mode regions and cannot say which of its outputs carry a gradient; compute that part "
                "outside the no_grad block")
        sub = getattr(gm, holder.target)
        inline_grad_regions(sub, grad=bool(enabled), names=names)      # nested regions first
        inputs = [n for n in sub.graph.nodes if n.op == "placeholder"]
        with gm.graph.inserting_before(node):
            # under no_grad nothing the region computes tracks a gradient, in-place writes too (an
            # EMA of an activation added into a buffer: else the buffer took a gradient history,
            # longer each step): the inputs it reads without writing them, where they may carry a
            # gradient (activations, parameters), are read detached; what it writes stays itself, so
            # that every pass sees the write land there (a write into what carries a gradient --
            # a weight clamped, an activation -- is an error: eager PyTorch writes it unrecorded,
            # which the inlined graph cannot)
            writes = not enabled and any(meta.writes_first(n) for n in sub.graph.nodes)
            written = _written_by(sub, inputs, args) if writes else set()
            tracking = _tracking(gm) if writes else set()
            for a in written:
                if a in tracking:
                    what = (f"the parameter {names[a.name]}, which trains" if names and a.name in names else
                            f"%{a.name}, an activation computed from the parameters")
                    raise ParallelizeError(
                        f"a torch.no_grad block at {_where(node)} writes in place into {what}: eager PyTorch "
                        "writes it unrecorded and keeps its gradient, which fxtron's inlined graph cannot. Change "
                        "a weight outside the forward (after optimizer.step()); for an activation write the new "
                        "value with the gradient passed through as it is, outside no_grad: "
                        "`h = h + (h.clamp(...) - h).detach()`")
            held = {a: _detached(gm.graph, a) if writes and a not in written and a in tracking else a
                    for a in args if isinstance(a, fx.Node)}
            val_map = {n: held.get(a, a) if isinstance(a, fx.Node) else a for n, a in zip(inputs, args)}
            for n in sub.graph.nodes:
                if n.op == "get_attr":
                    raise ParallelizeError(f"a torch.no_grad region at {_where(node)} reads the attribute {n.target} "
                                           "(export lifts parameters and constants: this graph is not one fxtron knows)")
            outs = gm.graph.graph_copy(sub.graph, val_map)
            outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
            for d in held.values():
                if d not in args and not d.users:
                    gm.graph.erase_node(d)
            if not enabled:
                kept = set(args)
                outs = [_detached(gm.graph, o) if isinstance(o, fx.Node) and o not in kept
                        and isinstance(o.meta.get("val"), torch.Tensor) else o for o in outs]
                for n in [*val_map.values(), *outs]:
                    if isinstance(n, fx.Node) and n not in kept and n.graph is gm.graph:
                        meta.set(n, meta.NO_GRAD, True)
        for user in list(node.users):
            if user.op != "call_function" or user.target is not operator.getitem:
                raise ParallelizeError(f"a torch.no_grad region's result at {_where(node)} is used whole by "
                                       f"%{user.name}, not one output at a time")
            user.replace_all_uses_with(outs[user.args[1]])
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        if not holder.users:
            gm.graph.erase_node(holder)
            if not any(n.op == "get_attr" and n.target == holder.target for n in gm.graph.nodes):
                delattr(gm, holder.target)
    gm.graph.lint()
    gm.recompile()


def _written_by(sub: fx.GraphModule, inputs: list, args: tuple) -> set:
    """The region's arguments (of `args`, by its placeholders `inputs`) its in-place ops write,
    through views too."""
    out = set()
    for n in sub.graph.nodes:
        if meta.writes_first(n):
            out |= {a for p, a in zip(inputs, args) if p in meta.written(n)}
    return out


def _tracking(gm: fx.GraphModule) -> set:
    """The values of `gm` that carry a gradient when it runs: the inputs that require one
    (parameters) and the floating-point values computed from them, not through a detach (an
    argmax's indices carry none)."""
    got = set()
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if n.op == "placeholder":
            if isinstance(val, torch.Tensor) and val.requires_grad:
                got.add(n)
        elif n.op == "call_function" and n.target is not torch.ops.aten.detach.default \
                and any(a in got for a in n.all_input_nodes) \
                and not (isinstance(val, torch.Tensor) and not (val.is_floating_point() or val.is_complex())):
            got.add(n)
    return got


def _detached(graph: fx.Graph, value: fx.Node) -> fx.Node:
    out = graph.call_function(torch.ops.aten.detach.default, (value,))
    out.meta.update({k: v for k, v in value.meta.items() if k in ("nn_module_stack", "stack_trace", "tensor_meta")})
    out.meta["val"] = value.meta["val"].detach()
    return out


def _where(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return f"%{node.name} in {_clean_path(list(stack.values())[-1][0]) or '(top level)'}" if stack else f"%{node.name}"


# ops export keeps under an alias's name (torch.concatenate, torch.concat), renamed to the op
_ALIASES = {torch.ops.aten.concatenate.default: torch.ops.aten.cat.default,
            torch.ops.aten.concat.default: torch.ops.aten.cat.default}


def _to_graph_module(ep: ExportedProgram, model: torch.nn.Module, user_dims, in_spec, statics) -> fx.GraphModule:
    sig = ep.graph_signature
    gm = ep.graph_module
    inline_grad_regions(gm, names={spec.arg.name: _strip(spec.target) for spec in sig.input_specs
                                   if spec.kind == InputKind.PARAMETER})
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]

    # Tied parameters (lm_head.weight is wte.weight) are two placeholders of one tensor; keep
    # the name named_parameters() reports and route every use of the alias to it.
    canonical = {id(p): n for n, p in model.named_parameters()}
    aliases = {n: canonical[id(p)] for n, p in model.named_parameters(remove_duplicate=False)
               if canonical[id(p)] != n}

    params, buffers, constants = [], [], {}
    by_target: dict[str, fx.Node] = {}
    user_index = 0
    for node, spec in zip(placeholders, sig.input_specs):
        if spec.kind == InputKind.PARAMETER:
            name = _strip(spec.target)
            name = aliases.get(name, name)
            if name in by_target:  # second placeholder of a tied weight
                node.replace_all_uses_with(by_target[name])
                graph.erase_node(node)
                continue
            by_target[name] = node
            params.append(name)
            node._rename(name.replace(".", "_"))
            meta.set(node, meta.INPUT, meta.InputSpec("parameter", name))
        elif spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            name = _strip(spec.target)
            if spec.kind == InputKind.CONSTANT_TENSOR:
                constants[name] = ep.constants[spec.target]
            elif not spec.persistent:
                constants[name] = ep.constants[spec.target]
            buffers.append(name)
            node._rename("buf_" + name.replace(".", "_"))
            meta.set(node, meta.INPUT, meta.InputSpec("buffer", name))
        elif spec.kind == InputKind.USER_INPUT:
            node._rename(f"input_{user_index}")
            meta.set(node, meta.INPUT, meta.InputSpec("user", node.name, user_index, user_dims[user_index]))
            user_index += 1
        else:
            raise ParallelizeError(f"unsupported exported input {spec.kind} for {node.name}")

    # Name export's symbols B and S by the role most inputs give them (the first input's on a tie):
    # an (S, S) mask passed first has its batch_dim position equated with the sequence, and must
    # not name the sequence B
    votes: dict[sympy.Symbol, collections.Counter] = collections.defaultdict(collections.Counter)
    for node in placeholders:
        if node.graph is not graph or meta.get(node, meta.INPUT) is None:
            continue
        spec = meta.get(node, meta.INPUT)
        if spec.kind != "user" or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        for size, role in zip(node.meta["val"].shape, spec.dims):
            if isinstance(size, torch.SymInt) and role is not None:
                sym = sympy.sympify(size.node.expr)
                if isinstance(sym, sympy.Symbol):
                    votes[sym][role] += 1
    # (most_common keeps the first-counted role first among equal counts)
    symbols: dict[sympy.Symbol, sympy.Symbol] = {sym: BATCH if roles.most_common(1)[0][0] == "batch" else SEQ
                                                 for sym, roles in votes.items()}

    buffer_mutations = {}
    for i, spec in enumerate(sig.output_specs):
        if spec.kind == OutputKind.BUFFER_MUTATION:
            buffer_mutations[i] = _strip(spec.target)
        elif spec.kind != OutputKind.USER_OUTPUT:
            raise ParallelizeError(f"unsupported exported output {spec.kind} ({spec.target})")

    for node in graph.nodes:
        if node.op == "call_function" and node.target in _ALIASES:
            node.target = _ALIASES[node.target]          # one op, one name: the rules know the canonical one
        stack = node.meta.get("nn_module_stack") or {}
        path = _clean_path(list(stack.values())[-1][0]) if stack else ""
        meta.set(node, meta.MODULE, path)
        meta.set(node, meta.PROVENANCE, meta.Provenance("trace"))
    graph.lint()
    out = fx.GraphModule(gm, graph)
    signature = [None] * len(user_dims)
    for node in placeholders:
        spec = meta.get(node, meta.INPUT) if node.graph is graph else None
        val = node.meta.get("val")
        if spec is not None and spec.kind == "user" and isinstance(val, torch.Tensor):
            signature[spec.index] = (val.dtype, tuple(
                sympy.sympify(d.node.expr).xreplace(symbols) if isinstance(d, torch.SymInt) else sympy.Integer(int(d))
                for d in val.shape))
    returned = next(n for n in graph.nodes if n.op == "output").args[0]
    out.meta[TRACE_INFO] = TraceInfo(params=params, buffers=buffers, user_dims=list(user_dims),
                                     symbols=symbols, in_spec=in_spec, statics=statics, aliases=aliases,
                                     buffer_mutations=buffer_mutations, constants=constants,
                                     signature=signature, token_ranges=limits.token_ranges(out),
                                     ranges=_narrowed_ranges(ep, symbols),
                                     loss_dtype=_loss_gradient_dtype(returned, buffer_mutations))
    return out


#: the range torch.export gives a dynamic dim it has no reason to narrow (0 and 1 specialize)
_EXPORT_RANGE = (2, None)


def _infinite(bound) -> bool:
    from torch.utils._sympy.numbers import int_oo
    return bound in (int_oo, -int_oo, sympy.oo, -sympy.oo)


def _narrowed_ranges(ep: ExportedProgram, symbols: dict) -> dict:
    """B's and S's ranges where the model narrowed export's default [2, oo): its code branched
    on the size (`if ids.shape[1] > 8:`), export guarded the branch it took (S >= 9), and the
    graph holds that branch alone, so a size outside would compute what the model does not.
    The intersection over the inputs' symbols of each (every input's S is one length)."""
    out: dict = {}
    for sym, name in symbols.items():
        vr = ep.range_constraints.get(sym)
        if vr is None:
            continue
        lo = 0 if _infinite(vr.lower) else int(vr.lower)
        hi = None if _infinite(vr.upper) else int(vr.upper)
        old_lo, old_hi = out.get(name, (0, None))
        out[name] = (max(lo, old_lo), hi if old_hi is None else old_hi if hi is None else min(hi, old_hi))
    return {k: v for k, v in out.items() if v[0] > _EXPORT_RANGE[0] or v[1] is not None}


#: ops whose inputs receive their output's gradient whole, or a multiple of it: a sum, a
#: difference, a cast, a view, a copy, a product or a quotient
_PASS_GRADIENT = (opsets.CASTS | opsets.VIEWS | (opsets.COPIES - {aten.detach.default}) | opsets.ADDS | opsets.NEGS
                  | opsets.MULS | opsets.DIVS | {operator.getitem})


def _loss_gradient_dtype(returned, buffer_mutations) -> torch.dtype | None:
    """The loss's dtype (the graph's first tensor output), or float16 where an fp16 value
    receives the loss's gradient as backward starts -- the loss itself, or what it is a sum,
    cast, view or multiple of (an fp16 cross entropy added to an fp32 auxiliary loss: the sum is
    fp32, and the cross entropy's gradient the loss scale in fp16): fp16's loss scale is then
    capped to a value fp16 holds (runtime/precision.py LossScaler)."""
    first = next((v for i, v in enumerate(returned) if i not in buffer_mutations and isinstance(v, fx.Node)
                  and isinstance(v.meta.get("val"), torch.Tensor)), None)
    if first is None:
        return None
    seen, todo = {first}, [first]
    while todo:
        node = todo.pop()
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dtype == torch.float16:
            return torch.float16
        if node.op == "call_function" and node.target in _PASS_GRADIENT:
            for arg in node.all_input_nodes:
                if arg not in seen:
                    seen.add(arg)
                    todo.append(arg)
    return first.meta["val"].dtype


def _clean_path(path: str) -> str:
    """nn_module_stack paths look like 'L__self___model_blocks_0' under strict export and like
    'model.blocks.0' or "getattr(L['self'].model.blocks, '0')" otherwise; keep the dotted form."""
    if path.startswith("_empty_nn_module_stack"):   # export's placeholder for "no module" (size nodes)
        return ""
    path = path.replace("L['self'].", "").replace("getattr(", "").replace(")", "")
    path = path.replace(", '", ".").replace("'", "")
    return _strip(path) if path != "model" else ""


__all__ = ["BATCH", "SEQ", "TraceInfo", "default_loss", "info", "trace"]
