"""Device-true programs (issue "fxtron on the GPU"): a program names only the device type it is
built for, whatever device the model was built on. A model built on meta is traced as its CPU
build (fake CPU tensors), so every device its code names while tracing -- position aranges, the
rotary table's `.to(x.device)`, export's metadata asserts -- was written into the graph as the
CPU, and a GPU run crashed at its first step. Compile only, no processes: every rank's graph and
stage graph of transformers' Llama, Qwen3, GPT-2, Phi-3 and Mixtral, built on meta for
device="cuda" on this CPU-only machine, names no torch.device but cuda's (and device="cpu"
graphs only the CPU), under tp=2, pp=2, cp=2, ep=2 and zero=3; the verifier's check names a
node that names another; a mixture of experts' GEMMs take the path the program's dtype has on
CUDA (the bf16 grouped GEMM under dtype="bf16", transformers' fallback in fp32), and a
torch._grouped_mm CUDA cannot run is a ParallelizeError at parallelize. Where CUDA is present
(skipped here): a step captured in a CUDA graph (cuda_graphs=True) trains as the uncaptured one."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.fx as fx
import torch.utils._pytree as pytree

import fxtron
from fxtron.errors import ParallelizeError
from fxtron.passes import devices
from fxtron.passes.localize import drop_metadata_asserts
from fxtron.passes.verify import check_devices
from tp_models import batch, make

MODELS = ["hf-llama", "hf-qwen3", "hf-gpt2", "hf-phi3", "hf-mixtral"]
MESHES = {
    "tp2": (fxtron.Mesh(2, tp=2), {}),
    "pp2": (fxtron.Mesh(2, pp=2), {"microbatches": 2}),
    "cp2": (fxtron.Mesh(2, cp=2), {}),
    "zero3": (fxtron.Mesh(2), {"zero": 3}),
    "ep2": (fxtron.Mesh(2, ep=2), {}),
    "ep2-tp2": (fxtron.Mesh(4, ep=2, tp=2), {}),
    "pp2-tp2": (fxtron.Mesh(4, pp=2, tp=2), {"microbatches": 2, "recompute": "full"}),
}
#: every model on the four 2-rank meshes (experts on ep too), and two of 4 ranks
CASES = [(m, k) for m in MODELS for k in ("tp2", "pp2", "cp2", "zero3")] + \
        [("hf-mixtral", "ep2"), ("hf-mixtral", "ep2-tp2"), ("hf-llama", "pp2-tp2")]


def _parallelize(name: str, mesh_key: str, device: str, built_on: str = "meta", **options):
    mesh, extra = MESHES[mesh_key]
    with torch.device(built_on):
        model = make(name)
    args, kwargs = batch(name, 4, 8, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxtron.parallelize(model, mesh, example_inputs=args, example_kwargs=kwargs, device=device,
                                  **{**extra, **options})


def _named_devices(gm: fx.GraphModule) -> list[tuple[str, torch.device]]:
    """(node, device) for every torch.device in the args and kwargs of every node of gm and the
    graphs nested in it."""
    out = []
    for m in gm.modules():
        if isinstance(m, fx.GraphModule):
            for node in m.graph.nodes:
                out += [(node.name, a) for a in pytree.tree_leaves((node.args, node.kwargs))
                        if isinstance(a, torch.device)]
    return out


def _check_every_rank(pm, device: str) -> int:
    """Every rank's compiled graphs (its stages under pp) and pm.graph(rank)'s text name only
    `device`; returns how many device arguments were seen."""
    other = "cpu" if device == "cuda" else "cuda"
    seen = 0
    for rank in range(pm.mesh.world_size):
        rg = pm.compiled(rank)
        for g in rg.graphs + [rg.gm]:
            named = _named_devices(g)
            wrong = [(n, d) for n, d in named if d.type != device]
            assert not wrong, (rank, wrong[:5])
            seen += len(named)
        text = pm.graph(rank)
        assert f"device(type='{other}'" not in text, rank
        assert "_assert_tensor_metadata" not in text, rank
    return seen


@pytest.mark.parametrize("name,mesh_key", CASES)
def test_meta_model_for_cuda_names_only_cuda(name, mesh_key):
    """Built on meta, compiled for CUDA on a CPU-only machine: no rank's graph pins the CPU (before
    the fix transformers' Llama at tp=2 had 6 such lines a rank, Mixtral at ep=2 x tp=2 10)."""
    pm = _parallelize(name, mesh_key, "cuda", dtype="bf16" if name == "hf-mixtral" else "fp32")
    assert _check_every_rank(pm, "cuda") > 0      # the models do name devices (aranges, .to(device))


