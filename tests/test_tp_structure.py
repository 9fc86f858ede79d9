"""Tensor parallel, compile-only (no processes): the plan found on the graph, the collectives
per layer, placements and local shapes, user plans, and the errors a user can cause."""
from __future__ import annotations

import re

import pytest
import torch
import torch.fx as fx

import fxtron
from fxtron.core import meta
from fxtron.compiler import report
from fxtron.compiler.report import count
from fxtron.passes.tp_plan import Colwise, Replicated
from fxtron.core import layout as shard_math
from tp_models import RULE_NAMES, batch, make


def _pm(name, tp, **kw):
    args, kwargs = batch(name, 2, 8, seed=0)
    return fxtron.parallelize(make(name), fxtron.Mesh(tp, tp=tp), example_inputs=args, example_kwargs=kwargs, **kw)


EXPECTED_PLAN = {
    "gpt": {"wte": "vocab-parallel", "wpe": "replicate", "blocks.0.attn.qkv": "colwise",
            "blocks.0.attn.proj": "rowwise", "blocks.0.mlp.fc1": "colwise", "blocks.0.mlp.fc2": "rowwise",
            "lm_head": "colwise"},
    "llama": {"tok_embeddings": "vocab-parallel", "layers.1.attn.wq": "colwise", "layers.1.attn.wk": "colwise",
              "layers.1.attn.wv": "colwise", "layers.1.attn.wo": "rowwise", "layers.1.mlp.w1": "colwise",
              "layers.1.mlp.w3": "colwise", "layers.1.mlp.w2": "rowwise", "output": "colwise"},
    "hf-gpt2": {"transformer.wte": "vocab-parallel", "transformer.wpe": "replicate",
                "transformer.h.0.attn.c_attn": "colwise", "transformer.h.0.attn.c_proj": "rowwise",
                "transformer.h.0.mlp.c_fc": "colwise", "transformer.h.0.mlp.c_proj": "rowwise",
                "lm_head": "colwise"},
    "hf-llama": {"model.embed_tokens": "vocab-parallel", "model.layers.0.self_attn.q_proj": "colwise",
                 "model.layers.0.self_attn.k_proj": "colwise", "model.layers.0.self_attn.v_proj": "colwise",
                 "model.layers.0.self_attn.o_proj": "rowwise", "model.layers.0.mlp.gate_proj": "colwise",
                 "model.layers.0.mlp.up_proj": "colwise", "model.layers.0.mlp.down_proj": "rowwise",
                 "lm_head": "colwise"},
    # fused [q|k|v] of unequal parts (8 query heads, 4 kv heads) and fused [gate|up]
    "hf-phi3": {"model.embed_tokens": "vocab-parallel", "model.layers.0.self_attn.qkv_proj": "colwise",
                "model.layers.0.self_attn.o_proj": "rowwise", "model.layers.0.mlp.gate_up_proj": "colwise",
                "model.layers.0.mlp.down_proj": "rowwise", "lm_head": "colwise"},
}
_LAYER = {"model.embed_tokens": "vocab-parallel", "model.layers.0.self_attn.q_proj": "colwise",
          "model.layers.0.self_attn.k_proj": "colwise", "model.layers.0.self_attn.v_proj": "colwise",
          "model.layers.0.self_attn.o_proj": "rowwise", "model.layers.0.mlp.gate_proj": "colwise",
          "model.layers.0.mlp.up_proj": "colwise", "model.layers.0.mlp.down_proj": "rowwise", "lm_head": "colwise"}
# a norm after each sublayer between the row-parallel output and the residual; Gemma2 adds
# softcapping of the attention scores (with a mask added to them) and of the logits
EXPECTED_PLAN.update({"hf-gemma2": _LAYER, "hf-gemma3": _LAYER})
HIDDEN = {"gpt": 64, "llama": 64, "hf-gpt2": 32, "hf-llama": 64, "hf-phi3": 64, "hf-gemma2": 64, "hf-gemma3": 64}


def test_linears_written_as_matmul_with_a_transposed_weight():
    """Falcon writes its linears `x @ self.weight.T` and sums attention and MLP in place
    (`mlp_output += attention_output`) before the residual: split Megatron's way; the two
    partial sums are added before one all-reduce per layer forward (Megatron's layer, with its
    sequential residual, takes 2); backward one per layer, as both branches read one norm's
    output."""
    pm = _pm("hf-falcon", 2)
    table = {path: style for path, style, _ in pm.tp_plan.table()}
    assert {p: table[p] for p in ("transformer.h.0.self_attention.query_key_value", "transformer.h.0.self_attention.dense",
                                  "transformer.h.0.mlp.dense_h_to_4h", "transformer.h.0.mlp.dense_4h_to_h", "lm_head")} == {
        "transformer.h.0.self_attention.query_key_value": "colwise", "transformer.h.0.self_attention.dense": "rowwise",
        "transformer.h.0.mlp.dense_h_to_4h": "colwise", "transformer.h.0.mlp.dense_4h_to_h": "rowwise",
        "lm_head": "colwise"}
    recs = pm.collectives(0)
    fwd = [r for r in recs if r.phase == "forward" and r.op == "all_reduce"]
    bwd = [r for r in recs if r.phase == "backward" and r.kind == "all_reduce"]
    assert len(fwd) == 2 + 1 and len(bwd) == 2 + 1, (fwd, bwd)
    assert count(recs, "all_gather") == 0 and pm.fallbacks(0) == []


def test_post_sublayer_norms_hide_no_row_parallel_output():
    """OLMo2 as Gemma: every layer linear split. Its q/k norms span the whole split width: the
    statistic is this rank's sum of squares, all-reduced (one float per token, forward; its
    gradient's all-reduce backward), never the rows gathered; the norm weights are held as
    slices (no scatter, no all-gather of their gradient)."""
    pm = _pm("hf-olmo2", 2)
    table = {path: style for path, style, _ in pm.tp_plan.table()}
    assert all(table[p] == s for p, s in _LAYER.items()), table
    assert pm.tp_plan.unsplit() == {}
    recs = pm.collectives(0)
    fwd = [r for r in recs if r.phase == "forward" and r.op == "all_reduce"]
    wide = [r for r in fwd if r.shape[-1] == 64]
    stats = [r for r in fwd if r.shape[-1] == 1]
    assert len(wide) == 2 * 2 + 1 and len(stats) == 2 * 2 and len(fwd) == len(wide) + len(stats), fwd
    assert {r.module.rsplit(".", 1)[1] for r in stats} == {"q_norm", "k_norm"}
    assert count(recs, "all_gather") == 0 and pm.fallbacks(0) == []
    local = pm.compiled(0).local
    assert tuple(local["model.layers.0.self_attn.q_norm.weight"].local_shape) == (32,)   # of 64
    assert tuple(local["model.layers.0.self_attn.k_norm.weight"].local_shape) == (16,)   # of 32


@pytest.mark.parametrize("name", list(EXPECTED_PLAN))
def test_megatron_pattern_found_on_the_graph(name):
    plan = _pm(name, 2).compiled(0).plan
    table = {path: style for path, style, _ in plan.table()}
    for path, style in EXPECTED_PLAN[name].items():
        assert table[path] == style, (path, table)


