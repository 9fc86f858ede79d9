"""The transformers decoder architectures fxtron is held to (tp_models.ZOO: 40 families, and
Falcon in both its layouts, from tiny random configs, two layers, no downloads), split the way
Megatron would -- experts too, when ep does not take them (Megatron's expert tensor parallelism:
each expert's gate/up split by columns, its down by rows): 3-D weights under a grouped GEMM
(Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3, GraniteMoE), a bmm of every expert over every token
(Llama 4, beside its shared expert), one linear per expert's rows (JetMoE's ParallelExperts, in
its MLP and its mixture of attention heads). State-space layers too: Mamba-1 (transformers' slow
path: in_proj by columns, the depthwise conv, A_log, D and dt_proj -- written weight @ x -- by
channel, x_proj and out_proj by rows) and Mamba-2 (in_proj's [z | x | B | C | dt] each split by
heads or groups, the conv, A_log, D and dt_bias by head, the gated norm per group, out_proj by rows).

Compile-only, at tp=2, for every one: each layer linear split (the only linears left whole
are the routers and MLA's low-rank down-projections, which Megatron keeps whole too), a
rank's share of the layers' parameters about 1/tp, Megatron's forward all-reduces -- 2 per
layer and 1 for the vocab-parallel embedding -- and no all-gather, no op run replicated for
want of a rule.

Then two gloo jobs train two AdamW steps (global batches of 4, sequence lengths 16 then 12)
equal to one process: every architecture at tp=2, a third of them at tp=2 with sequence
parallel and another third at tp=4. Losses within 2e-6, the first step's gradients within 1e-6
(absolute: the largest gradients are 0.08 to 0.4, and a gradient that is zero in exact
arithmetic, OPT's key bias, holds only round-off, ~1e-8), the weights after both steps within
1e-5. Adam's eps is 1e-4 here: with a smaller one, a gradient of 1e-6 (an embedding row of a
rare token) moves its weight by a full step whose size its round-off decides.
"""
from __future__ import annotations

import math
import re

import pytest
import torch

import fxtron
from fxtron.compiler import report
from fxtron.passes.tp_plan import router_weights
from fxtron.tools.testing import adamw, assert_trains_like, cases_fixture, max_abs_diff, ranks_of, reference_training, train_program
from tp_models import ZOO, batch, batches, make

pytestmark = pytest.mark.slow      # a minute of compiling 25 architectures, then gloo jobs of 2 and 4 processes

ARCHS = list(ZOO)
LAYERS = 2
# a third with sequence parallel at tp=2, another at tp=4 (both: norms before and after the
# sublayers, parallel residuals, fused qkv, rotary variants, experts, latent attention)
SP = ["Llama", "Qwen3", "Gemma2", "OLMo2", "Phi", "GPT-J", "GPT-NeoX", "Falcon", "Cohere", "GPTBigCode"]
TP4 = ["Mistral", "Gemma3", "OLMoE", "Phi-3", "GPT-2", "Starcoder2", "Mixtral", "DeepSeek-V3", "CodeGen", "GPTBigCode",
       "Ergo"]
