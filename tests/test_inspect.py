"""Inspection as a product, without processes: `fxtron inspect` on every shipped preset and on
transformers architectures, golden printed graphs (expect-tests: any unintended change to a
pass shows up as a diff; regenerate with FXTRON_UPDATE_GOLDEN=1 after checking it), per-pass
dumps, graph pictures, and the what-if planner against hand-computed cases."""
from __future__ import annotations

from fractions import Fraction

import json
import os
import pathlib

import pytest
import torch

import fxtron
from fxtron.tools import planner
from fxtron.cli import main
from fxtron.models import PRESETS, build, example_inputs
from tp_models import batches, make

GOLDEN = pathlib.Path(__file__).parent / "golden"


def _golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("FXTRON_UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with FXTRON_UPDATE_GOLDEN=1 once and review it"
    want = path.read_text()
    if text != want:
        import difflib
        diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True), "golden", "now", n=1))
        raise AssertionError(f"printed graph changed ({name}); if intended, FXTRON_UPDATE_GOLDEN=1:\n{diff[:6000]}")


@pytest.mark.parametrize("mesh,rank,name", [(fxtron.Mesh(2, tp=2), 1, "gpt-tiny_tp2_rank1.txt"),
                                             (fxtron.Mesh(4, tp=2, pp=2), 3, "gpt-tiny_tp2_pp2_rank3.txt")])
def test_golden_printed_graphs(mesh, rank, name):
    model = build("gpt-tiny", device="meta")
    pm = fxtron.parallelize(model, mesh, example_inputs=example_inputs("gpt-tiny", 2, 16, device="meta"),
                            microbatches=2 if mesh.pp > 1 else 1)
    _golden(name, pm.graph(rank) + "\n")