@pytest.mark.parametrize("name", ["hf-llama", "hf-mixtral"])
def test_cpu_programs_name_only_the_cpu(name):
    """device="cpu" keeps the CPU, for a meta-built model and a CPU-built one."""
    for built_on in ("meta", "cpu"):
        pm = _parallelize(name, "tp2", "cpu", built_on=built_on)
        assert _check_every_rank(pm, "cpu") > 0


def test_cpu_built_model_for_cuda_names_only_cuda():
    """A model built on the CPU (real weights) and compiled for CUDA: the same graphs."""
    pm = _parallelize("hf-llama", "tp2", "cuda", built_on="cpu")
    assert _check_every_rank(pm, "cuda") > 0


@pytest.mark.parametrize("dtype,kernel", [("bf16", "aten._grouped_mm.default"),
                                          ("fp32", "transformers.grouped_mm_fallback.default")])
def test_experts_take_the_path_cuda_has(dtype, kernel):
    """Mixtral at ep=2 for CUDA: in bf16 the experts' GEMMs are torch._grouped_mm in bfloat16
    (its only dtype on CUDA); in fp32 transformers' fallback (no _grouped_mm), which runs any dtype."""
    pm = _parallelize("hf-mixtral", "ep2", "cuda", dtype=dtype)
    for rank in range(2):
        gmms = [n for n in pm.compiled(rank).gm.graph.nodes if "grouped_mm" in str(n.target)]
        assert gmms and {str(n.target) for n in gmms} == {kernel}, rank
        if dtype == "bf16":
            assert all(a.meta["val"].dtype == torch.bfloat16 for n in gmms for a in n.args[:2])


def _grouped_mm_graph(dtype: torch.dtype) -> fx.GraphModule:
    """x @ w by groups through torch._grouped_mm, its values' dtype `dtype` (made by hand: the
    trace's meta rule refuses all but bf16 already, while CUDA's kernel is the narrower rule)."""
    g = fx.Graph()
    x, w, offs = g.placeholder("x"), g.placeholder("w"), g.placeholder("offs")
    x.meta["val"], w.meta["val"] = torch.empty(8, 16, dtype=dtype, device="meta"), \
        torch.empty(4, 16, 32, dtype=dtype, device="meta")
    offs.meta["val"] = torch.empty(4, dtype=torch.int32, device="meta")
    out = g.call_function(torch.ops.aten._grouped_mm.default, (x, w, offs))
    out.meta["val"] = torch.empty(8, 32, dtype=dtype, device="meta")
    g.output(out)
    return fx.GraphModule(torch.nn.Module(), g)


def test_grouped_mm_cuda_cannot_run_is_an_error():
    """torch._grouped_mm in float32 built for CUDA: a ParallelizeError naming the dtype and dtype='bf16';
    in bfloat16, or for the CPU, nothing."""
    with pytest.raises(ParallelizeError, match=r"float32.*bfloat16.*dtype='bf16'"):
        devices.check_kernels(_grouped_mm_graph(torch.float32), "cuda")
    devices.check_kernels(_grouped_mm_graph(torch.bfloat16), "cuda")
    devices.check_kernels(_grouped_mm_graph(torch.float32), "cpu")