# forward all-reduces of the hidden state per layer where they differ from Megatron's 2:
# Falcon's parallel residual adds the attention and MLP partial sums before one all-reduce
# (CodeGen's and GPT-J's parallel blocks add the MLP's bias after its all-reduce, Megatron's way: 2)
# (a Mamba-2 mixer is one projection in, one out: 1)
# Doge's dt_proj reads the rank's value heads (its input split, row-parallel) and gives one
# number per head and token: a third, small all-reduce (B, S, heads), then sliced to the rank's heads
# LongCat-Flash's layer is two attentions, two dense MLPs and a mixture of experts: 5
FWD_PER_LAYER = {"Falcon": 1, "Falcon-40B": 1, "Mamba2": 1, "Doge": 3, "LongCat-Flash": 5}
# linears split per layer where a layer has fewer than attention's q/kv/o and the MLP's up/down
# (Mamba-2's mixer alone: in_proj by columns, out_proj by rows)
SPLIT_PER_LAYER = {"Mamba2": 2}
# q/k norms over the whole split width (OLMo2, OLMoE): each statistic is one all-reduce of a
# float per token (the sum of squares), forward; its gradient's, backward
STATISTICS = {"OLMo2": 2, "OLMoE": 2}
# statistics all-reduced once per step, not per layer: Cohere's layer norm, written out, takes
# the mean of the vocab-parallel embedding's partial sum before that sum is all-reduced; MiniMax's
# lightning attention (the second of its two layers) norms its heads' output over the whole split width
STATISTICS_ONCE = {"Cohere": 1, "MiniMax": 1}
# all-gathers in backward only: GPTBigCode's one key and value head, whole on every rank and
# expanded to the query heads, is sliced to the rank's heads; the slice's backward gathers the
# gradient (2 a layer). Megatron cannot split this layer at all
# Doge's dynamic mask is made whole (from dt_proj's all-reduced output, a number per head and
# token) and expanded to (B, heads, S, S) before it is sliced to the rank's heads: the slice's
# backward gathers that gradient (1 a layer; slicing before the expand would gather B*S*heads)
BACKWARD_GATHERS = {"GPTBigCode": 2, "Doge": 1}
# ... once a step: CPM-Ant's relative position bias (B, heads, S, S), made once from a table of
# heads columns and sliced to the rank's heads in every layer
BACKWARD_GATHERS_ONCE = {"CPM-Ant": 1}
# linears Megatron keeps whole, and why (DeepSeek-V3.2's indexer: whole in DeepSeek's reference;
# Qwen3-Next's shared-expert gate, one output per token)
WHOLE_BY_DESIGN = ("a router", "a low-rank down-projection", "computed under torch.no_grad",
                   "a gate of one output per token")
LAYER_PARAM = re.compile(r"\.(layers|h)\.\d+\.")
SEQS = [16, 12]
_opt = adamw(eps=1e-4)


# sequence lengths fixed by the trace: transformers' Mamba-1 slow path unrolls its scan over the
# tokens in Python (traced at 8 tokens, the batch size still free); CPM-Ant concatenates its
# prompt ids before the text's
FIXED_SEQS = {"hf-mamba": [8, 8], "hf-cpmant": [8, 8]}
# Mamba-2's chunked scan traces with its number of chunks fixed (torch.export specializes the
# chunk count + 1 of the inter-chunk decay) and its padding branch taken (seq_len % chunk_size):
# traced at 12 tokens, it trains on 16 and 12 (padded to 16), two chunks of 8 each
EXAMPLE_SEQ = {"hf-mamba2": 12}


def _batches(name):
    return batches(name, 4, FIXED_SEQS.get(name, SEQS), seed=10)


def _pm(name, tp, **kw):
    args, kwargs = batch(name, 2, 8, seed=0)
    return fxtron.parallelize(make(name), fxtron.Mesh(tp, tp=tp), example_inputs=args, example_kwargs=kwargs, **kw)


def _checked(arch: str) -> str | None:
    """`_split_check(arch)` in a pool worker: None, or the failure's traceback."""
    import traceback
    import warnings
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    try:
        _split_check(arch)
    except BaseException:   # noqa: BLE001 -- reported by the test of that architecture
        return traceback.format_exc()
    return None


@pytest.fixture(scope="module")
def split_checks() -> dict[str, str | None]:
    """Every architecture's compile-only check, in a pool of two processes: each check is
    single-threaded Python (tracing, the passes), so one at a time would leave a core idle."""
    import multiprocessing as mp
    with mp.get_context("forkserver").Pool(2, maxtasksperchild=12) as pool:
        return dict(zip(ARCHS, pool.map(_checked, ARCHS, chunksize=1)))


