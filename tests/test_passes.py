"""The compiler's pass list and what guards it: the order constraints checked when the list is
built, the verifier that runs after every pass (FXTRON_VERIFY, set by conftest.py) catching a
graph a pass broke, and the public registry of sharding rules that the "no rule" error points
users to."""
from __future__ import annotations

import pytest
import torch

import fxtron
from fxtron.compiler import passmanager
from fxtron.compiler.passmanager import PASSES, Pass, pass_list
from fxtron.core import meta
from fxtron.core.placement import Partial, Replicate
from fxtron.ops import registry
from fxtron.passes import verify as verifier
from fxtron.passes.rules import registry as rules
from tp_models import batch, make


def _noop(state):
    return None


def test_pass_list_checks_its_order_constraints():
    a, b = Pass("a", "first", _noop), Pass("b", "needs a", _noop, after=("a",))
    assert [p.name for p in pass_list(a, b)] == ["a", "b"]
    with pytest.raises(ValueError, match="'b' must run after 'a', which is later in the list"):
        pass_list(b, a)
    with pytest.raises(ValueError, match="'b' must run after 'a', which is not in the list"):
        pass_list(b)
    with pytest.raises(ValueError, match="appears twice"):
        pass_list(a, a)


def test_the_pipeline_reads_top_to_bottom():
    names = [p.name for p in PASSES]
    assert names[0] == "trace" and names[-2:] == ["shard_params", "shard_data_parallel"]
    for p in PASSES:
        assert p.reason and p.when_doc, p.name
        assert all(names.index(q) < names.index(p.name) for q in p.after), p.name
    # the constraint that once lived only in an error message: redistribution needs placements
    assert "propagate_tp" in dict((p.name, p.after) for p in PASSES)["insert_redistributions"]


def test_verifier_is_on_in_the_tests():
    assert verifier.enabled()


def _after(pass_name: str, mesh: fxtron.Mesh, name: str = "gpt", **kw) -> torch.fx.GraphModule:
    """The rank-0 graph right after `pass_name` (a copy, as the observer saw it)."""
    pm = fxtron.parallelize(make(name), mesh, example_inputs=batch(name, 2, 8, seed=0)[0], **kw)
    seen = {}

    def observe(name, gm, seconds, doc):
        if name == pass_name:
            seen["gm"] = meta.copy_graph(gm)

    passmanager.compile_rank(pm.traced, mesh, 0, plan=pm.tp_plan, stage_assignment=pm.stage_assignment,
                          observer=observe)
    return seen["gm"]


def test_verifier_accepts_every_pass_of_a_tp_pp_sp_compilation():
    mesh = fxtron.Mesh(4, tp=2, pp=2)
    gm = _after("insert_redistributions", mesh, sequence_parallel=True, microbatches=2)
    verifier.verify(gm, after="insert_redistributions", redistributed=True)
    assert meta.graph_axes(gm) == ("tp",)


def test_verifier_finds_a_missing_all_reduce():
    gm = _after("insert_redistributions", fxtron.Mesh(2, tp=2))
    reduces = [n for n in gm.graph.nodes
               if registry.axis_of(n) == "tp" and registry.op_name(n.target) == "all_reduce"]
    assert len(reduces) == 2 * 2 + 1                  # two per layer of the 2-layer GPT, one after the embedding
    victim = reduces[0]
    src = victim.args[0]
    assert isinstance(meta.placement(src, "tp"), Partial) and isinstance(meta.placement(victim, "tp"), Replicate)
    victim.replace_all_uses_with(src)
    gm.graph.erase_node(victim)
    with pytest.raises(verifier.VerifyError, match=rf"expects tp:R of %{src.name}, which is tp:P.*no redistribution"):
        verifier.verify(gm, after="a broken pass", redistributed=True)


def test_verifier_finds_a_value_without_placement():
    gm = _after("propagate_tp", fxtron.Mesh(2, tp=2))
    node = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.gelu.default)
    del node.meta[meta.PLACEMENT]
    with pytest.raises(verifier.VerifyError, match=rf"after a broken pass: %{node.name} .* no placement on axis tp"):
        verifier.verify(gm, after="a broken pass")


