"""Tracing: torch.export to a GraphModule with lifted parameters, symbolic batch and sequence,
the node.meta contract, third-party models, and a readable error for untraceable models."""
from __future__ import annotations

import dataclasses
import re

import pytest
import sympy
import torch

import fxtron
from fxtron.core import meta
from fxtron.compiler.trace import trace
from fxtron.core.meta import BATCH, SEQ, info
from fxtron.models import build, example_inputs


def _run(gm, model, *inputs):
    ti = info(gm)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    args = [params[n] for n in ti.params] + [buffers.get(n, ti.constants.get(n)) for n in ti.buffers]
    return gm(*args, *inputs)[0]


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_shipped_models_trace_symbolic(name):
    model = build(name, seed=0)
    gm = trace(model, example_inputs(name, batch=2, seq=8))
    ti = info(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    kinds = [meta.get(n, meta.INPUT).kind for n in placeholders]
    # parameters, then buffers, then the user inputs
    assert kinds == sorted(kinds, key=["parameter", "buffer", "user"].index)
    assert kinds.count("user") == 2 and ti.user_dims == [("batch", "seq")] * 2
    assert set(ti.params) == {n for n, _ in model.named_parameters()}
    assert tuple(ti.shape(placeholders[-1].meta["val"])) == (BATCH, SEQ)
    # every linear knows the module it came from
    linears = [n for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default]
    assert linears and all(meta.get(n, meta.MODULE) for n in linears)
    # one program, any batch and sequence: equal to eager at another shape
    x, y = example_inputs(name, batch=3, seq=24, seed=5)
    torch.testing.assert_close(_run(gm, model, x, y), model(x, y), rtol=1e-6, atol=1e-6)


def test_tied_weights_are_one_input():
    model = build("gpt-tiny", seed=0)
    ti = info(trace(model, example_inputs("gpt-tiny")))
    assert ti.aliases == {"lm_head.weight": "wte.weight"}
    assert "lm_head.weight" not in ti.params


def test_meta_contract_is_typed():
    keys = meta.keys()
    assert {"fxtron_input", "fxtron_module", "fxtron_placement", "fxtron_local_shape"} <= set(keys)
    for k in keys.values():
        assert k.meaning and k.written_by and k.name.startswith("fxtron_")
    node = torch.fx.Graph().placeholder("x")
    with pytest.raises(TypeError):
        meta.set(node, meta.MODULE, 3)
    with pytest.raises(KeyError):
        meta.set(node, "fxtron_typo", "x")
    spec = meta.InputSpec("user", "x", 0, ("batch",))
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.kind = "parameter"


def test_shapes_use_batch_and_sequence_symbols():
    model = build("gpt-tiny", seed=0)
    pm = fxtron.parallelize(model, fxtron.Mesh(1), example_inputs=example_inputs("gpt-tiny"))
    text = pm.graph(0)
    assert "(B, S, 64)" in text and "(B*S, 256)" in text
    for node in pm.compiled(0).gm.graph.nodes:
        shape = meta.get(node, meta.LOCAL_SHAPE)
        if shape is not None:
            assert all(e.free_symbols <= {BATCH, SEQ} for e in shape if isinstance(e, sympy.Expr))


class _DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        if h.sum() > 0:        # Python control flow on a tensor value: not traceable
            h = h * 2
        return h.mean()


def test_untraceable_model_gets_parallelize_error_with_export_reason():
    with pytest.raises(fxtron.ParallelizeError) as err:
        trace(_DataDependent(), (torch.randn(2, 3, 4),))
    msg = str(err.value)
    assert "_DataDependent" in msg and "torch.export" in msg and "data-dependent" in msg.lower()


def test_model_without_loss_needs_loss_fn():
    model = build("gpt-tiny", seed=0)
    x, _ = example_inputs("gpt-tiny")
    with pytest.raises(fxtron.ParallelizeError, match="loss_fn"):
        trace(model, (x,))
    gm = trace(model, (x,), loss_fn=lambda logits: logits.float().pow(2).mean())
    torch.testing.assert_close(_run(gm, model, x), model(x).pow(2).mean())


def _hf_models():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    return {"gpt2": gpt2, "llama": llama}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_transformers_models_trace(arch):
    model = _hf_models()[arch]
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    gm = trace(model, (), example_kwargs=dict(input_ids=ids, labels=ids))
    ti = info(gm)
    assert ti.user_dims == [("batch", "seq")] * 2
    ids2 = torch.randint(0, 128, (3, 12), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_run(gm, model, ids2, ids2), model(input_ids=ids2, labels=ids2).loss,
                               rtol=1e-6, atol=1e-6)
    # the program built from it trains like the model (1-rank mesh: no processes)
    pm = fxtron.parallelize(model, fxtron.Mesh(1), example_kwargs=dict(input_ids=ids, labels=ids))
    prog = pm.program(0)
    loss = prog(input_ids=ids2, labels=ids2)
    loss.backward()
    model.zero_grad()
    model(input_ids=ids2, labels=ids2).loss.backward()
    for name, p in model.named_parameters(remove_duplicate=True):
        torch.testing.assert_close(prog.get_parameter(name).grad, p.grad, rtol=1e-5, atol=1e-6)


class _Concatenate(torch.nn.Module):
    """torch.concatenate (export keeps the alias's name) of two column-split values."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.up = torch.nn.Linear(32, 64)
        self.down = torch.nn.Linear(64, 32)
        self.head = torch.nn.Linear(32, 64)

    def forward(self, idx, targets):
        x = self.emb(idx)
        h = self.up(x)
        h = torch.concatenate([h.unsqueeze(2), torch.relu(h).unsqueeze(2)], dim=2).sum(2)
        x = x + self.down(h)
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def test_op_aliases_take_the_ops_name():
    """torch.concatenate traces as aten.concatenate (Zamba's hybrid layer): renamed aten.cat, so
    cat's sharding rule keeps the split (no op run replicated, no gather)."""
    ids = torch.randint(0, 64, (2, 9))
    gm = trace(_Concatenate(), (ids[:, :-1], ids[:, 1:]))
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.cat.default in targets and torch.ops.aten.concatenate.default not in targets
    pm = fxtron.parallelize(_Concatenate(), fxtron.Mesh(2, tp=2), example_inputs=(ids[:, :-1], ids[:, 1:]), strict=True)
    pm.compiled(0)
    assert pm.fallbacks(0) == [] and pm.gathers(0) == []


def test_tracing_leaves_the_users_model_as_it_was():
    """transformers' longrope rotary embedding keeps what its forward computes on the module (the
    long factors as `long_inv_freq`, inv_freq registered anew). Under export those were
    FakeTensors, left on the user's model: pm.program() then failed copying it (a RuntimeError
    about a FakeTensor's data pointer) and the model's own forward computed with the trace's
    short factors (4.825287 where a fresh model gives 4.825333). Now the trace puts every module's
    attributes, parameters and buffers back: the model computes as a fresh one, and the program
    trains as it does."""
    transformers = pytest.importorskip("transformers")
    hd = 16
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * (hd // 2),
                         "long_factor": [float(4 + i) for i in range(hd // 2)], "original_max_position_embeddings": 28})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    fresh = transformers.LlamaForCausalLM(cfg)
    fresh.load_state_dict(model.state_dict())
    rotary = model.model.rotary_emb
    before = (dict(vars(rotary)), dict(rotary._buffers))
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    pm = fxtron.parallelize(model, fxtron.Mesh(1), example_kwargs=batch)
    assert vars(rotary).keys() == before[0].keys() and all(rotary._buffers[k] is v for k, v in before[1].items())
    want = fresh(**batch).loss
    assert float(model(**batch).loss) == float(want)
    prog = pm.program(0)
    loss = prog.train_step((), torch.optim.SGD(prog.parameters(), lr=0.0), kwargs=batch)
    assert abs(loss - float(want)) < 1e-6 * float(want), (loss, float(want))


def test_a_node_says_where_in_the_models_python_it_was_made():
    """meta.source: the model's file, line, function and code of a node (what a refusal names, so
    that a user finds the line: the load-balancing loss's call in Mixtral's forward at cp=2)."""
    gm = trace(_Concatenate(), (torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))))
    cat = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.cat.default)
    assert re.fullmatch(r"test_trace\.py:\d+ in forward: `h = torch\.concatenate\(.*", meta.source(cat)), meta.source(cat)
