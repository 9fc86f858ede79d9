"""Tests of the shipped models: presets, init, weight tying, GQA + rotary attention against a
float64 reference, and torch.export with dynamic batch and sequence dims."""
from __future__ import annotations

import math
import time

import pytest
import torch
from torch.export import Dim
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from fxtron import models
from fxtron.errors import ParallelizeError
from fxtron.models.llama import apply_rotary, rope_tables

TINY = ["gpt-tiny", "llama-tiny"]

# ops whose output (or output shape) depends on tensor values
DATA_DEPENDENT_OPS = {
    "aten::_local_scalar_dense",
    "aten::item",
    "aten::nonzero",
    "aten::masked_select",
    "aten::_unique2",
    "aten::unique_consecutive",
    "aten::bincount",
    "aten::repeat_interleave.Tensor",
}


@pytest.mark.parametrize("name", TINY)
def test_tiny_forward_loss_near_log_vocab(name):
    model = models.build(name)
    idx, targets = models.example_inputs(name, batch=2, seq=16)
    vocab = models.config(name).vocab_size
    logits = model(idx)
    assert logits.shape == (2, 16, vocab)
    loss = model(idx, targets)
    assert loss.dim() == 0 and torch.isfinite(loss)
    # near-uniform predictions at init
    assert abs(loss.item() - math.log(vocab)) < 0.15, loss.item()


def test_gpt_weight_tying():
    model = models.build("gpt-tiny")
    assert model.lm_head.weight is model.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names  # deduplicated
    n_all = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert models.num_parameters(model) == n_all - model.wte.weight.numel()


def _gpt_param_count(V, S, L, h):
    per_block = (3 * h * h + 3 * h) + (h * h + h) + (4 * h * h + 4 * h) + (4 * h * h + h) + 4 * h
    return V * h + S * h + L * per_block + 2 * h  # lm_head tied to wte


def test_gpt2_124m_on_meta():
    model = models.build("gpt2-124m", device="meta")
    assert all(p.is_meta for p in model.parameters())
    n = models.num_parameters(model)
    assert n == _gpt_param_count(50304, 1024, 12, 768) == 124_475_904
    assert 124.3e6 < n < 124.6e6


def test_llama_7b_on_meta_is_fast():
    t0 = time.perf_counter()
    model = models.build("llama-7b", device="meta")
    elapsed = time.perf_counter() - t0
    assert all(p.is_meta for p in model.parameters())
    n = models.num_parameters(model)
    d, f, V, L = 4096, 11008, 32000, 32
    assert n == 2 * V * d + L * (4 * d * d + 3 * d * f + 2 * d) + d == 6_738_415_616
    assert elapsed < 5.0, f"meta build took {elapsed:.1f}s"


def test_same_seed_same_weights():
    for name in TINY:
        a = models.build(name, seed=123).state_dict()
        b = models.build(name, seed=123).state_dict()
        c = models.build(name, seed=124).state_dict()
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert not all(torch.equal(a[k], c[k]) for k in a)
        i1, t1 = models.example_inputs(name, seed=5)
        i2, t2 = models.example_inputs(name, seed=5)
        assert torch.equal(i1, i2) and torch.equal(t1, t2)
        assert torch.equal(i1[:, 1:], t1[:, :-1])  # targets are the next tokens


def test_presets_and_unknown_name():
    assert models.list_presets() == [
        "gpt-tiny", "gpt-small", "gpt2-124m", "llama-tiny", "llama-small", "llama-7b", "moe-tiny",
        "mixtral-8x7b", "deepseek-moe-16b"
    ]
    assert isinstance(models.build("gpt-small", device="meta"), models.GPT)
    assert isinstance(models.build("llama-small", device="meta"), models.Llama)
    assert isinstance(models.build("mixtral-8x7b", device="meta"), models.MoETransformer)
    with pytest.raises(ParallelizeError, match="gpt-tiny.*llama-7b"):
        models.build("gpt-huge")
    with pytest.raises(ParallelizeError):
        models.example_inputs("gpt-tiny", seq=129)


