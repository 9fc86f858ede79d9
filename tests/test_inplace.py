"""In-place writes, without processes: a gradient written into memory in place reaches that
memory's later readers through every view, piece and in-place result that shares it, and no
further -- a parameter read only for its shape (`zeros_like(p)`) takes none. Each model trains at
world 1 against the unmodified model in one process: losses, first-step gradients (None where the
model's is None: AdamW's decay then leaves the parameter as the model does) and weights. At tp=2,
compile-only: an in-place op's destination is never handed a redistributed copy while the
memory is read afterwards (a whole buffer stays whole; what no placement makes exact is an
error)."""
from __future__ import annotations

import copy

import pytest
import torch

import fxtron
from fxtron.core import meta
from fxtron.compiler.trace import trace
from fxtron.tools.testing import adamw, assert_trains_like, reference_training, run_on_ranks, train_program
from tp_models import batch, make


class _Written(torch.nn.Module):
    """up(x) written in place into a part of a fresh buffer (by `how`); down reads the buffer
    afterwards, so up's gradient reaches the loss only through that write."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.up = torch.nn.Linear(4, 4, bias=False)
        self.down = torch.nn.Linear(8, 4, bias=False)

    def forward(self, x):
        y = self.up(x)                                      # (B, S, 4)
        buf = x.new_zeros(x.shape[0], x.shape[1], 8)
        how, read = self.how, buf
        if how == "tensor_split":                           # a piece: getitem of tensor_split's list
            buf.tensor_split(2, dim=-1)[1].copy_(y)
        elif how == "movedim":
            buf.movedim(-1, 0)[:4].copy_(y.movedim(-1, 0))
        elif how == "view_as_real":                         # a complex view's real parts
            torch.view_as_real(torch.view_as_complex(buf.unflatten(-1, (4, 2))))[..., 0].copy_(y)
        elif how == "in_place_result":                      # a view of mul_'s result; read through an earlier view
            read = buf.unflatten(-1, (2, 4))
            buf.mul_(2.0)[..., 4:].copy_(y)
            read = read.flatten(-2)
        elif how == "view_of_slice":                        # a view of the written slice, made before the write
            part = buf[..., :4]
            early = part.unflatten(-1, (2, 2))
            part.copy_(y)
            read = torch.nn.functional.pad(early.flatten(-2), (0, 4))
        elif how == "view_dtype":                           # a view autograd does not differentiate: no gradient
            buf.view(torch.float32)[..., :4].copy_(y)
        elif how == "narrow":
            buf.narrow(-1, 2, 4).copy_(y)
        return self.down(read).pow(2).mean()


class _ShapeOnly(torch.nn.Module):
    """A parameter whose one use is lending its shape to a fresh buffer (`how`) then written
    into: the model leaves its .grad None, and AdamW's weight decay leaves it where it was."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.up = torch.nn.Linear(4, 4, bias=False)
        self.shape_only = torch.nn.Parameter(torch.randn(2, 3, 4))

    def forward(self, x):
        p, how = self.shape_only, self.how
        out = (torch.zeros_like(p) if how == "zeros_like" else p.new_zeros(p.shape) if how == "new_zeros"
               else torch.zeros_like(p.view(6, 4)).view(2, 3, 4))
        h = self.up(x)
        for i in range(3):
            out[:, i] = h[:, i] * 2
        return out.pow(2).mean()


def _trains_like_one_process(model, x, steps: int = 2):
    ref = reference_training(copy.deepcopy(model), [(x,)] * steps, adamw(lr=1e-2))
    prog = fxtron.parallelize(copy.deepcopy(model), fxtron.Mesh(1), example_inputs=(x,)).program(0)
    got = train_program(prog, [((x,), {})] * steps, adamw(lr=1e-2)(prog.parameters()))
    assert_trains_like(got, ref)        # the gradients' keys too: None where the model's is None
    return ref


class RunningMean(torch.nn.Module):
    """A buffer holding a running average of an activation's batch mean, updated in place under
    torch.no_grad() (an EMA of features), read after the update ("after") or before it ("before")."""

    def __init__(self, read: str = "after"):
        super().__init__()
        self.read = read
        self.l1, self.l2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        self.register_buffer("ema", torch.zeros(16))

    def forward(self, x, y):
        h = torch.relu(self.l1(x))
        if self.read == "before":
            loss = torch.nn.functional.cross_entropy(self.l2(h - self.ema), y)
        with torch.no_grad():
            self.ema.mul_(0.9).add_(h.mean(0) * 0.1 + self.l1.weight.sum(1) * 0.01)
        if self.read == "before":
            return loss
        return torch.nn.functional.cross_entropy(self.l2(h - self.ema), y)


