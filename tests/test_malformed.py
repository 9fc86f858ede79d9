"""Malformed configurations and inputs, table-driven (issue: reliability, item 5): each one a user
could make is a ParallelizeError whose message says what is wrong and what to change -- raised
at parallelize where it can be known then (a mesh, an option, a model or example inputs export
cannot trace, a stage cut), when the rank's program is compiled for what only the per-rank
compilation finds (a head count tp does not divide), and at train_step's entry, before any
collective, for a batch (a size dp x microbatches does not divide, a sequence sp or cp cannot
split or longer than the model takes, inputs of another structure, rank, dtype or static size
than traced, token ids outside the embedding table or the loss's classes -- which a
vocab-parallel lookup would otherwise read as zeros -- tensors on another device, an optimizer
over the original model's parameters). None is an internal traceback and none hangs: the step
cases run in one gloo job with a collective timeout, every rank raising the same error.
"""
from __future__ import annotations

import ast
import re
import types
import warnings

import pytest
import torch

import fxtron
from fxtron import Mesh
from fxtron.tools.testing import cases_fixture, ranks_of, scaled
from tp_models import batch, make


def _gpt(layers=2):
    return make("gpt", layers=layers)


def _ex(name="gpt", b=2, s=8):
    return batch(name, b, s, 0)[0]


def _par(model, mesh, **kw):
    return fxtron.parallelize(model, mesh, example_inputs=_ex(), **kw)


def _compiled(model, mesh, **kw):
    pm = _par(model, mesh, **kw)
    for r in range(mesh.world_size):
        pm.compiled(r)
    return pm


class _Features(torch.nn.Module):
    """A model that returns features, not a loss; and one whose Python branches on data."""

    def __init__(self, branch=False):
        super().__init__()
        self.lin, self.branch = torch.nn.Linear(8, 8), branch

    def forward(self, x):
        y = self.lin(x)
        if self.branch:
            return y.sum() if y.sum() > 0 else y.mean()
        return y


class _Masked(torch.nn.Module):
    """Attention scores under a 4-D mask (B, 1, S, S), as transformers takes one (or a 3-D one,
    (B, S, S): a prefix-LM's)."""

    def __init__(self, heads: bool = True):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.heads = heads

    def forward(self, ids, mask):
        x = self.emb(ids)
        scores = x @ x.transpose(1, 2)
        scores = (scores.unsqueeze(1) if self.heads else scores).masked_fill(~mask, -1e9)
        return scores.softmax(-1).mean()


def _mask4d(heads: bool = True):
    ids = torch.randint(0, 16, (2, 8))
    mask = torch.ones(2, 8, 8, dtype=torch.bool).tril()
    return ids, mask.unsqueeze(1) if heads else mask


class _Square(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x).pow(2).mean()