def test_verifier_names_a_node_on_another_device():
    """check_devices: a graph built for CUDA whose node names the CPU is a ParallelizeError naming
    that node, in the top graph or in a nested one; on_device clears it."""
    class M(torch.nn.Module):
        def forward(self, x):
            return x + torch.arange(x.shape[0], device=torch.device("cpu"))
    gm = fx.symbolic_trace(M())
    with pytest.raises(ParallelizeError, match=r"%arange .*names the device cpu.*built for cuda"):
        check_devices(gm, "cuda")
    check_devices(gm, "cpu")
    outer = fx.symbolic_trace(torch.nn.Identity())
    outer.add_submodule("inner", gm)
    with pytest.raises(ParallelizeError, match=r"%arange"):
        check_devices(outer, "cuda")
    devices.on_device(outer, "cuda")
    check_devices(outer, "cuda")
    assert [d for _, d in _named_devices(outer)] == [torch.device("cuda")]


def test_metadata_asserts_go_from_nested_graphs_too():
    """export's _assert_tensor_metadata pins the traced device (device=cpu for a meta model): the
    trace pass drops it from the graph and from every graph nested in it."""
    def body():
        g = fx.Graph()
        x = g.placeholder("x")
        g.call_function(torch.ops.aten._assert_tensor_metadata.default, (x,),
                        {"dtype": torch.float32, "device": torch.device("cpu"), "layout": torch.strided})
        g.output(x)
        return fx.GraphModule(torch.nn.Module(), g)
    outer = body()
    outer.add_submodule("inner", body())
    drop_metadata_asserts(outer)
    assert not [n for m in outer.modules() if isinstance(m, fx.GraphModule) for n in m.graph.nodes
                if n.target == torch.ops.aten._assert_tensor_metadata.default]
    check_devices(outer, "cuda")


def _captured_job(rank: int, mesh, steps: int) -> dict:
    """Train gpt-tiny on one NCCL rank captured (cuda_graphs, one warm-up step) and uncaptured,
    on the same batches; what each trained, and where the capture happened."""
    from fxtron.tools.testing import adamw, train_program
    from tp_models import batches as make_batches
    items = make_batches("gpt", 4, [16] * steps, seed=7)
    out = {}
    for captured in (True, False):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm = fxtron.parallelize(make("gpt"), mesh, example_inputs=items[0][0], device="cuda", clip_grad=1.0,
                                    cuda_graphs=captured, **({"cuda_graph_warmup": 1} if captured else {}))
        prog = pm.program(rank)
        res = train_program(prog, items, adamw()(prog.parameters()))
        res["captured_at"] = prog.captured.captured_at if captured else None
        res["norm"] = prog.last_grad_norm
        out[captured] = {k: ({n: t.cpu() for n, t in v.items()} if isinstance(v, dict) else v) for k, v in res.items()}
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA graph needs a GPU")
def test_captured_step_trains_as_the_uncaptured_one():
    """cuda_graphs=True on one NCCL rank, fp32: step 1 eager (warm-up), step 2 captured and
    replayed, steps 3-5 replays -- the same losses, gradient norms and weights as the uncaptured
    program (capturable Adam's float32 bias corrections the only difference) and as the model
    in one process."""
    from fxtron.tools.testing import adamw, assert_trains_like, max_abs_diff, reference_training
    from tp_models import batches as make_batches
    mesh = fxtron.Mesh(1)
    r = fxtron.launch(_captured_job, mesh, args=(mesh, 5), backend="nccl", timeout_s=600, shm_transport=False)[0]
    got, plain = r[True], r[False]
    assert got["captured_at"] == 2
    assert max(abs(a - b) for a, b in zip(got["losses"], plain["losses"])) < 1e-5
    assert abs(got["norm"] - plain["norm"]) < 1e-5
    dw, where = max_abs_diff(got["state"], plain["state"])
    assert dw < 1e-6, (where, dw)
    on_gpu = [(tuple(t.cuda() for t in a), kw) for a, kw in make_batches("gpt", 4, [16] * 5, seed=7)]
    ref = reference_training(make("gpt").cuda(), on_gpu, adamw(), clip_grad=1.0)     # (the same GPU's kernels)
    ref = {k: ({n: t.cpu() for n, t in v.items()} if isinstance(v, dict) else v) for k, v in ref.items()}
    assert_trains_like(got, ref)
