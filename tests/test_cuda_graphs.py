"""CUDA graphs (`cuda_graphs=True`, runtime/graphs.py): the whole training step captured once and
replayed. This machine has no GPU, so the capture itself is tested in tests/test_device.py
(skipped without CUDA) and benchmarks/gpu_check.py's `cuda_graphs` key; here, without
processes:

- every refusal is a ParallelizeError naming its cause and what to change: at parallelize (a
  CPU device, fp16's loss scaling, microbatches and pp, zero, recomputation, cp, ep, the
  collective check), at program build (data-dependent shapes, random draws, a program not on CUDA, gloo
  groups and the shared-memory channel), at a step (an optimizer other than Adam / AdamW, a
  Microbatches list, a batch of another shape, a hyperparameter changed after capture, a
  non-finite norm under skip_nonfinite);
- the option's flag, TOML key and shorthand, and the summary's line;
- the captured step's body (its warm-up steps: static buffers, the batch's token counts in
  static tensors, the loss and norm kept on the device, the lr a tensor the schedule's floats
  are copied into) trains a 1-rank CPU program exactly as the uncaptured step does, and as the
  unmodified model in one process.
"""
from __future__ import annotations

import argparse
import math
import warnings

import pytest
import torch
from torch import nn

import fxtron
from fxtron.config import Config
from fxtron.config.flags import add_arguments, from_arguments
from fxtron.errors import ParallelizeError
from fxtron.runtime.graphs import CapturedStep, check_program
from fxtron.runtime.groups import ProcessGroups
from fxtron.tools.testing import adamw, assert_trains_like, max_abs_diff, reference_training, run_on_ranks
from tp_models import batches, make

CUDA = dict(cuda_graphs=True, device="cuda")


# ----------------------------------------------------------------------------- the option
def test_flag_toml_and_shorthand():
    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = from_arguments(p.parse_args(["--cuda-graphs", "--device", "cuda", "--cuda-graph-warmup", "3"]))
    assert cfg.codegen.cuda_graphs and cfg.codegen.cuda_graph_warmup == 3
    assert "--cuda-graphs" in p.format_help()
    assert Config.from_dict(cfg.to_dict()).codegen.cuda_graphs
    assert "cuda_graphs = true" in cfg.to_toml()
    assert Config().replace(**CUDA).codegen.cuda_graphs


@pytest.mark.parametrize("options,cause", [
    ({"device": "cpu"}, "the programs run on the CPU"),
    ({"dtype": "fp16"}, "fp16's dynamic loss scaling reads the gradients' overflow check on the host"),
    ({"microbatches": 2}, "use pp=1 and microbatches=1"),
    ({"zero": 1}, "use zero=0"),
    ({"zero": 3}, "use zero=0"),
    ({"recompute": "full"}, "use recompute=None"),
    ({"check_collectives": True}, "FXTRON_CHECK_COLLECTIVES=0"),
])
def test_config_refusals(options, cause):
    with pytest.raises(ParallelizeError, match="cuda_graphs=True cannot capture this step") as e:
        Config().replace(**{**CUDA, **options})
    assert cause in str(e.value) and "turn cuda_graphs off" in str(e.value)


@pytest.mark.parametrize("mesh,cause", [(fxtron.Mesh(2, pp=2), "pp > 1"), (fxtron.Mesh(2, ep=2), "ep=1"),
                                        (fxtron.Mesh(2, cp=2), "cp=1")])
def test_mesh_refusals(mesh, cause):
    with pytest.raises(ParallelizeError, match="cuda_graphs=True cannot capture") as e:
        Config().replace(**CUDA).check(mesh)
    assert cause in str(e.value)


def test_parallelize_on_a_cpu_machine_is_refused():
    if torch.cuda.is_available():
        pytest.skip("the device resolves to cuda here")
    model = make("gpt")
    with pytest.raises(ParallelizeError, match="the programs run on the CPU"):
        fxtron.parallelize(model, fxtron.Mesh(1), example_inputs=batches("gpt", 4, [16], 0)[0][0], cuda_graphs=True)


# ----------------------------------------------------------------------------- program build
class Nonzero(nn.Module):
    """A loss over the rows a data-dependent mask picks (aten.nonzero: its shape is the data's)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        idx = torch.nonzero(x[:, 0] > 0).squeeze(1)
        return y.index_select(0, idx).sum() + y.mean()


class Indexing(nn.Module):
    """Rows picked by integer indices (a gather of fixed shape: capturable) and by a boolean mask
    (the host counts the rows: refused)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        rows = torch.arange(y.shape[0] - 1, -1, -1, device=x.device)
        return y[rows].mean() + y[x[:, 0] > 0].sum()