# the 47B and 16B mixtures of experts take 10-20 s each here and show nothing moe-tiny does not
# (tests/test_moe.py builds them on meta)
@pytest.mark.parametrize("preset", [p for p in PRESETS if p not in ("mixtral-8x7b", "deepseek-moe-16b")])
def test_cli_inspect_every_preset(preset, capsys):
    rc = main(["inspect", preset, "--world-size", "8", "--tp", "2", "--pp", "2", "--rank", "7", "--json",
               "--batch", "1", "--seq", "64"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert data["rank"] == 7 and data["coords"]["pp"] == "1/2" and data["coords"]["tp"] == "1/2"
    assert data["groups"]["tp"] == [6, 7] and data["groups"]["pp"] == [3, 7]
    assert data["pipeline"]["stages"] == [1]
    kinds = {c["collective"] for c in data["collectives"]}
    assert "all_reduce" in kinds
    assert data["memory"]["parameters"] > 0 and data["memory"]["total"] > data["memory"]["parameters"]


@pytest.mark.parametrize("arch", ["hf:llama", "hf:gpt2"])
def test_cli_inspect_transformers_architecture(arch, capsys):
    """The library's default config on the meta device (Llama-2-7B-sized for llama; GPT-2
    small's, whose 50257-token vocabulary does not divide by tp, for gpt2)."""
    args = ["inspect", arch, "--world-size", "8", "--pp", "2", "--rank", "5", "--seq", "128", "--no-graph"]
    if arch == "hf:llama":
        args += ["--tp", "4"]
    rc = main(args)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "rank 5" in out and "stage" in out and "memory per rank" in out


def test_cli_inspect_text_and_dumps(tmp_path, capsys):
    rc = main(["inspect", "gpt-tiny", "--world-size", "4", "--tp", "2", "--pp", "2", "--rank", "2",
               "--dump", str(tmp_path / "dump"), "--svg", str(tmp_path / "rank2.svg"), "--seq", "32"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "groups of this rank" in out and "all_reduce" in out and "bubble over ideal time" in out
    files = sorted((tmp_path / "dump" / "rank2").iterdir())
    names = [f.name for f in files]
    for p in ("plan", "propagate", "insert_redistributions", "localize", "fuse_linears", "split_stages"):
        assert any(p in n for n in names), names
    inserted = next(f for f in files if "insert_redistributions" in f.name).read_text()
    assert inserted.startswith("# fxtron: graph after pass `insert_redistributions`") and "fxtron.all_reduce" in inserted
    assert "fxtron.all_reduce" not in next(f for f in files if "propagate" in f.name).read_text().split("\n\n", 1)[1]
    assert (tmp_path / "rank2.svg").read_text().lstrip().startswith("<?xml")


def test_inspect_zb_v_bubble_and_every_collective(capsys):
    """inspect --json at pp=4, m=8: the bubble over ideal time is ZB-V 1/16 < ZB-H1 1/8 < 1F1B
    3/8; at tp=2 x pp=2 x dp=2 (llama-tiny) the collective list has the pipeline's sends and
    receives and the data-parallel bucket all-reduce, and the step total is their sum."""
    import json
    bubbles = {}
    for schedule in ("zb-v", "zb-h1", "1f1b"):
        rc = main(["inspect", "hf:llama", "--model-config", "num_hidden_layers=8", "hidden_size=64",
                   "intermediate_size=128", "num_attention_heads=4", "num_key_value_heads=2", "vocab_size=256",
                   "--world-size", "4", "--pp", "4", "--microbatches", "8", "--schedule", schedule, "--json",
                   "--seq", "32"])
        out = capsys.readouterr().out
        assert rc == 0, out
        bubbles[schedule] = Fraction(json.loads(out)["pipeline"]["bubble"])
    assert bubbles == {"zb-v": Fraction(1, 16), "zb-h1": Fraction(1, 8), "1f1b": Fraction(3, 8)}
    rc = main(["inspect", "llama-tiny", "--world-size", "8", "--tp", "2", "--pp", "2", "--microbatches", "4",
               "--json", "--batch", "1", "--seq", "128"])
    out = capsys.readouterr().out
    assert rc == 0, out
    report = json.loads(out)
    kinds = {(c["collective"], c["group"].split(" ")[0], c["per"]) for c in report["collectives"]}
    assert {("send", "pp", "microbatch"), ("recv", "pp", "microbatch"), ("all_reduce", "dp", "step"),
            ("all_reduce", "tp", "microbatch")} <= kinds, kinds
    total = sum(c["wire_at"] * (4 if c["per"] == "microbatch" else 1) for c in report["collectives"])
    assert report["step_bytes"] == total > 0


def test_cli_what_if(capsys):
    rc = main(["inspect", "llama-small", "--world-size", "16", "--what-if", "--gpu-memory", "1GiB",
               "--global-batch", "64", "--seq", "256"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "step s" in out and "assumed:" in out


# ----------------------------------------------------------------------------- the planner's formulas
def test_planner_formulas_against_papers():
    # Korthikanti: 5as/h = 80 for GPT-3 (a=96, s=2048, h=12288); Eq. 1 = sbh(34 + 80)
    s, b, h, a = 2048, 1, 12288, 96
    assert planner.activation_bytes_per_layer(s, b, h, a, 1, False) == s * b * h * (34 + 80)
    # Eq. 4 is Eq. 1 / t; Eq. 2 keeps 10 sbh unsplit
    assert planner.activation_bytes_per_layer(s, b, h, a, 8, True) == pytest.approx(s * b * h * (34 + 80) / 8)
    assert planner.activation_bytes_per_layer(s, b, h, a, 8, False) == pytest.approx(s * b * h * (10 + 3 + 10))
    # Narayanan Eq. 2 reproduces Table 1's parameter counts (V=51200, s=2048) to the digit shown
    for billions, hidden, layers in [(1.7, 2304, 24), (3.6, 3072, 30), (7.5, 4096, 36), (18.4, 6144, 40),
                                     (39.1, 8192, 48), (76.1, 10240, 60), (145.6, 12288, 80), (310.1, 16384, 96),
                                     (529.6, 20480, 105), (1008.0, 25600, 128)]:
        assert round(planner.narayanan_params(layers, hidden, 51200, 2048) / 1e9, 1) == billions
    # interleaving multiplies the first stage's activations by 1 + (p-1)/(p v)
    dims = planner.ModelDims(layers=96, hidden=h, heads=a, vocab=51200, params=175_000_000_000)
    one = planner.first_stage_activation_bytes(dims, s, 1, 8, True, 8)
    assert planner.first_stage_activation_bytes(dims, s, 1, 8, True, 8, v=3) == pytest.approx(one * (1 + 7 / 24))
    # Eq. 7 model FLOPs; mixed-precision weights as fxtron holds them: 18 bytes/param, 10 + 8/dp with zero
    assert planner.model_flops(dims, 1, s) == pytest.approx(72 * 96 * s * h * h * (1 + s / (6 * h) + 51200 / (12 * h * 96)))
    assert planner.weight_bytes(1e9, 8, 0) == 18e9 and planner.weight_bytes(1e9, 8, 1) == 11e9


def test_planner_hand_computed_plan():
    dims = planner.ModelDims(layers=4, hidden=1024, heads=16, vocab=32000, params=100_000_000)
    hw = planner.Hardware(memory=2**40, flops_per_s=1e12, efficiency=1.0, intra_node_bw=1e9, inter_node_bw=1e8)
    p = planner.rate(dims, hw, world=8, tp=2, pp=2, sp=False, schedule="1f1b", v=1, global_batch=8, seq=128,
                     micro_batch=1, zero=0)
    assert (p.dp, p.microbatches) == (2, 4)
    assert p.weights_bytes == 100e6 / 4 * 18
    assert p.compute_s == pytest.approx(planner.model_flops(dims, 8, 128) / 8 / 1e12)
    assert p.bubble_s == pytest.approx(p.compute_s * 1 / 4)
    assert p.tp_comm_s == pytest.approx(4 * 2 * 0.5 * 128 * 1024 * 2 * 2 * 4 / 1e9)      # 4 AR x layers 2 x m 4
    assert p.pp_comm_s == pytest.approx(2 * 128 * 1024 * 2 * 4 / 1e8)
    assert p.dp_comm_s == pytest.approx(2 * 0.5 * 100e6 / 4 * 4 / 1e8)
    ranked = planner.candidates(dims, hw, world=8, global_batch=8, seq=128)
    assert ranked == sorted(ranked, key=lambda q: (q.step_s, q.memory_bytes))
    assert {(q.tp, q.pp, q.dp) for q in ranked} >= {(1, 1, 8), (2, 2, 2), (8, 1, 1), (2, 4, 1)}
    tight = planner.candidates(dims, planner.Hardware(memory=600e6), world=8, global_batch=8, seq=128)
    assert tight and all(q.memory_bytes <= 600e6 for q in tight)
    keys = {(q.tp, q.pp, q.dp, q.zero) for q in tight}
    assert (1, 1, 8, 0) not in keys          # 100M x 18 B = 1.8 GB
    assert (1, 1, 8, 1) not in keys          # 100M x (10 + 8/8) B = 1.1 GB (fxtron's fp32 parameters whole)
    assert (2, 1, 4, 1) not in keys          # 50M x (10 + 8/4) B = 600 MB + activations
    assert (2, 2, 2, 1) in keys              # 25M x (10 + 8/2) B = 350 MB + activations


def test_planner_counts_the_pipeline_ends_parameters():
    """The embedding sits on the first stage and the output layer on the last (both on rank 0
    under ZB-V): those ranks hold more than P / pp (llama-7b at tp=2 pp=8: 1.12x, and ZB-V's rank 0
    27% more than the planner said)."""
    dims = planner.ModelDims(layers=32, hidden=4096, heads=32, vocab=32000, params=6_738_415_616)
    ends = 32000 * 4096
    assert planner.stage_dense_params(dims, 1) == dims.params
    assert planner.stage_dense_params(dims, 8) == pytest.approx((dims.params - 2 * ends) / 8 + ends)
    assert planner.stage_dense_params(dims, 8, "zb-v") == pytest.approx((dims.params - 2 * ends) / 8 + 2 * ends)
    assert planner.stage_dense_params(dims, 8) / (dims.params / 8) == pytest.approx(1.117, abs=1e-3)


def test_planner_expert_parallel():
    """A mixture of experts (8 experts, top-2, 80M of 100M parameters in experts) at ep=2 x
    tp=2 x pp=2 on 16 ranks, against the formulas computed by hand; a dense model gets no ep."""
    dims = planner.ModelDims(layers=4, hidden=1024, heads=16, vocab=32000, params=100_000_000, experts=8, top_k=2,
                            expert_params=80_000_000, moe_layers=4)
    hw = planner.Hardware(memory=2**40, flops_per_s=1e12, efficiency=1.0, intra_node_bw=1e9, inter_node_bw=1e8)
    p = planner.rate(dims, hw, world=16, tp=2, pp=2, sp=True, schedule="1f1b", v=1, global_batch=8, seq=128,
                     micro_batch=1, zero=1, ep=2)
    assert (p.dp, p.microbatches, p.ep) == (4, 2, 2)
    # per rank: the fullest stage's dense parameters / tp (here the embedding's 32.8M, larger than
    # the 20M dense: the ends hold it), the experts / (tp ep pp)
    dense, experts = 32000 * 1024 / 2, 80e6 / 8
    assert p.weights_bytes == pytest.approx(dense * (10 + 8 / 4) + experts * (10 + 8 / 2))   # zero: dp 4, edp 2
    active = 100e6 - (1 - 2 / 8) * 80e6 - 32000 * 1024
    flops = 6 * 8 * 128 * active + 12 * 8 * 4 * 128 * 128 * 1024 + 6 * 8 * 128 * 1024 * 32000
    assert planner.model_flops(dims, 8, 128) == pytest.approx(flops)
    assert p.compute_s == pytest.approx(flops / 16 / 1e12)
    # 4 all-to-alls x (e-1)/e x k b s h x 2 B x 2 MoE layers per stage x 2 microbatches, tp x ep in a node
    assert p.ep_comm_s == pytest.approx(4 * 0.5 * 2 * 128 * 1024 * 2 * 2 * 2 / 1e9)
    assert p.dp_comm_s == pytest.approx((2 * 3 / 4 * dense * 4 + 2 * 1 / 2 * experts * 4) / 1e8)
    ranked = planner.candidates(dims, hw, world=16, global_batch=8, seq=128)
    assert {q.ep for q in ranked} == {1, 2, 4, 8, 16} - {16}   # ep divides the experts and world/(tp pp)
    # ep drawn from dp x cp: a rank dispatches the copies of its own s/cp tokens
    assert any(q.ep > 1 and q.cp > 1 for q in ranked)
    both = planner.rate(dims, hw, world=16, tp=2, pp=2, sp=True, schedule="1f1b", v=1, global_batch=8, seq=128,
                        micro_batch=1, zero=1, cp=2, ep=2)
    assert (both.dp, both.microbatches) == (2, 4)
    assert both.ep_comm_s == pytest.approx(4 * 0.5 * 2 * 64 * 1024 * 2 * 2 * 4 / 1e9)
    dense_model = planner.ModelDims(layers=4, hidden=1024, heads=16, vocab=32000, params=100_000_000)
    assert {q.ep for q in planner.candidates(dense_model, hw, world=16, global_batch=8, seq=128)} == {1}
    assert "ep comm s" in planner.format_candidates(ranked, hw)
    # read off the shipped MoE model's graph: 2 layers of 4 experts, top-2, 2 x 2 x [4, 2x96 | 96, 64] expert weights
    from fxtron.compiler.trace import trace
    from fxtron.models import build, example_inputs
    got = planner.dims_of(trace(build("moe-tiny"), example_inputs("moe-tiny", 2, 16)))
    assert (got.experts, got.top_k, got.moe_layers, got.expert_params) == (4, 2, 2, 2 * 4 * 3 * 96 * 64)


def test_planner_context_parallel():
    dims = planner.ModelDims(layers=4, hidden=1024, heads=16, vocab=32000, params=100_000_000)
    hw = planner.Hardware(memory=2**40, flops_per_s=1e12, efficiency=1.0, intra_node_bw=1e9, inter_node_bw=1e8)
    kw = dict(world=8, pp=1, sp=True, schedule="1f1b", v=1, global_batch=8, seq=4096, micro_batch=1, zero=1)
    one, two = planner.rate(dims, hw, tp=2, cp=1, **kw), planner.rate(dims, hw, tp=2, cp=2, **kw)
    assert (two.cp, two.dp, two.microbatches) == (2, 2, 4)
    # a rank holds half the tokens, each against every key: the s b h factor halves, 5as/h stays
    assert two.activation_bytes == pytest.approx(one.activation_bytes / 2)
    assert planner.activation_bytes_per_layer(4096, 1, 1024, 16, 2, True, cp=2) == pytest.approx(
        2048 * 1024 / 2 * (34 + 5 * 16 * 4096 / 1024))
    # the distributed optimizer shards over dp x cp; the gradients are reduced over it
    assert two.weights_bytes == one.weights_bytes
    assert two.dp_comm_s == pytest.approx(one.dp_comm_s)
    # the ring: K and V of b (s/cp) h/tp 16-bit values each, cp-1 steps forward and 2cp-1 backward,
    # per layer and microbatch
    assert two.cp_comm_s == pytest.approx((1 + 3) * 2 * 1 * 2048 * 1024 / 2 * 2 * 4 * 4 / 1e9)
    assert one.cp_comm_s == 0 and two.step_s == pytest.approx(
        two.compute_s + two.bubble_s + two.tp_comm_s + two.cp_comm_s + two.pp_comm_s + two.dp_comm_s
        - two.tp_hidden_s - two.dp_hidden_s)
    # a sequence that fits only with its tokens split: Llama-2-7B at 16384 tokens on 64 GPUs of 80 GB
    # (Korthikanti's activations keep the s x s scores, 5as/h = 640 here: no mesh fits at cp=1 without recomputation)
    big = planner.ModelDims(layers=32, hidden=4096, heads=32, vocab=32000, params=6_740_000_000)
    ranked = planner.candidates(big, planner.Hardware(), world=64, global_batch=8, seq=16384)
    # ... unless recomputation drops the scores (selective): then cp=1 fits too, with it
    assert ranked and all(q.cp >= 4 or q.recompute for q in ranked)
    assert any(q.cp >= 4 and q.recompute is None for q in ranked)
    assert "cp comm s" in planner.format_candidates(ranked, planner.Hardware())


def test_planner_reads_dims_from_the_graph():
    from fxtron.compiler.trace import trace
    traced = trace(build("llama-7b", device="meta"), example_inputs("llama-7b", 1, 16, device="meta"))
    dims = planner.dims_of(traced)
    assert (dims.layers, dims.hidden, dims.heads, dims.vocab) == (32, 4096, 32, 32000)
    assert dims.params == pytest.approx(6.74e9, rel=0.01)


def test_bench_summary_table(tmp_path):
    from fxtron.tools.bench import summarize
    data = {"machine_info": {"cpu": {"brand_raw": "test cpu"}}, "benchmarks": [
        {"name": "test_train_step[fxtron_tp2]", "stats": {"median": 0.25},
         "extra_info": {"ratio_vs_single_process": 0.8, "ratio_vs_dtensor": 0.7}},
        {"name": "test_pipeline_step[1f1b-m4]", "stats": {"median": 0.2},
         "extra_info": {"bubble_measured": 0.3, "bubble_formula": 0.25, "ratio_vs_single_process": 0.9}}]}
    path = tmp_path / "b.json"
    path.write_text(json.dumps(data))
    text = summarize(str(path))
    assert "PyTorch DTensor tp=2" in text and "0.70x" in text and "formula 0.250" in text and "1.20x" in text


def test_planner_recomputation():
    """Korthikanti Sec. 4: selective drops 5as/h, full keeps the layer input (2sbh, /t under sp);
    the FLOPs they add; a mesh that fits only with recomputation is listed with it, the cheapest
    first, and one that fits without is listed without."""
    s, b, h, a = 2048, 1, 12288, 96
    assert planner.activation_bytes_per_layer(s, b, h, a, 8, True, recompute="selective") == pytest.approx(s * b * h * 34 / 8)
    assert planner.activation_bytes_per_layer(s, b, h, a, 8, False, recompute="selective") == pytest.approx(
        s * b * h * (10 + 3))
    assert planner.activation_bytes_per_layer(s, b, h, a, 8, True, recompute="full") == pytest.approx(2 * s * b * h / 8)
    assert planner.activation_bytes_per_layer(s, b, h, a, 1, False, recompute="full") == 2 * s * b * h
    dims = planner.ModelDims(layers=96, hidden=h, heads=a, vocab=51200, params=175_000_000_000)
    assert planner.first_stage_activation_bytes(dims, s, b, 8, True, 8, recompute="full") == pytest.approx(
        96 * 2 * s * b * h / 8)                   # the layers' inputs (rate adds the layer being recomputed)
    # full adds a forward of the layers: Eq. 7's 72 -> 96 for the layer terms
    assert planner.model_flops(dims, 1, s) + planner.recompute_flops(dims, 1, s, "full") == pytest.approx(
        96 * 96 * s * h * h * (1 + s / (6 * h)) + 6 * s * h * 51200)
    assert planner.recompute_flops(dims, 1, s, "selective") == 4 * 96 * s * s * h
    small = planner.ModelDims(layers=4, hidden=1024, heads=16, vocab=32000, params=100_000_000)
    roomy = planner.Hardware(memory=2**40)
    plain = planner.rate(small, roomy, world=8, tp=8, pp=1, sp=True, schedule="1f1b", v=1, global_batch=8, seq=2048,
                        micro_batch=1, zero=0)
    full = planner.rate(small, roomy, world=8, tp=8, pp=1, sp=True, schedule="1f1b", v=1, global_batch=8, seq=2048,
                       micro_batch=1, zero=0, recompute="full")
    assert full.activation_bytes < plain.activation_bytes and full.compute_s > plain.compute_s
    # 1 microbatch on 1 stage: 4 layers' inputs plus one layer whole while it is recomputed
    assert full.activation_bytes == pytest.approx(4 * 2 * 2048 * 1024 / 8 + plain.activation_bytes / 4)
    # the tp collectives: 4 all-reduces' worth a layer, + 1 (sp's re-gathers), + 2 (the forward again)
    assert full.tp_comm_s == pytest.approx(plain.tp_comm_s * 7 / 5)
    # memory between the two: the mesh is listed with full recomputation, nothing without
    tight = planner.Hardware(memory=(full.memory_bytes + plain.memory_bytes) / 2)
    listed = [q for q in planner.candidates(small, tight, world=8, global_batch=8, seq=2048)
              if (q.tp, q.pp, q.sequence_parallel, q.zero) == (8, 1, True, 0)]
    assert [q.recompute for q in listed] in (["full"], ["selective"])
    assert all(q.memory_bytes <= tight.memory for q in listed)
    assert all(q.recompute is None for q in planner.candidates(small, roomy, world=8, global_batch=8, seq=2048))
    text = planner.format_candidates(listed, tight)
    assert "recompute" in text.splitlines()[0] and listed[0].recompute in text


def test_cli_inspect_with_recomputation(capsys):
    """--recompute reaches parallelize: the regions in the per-rank graph, and the activation
    estimate keeps only what a recomputed region returns (full: the layers' inputs)."""
    def activations(*extra):
        assert main(["inspect", "gpt-tiny", "--world-size", "2", "--tp", "2", "--seq", "64", *extra]) == 0
        out = capsys.readouterr().out
        line = next(l for l in out.splitlines() if l.startswith("activations per microbatch"))
        return float(line.split()[-2]), out
    plain, _ = activations("--no-graph")
    full, out = activations("--recompute", "full", "--recompute-layers", "2")
    assert full < plain / 4
    assert "blocks.0..1" in out                      # the graph's recompute column: both layers, one region


def test_activation_estimate_is_what_autograd_saves():
    """inspect's activations are what autograd keeps (the runtime tracker's measure, counted on
    fake tensors): gpt-small at tp=2, batch 4 x 128 saves 11.33 MB a microbatch (the upper bound
    of every tensor the forward makes was 21.0 MB); one process against the tracker itself for
    plain, selective and full recomputation, bf16 (the layers' half of the fp32 figure) and microbatches (tp, sp,
    pp, cp and the schedules are held to the tracker in tests/test_recompute.py)."""
    from fxtron.tools.activations import peak_saved_bytes, saved_bytes
    from fxtron.tools.inspect import inspect, load_model
    model, args, kwargs = load_model("gpt-small", batch=2, seq=16)
    pm = fxtron.parallelize(model, fxtron.Mesh(2, tp=2), example_inputs=args)
    report = inspect(pm, 0, batch=4, seq=128)
    assert report.memory["activations per microbatch"] == 11_334_656
    assert "what autograd saves" in report.notes[0]
    fp32 = None
    for kw in [{}, dict(recompute="selective"), dict(recompute="full"), dict(dtype="bf16"), dict(microbatches=2)]:
        steps = batches("gpt", 4, [32], seed=0)
        pm = fxtron.parallelize(make("gpt"), fxtron.Mesh(1), example_inputs=steps[0][0], **kw)
        prog = pm.program(0)
        prog.track_memory = True
        prog.train_step(steps[0][0], torch.optim.SGD(prog.parameters(), lr=0.0))
        measured = max(s.activations for s in prog.memory_timeline())
        per = saved_bytes(pm, 0, 4 // pm.config.pipeline.microbatches, 32)
        estimate = peak_saved_bytes(pm, 0, per)
        assert abs(estimate / measured - 1) <= 0.01, (kw, estimate, measured)
        if not kw:
            fp32 = per[0]
        if kw.get("dtype") == "bf16":      # the layers' half; the loss computes in fp32 (the model upcasts its logits)
            assert abs(per[0].layers / fp32.layers - 0.5) <= 0.02, (per[0], fp32)
            assert per[0].post > fp32.post / 2, (per[0], fp32)


def test_planner_uses_the_measured_activations_and_models_overlap_and_zb_v():
    """The planner's activations are inspect's (tools/activations.py on the same model, 16-bit) for
    tp with sp, pp under 1F1B, interleaved, ZB-V, and full recomputation (with the region held
    while backward runs it again); it hides the backward's tp communication behind the
    weight-gradient GEMMs and the dp buckets behind the last backward, and rates ZB-V's bubble
    (p-1)/(6m) of the compute, below 1F1B's (p-1)/m."""
    from fxtron.compiler.trace import trace
    from fxtron.tools.inspect import inspect, load_model
    model, args, kwargs = load_model("gpt-small", batch=2, seq=16)
    dims = planner.dims_of(trace(model, args, example_kwargs=kwargs))
    measured = planner.MeasuredActivations(model, args, kwargs, micro_batch=2, seq=256)
    hw = planner.Hardware(memory=2**40)
    for tp, pp, sp, schedule, v, rc in [(2, 1, True, "1f1b", 1, None), (2, 2, False, "1f1b", 1, None),
                                        (1, 4, False, "1f1b", 1, "full"), (2, 2, True, "interleaved", 2, None),
                                        (1, 2, False, "zb-v", 2, "selective")]:
        c = planner.rate(dims, hw, world=tp * pp, tp=tp, pp=pp, sp=sp, schedule=schedule, v=v, global_batch=16,
                         seq=256, micro_batch=2, zero=0, recompute=rc, activations=measured)
        assert c.activations_from == "measured"
        pm = fxtron.parallelize(model, fxtron.Mesh(tp * pp, tp=tp, pp=pp), example_inputs=args, sequence_parallel=sp,
                                recompute=rc, dtype="bf16", microbatches=c.microbatches, schedule=schedule,
                                virtual_stages=v if schedule == "interleaved" else 1)
        held = max(next(b for k, b in inspect(pm, r, batch=2, seq=256).memory.items()
                        if k.startswith("activations held")) for r in range(0, tp * pp, tp))
        assert abs(c.activation_bytes / held - 1) <= 0.10, (tp, pp, sp, schedule, rc, c.activation_bytes, held)
    one = dict(world=16, tp=2, pp=4, sp=True, global_batch=64, seq=256, micro_batch=1, zero=1, bucket_size=10_000)
    f1b = planner.rate(dims, hw, schedule="1f1b", v=1, **one)
    zbv = planner.rate(dims, hw, schedule="zb-v", v=2, **one)
    assert zbv.bubble_s == pytest.approx(f1b.bubble_s / 6)
    assert zbv.pp_comm_s == pytest.approx(2 * f1b.pp_comm_s)
    assert 0 < f1b.tp_hidden_s < f1b.tp_comm_s and 0 < f1b.dp_hidden_s < f1b.dp_comm_s
    assert f1b.step_s == pytest.approx(f1b.compute_s + f1b.bubble_s + f1b.tp_comm_s + f1b.pp_comm_s + f1b.dp_comm_s
                                       - f1b.tp_hidden_s - f1b.dp_hidden_s)
    listed = planner.candidates(dims, hw, world=16, global_batch=64, seq=256)
    assert any(q.schedule == "zb-v" for q in listed)
    text = planner.format_candidates(listed, hw)
    assert "hidden s" in text and "overlapped" in text and "zb-v" in text


def test_planner_rates_ulysses_and_hierarchical_cp():
    """The planner's cp bytes are the runtime's: the ring moves K and V c-1 times forward and
    2c-1 times backward; a2a four all-to-alls each way of (c-1)/c of b (s/c) h; a2a+p2p those
    at (a-1)/a inside groups of a (intra-node where tp x a fits one) and the ring of the c/a
    groups across them. Listed where tp x (the all-to-all group) divides the heads. The
    formulas are pm.collectives' for the same mesh (llama, fp32, checked at the end)."""
    dims = planner.ModelDims(layers=32, hidden=4096, heads=32, vocab=32000, params=6_738_415_616)
    hw = planner.Hardware()
    one = dict(world=64, tp=4, pp=1, sp=True, schedule="1f1b", v=1, global_batch=64, seq=16384, micro_batch=1,
               zero=1, cp=4)
    ring, ulysses = planner.rate(dims, hw, **one), planner.rate(dims, hw, **one, cp_comm_type="a2a")
    hier = planner.rate(dims, hw, **one, cp_comm_type="a2a+p2p", cp_a2a_size=2)
    m = 64 // (64 // 16)                                # microbatches of the rank's dp share
    bsh = 1 * 16384 * 4096 / 4 * 2 * 32 * m             # 16-bit b s h / tp, every layer and microbatch
    inter, intra = hw.inter_node_bw, hw.intra_node_bw   # tp x cp = 16 spans nodes; tp x 2 = 8 does not
    assert ring.cp_comm_s == pytest.approx((3 * 4 - 2) * 2 * bsh / 4 / inter)
    assert ulysses.cp_comm_s == pytest.approx(8 * 3 / 4 * bsh / 4 / inter) and ulysses.cp_comm_type == "a2a"
    assert hier.cp_comm_s == pytest.approx(8 / 2 * bsh / 4 / intra + (3 * 2 - 2) * 2 * bsh / 4 / inter)
    assert hier.cp_a2a_size == 2 and ring.cp_a2a_size is None
    listed = planner.candidates(dims, hw, world=64, global_batch=64, seq=16384)
    for comm in ("a2a", "a2a+p2p"):
        assert any(q.cp_comm_type == comm for q in listed)
    assert all(dims.heads % (q.tp * q.cp) == 0 for q in listed if q.cp_comm_type == "a2a")
    assert all(dims.heads % (q.tp * q.cp_a2a_size) == 0 and q.cp % q.cp_a2a_size == 0 and 1 < q.cp_a2a_size < q.cp
               for q in listed if q.cp_comm_type == "a2a+p2p")
    text = planner.format_candidates([q for q in listed if q.cp_comm_type != "p2p"], hw, top=len(listed))
    assert "a2a" in text and "a2a+p2p:2" in text
    # the same formulas as the compiled graphs' records: gpt (hidden 64, no grouped-query
    # keys), B=2, S=16, fp32, per attention
    args, _ = batches("gpt", 2, [16], seed=0)[0]
    for comm, a in (("p2p", 1), ("a2a", 4), ("a2a+p2p", 2)):
        pm = fxtron.parallelize(make("gpt"), fxtron.Mesh(4, cp=4), example_inputs=args, cp_comm_type=comm,
                                **({"cp_a2a_size": a} if comm == "a2a+p2p" else {}))
        recs = [r for r in pm.collectives(0, graphs_only=True) if r.op in
                ("ring_attention", "cp_all_to_all", "hierarchical_attention")]
        wire = sum(r.evaluate(2, 16)[1] for r in recs) / 2                    # two layers
        assert wire == pytest.approx(sum(planner.cp_bytes(a, 4, 2 * 16 * 64 * 4))), comm


def test_bf16_zero1_reports_the_fp32_parameters_it_holds_and_gathers():
    """Under a 16-bit compute dtype the rank holds fp32 parameters (the optimizer's main weights),
    and zero=1 all-gathers their updated fp32 shards: the summary's param bytes and the
    all-gather's bytes are those, not the 16-bit copies' (half: 243.5 KiB where the rank held
    487 KiB, and a gather of 124,672 B where 249,344 went over the wire)."""
    from fxtron.models import build, example_inputs
    pm = fxtron.parallelize(build("gpt-tiny"), fxtron.Mesh(2), example_inputs=example_inputs("gpt-tiny"), zero=1,
                            dtype="bf16")
    n = sum(p.numel() for p in pm.model.parameters())
    gathers = [r for r in pm.collectives(0) if r.op == "all_gather" and r.phase == "step"]
    assert sum(int(r.payload_bytes) for r in gathers) == 4 * n, gathers
    assert f"{4 * n / 1024:.1f} KiB" in pm.summary(), pm.summary()
