"""The stage-cutting pass, without processes: which layers each stage gets, what crosses a
stage boundary (only the residual stream; masks, positions and rotary tables are recomputed),
tied weights on the first and last stage, user split points, and the errors a bad cut
raises."""
from __future__ import annotations

import pytest
import torch

import fxtron
from fxtron import ParallelizeError
from fxtron.core import meta
from fxtron.passes.pp import _balanced
from tp_models import batch, make


def _pm(name, mesh, layers=4, **kw):
    args, kwargs = batch(name, 2, 8, seed=0)
    return fxtron.parallelize(make(name, layers=layers), mesh, example_inputs=args, example_kwargs=kwargs, **kw)


@pytest.mark.parametrize("name,hidden", [("gpt", 64), ("llama", 64), ("hf-gpt2", 32), ("hf-llama", 64)])
def test_one_tensor_crosses_each_boundary(name, hidden):
    """Between two stages travels the residual stream (B, S, h) and nothing else."""
    pm = _pm(name, fxtron.Mesh(4, pp=4))
    plan = pm.stages()
    assert [len(plan.layers(s)) for s in range(4)] == [1, 1, 1, 1]
    for rank in range(4):
        (stage,) = pm.compiled(rank).stages
        assert stage.index == rank
        assert len(stage.inputs) == (rank > 0) and len(stage.outputs) == (rank < 3)
        for name_ in stage.inputs + stage.outputs:
            shape = meta.get(stage.values[name_], meta.LOCAL_SHAPE)
            assert [str(d) for d in shape] == ["B", "S", str(hidden)]
        assert stage.has_loss == (rank == 3)


def test_tied_embedding_lives_on_first_and_last_stage():
    pm = _pm("gpt", fxtron.Mesh(2, pp=2))
    first, last = pm.compiled(0), pm.compiled(1)
    assert "wte.weight" in first.local and "wte.weight" in last.local
    assert "wpe.weight" in first.local and "wpe.weight" not in last.local
    assert first.shared == last.shared == {"wte.weight": (0, 1)}
    assert "ln_f.weight" in last.local and "blocks.0.ln1.weight" not in last.local


def test_rotary_tables_are_recomputed_not_sent():
    pm = _pm("llama", fxtron.Mesh(2, pp=2))
    for rank in range(2):
        (stage,) = pm.compiled(rank).stages
        assert {"rope_cos", "rope_sin"} <= set(stage.buffers)
        assert stage.user_inputs == ([0] if rank == 0 else [0, 1])   # tokens (for sizes), targets on the last


def test_interleaved_layout_follows_megatron():
    """Stage j on rank j % pp as chunk j // pp: pp=2, v=2, 8 layers -> rank 0 runs layers
    0-1 and 4-5, rank 1 runs 2-3 and 6-7."""
    pm = _pm("gpt", fxtron.Mesh(2, pp=2), layers=8, schedule="interleaved", virtual_stages=2, microbatches=2)
    plan = pm.stages()
    assert [plan.layers(s) for s in plan.stages_of(0)] == [["blocks.0", "blocks.1"], ["blocks.4", "blocks.5"]]
    assert [plan.layers(s) for s in plan.stages_of(1)] == [["blocks.2", "blocks.3"], ["blocks.6", "blocks.7"]]
    assert [s.index for s in pm.compiled(1).stages] == [1, 3]
    assert "pp rank" in str(plan) and "blocks.0 .. 1" in str(plan)


def test_split_points():
    pm = _pm("gpt", fxtron.Mesh(2, pp=2), split_points=["blocks.3"])
    assert pm.stages().layers(0) == ["blocks.0", "blocks.1", "blocks.2"]
    for bad, match in ((["blocks.9"], "not one of the model.s layers"), (["blocks.1", "blocks.2"], "must name one layer")):
        with pytest.raises(ParallelizeError, match=match):
            _pm("gpt", fxtron.Mesh(2, pp=2), split_points=bad).stages()


def test_balancing_weighs_embeddings_and_head():
    assert _balanced([1, 1, 1, 5], 2) == [0, 3, 4]
    assert _balanced([1] * 8, 4) == [0, 2, 4, 6, 8]
    assert _balanced([3, 1, 1, 1, 1, 3], 3) == [0, 1, 4, 6]   # 3 | 3 | 4: the heavy ends get fewer layers
    # a large vocabulary makes the first and last layers' stages lighter on layers
    pm = _pm("gpt", fxtron.Mesh(2, pp=2), layers=4)
    assert sum(len(pm.stages().layers(s)) for s in range(2)) == 4


def test_collectives_split_across_stages():
    """tp=2 x pp=2: the stages' tensor-parallel collectives together are the pp=1 program's;
    around them each stage sends and receives one boundary tensor per microbatch and direction,
    both stages sum the tied embedding's gradient and the loss over pp."""
    whole = _pm("gpt", fxtron.Mesh(2, tp=2))
    piped = _pm("gpt", fxtron.Mesh(4, tp=2, pp=2))
    count = lambda recs: sorted((r.op, r.phase) for r in recs)  # noqa: E731
    first, last = piped.collectives(0, graphs_only=True), piped.collectives(2, graphs_only=True)
    assert count(first + last) == count(whole.collectives(0)) == count(whole.collectives(0, graphs_only=True))
    around = [r for r in piped.collectives(0) if r.group != "tp"]
    assert sorted((r.op, r.phase, r.group, r.per) for r in around) == [
        ("all_reduce", "step", "embedding", "step"), ("all_reduce", "step", "pp", "step"),
        ("recv", "backward", "pp", "microbatch"), ("recv", "backward", "pp control", "microbatch"),
        ("send", "forward", "pp", "microbatch"), ("send", "forward", "pp control", "microbatch")]