def _reference_attention(attn, x, theta):
    """Llama attention by hand in float64: projections, per-position rotation of dim pairs
    (j, j + hd/2), query head h reading kv head h // (nh // nkv), causal softmax, wo."""
    B, T, _ = x.shape
    nh, nkv, hd = attn.n_head, attn.n_kv_head, attn.head_dim
    wq, wk, wv, wo = (m.weight.detach().double() for m in (attn.wq, attn.wk, attn.wv, attn.wo))
    q = torch.einsum("btd,ed->bte", x, wq).reshape(B, T, nh, hd)
    k = torch.einsum("btd,ed->bte", x, wk).reshape(B, T, nkv, hd)
    v = torch.einsum("btd,ed->bte", x, wv).reshape(B, T, nkv, hd)

    def rotate(t):
        out = torch.empty_like(t)
        half = hd // 2
        for pos in range(T):
            for j in range(half):
                angle = pos * theta ** (-2.0 * j / hd)
                c, s = math.cos(angle), math.sin(angle)
                a, b = t[:, pos, :, j], t[:, pos, :, j + half]
                out[:, pos, :, j] = a * c - b * s
                out[:, pos, :, j + half] = b * c + a * s
        return out

    q, k = rotate(q), rotate(k)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    y = torch.zeros(B, T, nh, hd, dtype=torch.float64)
    for h in range(nh):
        g = h // (nh // nkv)
        scores = torch.einsum("bid,bjd->bij", q[:, :, h], k[:, :, g]) / math.sqrt(hd)
        scores = scores.masked_fill(~causal, float("-inf"))
        y[:, :, h] = torch.einsum("bij,bjd->bid", scores.softmax(-1), v[:, :, g])
    return torch.einsum("bte,de->btd", y.reshape(B, T, nh * hd), wo)


