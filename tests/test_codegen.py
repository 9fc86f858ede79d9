"""Compiled per-rank programs (`compile=True`, codegen/regions.py): each rank's graph cut at
fxtron's ops into regions that Inductor compiles, everything else as it was.

Held per parallelism on tiny models, in one job of 2 gloo processes with the collective-order
check on (every rank issues the same collectives in the same order): a compiled program trains
three steps equal to the same program uncompiled (float round-off: Inductor fuses and reorders
the elementwise math) and to the unmodified model in one process (the equivalence tests'
tolerances): tp with sequence parallel, pp under every schedule (GPipe, 1F1B, interleaved, ZB-H1 and ZB-V: their
weight-gradient passes deferred), dp with zero 1, 2 and 3, cp, ep,
recompute, bf16 and fp16. Without processes: the regions a graph is cut into, and the summary's line.
Inductor compiles on the first step (seconds a region on 2 cores): the module is slow-marked, and
its cases share one model (the shipped Llama; the shipped MoE for ep) so that their regions
repeat and the cache serves them.
"""
from __future__ import annotations

import pytest
import torch

import fxtron
from fxtron.core import meta
from fxtron.codegen.regions import Compiler, opaque, plan
from fxtron.ops.rng import rng_call
from fxtron.tools.testing import adamw, assert_trains_like, cases_fixture, max_abs_diff, ranks_of, \
    reference_training, train_program
from test_inplace import RunningMean, running_mean_items
from tp_models import Case, batches, make

pytestmark = pytest.mark.slow

SEQS = [16, 16, 16]


def _items(case: Case):
    return batches(case.name, 8, SEQS, seed=3)


def _model(case: Case) -> torch.nn.Module:
    return make(case.name, layers=case.kw.get("layers", 2))


def _run(rank: int, mesh: fxtron.Mesh, case: Case) -> dict:
    items = _items(case)
    args, kwargs = items[0]
    out = {}
    for compiled in (False, True):
        kw = {k: v for k, v in case.kw.items() if k != "layers"}
        pm = fxtron.parallelize(_model(case), mesh, example_inputs=args, example_kwargs=kwargs or None,
                                compile=compiled, **kw)
        prog = pm.program(rank)
        out[compiled] = train_program(prog, items, adamw()(prog.parameters()))
        if compiled:
            stats = prog.compiled
            out["stats"] = (stats.regions, stats.distinct, stats.opaque, stats.seconds)
            out["recomputed"] = (stats.recomputed, stats.inside)
            out["fused"], out["master"] = (sum(n.target == op for g in pm.compiled(rank).graphs for n in g.graph.nodes)
                                           for op in (torch.ops.fxtron.linear.default,
                                                      torch.ops.fxtron.master_linear.default))
    return out


CASES = {
    fxtron.Mesh(2, tp=2): [Case("llama"), Case("llama", sequence_parallel=True), Case("llama", recompute="full"),
                           Case("llama", dtype="bf16"),
                           # a region returning a value and tp's f of it (its backward all-reduce kept)
                           Case("two-branch-mlp")],
    fxtron.Mesh(2, pp=2): [Case("llama", schedule="1f1b", microbatches=2),
                           Case("gpt", schedule="1f1b", microbatches=2, dtype="fp16"),   # tied, over the stages;
                           # fp16's loss scale and its overflow check over both stages
                           Case("llama", schedule="zb-v", microbatches=2, layers=4),
                           # the other schedules: GPipe's order, two chunks a rank, ZB-H1's deferred W passes
                           Case("llama", schedule="gpipe", microbatches=2),
                           Case("llama", schedule="interleaved", microbatches=2, virtual_stages=2, layers=4),
                           Case("llama", schedule="zb-h1", microbatches=2)],
    # zero=3 recomputing its layers: the gathered weights' saved-tensor hooks around the checkpoints
    fxtron.Mesh(2): [Case("llama", zero=1), Case("llama", zero=2), Case("llama", zero=3, recompute="full")],
    fxtron.Mesh(2, cp=2): [Case("llama")],
    fxtron.Mesh(2, ep=2): [Case("moe")],
}
PARAMS = [pytest.param(m, c, id=f"{m}-{c.key}") for m, cs in CASES.items() for c in cs]