@pytest.mark.parametrize("name", list(EXPECTED_PLAN))
def test_two_all_reduces_per_layer_and_no_logit_gather(name):
    pm = _pm(name, 2)
    recs = pm.collectives(1)
    h, layers = HIDDEN[name], 2
    from fxtron.core.meta import BATCH, SEQ
    bsh = BATCH * SEQ * h * 4   # fp32 bytes of a (B, S, h) activation
    fwd = [r for r in recs if r.phase == "forward" and r.kind == "all_reduce" and r.op == "all_reduce"]
    bwd = [r for r in recs if r.phase == "backward" and r.kind == "all_reduce"]
    # per layer: after the attention output projection and after the MLP down projection;
    # plus one after the vocab-parallel embedding
    assert len(fwd) == 2 * layers + 1 and all(r.payload_bytes == bsh for r in fwd), fwd
    # backward conjugates: before the attention and MLP input projections, and before the LM head
    assert len(bwd) == 2 * layers + 1 and all(r.payload_bytes == bsh for r in bwd), bwd
    # the cross entropy's 3 all-reduces carry one float per token, never the logits
    ce = [r for r in recs if r.op == "vocab_parallel_cross_entropy"]
    assert len(ce) == 1 and ce[0].count == 3 and ce[0].payload_bytes == 3 * 4 * BATCH * SEQ
    assert count(recs, "all_gather") == 0 and count(recs, "reduce_scatter") == 0
    for layer in range(layers):
        in_layer = [r for r in fwd if f".{layer}." in r.module]
        assert len(in_layer) == 2, (layer, [r.module for r in fwd])


def test_fused_qkv_gives_each_rank_whole_heads_of_q_k_and_v():
    pm = _pm("gpt", 2)
    rg = pm.compiled(1)
    node = next(n for n in rg.gm.graph.nodes if n.name == "blocks_0_attn_qkv_weight")
    assert str(meta.placement(node, "tp")) == "S(0,x3)"
    full = torch.arange(3 * 64).float()[:, None].expand(192, 64)
    view = pm.mesh.view(1)
    local = rg.local["blocks.0.attn.qkv.weight"].local_of(full, view.sizes, view.coords)[:, 0]
    # rank 1 holds heads 2..3 (rows 32..63) of each of q, k, v
    expected = torch.cat([torch.arange(32, 64), torch.arange(96, 128), torch.arange(160, 192)]).float()
    assert torch.equal(local, expected)


def test_unequal_fused_qkv_gives_each_rank_whole_heads_of_q_k_and_v():
    """Phi-3 slices its fused qkv_proj output at q = 8 heads and k = v = 4 heads of 8: each rank
    holds its half of each part (proportions 2:1:1) and slices them locally, with no gather."""
    rg = _pm("hf-phi3", 2).compiled(1)
    name = "model.layers.0.self_attn.qkv_proj.weight"
    node = next(n for n in rg.gm.graph.nodes if meta.get(n, meta.INPUT) and meta.get(n, meta.INPUT).target == name)
    assert str(meta.placement(node, "tp")) == "S(0,2:1:1)"
    view = rg.mesh.view(1)
    local = rg.local[name].local_of(torch.arange(128).float()[:, None].expand(128, 64), view.sizes, view.coords)[:, 0]
    expected = torch.cat([torch.arange(32, 64), torch.arange(80, 96), torch.arange(112, 128)]).float()
    assert torch.equal(local, expected)       # query heads 4-7, kv heads 2-3 of k and of v
    slices = [n for n in rg.gm.graph.nodes if n.target == torch.ops.aten.slice.Tensor
              and n.args[0].target == torch.ops.fxtron.linear.default]
    assert [tuple(n.args[2:4]) for n in slices[:3]] == [(0, 32), (32, 48), (48, 2**63 - 1)]
    assert [str(meta.placement(n, "tp")) for n in slices[:3]] == ["S(2)"] * 3


def test_local_shapes_stay_symbolic_with_the_tp_division():
    pm = _pm("gpt", 2)
    text = pm.graph(0)
    assert "(B, S, 96)" in text       # fused qkv: 3*64/2
    assert "(B, 2, S, 16)" in text    # 4 heads / 2 per rank
    assert "fxtron.all_reduce" in text and "fxtron.copy_to_region" in text
    assert "fxtron.vocab_parallel_cross_entropy" in text
    for node in pm.compiled(0).gm.graph.nodes:   # every node a pass made says which pass
        if node.op == "call_function" and str(node.target).startswith("fxtron."):
            expected = "fuse_linears" if node.target == torch.ops.fxtron.linear.default else "insert_redistributions"
            assert meta.get(node, meta.PROVENANCE).pass_name == expected


def test_user_plan_overrides_and_replaces():
    pm = _pm("gpt", 2, plan={"blocks.*.mlp.*": "replicate"})
    table = {p: s for p, s, _ in pm.compiled(0).plan.table()}
    assert table["blocks.0.mlp.fc1"] == "replicate" and table["blocks.0.attn.qkv"] == "colwise"
    fwd = [r for r in pm.collectives(0) if r.phase == "forward" and r.op == "all_reduce"]
    assert len(fwd) == 1 + 2     # embedding + one per layer (attention only)
    pm = _pm("gpt", 2, plan={"blocks.*.attn.qkv": "colwise", "blocks.*.attn.proj": "rowwise"},
             plan_mode="replace")
    table = {p: s for p, s, _ in pm.compiled(0).plan.table()}
    assert table["wte"] == "replicate" and table["lm_head"] == "replicate"
    assert table["blocks.1.attn.proj"] == "rowwise"


def test_gather_output_all_gathers_the_logits():
    pm = _pm("llama", 2, plan={"output": Colwise(gather_output=True)})
    recs = pm.collectives(0)
    gathers = [r for r in recs if r.kind == "all_gather" and r.phase == "forward"]
    assert len(gathers) == 1 and gathers[0].module == "output"
    assert not any(r.op == "vocab_parallel_cross_entropy" for r in recs)


def test_heads_not_divisible_by_tp():
    from fxtron.models.gpt import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=1, n_head=6, n_embd=48))
    args, _ = batch("gpt", 2, 8, seed=0)
    pm = fxtron.parallelize(model, fxtron.Mesh(4, tp=4), example_inputs=args)
    with pytest.raises(fxtron.ParallelizeError) as err:
        pm.graph(0)
    msg = str(err.value)
    assert "%view" in msg and "blocks.0.attn" in msg and "size 48" in msg and "(6, 8)" in msg
    assert "tp=4" in msg and "heads" in msg


def test_unequal_fused_kv_heads_not_divisible_by_tp():
    args, kwargs = batch("hf-phi3", 2, 8, seed=0)     # 4 kv heads of 8: k and v blocks of 32 rows
    pm = fxtron.parallelize(make("hf-phi3"), fxtron.Mesh(8, tp=8), example_inputs=args, example_kwargs=kwargs)
    with pytest.raises(fxtron.ParallelizeError) as err:
        pm.graph(0)
    msg = str(err.value)
    assert "self_attn" in msg and "tp=8" in msg and "heads" in msg


def test_kv_heads_not_divisible_by_tp():
    from fxtron.models.llama import Llama, LlamaConfig
    model = Llama(LlamaConfig(vocab_size=256, max_seq_len=32, n_layer=1, n_head=8, n_kv_head=2, dim=64, ffn_dim=96))
    args, _ = batch("llama", 2, 8, seed=0)
    pm = fxtron.parallelize(model, fxtron.Mesh(4, tp=4), example_inputs=args)
    with pytest.raises(fxtron.ParallelizeError) as err:
        pm.graph(0)
    msg = str(err.value)
    assert "layers.0.attn" in msg and "tp=4" in msg and "heads" in msg