@pytest.mark.parametrize("arch", ARCHS)
def test_split_megatron_way_at_tp2(split_checks, arch):
    """Each architecture split Megatron's way at tp=2 (the module's docstring; `_split_check`)."""
    if split_checks[arch] is not None:
        pytest.fail(f"{arch}:\n{split_checks[arch]}", pytrace=False)


def _split_check(arch: str) -> None:
    name = ZOO[arch]
    model = make(name)
    args, kwargs = batch(name, 2, 8, seed=0)
    pm = fxtron.parallelize(model, fxtron.Mesh(2, tp=2), example_inputs=args, example_kwargs=kwargs)
    plan = pm.tp_plan
    assert plan.unsplit() == {}, plan.unsplit()
    whole = {p: u.why for p, u in plan.replicated.items()}
    assert all(why.startswith(WHOLE_BY_DESIGN) for why in whole.values()), whole
    split = [p for p, style, _ in plan.table() if style != "replicate" and plan.layers[p].kind == "linear"]
    assert len(split) >= SPLIT_PER_LAYER.get(arch, 4) * LAYERS + 1, plan.table()          # at least q/kv/o and up/down per layer, and the head

    full = dict(model.named_parameters())
    local = pm.compiled(0).local
    # (DeepSeek-V3.2's indexer, whole by design, left out: in a tiny config it is a tenth of a layer)
    layer = [n for n in local if LAYER_PARAM.search(n) and ".indexer." not in n]
    share = (sum(torch.Size(local[n].local_shape).numel() for n in layer) / sum(full[n].numel() for n in layer))
    assert share < 0.55, f"a rank holds {share:.3f} of the layers' parameters"
    # the experts' 3-D weights (grouped GEMM, bmm or one linear per expert): each expert split, 1/tp a rank
    experts = {l.weight for l in plan.layers.values() if l.layout.startswith("e_")}
    if experts:
        held = sum(torch.Size(local[n].local_shape).numel() for n in experts) / sum(full[n].numel() for n in experts)
        assert held == 0.5, f"a rank holds {held:.3f} of the experts' weights"

    recs = pm.collectives(0)
    fwd = [r for r in recs if r.phase == "forward" and r.op == "all_reduce"]
    stats = [r for r in fwd if str(r.shape[-1]) == "1"]
    hidden = [r for r in fwd if r not in stats]
    assert len(hidden) == FWD_PER_LAYER.get(arch, 2) * LAYERS + 1, [(r.module, r.shape) for r in fwd]
    assert len(stats) == STATISTICS.get(arch, 0) * LAYERS + STATISTICS_ONCE.get(arch, 0), \
        [(r.module, r.shape) for r in stats]
    assert not [r for r in recs if r.kind == "all_gather" and r.phase == "forward"], recs
    gathers = [(r.node, r.module, r.shape) for r in recs if r.kind == "all_gather"]
    assert len(gathers) == BACKWARD_GATHERS.get(arch, 0) * LAYERS + BACKWARD_GATHERS_ONCE.get(arch, 0), gathers
    assert pm.gathers(0) == [] and pm.fallbacks(0) == []

    # every parameter accounted for: split, or held whole with its reason, the shares adding up
    total, held = report.held_whole(local, plan, router_weights(pm.traced))
    assert total == sum(p.numel() for p in model.parameters())
    split = sum(math.prod(lp.full_shape) for lp in local.values() if any(s.axis == "tp" for s in lp.shards))
    assert split + sum(h.numel for h in held) == total
    assert not [h for h in held if h.loud], held
    line = next(ln for ln in pm.summary().splitlines() if ln.startswith("parameters at tp=2"))
    shares = [float(x) for x in re.findall(r"(\d+\.\d)% ", line)]
    assert abs(sum(shares) - 100) <= 0.05 * len(shares), line