def running_mean_items(steps: int = 3, batch: int = 8) -> list[tuple]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(batch, 8, generator=g), torch.randint(0, 4, (batch,), generator=g)) for _ in range(steps)]


def _trains_at_world_one(model):
    """`model` trained three steps at world 1 equal to one process (the gradients' keys too):
    its program."""
    items = running_mean_items()
    ref = reference_training(copy.deepcopy(model), items, adamw(lr=1e-2))
    prog = fxtron.parallelize(copy.deepcopy(model), fxtron.Mesh(1), example_inputs=items[0]).program(0)
    got = train_program(prog, [(b, {}) for b in items], adamw(lr=1e-2)(prog.parameters()))
    assert set(got["grads"]) == set(ref["grads"])
    assert_trains_like(got, ref)
    return prog


@pytest.mark.parametrize("read", ["after", "before"])
def test_a_buffer_written_under_no_grad_from_activations_records_no_history(read):
    """Under torch.no_grad() the running average's update records no gradient history, though
    it reads an activation and a weight: the inlined no-grad region reads them detached. The
    buffer took a history before, one step longer each step (a leak), and read before its update
    the second step's backward walked into the first's freed graph (an error)."""
    torch.manual_seed(0)
    prog = _trains_at_world_one(RunningMean(read))
    assert prog.ema.grad_fn is None and not prog.ema.requires_grad


class _NoGradWrites(RunningMean):
    """Writes under torch.no_grad(): into what trains, a weight clamped in place ("weight") or an
    activation clamped in place and used on ("activation"); or DINO's center of the batch's
    outputs into a frozen parameter ("center")."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.center = torch.nn.Parameter(torch.zeros(4), requires_grad=False)

    def forward(self, x, y):
        if self.kind == "weight":
            with torch.no_grad():
                self.l1.weight.clamp_(-0.2, 0.2)
        h = self.l1(x)
        if self.kind == "activation":
            with torch.no_grad():
                h.clamp_(-0.3, 0.3)
        t = self.l2(torch.relu(h))
        loss = torch.nn.functional.cross_entropy(t - self.center, y)
        if self.kind == "center":
            with torch.no_grad():
                self.center.mul_(0.9).add_(t.mean(0), alpha=0.1)
        return loss


class _PassedThrough(_NoGradWrites):
    """The activation case as the refusal suggests it: the clamped values, the gradient passed
    through as it is -- what eager PyTorch's unrecorded no_grad write computes."""

    def forward(self, x, y):
        h = self.l1(x)
        h = h + (h.clamp(-0.3, 0.3) - h).detach()
        return torch.nn.functional.cross_entropy(self.l2(torch.relu(h)) - self.center, y)


@pytest.mark.parametrize("kind, what", [("weight", "the parameter l1.weight, which trains"),
                                        ("activation", r"%\w+, an activation computed from the parameters")])
def test_a_no_grad_block_writing_into_what_carries_a_gradient_is_refused(kind, what):
    """A weight that trains clamped in place under no_grad, or an activation: eager PyTorch writes
    it unrecorded and keeps its gradient, which the inlined graph cannot -- recorded, the write
    cut the activation's gradient (8.3e-3 off the losses, silently), and read through a detached
    copy a weight took none. An error naming the tensor and what to do instead; the activation's
    suggested rewrite trains as the model does in one process."""
    with pytest.raises(fxtron.ParallelizeError, match=r"torch.no_grad block .* writes in place into " + what):
        fxtron.parallelize(_NoGradWrites(kind), fxtron.Mesh(1), example_inputs=running_mean_items()[0])
    if kind == "activation":
        torch.manual_seed(0)
        model = _NoGradWrites(kind)
        rewritten = _PassedThrough(kind)
        rewritten.load_state_dict(model.state_dict())
        items = running_mean_items()
        ref = reference_training(model, items, adamw(lr=1e-2))
        prog = fxtron.parallelize(rewritten, fxtron.Mesh(1), example_inputs=items[0]).program(0)
        assert_trains_like(train_program(prog, [(b, {}) for b in items], adamw(lr=1e-2)(prog.parameters())), ref)


class _IndicesWritten(RunningMean):
    def forward(self, x, y):
        h = self.l1(x)
        idx = h.argmax(-1)                      # computed from a weight, but integers: no gradient
        with torch.no_grad():
            idx[idx > 10] = 0
        return (torch.nn.functional.cross_entropy(self.l2(torch.relu(h)), y)
                + 0.01 * torch.nn.functional.embedding(idx, self.l2.weight.t()).sum())