class Gather(nn.Module):
    """Rows picked by integer indices alone: a gather of fixed shape, which a graph replays."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return y[torch.arange(y.shape[0] - 1, -1, -1, device=x.device)].pow(2).mean()


class Dropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.drop(self.lin(x)).pow(2).mean()


@pytest.mark.parametrize("model,cause", [(Nonzero, "aten.nonzero.default has a data-dependent output"),
                                         (Indexing, "aten.index.Tensor indexes by a boolean mask"),
                                         (Dropout, "draws random numbers")])
def test_graph_refusals_at_program_build(model, cause):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = fxtron.parallelize(model(), fxtron.Mesh(1), example_inputs=(torch.randn(4, 8),), seq_dim=None, **CUDA)
    assert cause in pm.summary() and "refused at program build" in pm.summary()
    with pytest.raises(ParallelizeError, match="cuda_graphs=True cannot capture this program's step") as e:
        pm.program(0)
    assert cause in str(e.value)
    assert "the program runs on cpu" in str(e.value)      # (a 1-rank program without groups: the CPU)


def test_integer_indexing_is_not_refused():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = fxtron.parallelize(Gather(), fxtron.Mesh(1), example_inputs=(torch.randn(4, 8),), seq_dim=None, **CUDA)
    assert any(n.target == torch.ops.aten.index.Tensor for g in pm.compiled(0).graphs for n in g.graph.nodes)
    assert pm.compiled(0).spec().host_bound == ()
    assert "refused" not in pm.summary()


def _groups(backend: str, channels=None) -> ProcessGroups:
    g = ProcessGroups(mesh=fxtron.Mesh(2, tp=2), rank=0, backend=backend, device=torch.device("cuda", 0))
    g.channels = channels or {}
    return g


def test_gloo_and_shm_refused_from_the_groups():
    cuda = torch.device("cuda", 0)
    with pytest.raises(ParallelizeError, match="the process groups are on gloo") as e:
        check_program((), _groups("gloo"), cuda)
    assert "backend='nccl'" in str(e.value)
    with pytest.raises(ParallelizeError, match="shared-memory channel") as e:
        check_program((), _groups("gloo", {"tp": object()}), cuda)
    assert "FXTRON_SHM=0" in str(e.value) and "shm_transport=False" in str(e.value)
    check_program((), _groups("nccl"), cuda)      # NCCL on CUDA: nothing to refuse


def test_summary_says_when_the_step_is_captured():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = fxtron.parallelize(make("gpt"), fxtron.Mesh(1), example_inputs=batches("gpt", 4, [16], 0)[0][0],
                                cuda_graph_warmup=3, **CUDA)
    text = pm.summary()
    assert "captured in one CUDA graph on step 4" in text and "3 warm-up step(s)" in text


# ----------------------------------------------------------------------------- the step's body, on the CPU
def _program(**options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = fxtron.parallelize(make("gpt"), fxtron.Mesh(1), example_inputs=batches("gpt", 4, [16], 0)[0][0],
                                **options)
    return pm.program(0)


def _run(prog, step, items, opt, lrs):
    losses, grads = [], None
    for item, lr in zip(items, lrs):
        for g in opt.param_groups:
            g["lr"] = lr                     # a schedule's float, between steps
        args, kwargs = item
        losses.append(step(args, opt, kwargs=kwargs))
        if grads is None:
            grads = prog.full_grads()
    return {"losses": losses, "grads": grads, "state": prog.full_state_dict()}


def test_warm_up_body_trains_as_the_uncaptured_step():
    """The captured step's work (CapturedStep._body on static buffers, nothing read on the host
    until the step ends) run as warm-up steps on the CPU: the same losses, norms and weights
    as the uncaptured step, and as the model in one process, with clipping and an lr that
    changes every step."""
    items = batches("gpt", 4, [16, 16, 16], 5)
    for i, ((_, targets), _) in enumerate(items):
        targets[i, : 4 * i + 1] = -100       # ignored labels: the token mean's count differs every step
    lrs = [1e-3, 5e-4, 2e-3]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = fxtron.parallelize(make("gpt"), fxtron.Mesh(1), example_inputs=items[0][0], clip_grad=0.5)
    plain, prog = pm.program(0), pm.program(0)
    want = _run(plain, plain.train_step, items, adamw()(plain.parameters()), lrs)
    captured = CapturedStep(prog, warmup=len(items))
    opt = adamw()(prog.parameters())
    got = _run(prog, captured.step, items, opt, lrs)
    assert captured.graph is None and captured.steps == 3
    assert max(abs(a - b) for a, b in zip(got["losses"], want["losses"])) < 1e-6, (got, want)
    assert abs(prog.last_grad_norm - plain.last_grad_norm) < 1e-6
    for key in ("grads", "state"):
        d, where = max_abs_diff(got[key], want[key])
        assert d < 1e-6, (key, where, d)
    assert all(isinstance(g["lr"], torch.Tensor) and float(g["lr"]) == pytest.approx(lrs[-1])
               for g in opt.param_groups)

    class Schedule:          # (reference_training's: `.lr` before each step, `.step()` after it)
        at = 0
        lr = property(lambda self: lrs[self.at])

        def step(self):
            self.at += 1
    ref = reference_training(make("gpt"), items, adamw(), clip_grad=0.5, schedule=Schedule())
    assert abs(prog.last_grad_norm - ref["norms"][-1]) < 1e-5
    assert_trains_like(got, ref)


def test_step_refusals():
    prog = _program()
    (args, kwargs), = batches("gpt", 4, [16], 1)
    with pytest.raises(ParallelizeError, match="not torch.optim.sgd.SGD: use AdamW"):
        CapturedStep(prog, 2).step(args, torch.optim.SGD(prog.parameters(), lr=0.1), kwargs)
    with pytest.raises(ParallelizeError, match="a Microbatches list"):
        CapturedStep(prog, 2).step(fxtron.Microbatches([(args, kwargs)]), adamw()(prog.parameters()), None)
    captured = CapturedStep(prog, 3)
    opt = adamw()(prog.parameters())
    captured.step(args, opt, kwargs)
    (longer, lkw), = batches("gpt", 4, [32], 2)
    with pytest.raises(ParallelizeError, match=r"a CUDA graph replays the shapes it was captured with") as e:
        captured.step(longer, opt, lkw)
    assert "(4, 32)" in str(e.value) and "(4, 16)" in str(e.value)
    with pytest.raises(ParallelizeError, match="not the one the step was captured with"):
        captured.step(args, adamw()(prog.parameters()), kwargs)
    opt.param_groups[0]["weight_decay"] = 0.5
    with pytest.raises(ParallelizeError, match=r"weight_decay of group 0 \('0.1' -> '0.5'\) changed"):
        captured.step(args, opt, kwargs)


def test_a_non_finite_norm_is_an_error_not_a_skip():
    prog = _program()
    prog.skip_nonfinite = True
    captured = CapturedStep(prog, 2)
    captured.steps = 4
    with pytest.raises(ParallelizeError, match="step 4 of this program: the global gradient norm is nan"):
        captured._read(torch.tensor(1.0), torch.tensor(math.nan))
    assert captured._read(torch.tensor(2.5), torch.tensor(1.0)) == 2.5


def _dp_job(rank: int, mesh: fxtron.Mesh, items: list, lrs: list) -> dict:
    """On each dp rank: the uncaptured program and a CapturedStep's warm-up steps (the step's
    work, run eagerly) on the same batches."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = fxtron.parallelize(make("gpt"), mesh, example_inputs=items[0][0], clip_grad=0.5)
    plain, prog = pm.program(rank), pm.program(rank)
    want = _run(plain, plain.train_step, items, adamw()(plain.parameters()), lrs)
    captured = CapturedStep(prog, warmup=len(items))
    got = _run(prog, captured.step, items, adamw()(prog.parameters()), lrs)
    return {"got": got, "want": want, "statistics": sorted(captured.batch.values), "norms": (prog.last_grad_norm,
                                                                                              plain.last_grad_norm)}