def _train(rank: int, mesh: fxtron.Mesh, case: str) -> dict:
    arch, sp = case.removesuffix("+sp"), case.endswith("+sp")
    name = ZOO[arch]
    args, kwargs = batch(name, 2, EXAMPLE_SEQ.get(name, 8), seed=0)
    pm = fxtron.parallelize(make(name), mesh, example_inputs=args, example_kwargs=kwargs, sequence_parallel=sp)
    prog = pm.program(rank)
    return train_program(prog, _batches(name), _opt(prog.parameters()))


MESH2, MESH4 = fxtron.Mesh(2, tp=2), fxtron.Mesh(4, tp=4)
CASES = [(MESH2, a) for a in ARCHS] + [(MESH2, a + "+sp") for a in SP] + [(MESH4, a) for a in TP4]


results = cases_fixture({2: [(MESH2, ARCHS + [a + "+sp" for a in SP])], 4: [(MESH4, TP4)]}, _train)


@pytest.fixture(scope="module")
def reference():
    return {arch: reference_training(make(ZOO[arch]), _batches(ZOO[arch]), _opt) for arch in ARCHS}


@pytest.mark.parametrize("mesh,case", CASES, ids=[f"tp{m.tp}-{c}" for m, c in CASES])
def test_trains_like_one_process(results, reference, mesh, case):
    ref = reference[case.removesuffix("+sp")]
    for rank in range(mesh.world_size):
        assert_trains_like(results[(str(mesh), case, rank)], ref, rank=rank)


# ------------------------------------------------------------------------------ multi-query attention
def _mqa(rank: int, mesh: fxtron.Mesh, case: str, path: str) -> dict:
    name = ZOO["GPTBigCode"]
    _, kwargs = batch(name, 2, 8, seed=0)
    options = dict(zero=1, clip_grad=0.05) if case == "zero" else {}
    prog = fxtron.parallelize(make(name), mesh, example_kwargs=kwargs, **options).program(rank)
    opt = _opt(prog.parameters())
    if case == "load":
        prog.load(path, opt)
        return prog.full_state_dict()
    out = train_program(prog, _batches(name)[:1] if case == "save" else _batches(name), opt)
    if case == "save":
        prog.save(path, opt)
    return {**out, "norm": prog.last_grad_norm}


def test_multi_query_attention_keeps_key_and_value_whole(tmp_path):
    """GPTBigCode's c_attn at tp=2 with dp=2 under zero=1 and clipping: the query heads split,
    the one key and value head whole on every rank (counted once in the norm), equal to one
    process; its checkpoint saved at tp=2 loads at tp=4, every parameter equal."""
    from functools import partial
    from fxtron.tools.testing import run_cases
    name, path = ZOO["GPTBigCode"], str(tmp_path / "ckpt")
    pm = fxtron.parallelize(make(name), fxtron.Mesh(2, tp=2), example_kwargs=batch(name, 2, 8, seed=0)[1])
    w = pm.compiled(0).local["transformer.h.0.attn.c_attn.weight"]
    assert w.full_shape == (80, 64) and w.local_shape == (48, 64), w     # 32 of 64 query rows, key and value whole
    run = partial(_mqa, path=path)
    got = run_cases({4: [(fxtron.Mesh(4, tp=2), ["zero"])], 2: [(fxtron.Mesh(2, tp=2), ["save"])]}, run)
    got.update(run_cases({4: [(fxtron.Mesh(4, tp=4), ["load"])]}, run))
    ref = reference_training(make(name), _batches(name), _opt, clip_grad=0.05)
    for rank, out in enumerate(ranks_of(got, fxtron.Mesh(4, tp=2), "zero")):
        assert_trains_like(out, ref, rank=rank)
        assert abs(out["norm"] - ref["norms"][-1]) < 1e-5 * ref["norms"][-1], (out["norm"], ref["norms"])
    saved = ranks_of(got, fxtron.Mesh(2, tp=2), "save")[0]["state"]
    for rank, state in enumerate(ranks_of(got, fxtron.Mesh(4, tp=4), "load")):
        assert max_abs_diff(state, saved)[0] == 0.0, rank