def test_llama_gqa_attention_matches_float64_reference():
    model = models.build("llama-tiny").double()
    cfg = model.config
    assert cfg.n_kv_head < cfg.n_head  # grouped-query attention is exercised
    attn = model.layers[0].attn
    T = 7
    x = torch.randn(2, T, cfg.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = attn(x, model.rope_cos[:T], model.rope_sin[:T])
    want = _reference_attention(attn, x, cfg.rope_theta)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_rotary_is_identity_at_position_zero_and_preserves_norm():
    cos, sin = rope_tables(32, 16)
    x = torch.randn(2, 4, 32, 16)
    y = apply_rotary(x, cos, sin)
    assert torch.equal(y[:, :, 0], x[:, :, 0])
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    assert not torch.allclose(y[:, :, 1:], x[:, :, 1:])


def test_llama_rope_buffers_non_persistent_and_rebuilt_after_meta():
    ref = models.build("llama-tiny")
    assert not any("rope" in k for k in ref.state_dict())
    model = models.build("llama-tiny", device="meta").to_empty(device="cpu")
    model.load_state_dict(ref.state_dict())
    model.reset_rope()
    idx, targets = models.example_inputs("llama-tiny")
    torch.testing.assert_close(model(idx, targets), ref(idx, targets))


@pytest.mark.parametrize("name", TINY)
def test_dropout_only_in_training(name):
    import dataclasses

    cfg = dataclasses.replace(models.config(name), dropout=0.1)
    torch.manual_seed(0)
    model = (models.GPT if name.startswith("gpt") else models.Llama)(cfg)
    idx, targets = models.example_inputs(name)
    assert not torch.equal(model(idx, targets), model(idx, targets))
    model.eval()
    assert torch.equal(model(idx, targets), model(idx, targets))


@pytest.mark.parametrize("name", TINY)
def test_export_dynamic_batch_and_seq(name):
    model = models.build(name)
    idx, targets = models.example_inputs(name, batch=2, seq=16)
    dyn = {0: Dim.DYNAMIC, 1: Dim.DYNAMIC}
    ep = torch.export.export(model, (idx, targets), dynamic_shapes=(dyn, dyn), strict=False)

    # no data-dependent ops, no unbacked symbols
    for node in ep.graph.nodes:
        if isinstance(node.target, torch._ops.OpOverload):
            op_name = node.target.name()  # e.g. "aten::view" or "aten::repeat_interleave.self_int"
            assert op_name not in DATA_DEPENDENT_OPS, node.format_node()
            assert op_name.split(".")[0] not in DATA_DEPENDENT_OPS, node.format_node()
        assert not free_unbacked_symbols(node.meta.get("val")), node.format_node()

    # batch and sequence dims stay symbolic
    user_inputs = [n for n in ep.graph.nodes if n.op == "placeholder"][-2:]
    for node in user_inputs:
        shape = node.meta["val"].shape
        assert all(isinstance(s, torch.SymInt) and s.node.expr.free_symbols for s in shape), shape
    assert len(ep.range_constraints) >= 2

    # same loss as eager at another batch and sequence length
    idx2, targets2 = models.example_inputs(name, batch=3, seq=24, seed=1)
    torch.testing.assert_close(ep.module()(idx2, targets2), model(idx2, targets2))


def test_meta_init_is_made_shard_by_shard_with_the_values_of_the_whole(monkeypatch):
    """runtime/materialize.py: a rank's shard of a meta model's parameter is made from blocks of
    rows (here 1,000 elements: a (256, 64) weight in 18 blocks) with the values the whole
    parameter has, for every layout fxtron cuts (rows, columns, a fused qkv's interleave, two
    axes); nothing is made whole; the model's own init (GPT.init_weights: normal(0, 0.02), the
    residual projections scaled by 1/sqrt(2 n_layer)) is what the parameters get."""
    from fxtron.core import layout
    from fxtron.core.params import AxisShard
    from fxtron.runtime import materialize
    monkeypatch.setattr(materialize, "BLOCK", 1000)
    m = materialize.MetaMaterializer(models.build("gpt-tiny", device="meta"), seed=3)
    for name, shards in [("wte.weight", (AxisShard("tp", 0),)), ("blocks.0.attn.qkv.weight", (AxisShard("tp", 0, 3),)),
                         ("blocks.1.mlp.fc2.weight", (AxisShard("tp", 1),)), ("blocks.0.attn.qkv.bias", (AxisShard("tp", 0, 3),)),
                         ("blocks.0.mlp.fc1.weight", (AxisShard("ep", 0), AxisShard("tp", 1)))]:
        whole = m.local(name, (), {}, {})
        for r in range(4):
            sizes, coords = {"tp": 2, "ep": 2}, {"tp": r % 2, "ep": r // 2}
            want = whole
            for s in shards:
                want = layout.shard(want, s.dim, sizes[s.axis], coords[s.axis], s.interleave)
            assert torch.equal(m.local(name, shards, sizes, coords), want), (name, r)
    assert m.whole == {}
    w = m.local("blocks.0.mlp.fc1.weight", (), {}, {})
    assert abs(w.std() - 0.02) < 0.002 and abs(w.mean()) < 0.002
    n_layer = models.build("gpt-tiny", device="meta").config.n_layer
    assert abs(m.local("blocks.0.mlp.fc2.weight", (), {}, {}).std() - 0.02 / (2 * n_layer) ** 0.5) < 0.001
    assert m.init_of["blocks.0.mlp.fc2.weight"] == f"GPT.init_weights: normal(0, {0.02 / (2 * n_layer) ** 0.5:.6g})"
    assert m.local("blocks.0.ln1.weight", (), {}, {}).eq(1).all()
    assert m.init_of["blocks.0.ln1.weight"] == "GPT.init_weights: ones"      # its LayerNorm.reset_parameters()
    # an init that writes a slice (Embedding's padding row) is recorded with its box, not made whole
    holder = torch.nn.Module()
    holder.emb = torch.nn.Embedding(10, 4, padding_idx=3, device="meta")
    p = materialize.MetaMaterializer(holder, seed=0)
    for first in range(4):
        monkeypatch.setattr(materialize, "BLOCK", 4 * (first + 1))
        e = p.local("emb.weight", (), {}, {})
        assert e[3].eq(0).all() and e[[0, 1, 2, 4]].ne(0).all() and p.whole == {}
    assert p.init_of["emb.weight"] == "Embedding.reset_parameters: normal() then zeros on a slice"
    # one that reads the values (orthogonal_) is made whole first, and said so
    class Orthogonal(torch.nn.Linear):
        def reset_parameters(self):
            torch.nn.init.orthogonal_(self.weight)
            torch.nn.init.zeros_(self.bias)
    holder.lin = Orthogonal(6, 6, device="meta")
    o = materialize.MetaMaterializer(holder, seed=0)
    w = o.local("lin.weight", (AxisShard("tp", 0),), {"tp": 2}, {"tp": 1})
    assert torch.allclose(w @ w.T, torch.eye(3), atol=1e-5) and list(o.whole) == ["lin.weight"]
    assert o.local("lin.bias", (), {}, {}).eq(0).all() and o.init_of["lin.bias"] == "Orthogonal.reset_parameters: zeros"


def test_meta_init_of_a_linear_without_bias():
    """A linear built without a bias on meta (Llama's, Mistral's, Qwen's) keeps its own init:
    reset_parameters sees its bias slot empty, as in the module (issue 31's crash)."""
    from fxtron.runtime import materialize
    holder = torch.nn.Module()
    holder.proj = torch.nn.Linear(64, 32, bias=False, device="meta")
    m = materialize.MetaMaterializer(holder, seed=0)
    w = m.local("proj.weight", (), {}, {})
    assert w.shape == (32, 64) and w.abs().max() <= 1 / 64 ** 0.5 and w.std() > 0 and m.whole == {}