def test_graph_and_summary_show_stages():
    pm = _pm("gpt", fxtron.Mesh(4, tp=2, pp=2), microbatches=4)
    text = pm.graph(3)
    assert "stage 1 (chunk 0): receives" in text and "lm_head" in text
    summary = pm.summary(batch=2, seq=16)
    assert "p2p sent / microbatch" in summary and "bubble over ideal time: 1/4" in summary
    for node in pm.compiled(3).stages[0].gm.graph.nodes:
        if node.op == "call_function":
            assert meta.get(node, meta.STAGE) == 1


def test_schedule_chart(tmp_path):
    pm = _pm("gpt", fxtron.Mesh(2, pp=2), microbatches=4, schedule="zb-h1")
    path = pm.schedule_chart(str(tmp_path / "zb.png"))          # unit F, B, W: W drawn as its own pass
    assert open(path, "rb").read(4) == b"\x89PNG"


def test_zb_v_places_stages_in_a_v():
    """zb-v at pp=2 cuts 4 stages; rank 0 runs stage 0 and stage 3 (the embedding and the tied
    LM head, one parameter on one rank: no embedding-group sum), rank 1 stages 1 and 2."""
    pm = _pm("gpt", fxtron.Mesh(2, pp=2), microbatches=4, schedule="zb-v")
    plan = pm.stages()
    assert plan.num_stages == 4 and [plan.rank_of(s) for s in range(4)] == [0, 1, 1, 0]
    assert [[st.index for st in pm.compiled(r).stages] for r in range(2)] == [[0, 3], [1, 2]]
    assert "2 in a V" in str(plan)
    assert "wte.weight" in pm.compiled(0).stages[0].params and "wte.weight" in pm.compiled(0).stages[1].params
    assert not any("wte" in p for st in pm.compiled(1).stages for p in st.params)
    assert "bubble over ideal time: 1/24" in pm.summary(batch=2, seq=16)
    # one microbatch: the order's own bubble (its ramp is not filled), where the closed form said 1/6
    one = _pm("gpt", fxtron.Mesh(2, pp=2), microbatches=1, schedule="zb-v")
    assert "bubble over ideal time: 2/3" in one.summary(batch=2, seq=16)


@pytest.mark.parametrize("kw,mesh,match", [
    (dict(schedule="zb-v"), fxtron.Mesh(4, pp=4), "8 pipeline stages .* but the model has 4 layers"),
    (dict(), fxtron.Mesh(8, pp=8), "8 pipeline stages .* but the model has 4 layers"),
    (dict(schedule="interleaved", virtual_stages=2, microbatches=3), fxtron.Mesh(2, pp=2), "not a multiple of 2"),
    (dict(schedule="interleaved", virtual_stages=4), fxtron.Mesh(2, pp=2), "8 pipeline stages"),
    (dict(schedule="zb-h1", gradient_accumulation_fusion=False), fxtron.Mesh(2, pp=2), "gradient_accumulation_fusion"),
    (dict(scatter_gather=True), fxtron.Mesh(2, pp=2), "tp=1"),
    (dict(split_points=["blocks.2"]), fxtron.Mesh(2), "pp=1"),
])
def test_bad_cuts_raise(kw, mesh, match):
    with pytest.raises(ParallelizeError, match=match):
        pm = _pm("gpt", mesh, microbatches=kw.pop("microbatches", 2), **kw)
        pm.compiled(0)


def test_weight_tied_between_middle_stages_raises():
    class Block(torch.nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return x + self.lin(x)

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            shared = torch.nn.Linear(8, 8)
            self.blocks = torch.nn.ModuleList([Block(shared), Block(torch.nn.Linear(8, 8)),
                                               Block(shared), Block(torch.nn.Linear(8, 8))])

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x.mean()

    pm = fxtron.parallelize(Tied(), fxtron.Mesh(4, pp=4), example_inputs=(torch.randn(4, 3, 8),))
    with pytest.raises(ParallelizeError, match=r"blocks.0.lin.(weight|bias) is used on pipeline ranks \[0, 2\]"):
        pm.compiled(0)


def test_model_without_layers_raises():
    class Flat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

        def forward(self, x):
            return self.b(self.a(x)).mean()

    with pytest.raises(ParallelizeError, match="repeated layers"):        # at parallelize: the stage cut
        fxtron.parallelize(Flat(), fxtron.Mesh(2, pp=2), example_inputs=(torch.randn(4, 3, 8),))


def test_pipeline_program_has_no_plain_forward():
    pm = _pm("gpt", fxtron.Mesh(2, pp=2))
    from fxtron.runtime.build import build_program
    rg = pm.compiled(0)
    prog = build_program(pm.model, rg.spec(), None, pm.config)
    assert set(n for n, _ in prog.named_parameters()) == set(rg.local)
    with pytest.raises(ParallelizeError, match="train_step"):
        prog(*batch("gpt", 2, 8, seed=0)[0])