def test_a_no_grad_write_into_integers_computed_from_weights_trains():
    """Indices an argmax computes from the weights carry no gradient: a no_grad write into them
    is the model's own, not refused (review of the refusal above), and trains as one process."""
    torch.manual_seed(0)
    _trains_at_world_one(_IndicesWritten())


class _Reassigned(RunningMean):
    def forward(self, x, y):
        h = torch.relu(self.l1(x))
        loss = torch.nn.functional.cross_entropy(self.l2(h - self.ema), y)
        self.ema = 0.9 * self.ema + 0.1 * h.mean(0).detach()
        return loss


class _PlainAttribute(RunningMean):
    def __init__(self):
        super().__init__()
        self.scale = torch.ones(4)          # a tensor attribute, not a buffer

    def forward(self, x, y):
        out = torch.nn.functional.cross_entropy(self.l2(torch.relu(self.l1(x))) * self.scale, y)
        self.scale = self.scale * 0.5
        return out


def test_a_buffer_the_forward_reassigns_is_refused_a_tensor_attribute_said():
    """`self.ema = ...` in the forward: torch.export traces the new value and drops it, so the
    program never updated the buffer (0.156 off one process's after three steps, silently): an
    error naming it and the in-place write that works. A tensor attribute that is not a buffer
    export reads as a constant (torch's UserWarning alone; a small model's second loss 0.080 off
    one process's): fxtron's warning names it, since a cache computed alike each step (Phi-3's
    long_inv_freq) loses nothing."""
    with pytest.raises(fxtron.ParallelizeError, match=r"assigns buffer ema a new tensor.*self\.ema\.copy_\(new\)"):
        fxtron.parallelize(_Reassigned(), fxtron.Mesh(1), example_inputs=running_mean_items()[0])
    with pytest.warns(fxtron.ParallelizeWarning, match=r"tensor attribute scale, which is not a registered buffer"):
        fxtron.parallelize(_PlainAttribute(), fxtron.Mesh(1), example_inputs=running_mean_items()[0])


class _GivenBack(RunningMean):
    def forward(self, x, y):
        self.ema += 1                           # the buffer itself given back to the attribute
        self.ema = self.ema.to(x.dtype)         # (the same tensor: nothing lost)
        return torch.nn.functional.cross_entropy(self.l2(torch.relu(self.l1(x)) - self.ema), y)


def test_a_buffer_given_back_to_its_attribute_is_not_refused():
    """`self.steps += 1` assigns the attribute the buffer it holds, written in place; so does a
    `.to` that changes nothing: export keeps the write, and the model trains as one process (a
    review found both refused as reassignments)."""
    torch.manual_seed(0)
    _trains_at_world_one(_GivenBack())


def _running_mean_job(rank: int, mesh: fxtron.Mesh) -> dict:
    items = running_mean_items()
    out = {}
    for name, make_model in (("buffer", lambda: RunningMean("before")), ("center", lambda: _NoGradWrites("center"))):
        torch.manual_seed(0)
        prog = fxtron.parallelize(make_model(), mesh, example_inputs=items[0]).program(rank)
        out[name] = train_program(prog, [(b, {}) for b in items], adamw(lr=1e-2)(prog.parameters()))
    return out


def test_a_buffer_s_running_batch_mean_is_the_global_batch_s_at_dp2():
    """The loss reads the running average before its update, so the step's loss does not depend
    on the update's batch mean; the next step's does, through the buffer. Each dp rank averaged
    its own samples -- the ranks' buffers 0.085 apart, later losses 1.8e-3 off one process,
    silently --; the mean a buffer takes is the global batch's now, as the loss's statistics are
    (passes/statistics.py _upstream), and so is DINO's center in a frozen parameter (0.0186 off)."""
    items = running_mean_items()
    refs = {}
    for name, make_model in (("buffer", lambda: RunningMean("before")), ("center", lambda: _NoGradWrites("center"))):
        torch.manual_seed(0)
        refs[name] = reference_training(make_model(), items, adamw(lr=1e-2))
    for rank, got in enumerate(run_on_ranks(_running_mean_job, fxtron.Mesh(2), fxtron.Mesh(2))):
        for name, ref in refs.items():
            assert_trains_like(got[name], ref, rank=rank)


@pytest.mark.parametrize("how", ["tensor_split", "movedim", "view_as_real", "in_place_result", "view_of_slice",
                                 "narrow"])