results = cases_fixture({2: list(CASES.items())}, _run, check_collectives=True)


@pytest.mark.parametrize("mesh, case", PARAMS)
def test_compiled_program_trains_as_uncompiled_and_one_process(results, mesh, case):
    half = case.kw.get("dtype") in ("bf16", "fp16")
    ref = None if half else reference_training(_model(case), _items(case), adamw())
    for rank, got in enumerate(ranks_of(results, mesh, case)):
        plain, compiled = got[False], got[True]
        regions, distinct, n_opaque, seconds = got["stats"]
        assert regions > 0 and 0 < distinct <= regions and seconds > 0, got["stats"]
        # the linears stay fused (opaque, between the regions) under zero=3 (the weight regathered),
        # a zero-bubble schedule (deferred W passes) and a dp (dp-cp) reduction overlapping backward
        # (each linear reports its gradient as its GEMM runs); elsewhere on the CPU they are the
        # regions' own (tp, with sequence parallel too), aten ops in fp32, fxtron::master_linear
        # under 16-bit compute (passmanager.linears_in_regions)
        keeps_fused = (case.kw.get("zero") == 3 or case.kw.get("schedule") in ("zb-h1", "zb-v")
                       or mesh.dp * mesh.cp > 1)
        assert (got["fused"] > 0) == keeps_fused, (got["fused"], got["stats"])
        assert (got["master"] > 0) == (half and not keeps_fused), (got["master"], got["stats"])
        if not keeps_fused and mesh.pp > 1:    # a stage (model chunk) is one region (the last: two, around
            # its loss's token count over the microbatches)
            assert regions <= case.kw.get("virtual_stages", 1) + rank, got["stats"]
        recomputed, inside = got["recomputed"]
        # each recomputed layer a checkpointed call with its own graph compiled inside
        assert (recomputed, inside > 0) == ((2, True) if "recompute" in case.kw else (0, False)), got["recomputed"]
        if not keeps_fused and mesh.tp > 1:   # f and g inside the regions: cut at the vocab-parallel ops alone
            assert regions - inside <= 3 and n_opaque <= 3, got["stats"]   # (and at each checkpointed call)
        # the compiled program against the same program uncompiled: float round-off
        dl = max(abs(a - b) for a, b in zip(compiled["losses"], plain["losses"]))
        dw, where = max_abs_diff(compiled["state"], plain["state"])
        dg, gwhere = max_abs_diff(compiled["grads"], plain["grads"])
        tol = (2e-2, 2e-2) if half else (2e-6, 1e-5)
        assert dl < tol[0], (rank, compiled["losses"], plain["losses"])
        assert dg < tol[1] and dw < tol[1], (rank, dg, gwhere, dw, where)
        if not half:     # and against the model in one process (16-bit's compared above, with the uncompiled program)
            assert_trains_like(compiled, ref, rank=rank)