@pytest.mark.slow      # (a 2-rank gloo job: ~25 s on 2 shared cores)
def test_warm_up_body_under_data_parallel():
    """dp=2 (gloo): the loss summed over dp on the device and the global token count of a mean
    loss (ignored labels spread unevenly over the ranks and the steps) through the static
    tensors -- the same losses, norms and weights as the uncaptured step on every rank, and as
    the model in one process."""
    items = batches("gpt", 4, [16, 16, 16], 9)
    for i, ((_, targets), _) in enumerate(items):
        targets[i, : 5 * i + 2] = -100       # one rank's half of the batch loses more tokens, differently each step
    lrs = [1e-3, 5e-4, 2e-3]
    mesh = fxtron.Mesh(2)
    results = run_on_ranks(_dp_job, mesh, mesh, items, lrs)

    class Schedule:
        at = 0
        lr = property(lambda self: lrs[self.at])

        def step(self):
            self.at += 1
    ref = reference_training(make("gpt"), items, adamw(), clip_grad=0.5, schedule=Schedule())
    for rank, r in enumerate(results):
        assert r["statistics"], "the step has no batch statistics: the static tensors are not exercised"
        assert max(abs(a - b) for a, b in zip(r["got"]["losses"], r["want"]["losses"])) < 1e-6
        assert abs(r["norms"][0] - r["norms"][1]) < 1e-6
        for key in ("grads", "state"):
            d, where = max_abs_diff(r["got"][key], r["want"][key])
            assert d < 1e-6, (rank, key, where, d)
        assert_trains_like(r["got"], ref, rank=rank)