def test_a_write_through_any_view_carries_its_gradient_to_the_base(how):
    """Before, tensor_split's pieces, movedim, view_as_real/complex, a view of an in-place op's
    result and a view of the written slice made before the write were not known to share the
    written memory: up's .grad None, never trained (the second loss already off by ~5e-3)."""
    ref = _trains_like_one_process(_Written(how), torch.randn(2, 3, 4))
    assert "up.weight" in ref["grads"]


def test_a_write_through_view_dtype_takes_no_gradient_as_in_the_model():
    """view(dtype) is a view autograd does not differentiate: the model's up takes no gradient
    through it, and neither does the program's."""
    ref = _trains_like_one_process(_Written("view_dtype"), torch.randn(2, 3, 4))
    assert "up.weight" not in ref["grads"]


@pytest.mark.parametrize("how", ["zeros_like", "new_zeros", "zeros_like_of_view"])
def test_a_parameter_lending_only_its_shape_takes_no_gradient(how):
    """Before, the walk from the written buffer went on through zeros_like to the parameter:
    a zero .grad where the model's is None, and weight decay moved it (by ~5e-3 in two steps)."""
    model = _ShapeOnly(how)
    x = torch.randn(2, 3, 4)
    gm = trace(model, (x,))
    p = next(n for n in gm.graph.nodes if meta.param_name(n) == "shape_only")
    assert p not in meta.reaches_loss(gm)
    ref = _trains_like_one_process(model, x)
    assert "shape_only" not in ref["grads"]


def test_the_aliasing_tables_name_only_views():
    """Every op the walk treats as sharing its input's memory says so in its schema
    (`Tensor(a) self -> Tensor(a)`, a list for the pieces), and writes nothing -- but
    _unsafe_view, reshape's decomposition over memory it owns, whose schema claims no alias."""
    for op in (meta._ALIASING | meta._ALIASING_PIECES) - {torch.ops.aten._unsafe_view.default}:
        first, ret = op._schema.arguments[0].alias_info, op._schema.returns[0]
        assert first is not None and not first.is_write, op
        assert ret.alias_info is not None or str(ret.type) == "List[Tensor]", op


def test_a_whole_buffer_written_in_place_by_split_values_stays_whole_at_tp2():
    """add_ / masked_fill_ into slices of a whole buffer, of values split by the colwise up:
    the buffer stays whole, the values are gathered into it (before, the pointwise rule wanted
    the slice split: a scatter made a copy, the write landed there and the buffer's later
    readers saw zeros -- the first loss off by 0.03; tests/test_tensor_parallel.py trains it,
    in-place-mlp). Compile-only: nothing of fxtron's sits between a written slice and its write."""
    args, kwargs = batch("in-place-mlp", 2, 8, seed=0)
    pm = fxtron.parallelize(make("in-place-mlp"), fxtron.Mesh(2, tp=2), example_inputs=args, example_kwargs=kwargs)
    gm = pm.compiled(0).gm
    writes = [n for n in gm.graph.nodes if meta.writes_first(n)]
    assert {n.target for n in writes} == {torch.ops.aten.add_.Tensor, torch.ops.aten.masked_fill_.Scalar}
    for n in writes:
        assert n.args[0].target == torch.ops.aten.slice.Tensor, n.format_node()
        assert n.args[0].args[0].target == torch.ops.aten.new_zeros.default


class _PartialWrittenThroughView(torch.nn.Module):
    """A row-split linear's output (a partial sum on each tp rank) written in place, and read
    afterwards through a view made before the write."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(8, 16, bias=False)
        self.down = torch.nn.Linear(16, 8, bias=False)

    def forward(self, x):
        h = self.down(torch.relu(self.up(x)))
        v = h.unflatten(-1, (2, 4))
        h.add_(x)
        return v.pow(2).mean()


def test_a_write_into_a_partial_sum_read_through_another_name_is_an_error():
    """What no placement makes exact is an error naming the op and the reader: the partial sum
    reduced first would be a copy, and the view read after the write would see the old values."""
    pm = fxtron.parallelize(_PartialWrittenThroughView(), fxtron.Mesh(2, tp=2), example_inputs=(torch.randn(2, 3, 8),),
                            plan={"up": "colwise", "down": "rowwise"})
    with pytest.raises(fxtron.ParallelizeError, match=r"%add_ \(aten.add_.Tensor.*writes in place into %linear_1, "
                                                      r"which is tp:P\(sum\).*%pow_1 reads the written memory"):
        pm.compiled(0)


class _BufferLoss(torch.nn.Module):
    """The loss accumulated into a buffer in place and returned: the buffer itself is the output."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(4, 4, bias=False)
        self.register_buffer("acc", torch.zeros(()))

    def forward(self, x):
        self.acc.detach_().zero_()
        self.acc.add_(self.up(x).pow(2).mean())
        return self.acc