def test_verifier_finds_an_op_over_an_axis_the_graph_lacks():
    gm = _after("insert_redistributions", fxtron.Mesh(2, tp=2))
    node = next(n for n in gm.graph.nodes if registry.axis_of(n) == "tp")
    node.args = (node.args[0], "cp") + tuple(node.args[2:])
    with pytest.raises(verifier.VerifyError, match="communicates over 'cp'"):
        verifier.verify(gm, after="a broken pass", redistributed=True)


def test_a_failing_pass_is_named(monkeypatch):
    """A pass that fails where no check foresaw names itself, the rank and the mesh (a
    CompileError from the original exception); a user's mistake stays a ParallelizeError,
    with the pass as a note."""
    mesh = fxtron.Mesh(2, tp=2)
    pm = fxtron.parallelize(make("gpt"), mesh, example_inputs=batch("gpt", 2, 8, seed=0)[0])

    def broken(gm, **kw):
        raise IndexError("list index out of range")

    def refused(gm, **kw):
        raise fxtron.ParallelizeError("node %x: change y")

    for fn, kind in ((broken, fxtron.CompileError), (refused, fxtron.ParallelizeError)):
        monkeypatch.setattr(passmanager, "localize", fn)
        with pytest.raises(kind) as info:
            passmanager.compile_rank(pm.traced, mesh, 1, plan=pm.tp_plan)
        told = str(info.value) + "".join(getattr(info.value, "__notes__", []))
        assert "the pass 'localize' compiling rank 1 of Mesh(" in told, told
    assert isinstance(info.value, fxtron.ParallelizeError) and "change y" in str(info.value)


def test_bind_checks_its_output():
    """bind's output is checked too (the verifier runs before it): no op may still name a mesh
    axis where a process group belongs, nor a device other than the process's."""
    from fxtron.runtime.bind import BindError, bind, check_bound
    mesh = fxtron.Mesh(2, tp=2)
    pm = fxtron.parallelize(make("gpt"), mesh, example_inputs=batch("gpt", 2, 8, seed=0)[0])
    bound = bind(pm.compiled(0).gm, None, torch.device("cpu"))        # no groups: every axis bound to ""
    check_bound(bound, torch.device("cpu"))
    node = next(n for n in bound.graph.nodes if n.op == "call_function" and n.target == torch.ops.aten.arange.start
                or any(isinstance(a, torch.device) for a in n.kwargs.values()))
    node.kwargs = {**node.kwargs, "device": torch.device("meta")}
    with pytest.raises(BindError, match=f"%{node.name} .* names meta, not this process's cpu"):
        check_bound(bound, torch.device("cpu"))
    comm = passmanager.compile_rank(pm.traced, mesh, 0, plan=pm.tp_plan).gm
    node = next(n for n in comm.graph.nodes if registry.axis_of(n) == "tp")
    with pytest.raises(BindError, match=f"%{node.name} .* still names the axis 'tp'"):
        check_bound(comm, torch.device("cpu"))


