"""Tracing a model's repeated layers once (compiler/repeat.py): the graph made from a twin
with two layers is the graph a whole export makes, node for node, for the shipped and
transformers' models; models whose layers are not one program are traced whole."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from fxtron.core import meta
from fxtron.compiler.trace import trace
from fxtron.core.meta import info
from tp_models import MORE_NAMES, NAMES, batch, loss_of, make


def _inputs(gm, model):
    ti = info(gm)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    return [params[n] for n in ti.params] + [buffers.get(n, ti.constants.get(n)) for n in ti.buffers]


def assert_same_graph(a, b):
    """Node for node: op, target, arguments (through the node correspondence), module path,
    placeholder meaning and symbolic shape; and the same TraceInfo."""
    ia, ib = info(a), info(b)
    assert (ia.params, ia.buffers, ia.aliases, ia.user_dims, ia.buffer_mutations) == \
        (ib.params, ib.buffers, ib.aliases, ib.user_dims, ib.buffer_mutations)
    assert ia.constants.keys() == ib.constants.keys()
    na, nb = list(a.graph.nodes), list(b.graph.nodes)
    assert len(na) == len(nb)
    env = {}
    for x, y in zip(na, nb):
        where = f"{x.name} / {y.name}"
        assert (x.op, x.target) == (y.op, y.target), where
        assert meta.get(x, meta.MODULE) == meta.get(y, meta.MODULE), where
        assert meta.get(x, meta.INPUT) == meta.get(y, meta.INPUT), where
        lx, sx = pytree.tree_flatten((x.args, x.kwargs))
        ly, sy = pytree.tree_flatten((y.args, y.kwargs))
        assert sx == sy, where
        for u, v in zip(lx, ly):
            assert env[u] is v if isinstance(u, torch.fx.Node) else u == v, where
        vx, vy = x.meta.get("val"), y.meta.get("val")
        if isinstance(vx, torch.Tensor):
            assert ia.shape(vx) == ib.shape(vy) and vx.dtype == vy.dtype, where
        env[x] = y


# exported whole, and saying why: OLMoE's experts run transformers' grouped_mm fallback, which
# the fake-tensor layer check cannot run in fp32 (torch._grouped_mm's fake kernel wants bf16);
# Gemma2/3 alternate sliding-window and global attention, so their layers differ
WHOLE = {"hf-olmoe": "BF16", "hf-gemma2": "runs a different program", "hf-gemma3": "runs a different program"}
REPEATED = [n for n in NAMES + MORE_NAMES if n not in WHOLE]


@pytest.mark.parametrize("name", list(WHOLE))
def test_a_model_whose_layers_cannot_repeat_is_exported_whole_and_says_why(name):
    args, kwargs = batch(name, 2, 8, seed=0)
    layers = info(trace(make(name, layers=4), args, example_kwargs=kwargs)).layers
    assert layers.startswith("traced whole: ") and WHOLE[name] in layers, layers


@pytest.mark.parametrize("name", REPEATED)
def test_layers_traced_once_give_the_whole_export(name):
    model = make(name, layers=4)
    args, kwargs = batch(name, 2, 8, seed=0)
    once = trace(model, args, example_kwargs=kwargs)
    assert info(once).layers.endswith("4 layers, traced as 2"), info(once).layers
    whole = trace(model, args, example_kwargs=kwargs, layers_once=False)
    assert_same_graph(once, whole)
    # and it computes the model's loss at another batch and sequence length
    args, kwargs = batch(name, 3, 12, seed=1)
    flat = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    torch.testing.assert_close(once(*_inputs(once, model), *flat)[0], loss_of(model, args, kwargs),
                               rtol=1e-6, atol=1e-6)


def test_models_that_ask_whether_they_are_traced_repeat():
    """transformers' mask code checks `is_tracing(tensor)` (fake tensors count) before reading a
    tensor's value: the layer check runs on fake tensors, as export does, so it takes the same
    path (here HF Llama without a KV cache)."""
    model = make("hf-llama", layers=4)
    _, kwargs = batch("hf-llama", 2, 8, seed=0)
    kwargs["use_cache"] = False
    once = trace(model, (), example_kwargs=kwargs)
    assert info(once).layers.endswith("4 layers, traced as 2"), info(once).layers
    assert_same_graph(once, trace(model, (), example_kwargs=kwargs, layers_once=False))


def test_dropout_and_meta_models_repeat():
    """Dropout nodes are repeated per layer (each its own mask), and a model built on the meta
    device (no weights anywhere) traces the same way."""
    model = make("llama", dropout=0.1, layers=3)
    args, kwargs = batch("llama", 2, 8, seed=0)
    once = trace(model, args)
    assert_same_graph(once, trace(model, args, layers_once=False))
    drops = [n for n in once.graph.nodes if "dropout" in str(n.target)]
    assert len(drops) == 2 * 3        # attention and MLP outputs, per layer
    with torch.device("meta"):
        meta_model = make("gpt", layers=5)
    once = trace(meta_model, args)
    assert "5 layers, traced as 2" in info(once).layers
    assert_same_graph(once, trace(meta_model, args, layers_once=False))


# ------------------------------------------------------------- models that are traced whole
class Block(nn.Module):
    def __init__(self, i: int, width: int = 16):
        super().__init__()
        self.i = i
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class FlaggedBlock(Block):
    def forward(self, x):          # every third layer skips its nonlinearity
        h = self.lin(x)
        return x + (h if self.i % 3 == 2 else torch.tanh(h))


class FirstBlock(Block):
    def forward(self, x):          # the first layer is different
        h = torch.tanh(self.lin(x))
        return h if self.i == 0 else x + h


class ScaledBlock(Block):
    def forward(self, x):          # a constant that depends on the layer index
        return x + torch.tanh(self.lin(x)) / (self.i + 1)


class Stack(nn.Module):
    def __init__(self, blocks, scale_by_depth=False, skip=False):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(blocks)
        self.scale_by_depth, self.skip = scale_by_depth, skip

    def forward(self, idx, targets):
        x = self.emb(idx)
        seen = [x]
        for block in self.blocks:
            x = block(x)
            if self.skip and len(seen) >= 2:
                x = x + seen[-2]        # a residual from two layers back
            seen.append(x)
        if self.scale_by_depth:
            x = x / len(self.blocks)    # the forward depends on the number of layers
        return nn.functional.cross_entropy(x.flatten(0, 1), targets.flatten())


def _shared():
    b = Block(0)
    return Stack([b, b, b])


def _different_width():
    s = Stack([Block(i) for i in range(4)])
    s.blocks[3].lin = nn.Linear(16, 16, bias=False)
    return s


@pytest.mark.parametrize("factory,reason", [
    (lambda: Stack([FlaggedBlock(i) for i in range(4)]), "blocks.2 runs a different program"),
    (lambda: Stack([ScaledBlock(i) for i in range(4)]), "blocks.2 runs a different program"),
    (lambda: Stack([FirstBlock(i) for i in range(4)]), "different program"),   # layer 1 reads layer 0's tanh, layer 2 layer 1's sum
    (lambda: Stack([Block(i) for i in range(4)], scale_by_depth=True), "how many layers"),
    (lambda: Stack([Block(i) for i in range(4)], skip=True), "between two layers|different program"),
    (_shared, "shared"),
    (_different_width, "differs in structure"),
    (lambda: Stack([Block(i) for i in range(2)]), "has 2 entries"),
], ids=["flag", "index-constant", "first", "depth", "skip", "shared", "structure", "two-layers"])
def test_layers_that_are_not_one_program_are_traced_whole(factory, reason):
    torch.manual_seed(0)
    model = factory()
    g = torch.Generator().manual_seed(0)
    idx, tgt = torch.randint(0, 32, (2, 6), generator=g), torch.randint(0, 16, (2, 6), generator=g)
    gm = trace(model, (idx, tgt))
    assert info(gm).layers.startswith("traced whole"), info(gm).layers
    assert re.search(reason, info(gm).layers), info(gm).layers
    idx, tgt = torch.randint(0, 32, (3, 5), generator=g), torch.randint(0, 16, (3, 5), generator=g)
    torch.testing.assert_close(gm(*_inputs(gm, model), idx, tgt)[0], model(idx, tgt), rtol=1e-6, atol=1e-6)


def test_plain_repeated_stack_is_traced_once():
    torch.manual_seed(0)
    model = Stack([Block(i) for i in range(5)])
    g = torch.Generator().manual_seed(0)
    idx, tgt = torch.randint(0, 32, (2, 6), generator=g), torch.randint(0, 16, (2, 6), generator=g)
    once = trace(model, (idx, tgt))
    assert info(once).layers == "blocks: 5 layers, traced as 2"
    assert_same_graph(once, trace(model, (idx, tgt), layers_once=False))


def test_parallelize_says_how_it_traced_and_can_trace_whole():
    import fxtron
    model = make("gpt", layers=3)
    args, _ = batch("gpt", 2, 8, seed=0)
    once = fxtron.parallelize(model, fxtron.Mesh(2, tp=2), example_inputs=args)
    assert "trace: blocks: 3 layers, traced as 2" in once.summary()
    whole = fxtron.parallelize(model, fxtron.Mesh(2, tp=2), example_inputs=args, trace_layers_once=False)
    assert "trace: traced whole (layers_once=False)" in whole.summary()
    assert_same_graph(once.traced, whole.traced)
    def collectives(pm):
        return [(r.phase, r.kind, r.op, r.module, str(r.payload_bytes)) for r in pm.collectives(1)]
    assert collectives(once) == collectives(whole)


class GatedBlock(Block):
    def forward(self, x, gate):
        return x + torch.tanh(self.lin(x)) * gate[0] + gate[1]


class ConstantScaledStack(Stack):
    def forward(self, idx, targets):
        x = self.emb(idx)
        gate = torch.tensor([0.5, 0.25])      # a small constant made in the forward, read by every layer
        for block in self.blocks:
            x = block(x, gate)
        return nn.functional.cross_entropy(x.flatten(0, 1), targets.flatten())


def test_constants_made_before_the_layers_are_compared_by_value():
    """The layer check reads a small constant's values as the real tensor it holds, outside the
    fake mode (reading it through the fake mode raised DataDependentOutputException, and models
    that make one, such as transformers' caches, were traced whole)."""
    torch.manual_seed(0)
    model = ConstantScaledStack([GatedBlock(i) for i in range(4)])
    g = torch.Generator().manual_seed(0)
    idx, tgt = torch.randint(0, 32, (2, 6), generator=g), torch.randint(0, 16, (2, 6), generator=g)
    once = trace(model, (idx, tgt))
    assert info(once).layers == "blocks: 4 layers, traced as 2", info(once).layers
    assert_same_graph(once, trace(model, (idx, tgt), layers_once=False))
    torch.testing.assert_close(once(*_inputs(once, model), idx, tgt)[0], model(idx, tgt), rtol=1e-6, atol=1e-6)