def _eager_mixtral():
    import transformers as T
    return T.MixtralForCausalLM(T.MixtralConfig(
        vocab_size=256, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager"))


class _Wrapper(torch.nn.Module):
    """A multimodal-style wrapper: its config has no experts_implementation of its own, its text
    sub-config says eager."""
    def __init__(self, inner):
        super().__init__()
        self.model = inner
        self.config = types.SimpleNamespace(_experts_implementation=None, sub_configs={"text_config": None},
                                            text_config=inner.config)

    def forward(self, x, y):
        return self.model(x).logits.float().logsumexp(-1).mean()


def _dbrx():
    import transformers as T
    return T.DbrxForCausalLM(T.DbrxConfig(
        vocab_size=128, d_model=32, n_layers=2, n_heads=4, max_seq_len=64, attn_config=dict(kv_n_heads=2, rope_theta=1e4),
        ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2)))


def _hf(name, mesh):
    _, kw = batch(name, 2, 8, seed=0)
    return fxtron.parallelize(make(name), mesh, example_kwargs=kw)


class _MaxOverBatch(torch.nn.Module):
    """A loss with a max over the batch: no sum or mean the ranks' pieces could add up."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return h.pow(2).mean() + h.amax()


class _SortedScan(torch.nn.Module):
    """Sorts its tokens by a key, runs a scan over them in that order, and puts them back: under
    cp each rank sorts its own tokens, and the scan would see only them."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(256, 8), torch.nn.Linear(8, 256)

    def forward(self, idx, targets):
        flat = self.emb(idx).flatten(0, 1)
        order = torch.argsort(flat.sum(-1), stable=True)
        back = flat[order].cumsum(0)[torch.argsort(order)]
        return torch.nn.functional.cross_entropy(self.head(back), targets.flatten())


def _moe():
    from fxtron.models.moe import MoEConfig, MoETransformer
    return MoETransformer(MoEConfig(vocab_size=256, max_seq_len=64, n_layer=2, n_head=4, n_kv_head=2, dim=32,
                                    ffn_dim=48, n_experts=4, top_k=2))


def _x():
    return (torch.randn(2, 4, 8),)


# (id, what the user does, a pattern the message must match)
AT_PARALLELIZE = [
    ("mesh: tp does not divide the world", lambda: Mesh(4, tp=3), r"world_size 4 is not divisible by tp\*pp\*cp = 3"),
    ("mesh: tp of 0", lambda: Mesh(4, tp=0), r"tp must be a positive int, got 0"),
    ("mesh: negative tp", lambda: Mesh(4, tp=-2), r"tp must be a positive int, got -2"),
    ("mesh: world of 0", lambda: Mesh(0), r"world_size must be a positive int"),
    ("mesh: pp larger than the world", lambda: Mesh(2, pp=4), r"not divisible by tp\*pp\*cp = 4"),
    ("mesh: cp does not divide", lambda: Mesh(6, cp=4), r"not divisible by tp\*pp\*cp = 4"),
    ("mesh: ep does not divide", lambda: Mesh(6, ep=4), r"expert layout"),
    ("mesh: unknown axis in order", lambda: Mesh(4, tp=2, order="tp-dp-xx"), r"unknown axis 'xx'"),
    ("mesh: axis twice in order", lambda: Mesh(4, tp=2, order="tp-tp-cp-ep-dp-pp"), r"lists axis 'tp' 2 times"),
    ("mesh: order without a split axis", lambda: Mesh(4, tp=2, pp=2, order="tp-dp"), r"pp"),
    ("mesh: float tp", lambda: Mesh(4, tp=2.0), r"tp must be a positive int, got 2.0"),
    ("mesh: string world", lambda: Mesh("4"), r"world_size must be a positive int, got '4'"),
    ("mesh: not a Mesh", lambda: fxtron.parallelize(_gpt(), 2, example_inputs=_ex()), r"mesh must be a fxtron\.Mesh"),
    ("model: not a module", lambda: fxtron.parallelize(lambda x: x, Mesh(2), example_inputs=_x()), r"must be a torch\.nn\.Module"),
    ("model: returns features, no loss", lambda: fxtron.parallelize(_Features(), Mesh(2, tp=2), example_inputs=_x()),
     r"returned a tensor of shape .* not a scalar loss.*loss_fn"),
    ("model: branches on data", lambda: fxtron.parallelize(_Features(branch=True), Mesh(2), example_inputs=_x()),
     r"could not trace _Features.*data-dependent"),
    ("model: a 4-D mask at cp=2", lambda: fxtron.parallelize(_Masked(), Mesh(2, cp=2), example_inputs=_mask4d()),
     r"context parallel splits dim seq_dim=1 of every input as the sequence, but input 1 \(traced as \('B', 1, 8, 8\)\) "
     r"has size 1 there: .*a 4-D attention mask's head dim.*pass the mask as \(B, S\)"),
    ("model: a (B, S, S) mask at cp=2", lambda: fxtron.parallelize(_Masked(heads=False), Mesh(2, cp=2),
                                                                  example_inputs=_mask4d(heads=False)),
     r"input 1 \(traced as \('B', 8, 8\)\) has that length in dim 2 too\. If it is a mask of queries by keys.*"
     r"cannot be split over the sequence -- pass a \(B, S\) padding mask"),
    ("model: float64 at tp=2", lambda: _par(_gpt().double(), Mesh(2, tp=2)), r"parameter wte\.weight is float64"),
    ("model: every linear left replicated, strict", lambda: fxtron.parallelize(_Square(), Mesh(2, tp=2),
                                                                                example_inputs=_x(), strict=True),
     r"1 linear\(s\) stay replicated .* lin"),
    ("model: a head count tp does not divide", lambda: _par(_gpt(), Mesh(3, tp=3)),
     r"tp=3 does not divide the model's head counts \(n_head=4\).* blocks\.\*\.attn\.qkv.* Choose a tp that "
     r"divides them \(2, 4\), or keep the attention whole on purpose: plan=\{'blocks\.\*\.attn\.proj': 'replicate'"),
    ("model: a transformers model's head counts tp does not divide",
     lambda: fxtron.parallelize(make("hf-llama"), Mesh(3, tp=3), example_inputs=(), example_kwargs=batch("hf-llama", 2, 8, 0)[1]),
     r"\(num_attention_heads=8, num_key_value_heads=4\).* model\.layers\.\*\.self_attn\.q_proj.* \(2, 4\)"),
    ("model: dense, mesh asks for ep", lambda: _par(_gpt(), Mesh(2, ep=2)),
     r"ep=2 but the model has no mixture-of-experts layer .* use ep=1"),
    ("model: experts not divisible by ep", lambda: _par(_moe(), Mesh(3, ep=3)),
     r"4 experts of layers\.0\.mlp\.experts\.gate_up, layers\.0\.mlp\.experts\.down \(shape \(4, 96, 32\)\) do not "
     r"divide over ep=3 ranks; use an ep that divides 4"),
    ("options: a batch statistic fxtron cannot make global", lambda: fxtron.parallelize(_MaxOverBatch(), Mesh(2), example_inputs=_x()),
     r"%amax .* reduces over the batch \(input \(B, S, 8\) -> \(\)\).* moe_aux_loss='local'"),
    ("options: capacity factor without ep", lambda: _par(_moe(), Mesh(2), moe_capacity_factor=1.25),
     r"moe_capacity_factor=1.25 caps what each expert-parallel dispatch .* ep=1"),
    ("options: capacity factor of 0", lambda: _par(_moe(), Mesh(2, ep=2), moe_capacity_factor=0),
     r"moe_capacity_factor must be a positive number"),
    ("strict: experts over ep x tp not split column-then-row",
     lambda: _par(_moe(), Mesh(4, ep=2, tp=2), plan={"layers.*.mlp.experts.down": "replicate"}, strict=True),
     r"tp ranks of layers.0.mlp.experts, layers.1.mlp.experts dispatch the copies whole \(its last GEMM is not split "
     r"by rows.*2x the bytes of Megatron's"),
    ("options: padding to a capacity without one", lambda: _par(_moe(), Mesh(2, ep=2), moe_pad_to_capacity=True),
     r"moe_pad_to_capacity=True pads .* routing is dropless; give moe_capacity_factor"),
    ("options: aux loss kind unknown", lambda: _par(_moe(), Mesh(2), moe_aux_loss="both"),
     r"moe_aux_loss must be one of 'local', 'global', not 'both'"),
    ("model: a scan over tokens each cp rank sorted on its own", lambda: _compiled(_SortedScan(), Mesh(2, cp=2)),
     r"%cumsum \(aten.cumsum.default\) in module \(top level\): it has no rule that keeps the order of a value in a "
     r"rank-local order \(%argsort: "
     r"each cp rank sorted its own tokens.*or use cp=1"),
    ("model: transformers' experts run eagerly", lambda: fxtron.parallelize(_eager_mixtral(), Mesh(2, tp=2),
                                                                             example_inputs=_ex("llama")),
     r"experts_implementation='eager'.*'grouped_mm'"),
    ("model: a wrapper's text model runs its experts eagerly",
     lambda: fxtron.parallelize(_Wrapper(_eager_mixtral()), Mesh(2, tp=2), example_inputs=_ex("llama")),
     r"experts_implementation='eager'.*'grouped_mm'"),
    ("model: DBRX's experts loop over nonzero(), with no other implementation",
     lambda: fxtron.parallelize(_dbrx(), Mesh(2, tp=2), example_inputs=_ex("llama")),
     r"DbrxForCausalLM's experts \(DbrxExperts\) loop in Python .*nonzero\(\).*offers no other experts_implementation"),
    ("model: Llama 4's experts, a bmm over every token, over ep", lambda: _hf("hf-llama4", Mesh(4, tp=2, ep=2)),
     r"experts \(model.layers.\*.feed_forward.experts.down_proj, .*gate_up_proj\) are not a grouped GEMM.*use ep=1"),
    ("inputs: none", lambda: fxtron.parallelize(_gpt(), Mesh(2, tp=2)), r"parallelize needs example_inputs"),
    ("inputs: a dict where a tuple goes", lambda: fxtron.parallelize(_gpt(), Mesh(2), example_inputs={"x": 1}),
     r"example_inputs must be a tuple"),
    ("inputs: one too many", lambda: fxtron.parallelize(_gpt(), Mesh(2, tp=2), example_inputs=_ex() + (_ex()[0],)),
     r"could not trace GPT: TypeError: GPT\.forward\(\) takes"),
    ("inputs: float token ids", lambda: fxtron.parallelize(_gpt(), Mesh(2), example_inputs=tuple(t.float() for t in _ex())),
     r"could not trace GPT.*Long, Int"),
    ("inputs: a batch of one", lambda: fxtron.parallelize(_gpt(), Mesh(2), example_inputs=_ex(b=1)),
     r"a batch of 1 \(dim 0\).*at least 2"),
    ("inputs: a sequence of one", lambda: fxtron.parallelize(_gpt(), Mesh(2), example_inputs=_ex(s=1)),
     r"a sequence of 1 \(dim 1\)"),
    ("inputs: batch_dim past every input", lambda: _par(_gpt(), Mesh(2), batch_dim=5), r"batch_dim=5 but no example input"),
    ("inputs: negative batch_dim", lambda: _par(_gpt(), Mesh(2), batch_dim=-1), r"batch_dim must be an int of at least 0, not -1"),
    ("inputs: batch_dim equal to seq_dim", lambda: _par(_gpt(), Mesh(2, cp=2), seq_dim=0), r"both 0"),
    ("inputs: no sequence dim under cp", lambda: _par(_gpt(), Mesh(2, cp=2), seq_dim=7), r"no input of the model has a sequence dim \(seq_dim=7; the inputs' shapes are \(2, 8\), \(2, 8\)\)"),
    ("inputs: cp without seq_dim", lambda: _par(_gpt(), Mesh(2, cp=2), seq_dim=None), r"give seq_dim"),
    ("option: microbatches 0", lambda: _par(_gpt(), Mesh(2, pp=2), microbatches=0), r"microbatches must be a positive int, not 0"),
    ("option: negative microbatches", lambda: _par(_gpt(), Mesh(2, pp=2), microbatches=-1), r"microbatches must be a positive int, not -1"),
    ("option: fractional microbatches", lambda: _par(_gpt(), Mesh(2, pp=2), microbatches=2.5), r"microbatches must be a positive int, not 2\.5"),
    ("option: unknown schedule", lambda: _par(_gpt(), Mesh(2, pp=2), microbatches=2, schedule="2f2b"),
     r"schedule must be one of 'gpipe', '1f1b', 'interleaved', 'zb-h1', 'zb-v', not '2f2b'"),
    ("option: virtual_stages 0", lambda: _par(_gpt(), Mesh(2, pp=2), microbatches=2, virtual_stages=0),
     r"virtual_stages must be a positive int, not 0"),
    ("option: virtual stages without interleaving", lambda: _par(_gpt(4), Mesh(2, pp=2), microbatches=2, virtual_stages=2),
     r"virtual_stages=2 needs schedule='interleaved'"),
    ("option: interleaved with one chunk", lambda: _par(_gpt(), Mesh(2, pp=2), microbatches=2, schedule="interleaved"),
     r"needs virtual_stages >= 2"),
    ("option: interleaved microbatches not a multiple of pp",
     lambda: _par(_gpt(4), Mesh(2, pp=2), microbatches=3, schedule="interleaved", virtual_stages=2), r"use 2 or 4"),
    ("option: zb-h1 without fusion", lambda: _par(_gpt(), Mesh(2, pp=2), microbatches=2, schedule="zb-h1",
                                                   gradient_accumulation_fusion=False), r"needs gradient_accumulation_fusion"),
    ("option: zero=4", lambda: _par(_gpt(), Mesh(2), zero=4), r"zero must be one of 0, 1, 2, 3, not 4"),
    ("option: bucket_size 0", lambda: _par(_gpt(), Mesh(2), bucket_size=0), r"bucket_size must be a positive"),
    ("option: fp16 gradients without fp16's loss scaler", lambda: _par(_gpt(), Mesh(2), grad_reduce_dtype=torch.float16,
                                                                       dtype="bf16"),
     r"grad_reduce_dtype='fp16' .* but dtype='bf16' has no loss scaler .* use grad_reduce_dtype='bf16'"),
    ("option: integer gradient dtype", lambda: _par(_gpt(), Mesh(2), grad_reduce_dtype=torch.int32),
     r"grad_reduce_dtype must be one of 'fp32', 'bf16', 'fp16' or None, not 'torch.int32'"),
    ("option: negative clip", lambda: _par(_gpt(), Mesh(2), clip_grad=-1.0), r"clip_grad must be a number of at least 0\.0 or None, not -1\.0"),
    ("option: unknown cp_comm_type", lambda: _par(_gpt(), Mesh(2, cp=2), cp_comm_type="ring"), r"cp_comm_type must be one of"),
    ("option: integer dtype", lambda: _par(_gpt(), Mesh(2, tp=2), dtype=torch.int32), r"dtype must be one of 'fp32', 'bf16', 'fp16', not 'torch.int32'"),
    ("option: dtype misspelt", lambda: _par(_gpt(), Mesh(2, tp=2), dtype="bf61"), r"not 'bf61' \(did you mean 'bf16'\?\)"),
    ("option: unknown device", lambda: _par(_gpt(), Mesh(2), device="tpu"), r"device must be one of 'cpu', 'cuda' or None, not 'tpu'"),
    ("option: sequence parallel at tp=1", lambda: _par(_gpt(), Mesh(2), sequence_parallel=True), r"needs tensor parallel"),
    ("option: scatter/gather at tp=1", lambda: _par(_gpt(), Mesh(2, pp=2), microbatches=2, scatter_gather=True),
     r"the mesh has tp=1"),
    ("option: split points at pp=1", lambda: _par(_gpt(), Mesh(2), split_points=["blocks.1"]), r"the mesh has pp=1"),
    ("plan: a module the model lacks", lambda: _par(_gpt(), Mesh(2, tp=2), plan={"blocks.9.mlp.fc": "colwise"}),
     r"plan entry 'blocks\.9\.mlp\.fc' matches no linear"),
    ("plan: an unknown style", lambda: _par(_gpt(), Mesh(2, tp=2), plan={"blocks.0.mlp.fc1": "diagonal"}),
     r"use 'colwise', 'rowwise'"),
    ("plan: an unknown mode", lambda: _par(_gpt(), Mesh(2, tp=2), plan_mode="merge"), r"plan_mode must be"),
    ("stages: more than layers", lambda: _par(_gpt(), Mesh(4, pp=4), microbatches=4),
     r"4 pipeline stages .* the model has 2 layers"),
    ("stages: interleaved chunks more than layers",
     lambda: _par(_gpt(), Mesh(2, pp=2), microbatches=2, schedule="interleaved", virtual_stages=4), r"8 pipeline stages"),
    ("stages: a split point that is no layer", lambda: _par(_gpt(4), Mesh(2, pp=2), microbatches=2, split_points=["blocks.7"]),
     r"split point 'blocks\.7' is not one of the model's layers"),
    ("stages: too many split points",
     lambda: _par(_gpt(4), Mesh(2, pp=2), microbatches=2, split_points=["blocks.1", "blocks.2"]),
     r"must name one layer after blocks\.0 \(each the first layer of a stage\)"),
    ("stages: split points out of order",
     lambda: _par(_gpt(4), Mesh(4, pp=4), microbatches=4, split_points=["blocks.3", "blocks.1", "blocks.2"]),
     r"must name 3 distinct layers in order"),
    ("program: rank past the mesh", lambda: _par(_gpt(), Mesh(2, tp=2)).program(5), r"rank 5 is outside the mesh"),
    ("program: negative rank", lambda: _par(_gpt(), Mesh(2, tp=2)).program(-1), r"rank -1 is outside the mesh"),
    ("program: a rank as a string", lambda: _par(_gpt(), Mesh(2, tp=2)).graph("0"),
     r"rank must be an int in 0\.\.1, not '0' \(str\)"),
    ("summary: a negative batch", lambda: _par(_gpt(), Mesh(2, tp=2)).summary(batch=-3, seq=8),
     r"summary\(batch=-3\): the batch the figures are evaluated at is a positive int"),
    ("options: a plan entry matching nothing at tp=1", lambda: _par(_gpt(), Mesh(1), plan={"blocks.*.mlp.fc": "colwise"}),
     r"plan entry 'blocks\.\*\.mlp\.fc' matches no linear or embedding"),     # (refused at tp=2: found at tp=1 too)
    ("a pass dump where nothing can be written", lambda: fxtron.parallelize(_gpt(), Mesh(1), example_inputs=_tokens(),
                                                                            dump="/proc/fxtron-dump").graph(0),
     r"dump='/proc/fxtron-dump' \(FXTRON_DUMP, --dump\): the pass dump cannot write there"),
    ("example kwargs as a list", lambda: fxtron.parallelize(_gpt(), Mesh(1), example_inputs=_tokens(),
                                                            example_kwargs=[_tokens()[0]]),
     r"example_kwargs holds the model's keyword inputs as a dict \(name -> tensor\), not a list"),
]
AT_COMPILE = [
    ("heads: 4 heads at tp=8", lambda: _compiled(_gpt(), Mesh(8, tp=8)),
     r"node %view in module blocks\.0\.attn views dim 2 of size 64 \(sharded over tp=8\).*head count not divisible"),
    ("heads: 4 key/value heads at tp=8", lambda: fxtron.parallelize(make("llama"), Mesh(8, tp=8),
                                                                     example_inputs=_ex("llama")).compiled(0),
     r"layers\.0\.attn .*sharded over tp=8"),
]


@pytest.mark.parametrize("what,fn,pattern", AT_PARALLELIZE + AT_COMPILE, ids=[c[0] for c in AT_PARALLELIZE + AT_COMPILE])
def test_a_malformed_configuration_is_a_parallelize_error(what, fn, pattern):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(fxtron.ParallelizeError) as info:
            fn()
    assert re.search(pattern, str(info.value), re.S), str(info.value)


def test_a_plan_that_keeps_the_attention_whole_is_taken_at_any_tp():
    """The head-count refusal's own suggestion is accepted: attention replicated on purpose, the
    rest split where it divides."""
    with pytest.raises(fxtron.ParallelizeError) as info:
        fxtron.parallelize(make("hf-llama"), Mesh(3, tp=3), example_inputs=(), example_kwargs=batch("hf-llama", 2, 8, 0)[1])
    plan = ast.literal_eval(re.search(r"plan=(\{.*\})", str(info.value)).group(1))
    pm = fxtron.parallelize(make("hf-llama"), Mesh(3, tp=3), example_inputs=(), example_kwargs=batch("hf-llama", 2, 8, 0)[1],
                            plan=plan, strict=True)
    styles = dict((path, style) for path, style, _ in pm.tp_plan.table())
    assert styles["model.layers.0.self_attn.q_proj"] == "replicate" and styles["model.layers.0.mlp.gate_proj"] == "colwise"


def test_compile_errors_come_from_the_per_rank_compilation_not_parallelize():
    # the head count is found when the rank's views are propagated; parallelize itself passes
    _par(_gpt(), Mesh(8, tp=8))


# ------------------------------------------------------------------------------ at the step
VOCAB, SEQ = 256, 8


def _tokens(b=4, s=SEQ, seed=0):
    return batch("gpt", b, s, seed)[0]


def _bad_id(value, which=0):
    x, y = _tokens()
    t = [x.clone(), y.clone()]
    t[which][1, 3] = value
    return tuple(t)


class Step:
    """A step case: on `mesh` (axes), parallelize options, then train_step with `inputs()`."""

    def __init__(self, key, axes, inputs, pattern, options=None, optimizer=None):
        self.key, self.axes, self.inputs, self.pattern = key, axes, inputs, pattern
        self.options, self.optimizer = options or {}, optimizer


STEP = [
    Step("batch not divisible by dp", {}, lambda: _tokens(b=3), r"global batch 3 .* not divisible by dp=2"),
    Step("batch not divisible by dp x microbatches", {}, lambda: _tokens(b=2),
         r"does not divide into microbatches=2; use a global batch that is a multiple of dp x microbatches = 4",
         dict(microbatches=2)),
    Step("one input of two", {}, lambda: _tokens()[:1], r"inputs are 1 positional input and no keywords, but the "
                                                         r"model was traced with 2 positional inputs and no keywords"),
    Step("targets as a keyword", {}, lambda: (_tokens()[0],), r"inputs are 1 positional input and the keywords "
                                                              r"targets, but", dict(kwargs=True)),
    Step("float token ids", {}, lambda: tuple(t.float() for t in _tokens()), r"input 0 of shape \(4, 8\) is torch\.float32, but the model was traced with torch\.int64"),
    Step("int32 token ids", {}, lambda: tuple(t.int() for t in _tokens()), r"is torch\.int32, but the model was traced with torch\.int64"),
    Step("token ids without a batch dim", {}, lambda: tuple(t[0] for t in _tokens()), r"input 0 of shape \(8,\) has 1 dims.*\(B, S\)"),
    Step("targets one token shorter", {}, lambda: (_tokens()[0], _tokens()[1][:, :-1]),
         r"dim 1 of input 1 of shape \(4, 7\) is 7, but dim 1 of input 0 is 8: .* S .*sequence"),
    Step("targets of another batch", {}, lambda: (_tokens()[0], _tokens(b=6)[1]), r"is 6, but dim 0 of input 0 is 4"),
    Step("a token id past the table", {}, lambda: _bad_id(VOCAB), r"input 0 .* holds the id 256 at \(1, 3\): the embedding "
                                                                   r"table wte\.weight has 256 rows"),
    Step("a negative token id", {}, lambda: _bad_id(-1), r"holds the id -1 .*\[0, 256\)"),
    Step("a target past the classes", {}, lambda: _bad_id(999, 1), r"input 1 .* holds the id 999 .*256 classes.* or -100"),
    Step("a negative target not ignored", {}, lambda: _bad_id(-5, 1), r"holds the id -5"),
    Step("a sequence longer than the positions", {}, lambda: _tokens(s=130), r"130 tokens .* position table wpe\.weight has 128 rows"),
    Step("an input on the meta device", {}, lambda: tuple(t.to("meta") for t in _tokens()), r"is on meta, but this program runs on the CPU"),
    Step("too few microbatches given", {}, lambda: fxtron.Microbatches([(_tokens(), {})]),
         r"1 microbatches given, but the program was compiled for microbatches=2", dict(microbatches=2)),
    Step("a dict batch", {}, lambda: {"x": _tokens()[0]}, r"got inputs as dict; pass keyword inputs as kwargs="),
    Step("an optimizer over the original model", {}, _tokens, r"not this program's parameters .* prog\.parameters\(\)",
         optimizer="model"),
    Step("no optimizer", {}, _tokens, r"needs a torch\.optim\.Optimizer", optimizer="none"),
    Step("sequence parallel: a sequence tp does not split", dict(tp=2), lambda: _tokens(s=9),
         r"9 tokens .* sequence parallel cuts its tokens into tp = 2 parts.*8 or 10", dict(sequence_parallel=True)),
    Step("context parallel: a sequence 2 x cp does not split", dict(cp=2), lambda: _tokens(s=6),
         r"6 tokens .* 2 x cp = 4 equal chunks.*4 or 8"),
    Step("tp: a token id past the vocab-parallel table", dict(tp=2), lambda: _bad_id(VOCAB + 7),
         r"holds the id 263 .* wte\.weight has 256 rows"),
    Step("pp: batch not divisible by microbatches", dict(pp=2), lambda: _tokens(b=3),
         r"batch of 3 samples .* microbatches=2", dict(microbatches=2)),
    Step("pp: a target past the classes", dict(pp=2), lambda: _bad_id(4096, 1), r"holds the id 4096", dict(microbatches=2)),
]


_PROGRAMS: dict = {}     # per process: one program per mesh and options (a refused step changes nothing)


def _program(rank, mesh, opts):
    key = (str(mesh), tuple(sorted(opts.items())))
    if key not in _PROGRAMS:
        model = _gpt(4 if mesh.pp > 1 else 2)
        pm = fxtron.parallelize(model, mesh, example_inputs=_ex(), **opts)
        _PROGRAMS[key] = model, pm.program(rank)
    return _PROGRAMS[key]


def _step(rank, mesh, key):
    case = next(c for c in STEP if c.key == key)
    opts = {k: v for k, v in case.options.items() if k != "kwargs"}
    if mesh.pp > 1:
        opts.setdefault("microbatches", 2)
    model, prog = _program(rank, mesh, opts)
    opt = {"model": lambda: torch.optim.SGD(model.parameters(), lr=0.1), "none": lambda: None}.get(
        case.optimizer, lambda: torch.optim.SGD(prog.parameters(), lr=0.1))()
    inputs = case.inputs()
    try:
        if case.options.get("kwargs"):
            prog.train_step(inputs, opt, kwargs={"targets": _tokens()[1]})
        else:
            prog.train_step(inputs, opt)
    except fxtron.ParallelizeError as e:
        return ("ParallelizeError", str(e))
    except Exception as e:  # noqa: BLE001 - the test reports what leaked
        return (type(e).__name__, str(e))
    # a good step after the bad one: the ranks are still in step with each other
    return ("no error", "")


def _after(rank, mesh):
    _, prog = _program(rank, mesh, {"microbatches": 2} if mesh.pp > 1 else {})    # refused steps ran on it
    return prog.train_step(_tokens(), torch.optim.SGD(prog.parameters(), lr=0.1))


AFTER = "a good step after the bad ones"


def _dispatch(rank, mesh, key):
    return _after(rank, mesh) if key == AFTER else _step(rank, mesh, key)


def _mesh(axes):
    return Mesh(2, **axes)


def _jobs():
    plan: dict[str, list] = {}
    for c in STEP:
        plan.setdefault(str(_mesh(c.axes)), []).append(c.key)     # keys travel: the cases hold lambdas
    meshes = {str(_mesh(c.axes)): _mesh(c.axes) for c in STEP}
    return {2: [(meshes[k], keys + [AFTER]) for k, keys in plan.items()]}


# a bound on a hang (none should), stretched by the load: a case waits for its peers' compilation
stepped = cases_fixture(_jobs, _dispatch, timeout_s=600, collective_timeout_s=scaled(60))


@pytest.mark.slow
@pytest.mark.parametrize("case", STEP, ids=[c.key for c in STEP])
def test_a_malformed_batch_is_refused_at_the_step(stepped, case):
    for rank, (kind, msg) in enumerate(ranks_of(stepped, _mesh(case.axes), case.key)):
        assert kind == "ParallelizeError", f"rank {rank}: {kind}: {msg}"
        assert re.search(case.pattern, msg, re.S), f"rank {rank}: {msg}"


@pytest.mark.slow
def test_the_ranks_train_on_after_the_refused_steps(stepped):
    for axes in ({}, dict(tp=2), dict(cp=2), dict(pp=2)):
        losses = ranks_of(stepped, _mesh(axes), AFTER)
        assert all(abs(x - losses[0]) < 1e-6 and x == x for x in losses), losses


def test_the_table_tries_at_least_fifty_cases():
    assert len(AT_PARALLELIZE) + len(AT_COMPILE) + len(STEP) >= 50