def test_plan_errors():
    with pytest.raises(fxtron.ParallelizeError, match="matches no linear"):
        _pm("gpt", 2, plan={"blocks.*.nothing": "colwise"}).graph(0)
    with pytest.raises(fxtron.ParallelizeError, match="use 'colwise'"):
        _pm("gpt", 2, plan={"blocks.*.attn.qkv": "diagonal"}).graph(0)
    with pytest.raises(fxtron.ParallelizeError, match="256 output features.*not divisible by 3"):
        fxtron.parallelize(make("gpt"), fxtron.Mesh(3, tp=3), example_inputs=batch("gpt", 2, 8, 0)[0],
                           plan={"blocks.*.mlp.fc1": "colwise"}).graph(0)
    with pytest.raises(fxtron.ParallelizeError, match="divisible"):
        shard_math.check_divisible(10, 4, 1, "parameter w (10, 3) dim 0")


class _DeadLayer(torch.nn.Module):
    """An MLP the loss reads and a linear computed and thrown away (the compiler drops it)."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)
        self.dead = torch.nn.Linear(8, 8)

    def forward(self, x):
        self.dead(x)
        return self.down(torch.relu(self.up(x))).pow(2).mean()


@pytest.mark.parametrize("mode", ["override", "replace"])
def test_plan_naming_a_dead_layer_says_it_computes_nothing(mode):
    """A plan entry whose every layer computes nothing the outputs depend on is an error naming
    it (before, rowwise one failed in split_row_bias with KeyError: 'linear', and colwise
    split parameters no rank's graph reads). A pattern that also matches live layers splits
    those; 'replicate' of it asks for nothing fxtron cannot do."""
    def pm(plan):
        return fxtron.parallelize(_DeadLayer(), fxtron.Mesh(2, tp=2), example_inputs=(torch.randn(2, 3, 8),),
                                  plan=plan, plan_mode=mode)
    for style in ("rowwise", "colwise"):
        with pytest.raises(fxtron.ParallelizeError, match=r"plan entry 'dead' names dead, which computes nothing "
                                                          r"that reaches the model's outputs.*remove the entry"):
            pm({"up": "colwise", "down": "rowwise", "dead": style}).graph(0)
    both = pm({"up": "colwise", "d*": "rowwise"})
    assert both.tp_plan.styles == {"up": Colwise(), "down": fxtron.passes.tp_plan.Rowwise()}
    assert both.compiled(0).local["down.weight"].local_shape == (8, 8)
    pm({"up": "colwise", "down": "rowwise", "dead": "replicate"}).graph(0)


def test_llama_7b_on_64_ranks_compiles_without_processes():
    from fxtron.models import build, example_inputs
    model = build("llama-7b", device="meta")
    pm = fxtron.parallelize(model, fxtron.Mesh(64, tp=8), example_inputs=example_inputs("llama-7b", device="meta"))
    rg = pm.compiled(63)
    norms = (2 * 32 + 1) * 4096          # RMSNorm scales stay whole; everything else is split 8 ways
    assert rg.param_count == (6_738_415_616 - norms) // 8 + norms
    recs = pm.collectives(63)
    assert count(recs, "all_reduce", "forward") == 2 * 32 + 1 + 3
    assert "(B, S, 4, 128)" in pm.graph(63)   # 32 heads / 8 per rank


@pytest.mark.parametrize("name", ["gpt", "llama", "hf-llama"])
def test_sequence_parallel_swaps_all_reduces_for_gathers_and_scatters(name):
    from fxtron.core.meta import BATCH, SEQ
    tp_only, sp = _pm(name, 2), _pm(name, 2, sequence_parallel=True)
    recs = sp.collectives(0)
    h = HIDDEN[name]
    bsh = BATCH * SEQ * h * 4
    big = [r for r in recs if r.payload_bytes == bsh]
    # per layer: all-gather before attention and MLP, reduce-scatter after each; the conjugates
    # in backward; plus the embedding's reduce-scatter and the LM head's all-gather
    assert count(big, "all_gather", "forward") == 2 * 2 + 1
    assert count(big, "reduce_scatter", "forward") == 2 * 2 + 1
    assert count(big, "reduce_scatter", "backward") == 2 * 2 + 1
    # ... and, as Megatron's sequence-parallel linear, the linears after each all-gather save the
    # shard and all-gather it again in backward (for the weight gradient): one more per gather
    regathers = [r for r in big if r.op == "gather_from_sequence" and r.phase == "backward" and r.kind == "all_gather"]
    assert len(regathers) == 2 * 2 + 1
    assert count(big, "all_gather", "backward") == 2 * (2 * 2 + 1)
    assert count(big, "all_reduce") == 0
    # the same bytes on the wire as plain tensor parallel (Korthikanti et al. 2022), but for the
    # re-gathers that keep 1/tp of each linear's input instead of all of it ...
    wire = lambda rs: sum((r.wire_bytes for r in rs if r.payload_bytes == bsh), 0)  # noqa: E731
    assert sympy_equal(wire(recs), wire(tp_only.collectives(0)) + wire(regathers))
    # ... and token-wise ops on 1/tp of the sequence
    text = sp.graph(0)
    assert "(B, S/2, " in text
    # replicated norm weights see only their rank's tokens: their gradients are summed over tp
    # once per step after backward (Megatron's _allreduce_layernorm_grads), not in the graph
    assert not [r for r in recs if r.op == "copy_to_region" and r.shape == (h,)]
    # (so are the rowwise biases added on sequence shards, as Megatron marks them sequence_parallel)
    local = sp.compiled(0).local
    partial = [n for n, spec in local.items() if "tp" in spec.partial_grad]
    assert len([n for n in partial if "norm" in n or "ln" in n]) >= 2 * 2 + 1, partial
    assert all(len(local[n].full_shape) == 1 for n in partial), partial
    assert not [n for n, spec in tp_only.compiled(0).local.items() if spec.partial_grad]


def sympy_equal(a, b) -> bool:
    import sympy
    return sympy.simplify(a - b) == 0


def test_sequence_parallel_needs_tp():
    with pytest.raises(fxtron.ParallelizeError, match="tensor parallel"):
        fxtron.parallelize(make("gpt"), fxtron.Mesh(2), example_inputs=batch("gpt", 2, 8, 0)[0],
                           sequence_parallel=True)


def test_norm_over_a_split_width_is_not_summed_again():
    """OLMoE normalizes the whole q/k projection output (q_norm over num_heads * head_dim) after
    the column-split projections: each rank multiplies by its slice of the norm's weight, held
    as a slice, whose gradient is then exact. Summing it over tp after backward, as for a norm
    on sequence shards, made it tp times too large."""
    pm = _pm("hf-olmoe", 2)
    local = pm.compiled(0).local
    norms = [n for n in local if n.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(norms) == 2 * 2
    for n in norms:
        assert local[n].partial_grad == () and local[n].local_shape[0] * 2 == local[n].full_shape[0], local[n]
    assert "fxtron.scatter" not in pm.graph(0)


class _NoPattern(torch.nn.Module):
    """Two linears in a chain with no residual: neither Megatron's column/row pair nor an LM head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(16, 8)
        self.block = torch.nn.ModuleDict({"a": torch.nn.Linear(8, 32), "b": torch.nn.Linear(32, 8)})
        self.head = torch.nn.Linear(8, 16)

    def forward(self, idx, tgt):
        x = self.block["b"](torch.relu(self.block["a"](self.emb(idx))))
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), tgt.flatten())