def test_a_buffer_written_in_place_and_returned_carries_the_loss():
    """The loss is a buffer written in place and returned (export keeps the write in the graph;
    the output is the write itself): up takes its gradient, the program trains as the model."""
    ref = _trains_like_one_process(_BufferLoss(), torch.randn(2, 3, 4))
    assert "up.weight" in ref["grads"]


class _Block(torch.nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("state", torch.zeros(3, 4))

    def forward(self, h):
        if self.how == "returned":             # the layer's output is the buffer, written in place
            self.state.detach_().copy_(self.lin(h).mean(0))
            return self.state.expand(h.shape)
        if self.how == "copied":               # ... a copy of it: each microbatch its own
            self.state.detach_().copy_(self.lin(h).mean(0))
            return self.state.clone().expand(h.shape)
        h = self.lin(h)
        if self.how == "shared":
            self.state.detach_().copy_(h.mean(0))
        return h


class _Stages(torch.nn.Module):
    """Two layers, one a pipeline stage each at pp=2; `how`: what the first does with its buffer."""

    def __init__(self, how: str):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(how), _Block("plain")])

    def forward(self, x):
        early = self.blocks[0].state.view(12)  # "shared": the buffer viewed, written on stage 0, read on stage 1
        h = self.blocks[0](x)
        if self.blocks[0].how == "shared":
            h = h + early.view(3, 4)
        return self.blocks[1](h).pow(2).mean()


@pytest.mark.parametrize("how,match", [
    ("returned", r"buffer blocks\.0\.state is written in place in forward \(%copy_.*\) and its memory \(%expand\) is a "
                 r"pipeline stage's output.*buf\.clone\(\)"),
    ("shared", r"buffer blocks\.0\.state is written in place in forward on pipeline stage 0 .* read afterwards on stage 1")])
def test_pipeline_stages_refuse_a_buffer_written_in_place_that_leaves_its_stage(how, match):
    """pp=2, compile-only. Before: the returned buffer failed in backward with torch's "backward
    through the graph a second time" (both microbatches' outputs one tensor), and the buffer read
    on stage 1 read that rank's own copy, never written (pp's check of buffer writes read export's
    mutation outputs, which export no longer makes). A copy returned compiles."""
    x = torch.randn(8, 3, 4)
    with pytest.raises(fxtron.ParallelizeError, match=match):
        fxtron.parallelize(_Stages(how), fxtron.Mesh(2, pp=2), example_inputs=(x,), microbatches=2).compiled(0)
    fxtron.parallelize(_Stages("copied"), fxtron.Mesh(2, pp=2), example_inputs=(x,), microbatches=2).compiled(0)


class _Counted(torch.nn.Module):
    """Four layers and a step counter buffer t (no activation feeds its add_): `how` "early" reads
    t in the first layer, before the count at the end; "first" counts before the layers and every
    layer reads the count."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4))
        self.register_buffer("t", torch.zeros(()))

    def forward(self, x):
        if self.how == "first":
            self.t.add_(1)
        g = torch.sigmoid(self.t / 100)
        for i, layer in enumerate(self.layers):
            x = layer(x) * (1 + g) if i == 0 or self.how == "first" else layer(x)
        if self.how == "early":
            self.t.add_(1)
        return x.pow(2).mean()


def test_pipeline_stages_and_a_counter_no_activation_feeds():
    """A count at the end read in the first layer: stage 0 would read its own copy, which only
    the last stage counts (a stale value each step, silently): an error. A count before the
    layers that every layer reads is made by every stage that reads it, on its own copy (as
    before: giving such a write one stage failed to build the others' graphs)."""
    x = torch.randn(8, 4)
    with pytest.raises(fxtron.ParallelizeError, match=r"buffer t is written in place in forward on pipeline stage 1 "
                                                      r"\(%add_.*\) and read before it \(the value the previous step "
                                                      r"wrote\) on stage 0"):
        fxtron.parallelize(_Counted("early"), fxtron.Mesh(2, pp=2), example_inputs=(x,), seq_dim=None).compiled(0)
    pm = fxtron.parallelize(_Counted("first"), fxtron.Mesh(2, pp=2), example_inputs=(x,), seq_dim=None)
    for rank in range(2):
        assert any(str(n.target) == "aten.add_.Tensor" for st in pm.compiled(rank).stages for n in st.gm.graph.nodes)