# ----------------------------------------------------------------------------- register_rule
class _Cumsum(torch.nn.Module):
    """An MLP whose hidden activation (split by columns at tp=2) goes through cumprod, an op
    fxtron has no sharding rule for."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(16, 8)
        self.up = torch.nn.Linear(8, 32)
        self.down = torch.nn.Linear(32, 8)
        self.head = torch.nn.Linear(8, 16)

    def forward(self, idx, tgt):
        x = self.emb(idx)
        x = x + self.down(torch.cumprod(self.up(x), dim=1))   # a scan over the sequence
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), tgt.flatten())


def _cumsum_pm(**kw):
    idx = torch.randint(0, 16, (2, 4))
    return fxtron.parallelize(_Cumsum(), fxtron.Mesh(2, tp=2), example_inputs=(idx, idx),
                              **{"plan": {"head": "replicate"}, **kw})


def test_op_without_rule_runs_replicated_and_says_so():
    pm = _cumsum_pm()
    with pytest.warns(fxtron.ParallelizeWarning, match=r"%cumprod .*fxtron.register_rule"):
        rg = pm.compiled(0)
    node = next(n for n in rg.gm.graph.nodes if n.target == torch.ops.aten.cumprod.default)
    assert meta.get(node, meta.FALLBACK) == "tp" and str(meta.placement(node, "tp")) == "R"
    gathers = [n for n in rg.gm.graph.nodes if registry.op_name(n.target) == "all_gather"]
    assert [list(g.users) for g in gathers] == [[node]]     # its input gathered, nothing else
    assert pm.fallbacks(0) == ["%cumprod (aten.cumprod.default) in (top level): inputs made whole over tp, run replicated"]
    assert "ops run replicated for want of a sharding rule: %cumprod" in pm.summary()


def test_strict_no_rule_error_names_node_and_what_to_change():
    with pytest.raises(fxtron.ParallelizeError) as err:
        _cumsum_pm(strict=True).graph(0)
    msg = str(err.value)
    assert "%cumprod" in msg and "in module (top level)" in msg and "tp:S(2)" in msg   # the node, its inputs
    assert "plan={'up': 'replicate'}" in msg and "fxtron.register_rule(torch.ops.aten.cumprod.default)" in msg
    # the suggestion is accepted, and it is enough
    pm = _cumsum_pm(strict=True, plan={"head": "replicate", "up": "replicate"})
    assert "fxtron.all_gather" not in pm.graph(0) and pm.fallbacks(0) == []


def test_register_rule_makes_the_model_parallelize(monkeypatch):
    monkeypatch.setattr(rules, "_RULES", dict(rules._RULES))    # the registration ends with the test
    calls = []

    @fxtron.register_rule(torch.ops.aten.cumprod.default)
    def cumprod(ctx):
        calls.append(ctx.axis)
        p, dim = ctx.p[0], ctx.node.args[1] % ctx.node.meta["val"].dim()
        if isinstance(p, fxtron.Shard) and p.dim != dim:
            return p, [None]                   # a scan along another dim runs on each shard
        return fxtron.REPLICATE, [fxtron.REPLICATE]

    rg = _cumsum_pm().compiled(0)
    assert calls == ["tp"]
    node = next(n for n in rg.gm.graph.nodes if n.target == torch.ops.aten.cumprod.default)
    assert str(meta.placement(node, "tp")) == "S(2)"     # stayed split: no collective around it
    assert [registry.op_name(n.target) for n in rg.gm.graph.nodes if registry.axis_of(n)].count("all_gather") == 0
    with pytest.raises(ValueError, match="already has a sharding rule"):
        fxtron.register_rule(torch.ops.aten.cumprod.default)(lambda ctx: None)


class _SoftmaxMLP(_Cumsum):
    """The same MLP with a softmax over its (column-split) hidden width."""

    def forward(self, idx, tgt):
        x = self.emb(idx)
        x = x + self.down(torch.softmax(self.up(x), dim=-1))
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), tgt.flatten())


def test_verifier_finds_a_statistic_over_a_split_dim(monkeypatch):
    """A rule that lets a softmax run on each rank's slice of its dim computes a wrong value
    with no error; the verifier refuses the graph right after propagation."""
    idx = torch.randint(0, 16, (2, 4))
    pm = fxtron.parallelize(_SoftmaxMLP(), fxtron.Mesh(2, tp=2), example_inputs=(idx, idx))
    node = next(n for n in pm.compiled(0).gm.graph.nodes if n.target == torch.ops.aten.softmax.int)
    assert str(meta.placement(node, "tp")) == "R"        # the built-in rule gathers the width first
    monkeypatch.setattr(rules, "_RULES", dict(rules._RULES))

    @fxtron.register_rule(torch.ops.aten.softmax.int, replace=True)
    def wrong(ctx):
        return ctx.p[0], [None]

    pm = fxtron.parallelize(_SoftmaxMLP(), fxtron.Mesh(2, tp=2), example_inputs=(idx, idx))
    with pytest.raises(verifier.VerifyError, match=r"after propagate_tp: %softmax .* over dims \[2\], which is tp:S\(2\)"):
        pm.compiled(0)