def test_layers_left_replicated_are_never_silent():
    """Linears the pattern does not recognise stay whole on every rank; fxtron says so (a
    warning, the summary, an error under strict), and the plan the messages suggest is accepted."""
    idx = torch.randint(0, 16, (2, 4))

    def pm(**kw):
        return fxtron.parallelize(_NoPattern(), fxtron.Mesh(2, tp=2), example_inputs=(idx, idx), **kw)

    with pytest.warns(fxtron.ParallelizeWarning, match=r"at tp=2, 2 linear\(s\) stay replicated") as caught:
        loose = pm()
    msg = str(caught[0].message)
    assert "block.a, block.b: no Megatron pattern found" in msg
    assert set(loose.tp_plan.unsplit()) == {"block.a", "block.b"}
    assert "replicated linears: block.a, block.b: no Megatron pattern" in loose.summary()
    with pytest.raises(fxtron.ParallelizeError, match=r"2 linear\(s\) stay replicated.*'replicate' to keep it whole"):
        pm(strict=True)
    # a module's path names every linear under it; replicating on purpose is quiet
    kept = pm(strict=True, plan={"block": "replicate"})
    assert kept.tp_plan.unsplit() == {} and set(kept.tp_plan.replicated) == {"block.a", "block.b"}
    assert "block.a, block.b: replicated by the plan" in kept.summary()
    # naming the styles splits them Megatron's way
    split = pm(strict=True, plan={"block.a": "colwise", "block.b": "rowwise"})
    assert split.tp_plan.replicated == {}


class _PiecesOfOneMatrix(torch.nn.Module):
    """P[0] used as an up projection, P[1] as the down projection after it: one parameter the
    automatic plan would split by columns for one layer and by rows for the other."""

    def __init__(self):
        super().__init__()
        self.P = torch.nn.Parameter(torch.randn(2, 16, 16) * 0.1)
        self.emb = torch.nn.Embedding(32, 16)

    def forward(self, idx, t):
        h = self.emb(idx)
        h = h + torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(h, self.P[0])), self.P[1])
        return torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, self.emb.weight).flatten(0, 1),
                                                 t.flatten())


def test_pieces_of_one_parameter_split_two_ways_are_replicated_or_named():
    """The automatic plan replicates layers that would split one parameter two ways (a warning
    says why; it raised "used by two layers that split it differently", with a hint about tied
    embeddings); a user's plan that does so is an error naming both layers and their styles."""
    idx = torch.randint(0, 32, (2, 8))

    def pm(**kw):
        return fxtron.parallelize(_PiecesOfOneMatrix(), fxtron.Mesh(2, tp=2), example_inputs=(idx, idx), **kw)

    with pytest.warns(fxtron.ParallelizeWarning, match=r"P is used by P, P', which the automatic plan would split "
                                                      r"differently"):
        auto = pm()
    assert "P" not in auto.tp_plan.params and auto.tp_plan.params["emb.weight"].dim == 0
    auto.compiled(1)
    with pytest.raises(fxtron.ParallelizeError, match=r"parameter P is used by two layers that split it differently: "
                                                      r"P' \(Rowwise.*\) and P \(Colwise.*\).*'replicate' both"):
        pm(plan={"P": "colwise"})
    pm(plan={"P": "replicate", "P'": "replicate"}, strict=True).compiled(0)