def test_regions_of_a_graph():
    """GPT at world 1: in fp32 the linears and attention (no dropout) are the compiled region's
    own ops, the whole step one region, and so are the master-weight linears of bf16 compute; a
    16-bit model's linears and those of a step whose dp reduction overlaps backward stay fused
    (fp32 weight gradients into main_grad), opaque, the rest compiled as the module docstring
    says, a model's repeated layers sharing their regions."""
    (args, kwargs), = batches("gpt", 2, [8], seed=0)
    pm = fxtron.parallelize(make("gpt", layers=4), fxtron.Mesh(1), example_inputs=args, compile=True)
    gm = pm.compiled(0).gm
    st = plan([gm])
    assert not [n for n in gm.graph.nodes if n.target == torch.ops.fxtron.linear.default]
    attention = [n for n in gm.graph.nodes if n.target == torch.ops.aten.scaled_dot_product_attention.default]
    assert attention and not any(opaque(n) for n in attention)
    assert (st.regions, st.distinct, st.opaque) == (1, 1, 0), st
    assert "compile=True" in pm.summary() and st.line() in pm.summary()
    assert "left to the compiled regions" in pm.summary()
    # bf16 compute: every linear is fxtron::master_linear, the region's own op (the fp32 weight in,
    # its fp32 weight gradient out); the tied embedding reads a cast of the same weight
    pm = fxtron.parallelize(make("gpt", layers=4), fxtron.Mesh(1), example_inputs=args, compile=True, dtype="bf16")
    gm = pm.compiled(0).gm
    master = [n for n in gm.graph.nodes if n.target == torch.ops.fxtron.master_linear.default]
    assert len(master) == 4 * 4 + 1 and not any(opaque(n) for n in master)
    assert not [n for n in gm.graph.nodes if n.target == torch.ops.fxtron.linear.default]
    (lm_head,) = [n for n in master if meta.param_name(n.args[1]) == "wte.weight"]
    assert [u.target for u in lm_head.args[1].users if u is not lm_head] == [torch.ops.aten._to_copy.default]
    assert (plan([gm]).regions, plan([gm]).opaque) == (1, 0)
    assert "fxtron::master_linear" in pm.summary()
    # a 16-bit model under the default fp32 setting: its linears' weight gradients still
    # accumulate in fp32 inside the GEMM (autograd's would be rounded to bf16 first); under bf16
    # compute it has fp32 masters as an fp32 model does (runtime/build.py), and master linears
    for dtype, op in (("fp32", torch.ops.fxtron.linear.default), ("bf16", torch.ops.fxtron.master_linear.default)):
        gm = fxtron.parallelize(make("gpt", layers=2).bfloat16(), fxtron.Mesh(1), example_inputs=args,
                                compile=True, dtype=dtype).compiled(0).gm
        ops = {n.target for n in gm.graph.nodes} & {torch.ops.fxtron.linear.default, torch.ops.fxtron.master_linear.default}
        assert ops == {op}, (dtype, ops)
    # a dp reduction overlapping backward: each fused linear reports its gradient as its GEMM runs
    pm = fxtron.parallelize(make("gpt", layers=4), fxtron.Mesh(2), example_inputs=args, compile=True)
    gm = pm.compiled(0).gm
    st = plan([gm])
    linears = [n for n in gm.graph.nodes if n.target == torch.ops.fxtron.linear.default]
    assert linears and all(opaque(n) for n in linears)
    assert st.regions > st.distinct > 0, st          # 4 layers, each layer's regions compiled once
    assert "left to the compiled regions" not in pm.summary()
    gm = fxtron.parallelize(make("gpt", layers=2), fxtron.Mesh(2), example_inputs=args, compile=True,
                            overlap_grad_reduce=False).compiled(0).gm
    assert not [n for n in gm.graph.nodes if n.target == torch.ops.fxtron.linear.default]
    # tp=2 on the CPU: the regions hold the linears, and so tensor parallel's f and g between them
    # (Compiler(comm=True)): the layers are one region, cut only at the vocab-parallel embedding
    # and loss; under sequence parallel its gathers and reduce-scatters are the regions' too
    pm = fxtron.parallelize(make("gpt", layers=4), fxtron.Mesh(2, tp=2), example_inputs=args, compile=True)
    gm = pm.compiled(0).gm
    comm = [n for n in gm.graph.nodes if n.target in (torch.ops.fxtron.copy_to_region.default,
                                                       torch.ops.fxtron.all_reduce.default)]
    assert len(comm) >= 4 * 4 and not any(opaque(n, comm=True) for n in comm) and all(opaque(n) for n in comm)
    st, cut = plan([gm], comm=True), plan([gm])
    assert st.regions <= 3 and st.opaque <= 3 and cut.regions > 4 * 4, (st, cut)
    assert st.line() in pm.summary() and "tensor parallel's all-reduces inside them" in pm.summary()
    pm = fxtron.parallelize(make("gpt", layers=4), fxtron.Mesh(2, tp=2), example_inputs=args, compile=True,
                            sequence_parallel=True)
    gm = pm.compiled(0).gm
    comm = [n for n in gm.graph.nodes if n.target in (torch.ops.fxtron.gather_from_sequence.default,
                                                       torch.ops.fxtron.reduce_scatter.default)]
    assert len(comm) >= 4 * 4 and not any(opaque(n, comm=True) for n in comm) and all(opaque(n) for n in comm)
    assert plan([gm], comm=True).regions <= 3, plan([gm], comm=True)
    assert "gathers and reduce-scatters over the sequence inside them" in pm.summary()
    # beside a fused linear (a 16-bit model's) f stays opaque: its backward all-reduce runs while
    # the queued weight-gradient GEMMs compute
    pm = fxtron.parallelize(make("gpt", layers=2).bfloat16(), fxtron.Mesh(2, tp=2), example_inputs=args, compile=True)
    assert plan(pm.compiled(0).graphs, comm=True).regions == plan(pm.compiled(0).graphs).regions > 2
    assert "all-reduces inside them" not in pm.summary()
    # a graph with dropout: the random op stays outside the compiled regions
    drop = make("gpt", dropout=0.1)
    g = fxtron.parallelize(drop, fxtron.Mesh(1), example_inputs=args).compiled(0).gm
    random = [n for n in g.graph.nodes if n.target is rng_call]     # the random ops on fxtron's streams
    assert random and all(opaque(n) for n in random)
    assert not [n for n in g.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                and torch.Tag.nondeterministic_seeded in n.target.tags]


