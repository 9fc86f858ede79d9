"""Pretrained weights into the shards (issue 31, point 2, first part): `prog.load_pretrained`
reads a directory transformers' save_pretrained wrote in several files, each rank only its own
slices. Without processes: a one-rank program gets every weight, and a checkpoint that does
not fit is one ParallelizeError naming the missing, unexpected and mis-shaped tensors. Then a
gloo job of 4 (Llama at tp=2 x pp=2 and at tp=4; GPT-2, Conv1D and tied, at tp=2 x dp=2 with
zero=1 and at tp=2 with sequence parallel): every rank's parameters equal the saved model's,
and the first loss and gradients equal that model's in one process."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import fxtron
from fxtron.testing import cases_fixture, max_abs_diff, ranks_of
from tp_models import batch, make


def _saved(name: str, path: str) -> torch.nn.Module:
    torch.manual_seed(123)                  # other weights than make()'s: the load must replace them all
    model = make(name)
    model.save_pretrained(path, max_shard_size="60KB")   # several files and an index
    return model


def test_one_rank_loads_every_weight_and_refuses_what_does_not_fit(tmp_path):
    saved = _saved("hf-llama", str(tmp_path / "llama"))
    assert (tmp_path / "llama" / "model.safetensors.index.json").exists()
    _, kw = batch("hf-llama", 2, 8, seed=0)
    prog = fxtron.parallelize(make("hf-llama"), fxtron.Mesh(1), example_kwargs=kw).program(0)
    prog.load_pretrained(str(tmp_path / "llama"))
    assert max_abs_diff(prog.full_state_dict(), saved.state_dict())[0] == 0.0
    sd = {k: v.clone() for k, v in saved.state_dict().items()}
    del sd["model.layers.0.mlp.up_proj.weight"]
    sd["model.layers.0.extra"] = torch.zeros(3)
    sd["model.norm.weight"] = torch.zeros(7)
    save_file(sd, str(tmp_path / "bad.safetensors"))
    with pytest.raises(fxtron.ParallelizeError, match=r"missing 1: model.layers.0.mlp.up_proj.weight.*unexpected 1: "
                                                      r"model.layers.0.extra.*mis-shaped 1: model.norm.weight \(7,\)"):
        prog.load_pretrained(str(tmp_path / "bad.safetensors"))
    with pytest.raises(fxtron.ParallelizeError, match="neither model.safetensors nor"):
        prog.load_pretrained(str(tmp_path))


CASES = {"llama-tp2-pp2": ("hf-llama", dict(tp=2, pp=2), dict(microbatches=2)),
         "llama-tp4": ("hf-llama", dict(tp=4), {}),
         "gpt2-tp2-zero": ("hf-gpt2", dict(tp=2), dict(zero=1)),
         "gpt2-tp2-sp": ("hf-gpt2", dict(tp=2), dict(sequence_parallel=True))}


def _run(rank: int, mesh: fxtron.Mesh, key: str) -> dict:
    import os
    import tempfile
    import warnings
    name, _, options = CASES[key]
    # one directory per test run: the ranks' parent is the pytest process
    path = os.path.join(tempfile.gettempdir(), f"fxtron-pretrained-{os.getppid()}", name)
    if rank == 0 and not os.path.exists(os.path.join(path, "model.safetensors.index.json")):
        _saved(name, path)
    import torch.distributed as dist
    dist.barrier()
    args, kw = batch(name, 4, 8, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = fxtron.parallelize(make(name), mesh, example_kwargs=kw, **options).program(rank)
    prog.load_pretrained(path)
    state = prog.full_state_dict()
    opt = torch.optim.SGD(prog.parameters(), lr=0.0)
    loss = prog.train_step(args, opt, kwargs=kw)
    return {"state": state, "loss": loss, "grads": prog.full_grads()}


trained = cases_fixture({4: [(fxtron.Mesh(4, **CASES[k][1]), [k]) for k in CASES]}, _run)


@pytest.mark.slow
@pytest.mark.parametrize("key", list(CASES))
def test_every_rank_reads_its_slices(trained, key, tmp_path):
    name, axes, _ = CASES[key]
    ref = _saved(name, str(tmp_path / name))
    args, kw = batch(name, 4, 8, seed=1)
    loss = ref(*args, **kw).loss
    loss.backward()
    for rank, got in enumerate(ranks_of(trained, fxtron.Mesh(4, **axes), key)):
        assert max_abs_diff(got["state"], ref.state_dict())[0] == 0.0, rank
        assert abs(got["loss"] - float(loss)) < 2e-6, (got["loss"], float(loss))
        dg, where = max_abs_diff(got["grads"], {n: p.grad for n, p in ref.named_parameters()})
        assert dg < 1e-6, (rank, where, dg)