def test_routers_stay_replicated_quietly():
    """An MoE router (its output picks experts by topk) stays whole, as in Megatron: reported
    in the summary, not warned about."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxtron.ParallelizeWarning)
        pm = _pm("hf-olmoe", 2, strict=True)
    gates = {p: u for p, u in pm.tp_plan.replicated.items() if p.endswith("mlp.gate")}
    assert len(gates) == 2 and all(not u.loud and "router" in u.why for u in gates.values())


def test_new_tensors_and_index_select_keep_the_split():
    """h.new_ones(h.shape) is a new tensor split like h (its contents the same everywhere: no
    communication), and index_select along the sequence keeps h split over its hidden width."""
    pm = _pm("factories-mlp", 2)
    assert pm.fallbacks(0) == []
    nodes = {str(n.target): n for n in pm.compiled(0).gm.graph.nodes}
    assert str(meta.placement(nodes["aten.new_ones.default"], "tp")) == "S(2)"
    assert str(meta.placement(nodes["aten.index_select.default"], "tp")) == "S(2)"
    assert count(pm.collectives(0), "all_gather") == 0


def test_linears_written_with_einsum():
    """Bare parameters contracted by einsum are linears (named by the parameter): the output
    projection (nn.Linear's layout) and the MLP's down (Conv1D's) rowwise, the MLP's up
    colwise; a fused qkv viewed (B, S, 3, heads, d) and unbound splits per block; the
    attention einsums keep the heads split: Megatron's 2 all-reduces per layer."""
    pm = _pm("einsum-attn", 2)
    assert {p: s for p, s, _ in pm.tp_plan.table()} == {
        "emb": "vocab-parallel", "qkv": "colwise", "w_o": "rowwise", "w_up": "colwise", "w_down": "rowwise",
        "head": "colwise"}
    assert pm.tp_plan.interleave["qkv"] == 3
    local = pm.compiled(0).local
    assert local["w_o"].local_shape == (32, 16) and local["w_up"].local_shape == (32, 32)
    fwd = [r for r in pm.collectives(0) if r.phase == "forward" and r.op == "all_reduce"]
    assert len(fwd) == 3, fwd        # the embedding's, w_o's, w_down's
    assert pm.fallbacks(0) == [] and pm.gathers(0) == []


def test_experts_split_over_tp():
    """Mixtral's experts (3-D weights run by the grouped GEMM) split as Megatron splits experts
    over tp when they are not expert-parallel: gate/up by columns of each expert (both halves),
    down by rows; the router stays whole; the routed outputs, scaled and combined per token,
    are reduced once per layer on (B, S, hidden), not on the k copies per token."""
    pm = _pm("hf-mixtral", 2)
    table = {p: s for p, s, _ in pm.tp_plan.table()}
    assert table["model.layers.0.mlp.experts.gate_up_proj"] == "colwise"
    assert table["model.layers.0.mlp.experts.down_proj"] == "rowwise"
    assert table["model.layers.0.mlp.gate"] == "replicate"
    assert pm.tp_plan.replicated["model.layers.0.mlp.gate"].why.startswith("a router")
    local = pm.compiled(0).local
    assert local["model.layers.0.mlp.experts.gate_up_proj"].local_shape == (4, 32, 64)   # of (4, 64, 64)
    assert local["model.layers.0.mlp.experts.down_proj"].local_shape == (4, 64, 16)      # of (4, 64, 32)
    fwd = [r for r in pm.collectives(0) if r.phase == "forward" and r.op == "all_reduce"]
    moe = [r for r in fwd if r.module == "model.layers.0.mlp"]
    assert len(fwd) == 2 * 2 + 1 and len(moe) == 1 and str(moe[0].shape) == "(B, S, 64)", fwd
    # backward, the tokens enter the region before their top-2 copies are picked: the gradient
    # all-reduced is (B*S, hidden), not (2*B*S, hidden) (and a float per copy for the weights)
    bwd = [r for r in pm.collectives(0) if r.phase == "backward" and r.module == "model.layers.0.mlp.experts"]
    assert sorted(str(r.shape) for r in bwd) == ["(2*B*S, 1)", "(B*S, 64)"], bwd
    # a module's path names its experts: replicating them on purpose is accepted and quiet
    kept = _pm("hf-mixtral", 2, plan={"model.layers.*.mlp.experts": "replicate"}, strict=True)
    assert kept.tp_plan.style("model.layers.1.mlp.experts.down_proj") == Replicated()
    kept.graph(0)


def _falcon_multi_query(**kw):
    import transformers
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM(transformers.FalconConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=8, multi_query=True,
        new_decoder_architecture=False, parallel_attn=True, bias=False, eos_token_id=0, pad_token_id=0, bos_token_id=0))
    ids = torch.randint(0, 128, (2, 8))
    return fxtron.parallelize(model, fxtron.Mesh(2, tp=2), example_kwargs=dict(input_ids=ids, labels=ids), **kw)


def test_forced_gathers_are_reported_and_strict_refuses_them():
    """Falcon-7B's multi-query attention fuses 8 query heads with one key and one value head:
    split colwise, the heads dim of its (B, S, 10, d) view is not whole heads of each, so the
    rule of the slice that cuts q, k and v from it needs it whole: an all-gather per layer.
    Correct, but communication Megatron would not issue: listed by pm.gathers() and the
    summary, warned once; strict=True makes it an error."""
    with pytest.warns(fxtron.ParallelizeWarning, match=r"2 all-gather\(s\) on rank 0 make a split value whole"):
        pm = _falcon_multi_query()
        pm.graph(0)
    # transformers < 5.25 slices q, k and v from the view, later ones split_with_sizes it
    assert len(pm.gathers(0)) == 2 and all("self_attention" in g and ("aten.slice" in g or "aten.split_with_sizes" in g)
                                           for g in pm.gathers(0)), pm.gathers(0)
    assert "counted in the table's AG): %all_gather_default in transformer.h.0" in pm.summary()
    assert all(g.endswith(", split by transformer.h.%d.self_attention.query_key_value" % i)
               for i, g in enumerate(pm.gathers(0))), pm.gathers(0)
    with pytest.raises(fxtron.ParallelizeError, match="all-gather.*Replicate the layers named after 'split by'"):
        _falcon_multi_query(strict=True).graph(0)
    # what the error suggests is accepted: the fused projection whole, the rest split, no gather
    kept = _falcon_multi_query(strict=True, plan={"transformer.h.*.self_attention.query_key_value": "replicate"})
    assert kept.gathers(0) == [] and kept.tp_plan.style("transformer.h.0.mlp.dense_h_to_4h") == Colwise()


def test_batch_and_heads_folded_stay_split():
    """BLOOM folds batch and heads into one dim (B*heads, S, d) around its alibi scores: the
    split heads stay split inside the fold (B blocks of the heads, a symbolic count), the alibi
    table is cut to this rank's heads, and the layer keeps Megatron's 2 all-reduces, no gather."""
    pm = _pm("hf-bloom", 2)
    nodes = {n.name: n for n in pm.compiled(0).gm.graph.nodes}
    bmm = nodes["baddbmm"]
    assert str(meta.placement(bmm, "tp")).startswith("S(0,x")
    assert str(meta.placement(nodes["view_1"], "tp")) == "S(1)"            # (B, heads, S, S) again
    recs = pm.collectives(0)
    assert count([r for r in recs if r.phase == "forward" and r.op == "all_reduce"], "all_reduce") == 2 * 2 + 1
    assert count(recs, "all_gather") == 0 and pm.gathers(0) == []


def test_rules_by_op_name():
    """A library's custom op gets a rule by its qualified name (it need not be loaded when the
    rule is registered); a second rule for an op is refused unless replaced."""
    import transformers.integrations.moe  # noqa: F401 - defines torch.ops.transformers.grouped_mm_fallback
    from fxtron.passes.rules import registry
    assert registry.rule_for(torch.ops.transformers.grouped_mm_fallback.default) is not None
    with pytest.raises(ValueError, match="already has a sharding rule"):
        fxtron.register_rule("transformers::grouped_mm_fallback")(lambda ctx: None)


def test_gather_keeps_the_split():
    """torch.gather along the sequence of a value split on its hidden dim, with an index made
    by expand_as (which takes the split value's local shape): both stay split, no gather."""
    pm = _pm("gather-mlp", 2)
    nodes = {str(n.target): n for n in pm.compiled(0).gm.graph.nodes}
    assert str(meta.placement(nodes["aten.gather.default"], "tp")) == "S(2)"
    assert str(meta.placement(nodes["aten.expand_as.default"], "tp")) == "S(2)"
    assert pm.fallbacks(0) == [] and pm.gathers(0) == [] and count(pm.collectives(0), "all_gather") == 0


class _LearnedBias(torch.nn.Module):
    """An MLP with a learned (T, D) table added to the hidden states: a 2-d parameter that is no
    linear, no embedding and no vector, which no rule splits."""

    def __init__(self, vocab: int = 64, dim: int = 32, seq: int = 16):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.table = torch.nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.down = torch.nn.Linear(4 * dim, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.emb(idx) + self.table[: idx.shape[1]]
        x = x + self.down(torch.relu(self.up(x)))
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


class _InnerTable(_LearnedBias):
    """A learned (T, 4D) table, summed along its features (a cumsum: no rule splits that dim),
    added inside the MLP to the column-split hidden state: a layer's weight that should split
    with the up projection's columns, which no rule splits."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Parameter(torch.randn(16, 128) * 0.02)

    def forward(self, idx, targets):
        x = self.emb(idx) + self.table[: idx.shape[1]]
        x = x + self.down(torch.relu(self.up(x) + self.inner.cumsum(-1)[: idx.shape[1]]))
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def test_every_parameter_is_split_or_said_whole():
    """The summary accounts for every parameter (issue: every transformers causal LM, item 1): the
    split share and each group held whole, with its reason, add up to 100%; a parameter no rule
    splits is a ParallelizeWarning naming it (strict: an error), never held whole silently."""
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 9))
    args = (ids[:, :-1], ids[:, 1:])
    with pytest.warns(fxtron.ParallelizeWarning, match=r"no rule that splits them.*: inner$"):
        pm = fxtron.parallelize(_InnerTable(), fxtron.Mesh(2, tp=2), example_inputs=args)
        pm.compiled(0)
    line = next(ln for ln in pm.summary().splitlines() if ln.startswith("parameters at tp=2"))
    assert "inner (no rule splits it" in line, line
    shares = [float(x) for x in re.findall(r"(\d+\.\d)% ", line)]
    assert abs(sum(shares) - 100) <= 0.05 * len(shares), line
    with pytest.raises(fxtron.ParallelizeError, match="inner") as err:
        fxtron.parallelize(_InnerTable(), fxtron.Mesh(2, tp=2), example_inputs=args, strict=True).compiled(0)
    # the fix the message gives is accepted: the table whole on purpose, quiet even under strict
    assert "plan={'inner': 'replicate'}" in str(err.value)
    kept = fxtron.parallelize(_InnerTable(), fxtron.Mesh(2, tp=2), example_inputs=args, strict=True,
                              plan={"inner": "replicate"})
    kept.compiled(0)
    assert "inner (replicated by the plan)" in kept.summary()


class _PositionTables(_InnerTable):
    """Learned absolute positions written without an embedding op, beside the layer's `inner`:
    a table read at arange(T) (Whisper's weight[positions]) and Reformer's axial table, two parts
    broadcast to (4, 4, D/2) each, flattened and set side by side."""

    def __init__(self):
        super().__init__()
        self.axial = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(4, 1, 16) * 0.02),
                                             torch.nn.Parameter(torch.randn(1, 4, 16) * 0.02)])

    def forward(self, idx, targets):
        b, t = idx.shape
        axial = torch.cat([w.expand(4, 4, 16).reshape(16, 16) for w in self.axial], dim=-1)
        x = self.emb(idx) * 2.0 + self.table[torch.arange(t, device=idx.device).expand(b, t)]
        x = x + axial[:t]
        x = x + self.down(torch.relu(self.up(x) + self.inner.cumsum(-1)[:t]))
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def test_position_tables_are_whole_by_design():
    """A table read by position and added to the token embeddings is whole by design, as
    Megatron's position embeddings (a plain replicated nn.Embedding): found by how it is used,
    not by its name; a table a layer adds to its split hidden state is not one, and still warns."""
    ids = torch.randint(0, 64, (2, 9))
    pm = fxtron.parallelize(_PositionTables(), fxtron.Mesh(2, tp=2), example_inputs=(ids[:, :-1], ids[:, 1:]))
    assert pm.tp_plan.positions == {"table", "axial.0", "axial.1"}
    _, held = report.held_whole(pm.compiled(0).local, pm.tp_plan)
    why = {n: h.why for h in held for n in h.names}
    assert why["table"] == why["axial.0"] == why["axial.1"] == report.TABLE
    assert why["inner"] == report.NO_RULE


class _Unread(_LearnedBias):
    """A cross-attention the example never reaches (an encoder-decoder's decoder run without
    encoder states; a multimodal wrapper's vision tower without images)."""

    def __init__(self):
        super().__init__()
        self.cross = torch.nn.Linear(32, 32, bias=False)

    def forward(self, idx, targets, encoder_states=None):
        x = self.emb(idx) + self.table[: idx.shape[1]]
        if encoder_states is not None:
            x = x + self.cross(encoder_states)
        x = x + self.down(torch.relu(self.up(x)))
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def test_parameters_the_forward_never_reads_are_said_unread():
    """A parameter the traced forward never reads is held whole as unread, not as wanting a
    rule: no warning for it, even under strict (the sweep over transformers' causal LMs: BART's
    cross-attention, Gemma 3's vision tower)."""
    ids = torch.randint(0, 64, (2, 9))
    pm = fxtron.parallelize(_Unread(), fxtron.Mesh(2, tp=2), example_inputs=(ids[:, :-1], ids[:, 1:]), strict=True,
                            plan={"table": "replicate"})
    pm.compiled(0)
    line = next(ln for ln in pm.summary().splitlines() if ln.startswith("parameters at tp=2"))
    assert "cross.weight (not read by the traced forward" in line, line
    shares = [float(x) for x in re.findall(r"(\d+\.\d)% ", line)]
    assert abs(sum(shares) - 100) <= 0.05 * len(shares), line


class _BertHead(_LearnedBias):
    """BERT's LM head: dense -> gelu -> LayerNorm -> the vocabulary's linear."""

    def __init__(self):
        super().__init__()
        self.transform = torch.nn.Linear(32, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.pooler = torch.nn.Linear(32, 32)

    def forward(self, idx, targets):
        x = self.emb(idx) + self.table[: idx.shape[1]]
        x = x + self.down(torch.relu(self.up(x)))
        x = self.norm(torch.nn.functional.gelu(self.transform(x)))
        pooled = self.pooler(x[:, 0])      # noqa: F841 -- a pooler a causal LM computes and drops
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def test_lm_head_transform_is_whole_as_in_megatron():
    """BERT's head transform (a dense before the LM head, through its activation and norm) is
    whole by design, as Megatron's BERT LM head keeps it; a pooler whose output the forward
    drops is whole and unused: both quiet, with their reasons, under strict."""
    ids = torch.randint(0, 64, (2, 9))
    pm = fxtron.parallelize(_BertHead(), fxtron.Mesh(2, tp=2), example_inputs=(ids[:, :-1], ids[:, 1:]), strict=True,
                            plan={"table": "replicate"})
    pm.compiled(0)
    assert pm.tp_plan.unsplit() == {}
    assert pm.tp_plan.replicated["transform"].why.startswith("the LM head's transform"), pm.tp_plan.replicated
    assert pm.tp_plan.replicated["pooler"].why.startswith("its output reaches nothing"), pm.tp_plan.replicated
    assert pm.tp_plan.style("head").__class__.__name__ == "Colwise"


class _Gates(torch.nn.Module):
    """A gated norm (AXK2's: y * sigmoid(fc2(silu(fc1(y))))) before an MLP whose output a gate
    of the hidden width scales (RWKV's feed-forward: sigmoid(receptance(x)) * value(relu(key(x))^2))."""

    def __init__(self, vocab: int = 64, dim: int = 32):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.fc1, self.fc2 = torch.nn.Linear(dim, 8), torch.nn.Linear(8, dim)
        self.key, self.value = torch.nn.Linear(dim, 2 * dim), torch.nn.Linear(2 * dim, dim)
        self.receptance = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.emb(idx)
        y = torch.nn.functional.rms_norm(x, (32,))
        y = y * torch.sigmoid(self.fc2(torch.nn.functional.silu(self.fc1(y))))
        x = x + torch.sigmoid(self.receptance(y)) * self.value(torch.square(torch.relu(self.key(y))))
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def test_gates_without_an_exact_split_stay_whole_with_their_reasons():
    """A norm's gate MLP and a gate of the hidden width on a row-parallel output have no
    Megatron split: whole, each with its own reason (loud: the sweep reports them), the MLP
    around them split."""
    ids = torch.randint(0, 64, (2, 9))
    pm = fxtron.parallelize(_Gates(), fxtron.Mesh(2, tp=2), example_inputs=(ids[:, :-1], ids[:, 1:]))
    why = pm.tp_plan.unsplit()
    assert set(why) == {"fc1", "fc2", "receptance"}, why
    assert why["fc1"].startswith("a gate MLP of a norm") and why["fc2"] == why["fc1"], why
    assert why["receptance"].startswith("a gate of the hidden width multiplying a row-parallel output"), why
    assert str(pm.tp_plan.style("key")) == "colwise" and str(pm.tp_plan.style("value")) == "rowwise"
    assert pm.gathers(0) == [] and pm.fallbacks(0) == []


# the op each RULE_NAMES model runs on the split width, and its placement there
_RULE_OPS = {"square-mlp": ("aten.square.default", "S(2)"), "tensor-split-mlp": ("aten.tensor_split.sections", None),
             "complex-mlp": ("aten.view_as_complex.default", "S(2)"), "max-lse-mlp": ("aten.logsumexp.default", "S(2)"),
             "conv-mlp": ("aten.conv1d.default", "S(1)"), "no-grad-mlp": ("aten.topk.default", None),
             "min-other-mlp": ("aten.min.other", "S(2)"), "masked-ids-tied": ("aten.where.ScalarSelf", None),
             "head-gates-mlp": ("aten.baddbmm.default", "S(0)"), "reshape-as-mlp": ("aten.reshape_as.default", "S(2)"),
             "masked-fill-mlp": ("aten.masked_fill_.Scalar", "S(2)"), "log-sigmoid-var-mlp": ("aten.var.dim", "S(2)"),
             "stacked-heads": ("aten.stack.default", "S(3)")}


@pytest.mark.parametrize("name", RULE_NAMES)
def test_ops_keep_the_split(name):
    """relu^2, tensor_split, view_as_complex / view_as_real, max / min / logsumexp per head, a
    causal depthwise conv, a torch.no_grad region, an elementwise min / max against a scalar
    tensor, a tied embedding looked up with ids some replaced by the pad id, block-diagonal gates
    per head with their bias, rotary pairs reshape_as'd back, an in-place masked_fill_ and LM
    heads stacked (each head column split, the stack split by vocabulary), each on the split
    width of an MLP: no
    all-gather, no op run replicated, Megatron's forward all-reduces (the embedding's and the
    MLP's) and nothing else."""
    pm = _pm(name, 2, strict=True)
    nodes = {str(n.target): n for n in pm.compiled(0).gm.graph.nodes}
    target, want = _RULE_OPS[name]
    assert target in nodes, sorted(nodes)
    if want is not None:
        assert str(meta.placement(nodes[target], "tp")) == want
    assert pm.fallbacks(0) == [] and pm.gathers(0) == [] and count(pm.collectives(0), "all_gather") == 0
    fwd = [r for r in pm.collectives(0) if r.phase == "forward" and r.op == "all_reduce"]
    assert len(fwd) == 2, fwd


def test_depthwise_conv_weights_split_by_channel():
    """Mamba's causal conv1d (groups = channels) after a column-split projection: its weight and
    bias held by channel (each rank its half), the rank's conv run with half the groups."""
    pm = _pm("conv-mlp", 2)
    local = pm.compiled(0).local
    assert local["conv.weight"].local_shape == (32, 1, 4) and local["conv.bias"].local_shape == (32,)
    # RG-LRU's per-head gates: the weight and the bias (read as bias[:, None, :]) split by head
    local = _pm("head-gates-mlp", 2).compiled(0).local
    assert local["gate_weight"].local_shape == (4, 8, 8) and local["gate_bias"].local_shape == (4, 8)
    conv = next(n for n in pm.compiled(0).gm.graph.nodes if n.target == torch.ops.aten.conv1d.default)
    assert conv.args[-1] == 32


class _WeightLeft(torch.nn.Module):
    """Mamba-1's slow path in small: up by columns, then `down.weight @ h^T` (a weight on the
    left, by rows) and a per-channel parameter read through a cast, -exp and an unsqueeze."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Module()
        self.down.weight = torch.nn.Parameter(torch.randn(16, 32) * 0.1)
        self.a_log = torch.nn.Parameter(torch.zeros(32))

    def forward(self, x):
        h = self.up(x) * -torch.exp(self.a_log.float())[None, None, :]
        return (self.down.weight @ h.transpose(1, 2)).transpose(1, 2).square().mean()


def test_weight_left_of_matmul_and_parameters_through_casts_split():
    """A weight written on the left of a matmul (transformers' Mamba dt_proj.weight @ dt) is a
    linear, here the row-parallel one: its input comes split, its output a partial sum, one
    all-reduce and no gather; a parameter read through a cast, -exp and an unsqueeze by a value
    split on its dim is held split there (A_log), not whole and sliced each step."""
    pm = fxtron.parallelize(_WeightLeft(), fxtron.Mesh(2, tp=2), example_inputs=(torch.randn(2, 8, 16),),
                            plan={"up": "colwise", "down": "rowwise"}, strict=True)
    local = pm.compiled(0).local
    assert local["down.weight"].local_shape == (16, 16) and local["a_log"].local_shape == (16,)
    recs = pm.collectives(0)
    assert [r.op for r in recs if r.phase == "forward"] == ["all_reduce"], recs
    assert pm.gathers(0) == [] and pm.fallbacks(0) == [] and count(recs, "all_gather") == 0
    assert not [n for n in pm.compiled(0).gm.graph.nodes if n.target == torch.ops.fxtron.scatter.default]


def test_no_grad_region_inlined_and_its_linears_whole():
    """A torch.no_grad block (export's wrap_with_set_grad_enabled region) is inlined, its
    outputs detached: its linear stays whole (quietly: no gradient reaches it) and takes no
    gradient (.grad None, as in the model: the optimizer leaves it, no weight decay)."""
    pm = _pm("no-grad-mlp", 2, strict=True)
    assert pm.tp_plan.replicated["indexer"].why.startswith("computed under torch.no_grad")
    assert not pm.tp_plan.replicated["indexer"].loud
    local = pm.compiled(0).local
    assert not local["indexer.weight"].takes_grad and local["up.weight"].takes_grad
    assert not any(n.target == torch.ops.higher_order.wrap_with_set_grad_enabled for n in pm.compiled(0).gm.graph.nodes)


class _GradInsideNoGrad(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            with torch.enable_grad():
                y = self.w(x)
            z = y + 1
        return (y * z).sum()


def test_grad_enabled_again_inside_no_grad_keeps_its_gradient():
    """torch.enable_grad inside a no_grad block: export cuts it into regions one after another
    (no grad, grad, no grad), so y keeps its gradient and z = y + 1, made under no_grad, is
    detached: w takes the gradient of y * z through y alone, as in the model."""
    from fxtron.compiler.trace import trace
    model = _GradInsideNoGrad()
    x = torch.randn(2, 3, 4)
    gm = trace(model, (x,))
    assert not any(n.target == torch.ops.higher_order.wrap_with_set_grad_enabled for n in gm.graph.nodes)
    assert sum(n.target == torch.ops.aten.detach.default for n in gm.graph.nodes) == 1
    w = next(n for n in gm.graph.nodes if meta.param_name(n) == "w.weight")
    assert w in meta.reaches_loss(gm)


class _WrittenInPlace(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(4, 8, bias=False)
        self.down = torch.nn.Linear(8, 4, bias=False)

    def forward(self, x):
        h = self.up(x)
        out = torch.zeros_like(h)
        for i in range(h.shape[1]):          # the chunked delta rule's output, written chunk by chunk
            out[:, i] = h[:, i] * 2
        return self.down(out).pow(2).mean()


def test_values_written_in_place_keep_their_gradient():
    """A value written into a slice of a fresh zeros_like (`out[:, i] = y`: export's copy_ into
    a select of it) carries y's gradient on to whatever reads `out` later, as autograd's
    CopySlices does: the linear that made y reaches the loss and takes its gradient (before,
    fxtron held it gradless: its .grad None, silently never trained)."""
    from fxtron.compiler.trace import trace
    x = torch.randn(2, 3, 4)
    gm = trace(_WrittenInPlace(), (x,))
    up = next(n for n in gm.graph.nodes if meta.param_name(n) == "up.weight")
    zeros = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.zeros_like.default)
    assert up in meta.reaches_loss(gm) and zeros in meta.carries_grad(gm)
    pm = fxtron.parallelize(_WrittenInPlace(), fxtron.Mesh(2, tp=2), example_inputs=(x,))
    assert pm.compiled(0).local["up.weight"].takes_grad


@pytest.mark.parametrize("arch", ["Qwen3-Next", "Qwen3.5"])
def test_gated_deltanet_splits_megatron_way(arch):
    """Qwen3-Next's and Qwen3.5's Gated DeltaNet at tp=2, Megatron's way: the fused projection
    by heads (Qwen3-Next's in_proj_qkvz viewed per key-head group; Qwen3.5's in_proj_qkv in
    its q:k:v proportions, found through the conv to its split), the causal depthwise conv's
    weight held by the same channels (each rank its heads' q, k and v: a cat of the split q, k,
    v is their fused layout), A_log / dt_bias per head, the gated norm local, out_proj by
    rows. No all-gather, no op run replicated, nothing held whole for want of a rule."""
    from fxtron.compiler import report
    from tp_models import ZOO
    pm = _pm(ZOO[arch], 2)
    attn = "model.layers.0.linear_attn."
    local = pm.compiled(0).local
    assert local[attn + "conv1d.weight"].local_shape == (64, 1, 4)       # of (32 q | 32 k | 64 v) channels
    assert local[attn + "conv1d.weight"].shards[0].interleave == (1, 1, 2)
    assert local[attn + "out_proj.weight"].local_shape == (64, 32)
    if arch == "Qwen3.5":
        assert pm.tp_plan.interleave[attn + "in_proj_qkv"] == (1, 1, 2)
    assert pm.gathers(0) == [] and pm.fallbacks(0) == []
    assert count(pm.collectives(0), "all_gather") == 0
    _, held = report.held_whole(local, pm.tp_plan)
    assert not [h for h in held if h.why == report.NO_RULE], held


def test_mamba_splits_megatron_way():
    """Mamba's mixer at tp=2: in_proj by columns ([x | z] halves each split: interleave 2,
    found through its transpose to channels first), the causal depthwise conv on the rank's
    channels, x_proj by rows (its input comes split from in_proj through the conv: one
    all-reduce of its small dt/B/C output), out_proj by rows. Forward: the embedding's, x_proj's
    and out_proj's all-reduces, no all-gather, no op run replicated."""
    import transformers
    torch.manual_seed(0)
    model = transformers.MambaForCausalLM(transformers.MambaConfig(
        vocab_size=128, hidden_size=32, state_size=4, num_hidden_layers=1, expand=2, conv_kernel=4, use_mambapy=False))
    ids = torch.randint(0, 128, (2, 6))
    pm = fxtron.parallelize(model, fxtron.Mesh(2, tp=2), example_kwargs=dict(input_ids=ids, labels=ids))
    styles = {p: s for p, s, _ in pm.tp_plan.table()}
    mixer = "backbone.layers.0.mixer."
    assert [styles[mixer + n] for n in ("in_proj", "x_proj", "out_proj")] == ["colwise", "rowwise", "rowwise"]
    assert pm.tp_plan.interleave[mixer + "in_proj"] == 2
    assert pm.compiled(0).local[mixer + "conv1d.bias"].local_shape == (32,)
    recs = pm.collectives(0)
    fwd = [r.module for r in recs if r.phase == "forward" and r.op == "all_reduce"]
    assert fwd == ["backbone.embeddings", mixer + "x_proj", "backbone.layers.0"], fwd
    assert not [r for r in recs if r.kind == "all_gather" and r.phase == "forward"]
    assert pm.gathers(0) == [] and pm.fallbacks(0) == []


def test_experts_as_bmm_and_per_expert_linears_split_megatron_way():
    """Megatron's expert tensor parallelism on experts other than a grouped GEMM, under strict
    (nothing whole for want of a rule): Llama 4's bmm over (experts, tokens, hidden) -- gate_up
    split by columns in its two fused halves, down by rows, the shared expert's partial sum and
    the experts' summed before one all-reduce --, and JetMoE's per-expert F.linear(x, weight[i])
    in its MLP and its attention experts (queries split per head, the shared keys repeated per
    expert on the rank's heads, the combine an index_add of partial sums into zeros)."""
    pm = _pm("hf-llama4", 2, strict=True)
    local = pm.compiled(0).local
    moe = "model.layers.1.feed_forward."
    assert local[moe + "experts.gate_up_proj"].local_shape == (4, 64, 32)
    assert local[moe + "experts.down_proj"].local_shape == (4, 16, 64)
    assert str(pm.tp_plan.params[moe + "experts.gate_up_proj"]) == "S(2,x2)"      # [gate | up], each halved
    fwd = [r for r in pm.collectives(0) if r.phase == "forward" and r.op == "all_reduce"]
    assert len(fwd) == 2 * 2 + 1 and count(pm.collectives(0), "all_gather") == 0, fwd
    assert pm.fallbacks(0) == [] and pm.gathers(0) == []

    pm = _pm("hf-jetmoe", 2, strict=True)
    local = pm.compiled(0).local
    for name, shape in {"mlp.input_linear.weight": (4, 32, 64), "mlp.output_linear.weight": (4, 64, 16),
                        "self_attention.experts.input_linear.weight": (4, 16, 64),
                        "self_attention.experts.output_linear.weight": (4, 64, 16)}.items():
        assert local["model.layers.0." + name].local_shape == shape, name
    gm = pm.compiled(0).gm
    repeat = [str(meta.placement(n, "tp")) for n in gm.graph.nodes if n.target == torch.ops.aten.repeat.default]
    assert repeat == ["S(1,x2)"] * 4, repeat                # keys and values: top_k blocks of the rank's heads
    combine = {str(meta.placement(n, "tp")) for n in gm.graph.nodes if n.target == torch.ops.aten.index_add.default}
    assert combine == {"S(1)", "P(sum)"}, combine              # queries put back per head; outputs partial sums
    fwd = [r for r in pm.collectives(0) if r.phase == "forward" and r.op == "all_reduce"]
    assert len(fwd) == 2 * 2 + 1 and count(pm.collectives(0), "all_gather") == 0, fwd
    assert pm.fallbacks(0) == [] and pm.gathers(0) == []


def test_a_shared_expert_gate_is_whole_as_in_megatron():
    """Qwen2-MoE's shared_expert_gate (one output per token, its sigmoid scaling the shared
    expert's output) has nothing to split: whole by design, as Megatron's shared-expert gate
    weight, and quiet under strict."""
    from fxtron.tools import sweep
    model, kwargs = sweep.build("qwen2_moe")
    pm = fxtron.parallelize(model, fxtron.Mesh(2, tp=2), example_kwargs=kwargs, strict=True)
    pm.compiled(0)
    gates = {p: u for p, u in pm.tp_plan.replicated.items() if p.endswith("shared_expert_gate")}
    assert len(gates) == model.config.num_hidden_layers, pm.tp_plan.replicated
    assert all(u.why.startswith("a gate of one output") and not u.loud for u in gates.values()), gates
    assert pm.tp_plan.unsplit() == {}


class _IndexedEmbedding(torch.nn.Module):
    """Token embeddings written as indexing (weight[ids]) and, in the MLP, a bias gathered per
    row by other indices (gpt-oss' experts: out + bias[expert_of_row])."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, 32) * 0.1)
        self.up = torch.nn.Linear(32, 64, bias=False)
        self.row_bias = torch.nn.Parameter(torch.randn(4, 64) * 0.1)
        self.down = torch.nn.Linear(64, 32)
        self.head = torch.nn.Linear(32, 64)

    def forward(self, idx, targets):
        x = self.w[idx]
        bias = self.row_bias[idx % 4]            # gathered before the linear, as gpt-oss' graph has it
        x = x + self.down(torch.relu(self.up(x) + bias))
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def test_a_bias_gathered_per_row_is_no_residual():
    """A value gathered from a parameter's rows and added to a linear's output is its bias (the
    linear stays column-parallel, gpt-oss' gate_up); rows picked by the user's token ids are the
    residual stream (an embedding written weight[ids]: the MLP's down projection row-parallel)."""
    ids = torch.randint(0, 64, (2, 9))
    pm = fxtron.parallelize(_IndexedEmbedding(), fxtron.Mesh(2, tp=2), example_inputs=(ids[:, :-1], ids[:, 1:]))
    styles = {p: str(s) for p, s in pm.tp_plan.styles.items()}
    assert styles == {"up": "colwise", "down": "rowwise", "head": "colwise"}, styles


def test_unequal_fused_blocks_follow_a_view_only_of_the_features():
    """A qkv of 4 query, 2 key and 2 value heads (proportions 2:1:1), split by heads: viewed per
    head, (B, S, 8d) -> (B, S, 8, d), each rank keeps its share of each part; folded with the
    tokens, (B, S, 8d) -> (B*S*8, d), no block layout describes the rows a rank holds (each
    token's own q, k and v heads), so the view takes the value whole -- before, it claimed three
    blocks spanning every token's rows: a wrong layout, found by a review."""
    from fxtron.core.placement import Replicate, Shard
    from fxtron.passes.rules import Ctx, rule_for

    def view(shape_in, shape_out):
        g = fx.Graph()
        x = g.placeholder("x")
        x.meta["val"] = torch.empty(shape_in, device="meta")
        v = g.call_function(torch.ops.aten.view.default, (x, list(shape_out)))
        v.meta["val"] = torch.empty(shape_out, device="meta")
        return rule_for(torch.ops.aten.view.default)(Ctx(v, {x: Shard(2, (2, 1, 1))}, axis="tp", size=2, trace=None))

    assert view((2, 3, 32), (2, 3, 8, 4))[0] == Shard(2, (2, 1, 1))
    assert isinstance(view((2, 3, 32), (48, 4))[0], Replicate)