def test_world_one_compiled_step_equals_uncompiled_with_dropout():
    """Dropout drawn outside the regions: the compiled program draws the uncompiled one's masks;
    its eval-mode graph (dropout off) is compiled too and evaluates as the uncompiled one."""
    (args, kwargs), = batches("gpt", 4, [16], seed=1)
    losses, evals = {}, {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = make("gpt", dropout=0.2)
        pm = fxtron.parallelize(model, fxtron.Mesh(1), example_inputs=args, compile=compiled)
        prog, pm_summary = pm.program(0), pm.summary()
        opt = adamw()(prog.parameters())
        losses[compiled] = [prog.train_step(args, opt) for _ in range(3)]
        if compiled:
            assert isinstance(prog.compiled, type(Compiler().stats)) and prog.compiled.seconds > 0
            regions = prog.compiled.regions
        evals[compiled] = prog.eval_step(args)
        if compiled:
            # the eval graph's regions, compiled on first use, counted and said apart from the training graph's
            assert prog.compiled.regions > regions and prog.compiled.eval_regions == prog.compiled.regions - regions
            assert (f"in its training and eval-mode graphs ({prog.compiled.eval_regions} of the regions the "
                    "eval-mode graph's") in prog.compiled.line()
            assert "in its training graph," in pm_summary and "1 regions" not in prog.compiled.line()
    assert max(abs(a - b) for a, b in zip(losses[True], losses[False])) < 2e-6, losses
    assert abs(evals[True] - evals[False]) < 2e-6, evals


@pytest.mark.parametrize("read", ["after", "before"])
def test_a_buffer_written_in_place_under_no_grad_compiles(read):
    """A running average of an activation updated in place under torch.no_grad() inside a
    compiled region: the region's write records no gradient history (AOTAutograd took the buffer
    for an input that requires grad, and the second step's backward walked into the first's
    freed graph: an error), and three steps train as one process."""
    items = running_mean_items()
    torch.manual_seed(0)
    ref = reference_training(RunningMean(read), items, adamw(lr=1e-2))
    torch.manual_seed(0)
    prog = fxtron.parallelize(RunningMean(read), fxtron.Mesh(1), example_inputs=items[0], compile=True).program(0)
    got = train_program(prog, [(b, {}) for b in items], adamw(lr=1e-2)(prog.parameters()))
    assert_trains_like(got, ref)
    assert prog.ema.grad_fn is None


def test_shapes_past_dynamos_recompile_limit_run_uncompiled_with_a_warning():
    """Training and evaluating on batches of several shapes (each shape, grad mode and size-1 dim a
    compiled entry of its own) takes a region past Dynamo's recompile limit (8; 2 here, to
    compile less): a fullgraph region then raised; its calls past the limit now run the region's
    graph uncompiled -- the uncompiled program's numbers -- said in a warning and in the stats' line."""
    import warnings
    import torch._dynamo.config as dynamo_config
    shapes = [(4, 16), (4, 8), (1, 8)]
    got = {}
    for compiled in (False, True):
        prog = fxtron.parallelize(make("gpt"), fxtron.Mesh(1), example_inputs=batches("gpt", 4, [16], seed=0)[0][0],
                                  compile=compiled).program(0)
        opt = adamw()(prog.parameters())
        with warnings.catch_warnings(record=True) as caught, dynamo_config.patch(recompile_limit=2):
            warnings.simplefilter("always")
            got[compiled] = [(prog.train_step(a, opt), prog.eval_step(a))
                             for i, (b, s) in enumerate(shapes) for a in [batches("gpt", b, [s], seed=i)[0][0]]]
        if compiled:
            assert prog.compiled.uncompiled_calls > 0, prog.compiled.line()
            assert "region calls past Dynamo's recompile limit ran uncompiled" in prog.compiled.line()
            assert any("recompile_limit" in str(w.message) for w in caught)
    assert max(abs(x - y) for a, b in zip(got[True], got[False]) for x, y in zip(a, b)) < 2e-6, got


def test_recomputed_regions_are_compiled_inside_their_checkpointed_calls():
    """Under recompute each layer is a checkpointed call whose graph is cut and compiled as any
    other (its compiled code runs in the forward and again in the recomputation): the summary
    counts those regions, the step runs them compiled twice a layer, dropout included (the
    recomputation draws the first run's numbers), and trains as the uncompiled program does,
    the memory timeline's hooks on."""
    import warnings
    from torch.profiler import profile
    items = batches("gpt", 4, [16, 16], seed=1)
    args, _ = items[0]
    got = {}
    for compiled in (False, True):
        pm = fxtron.parallelize(make("gpt", dropout=0.1), fxtron.Mesh(1), example_inputs=args, compile=compiled,
                                recompute="full")
        prog = pm.program(0)
        prog.track_memory = True     # saved-tensor hooks on (the memory timeline): the recomputation gets
        # the checkpoint's inputs back as other tensors, and must run the forward's compiled graphs
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got[compiled] = train_program(prog, items, adamw()(prog.parameters()))
    assert not any("uncompiled" in str(w.message) for w in caught), [str(w.message) for w in caught]
    line = next(x for x in pm.summary().splitlines() if x.startswith("compile=True"))
    stats, planned = prog.compiled, plan(pm.compiled(0).graphs)
    assert stats.recomputed == planned.recomputed == 2, (stats, planned)
    assert (stats.regions, stats.distinct, stats.opaque, stats.inside) == \
        (planned.regions, planned.distinct, planned.opaque, planned.inside), (stats, planned)
    assert 0 < stats.inside < stats.regions, stats
    assert planned.line() in line and f"{stats.inside} of them inside 2 recomputed regions' checkpointed calls" in line, line
    # a layer's regions (between its dropouts) run compiled in the forward and in the recomputation
    with profile() as p:
        prog.train_step(args, adamw()(prog.parameters()))
    runs = sum(e.name.startswith("Torch-Compiled Region") for e in p.events())
    assert runs == stats.regions + stats.inside, (runs, stats)
    # an evaluation's graph has no backward: nothing in it is recomputed, nor counted so
    prog.eval_step(args)
    assert (prog.compiled.recomputed, prog.compiled.inside) == (2, planned.inside), prog.compiled
    # selective recomputation of GPT's attention cores: each checkpointed call holds the attention op
    # alone, nothing compiled inside, nothing counted
    selective = fxtron.parallelize(make("gpt", dropout=0.1), fxtron.Mesh(1), example_inputs=args, compile=True,
                                   recompute="selective")
    st = plan(selective.compiled(0).graphs)
    assert (st.recomputed, st.inside) == (0, 0) and "recomputed" not in st.line(), st
    dl = max(abs(a - b) for a, b in zip(got[True]["losses"], got[False]["losses"]))
    dg, where = max_abs_diff(got[True]["grads"], got[False]["grads"])
    assert dl < 2e-6 and dg < 1e-5, (dl, dg, where)
