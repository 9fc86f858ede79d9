"""Checkpoints that survive a failed save (issue: reliability, item 1). Faults are injected into
a real 2-rank save on gloo: a storage writer whose rank-1 writes fail with "No space left on
device" (over an existing checkpoint and into a new directory), a filesystem that really fills
(a 2.5 MB tmpfs mounted in a private mount namespace, where one checkpoint of 1.7 MB fits and
a second does not; skipped where unshare or mount is not permitted), a rank killed in the
middle of writing, a directory a save never finished, and a checkpoint of another model.

What each must leave behind: the previous checkpoint at the path loadable and unchanged, the
error on every rank naming the failed rank, the path and the OS error, nothing half-written
that `load` would take for a checkpoint, and the next save succeeding.
"""
from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

import fxtron
from fxtron.errors import LaunchError
from fxtron.tools.testing import max_abs_diff, run_on_ranks, scaled
from tp_models import batch, make

pytestmark = pytest.mark.slow      # gloo jobs, one under unshare on a small tmpfs


class FullDisk(FileSystemWriter):
    """A FileSystemWriter whose writes fail on `rank` as a full disk does (or kill the process)."""

    def __init__(self, path, rank, kill=False):
        super().__init__(path)
        self.failing, self.kill = rank, kill

    def write_data(self, plan, planner):
        if torch.distributed.get_rank() == self.failing:
            if self.kill:
                os._exit(17)                           # a rank dies in the middle of the save
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write_data(plan, planner)


def _program(rank, mesh):
    pm = fxtron.parallelize(make("gpt"), mesh, example_inputs=batch("gpt", 2, 8, seed=0)[0])
    prog = pm.program(rank)
    opt = torch.optim.AdamW(prog.parameters(), lr=1e-2)
    return prog, opt


def _step(prog, opt, seed):
    return prog.train_step(batch("gpt", 4, 16, seed=seed)[0], opt)


def _faults(rank, mesh, root):
    prog, opt = _program(rank, mesh)
    good = os.path.join(root, "good")
    _step(prog, opt, 1)
    prog.save(good, opt)
    saved = {k: v.clone() for k, v in prog.full_state_dict().items()}
    _step(prog, opt, 2)                                           # the weights move on
    out = {"saved": saved}
    for name, target in (("over", good), ("new", os.path.join(root, "new"))):
        try:
            prog.save(target, opt, storage_writer=lambda p: FullDisk(p, rank=1))
            out[name] = None
        except fxtron.ParallelizeError as e:
            out[name] = str(e)
    prog.load(good, opt)                                          # the previous checkpoint, unchanged
    out["reloaded"] = prog.full_state_dict()
    return out


def _killed(rank, mesh, root):
    prog, opt = _program(rank, mesh)
    _step(prog, opt, 3)
    prog.save(os.path.join(root, "good"), opt, storage_writer=lambda p: FullDisk(p, rank=1, kill=True))


def _after_kill(rank, mesh, root):
    prog, opt = _program(rank, mesh)
    prog.load(os.path.join(root, "good"), opt)
    loaded = prog.full_state_dict()
    _step(prog, opt, 4)
    prog.save(os.path.join(root, "good"), opt)                    # clears the killed save's leftovers
    return {"loaded": loaded, "after": prog.full_state_dict()}


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("faults"))
    mesh = fxtron.Mesh(2)                                          # dp=2
    out = run_on_ranks(_faults, mesh, mesh, root, timeout_s=300)
    with pytest.raises(LaunchError, match="exit code 17"):
        run_on_ranks(_killed, mesh, mesh, root, timeout_s=300)
    leftovers = sorted(os.listdir(root))
    after = run_on_ranks(_after_kill, mesh, mesh, root, timeout_s=300)
    return {"root": root, "ranks": out, "leftovers": leftovers, "after": after}


def _fills(rank, mesh, root):
    prog, opt = _program(rank, mesh)
    good = os.path.join(root, "good")
    _step(prog, opt, 1)
    prog.save(good, opt)                                          # 1.7 MB of 2.5: it fits
    out = {"saved": {k: v.clone() for k, v in prog.full_state_dict().items()}}
    _step(prog, opt, 2)
    for name, target in (("over", good), ("new", os.path.join(root, "new"))):
        try:
            prog.save(target, opt)                                # a second copy does not fit
            out[name] = None
        except fxtron.ParallelizeError as e:
            out[name] = str(e)
    out["left"] = sorted(os.listdir(root))
    # torch's serializer may meet the full disk as a short write ("unexpected pos"), not ENOSPC:
    # which one comes depends on where the space runs out; both must read as a full disk
    from fxtron.runtime.checkpoint.dcp import _why
    out["short write"] = _why(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"),
                              os.path.join(root, "new"))
    prog.load(good, opt)
    out["reloaded"] = prog.full_state_dict()
    return out


def _in_small_filesystem(root: str, size_k: int, result: str) -> None:
    """Run in a private mount namespace (unshare -m): mount a tmpfs of size_k KiB at root, save
    into it until it is full, write what every rank saw to `result` (outside the tmpfs)."""
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_k}k", "tmpfs", root], check=True)
    mesh = fxtron.Mesh(2)
    torch.save(run_on_ranks(_fills, mesh, mesh, root, timeout_s=300), result)


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root and unshare")
    root, result = tmp_path_factory.mktemp("smallfs"), tmp_path_factory.mktemp("result") / "filled.pt"
    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys; sys.path.insert(0, {here!r}); import test_checkpoint_faults as T; "
            f"T._in_small_filesystem({str(root)!r}, 2500, {str(result)!r})")
    run = subprocess.run(["unshare", "-m", sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=scaled(600))
    if run.returncode != 0 and ("Operation not permitted" in run.stderr or "permission denied" in run.stderr.lower()):
        pytest.skip(f"no private mount namespace here: {run.stderr.strip().splitlines()[-1]}")
    assert run.returncode == 0, run.stderr[-4000:]
    return torch.load(result, weights_only=False)


def test_a_filesystem_that_fills_during_a_save_leaves_the_checkpoint(filled):
    for rank, out in enumerate(filled):
        for name in ("over", "new"):
            msg = out[name]
            assert msg is not None, f"rank {rank}: the save {name} did not fail on a full filesystem"
            assert "No space left on device" in msg and "rank(s)" in msg, msg
        assert "good" in out["over"] and "unchanged" in out["over"], out["over"]
        assert "Nothing was written" in out["new"], out["new"]
        assert out["left"] == ["good"], out["left"]            # no half-written directory stays behind
        assert "unexpected pos" in out["short write"] and "No space left on device" in out["short write"]
        assert max_abs_diff(out["reloaded"], out["saved"])[0] == 0


def test_a_failed_save_over_a_checkpoint_leaves_it_loadable_and_unchanged(faults):
    for rank, out in enumerate(faults["ranks"]):
        msg = out["over"]
        assert msg is not None, f"rank {rank}: the save did not fail"
        assert "rank(s) 1" in msg and "No space left on device" in msg and "good" in msg, msg
        assert "unchanged" in msg
        assert max_abs_diff(out["reloaded"], out["saved"])[0] == 0


def test_a_failed_save_into_a_new_directory_leaves_nothing_loadable(faults):
    for out in faults["ranks"]:
        assert "No space left on device" in out["new"] and "Nothing was written" in out["new"]
    new = os.path.join(faults["root"], "new")
    assert not os.path.exists(new) and not os.path.exists(new + ".saving")
    with pytest.raises(fxtron.ParallelizeError, match="no checkpoint at"):
        fxtron.load_full_state_dict(new)


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(faults):
    assert "good" in faults["leftovers"] and "good.saving" in faults["leftovers"]    # the dead save's files
    saved = faults["ranks"][0]["saved"]
    for out in faults["after"]:
        assert max_abs_diff(out["loaded"], saved)[0] == 0
    assert sorted(os.listdir(faults["root"])) == ["good"]                  # the next save cleared them
    full = fxtron.load_full_state_dict(os.path.join(faults["root"], "good"))
    after = faults["after"][0]["after"]
    common = set(full) & set(after)                                        # (tied names: the checkpoint holds one)
    assert common and max_abs_diff({k: full[k] for k in common}, {k: after[k] for k in common})[0] == 0


def test_a_directory_whose_save_did_not_complete_is_refused(faults, tmp_path):
    partial = tmp_path / "partial"
    os.rename(os.path.join(faults["root"], "good"), partial)               # a copy without its marker
    os.remove(partial / ".fxtron-complete")
    with pytest.raises(fxtron.ParallelizeError, match="save did not complete.*before its saves were atomic.*"
                                                      r"create the empty file .*partial/\.fxtron-complete"):
        fxtron.load_full_state_dict(str(partial))
    prog = fxtron.parallelize(make("gpt"), fxtron.Mesh(1), example_inputs=batch("gpt", 2, 8, seed=0)[0]).program(0)
    with pytest.raises(fxtron.ParallelizeError, match="save did not complete"):
        prog.load(str(partial))
    os.rename(partial, os.path.join(faults["root"], "good"))


def test_a_checkpoint_of_another_model_lists_the_differences(tmp_path):
    small = fxtron.parallelize(make("gpt"), fxtron.Mesh(1), example_inputs=batch("gpt", 2, 8, seed=0)[0]).program(0)
    small.save(str(tmp_path / "gpt"))
    other = fxtron.parallelize(make("llama"), fxtron.Mesh(1), example_inputs=batch("llama", 2, 8, seed=0)[0]).program(0)
    with pytest.raises(fxtron.ParallelizeError, match=r"another model: missing from the checkpoint: .*layers\.0\.attn"
                                                      r".*not in the model: .*blocks\.0\.attn\.qkv\.weight"):
        other.load(str(tmp_path / "gpt"))
    deeper = fxtron.parallelize(make("gpt", layers=3), fxtron.Mesh(1),
                                example_inputs=batch("gpt", 2, 8, seed=0)[0]).program(0)
    with pytest.raises(fxtron.ParallelizeError, match=r"missing from the checkpoint: blocks\.2\."):
        deeper.load(str(tmp_path / "gpt"))


def test_each_param_group_resumes_with_the_settings_its_parameters_were_saved_with(tmp_path):
    """Groups are matched by their parameters, not by position (a pipeline stage's ranks hold
    another list of groups than the others': tests/test_checkpoint.py GROUPED): groups built in
    another order take their own settings, a group none of whose parameters was saved keeps its
    own, and one that joins parameters saved with other settings is refused."""
    def program():
        return fxtron.parallelize(make("gpt"), fxtron.Mesh(1), example_inputs=batch("gpt", 2, 8, seed=0)[0]).program(0)

    prog = program()
    named = list(prog.named_parameters())
    head, tail = [p for _, p in named[:3]], [p for _, p in named[3:]]
    opt = torch.optim.AdamW([{"params": head, "lr": 1e-4, "weight_decay": 0.0}, {"params": tail, "lr": 1e-2}])
    prog.train_step(batch("gpt", 2, 8, seed=0)[0], opt)
    prog.save(str(tmp_path / "ck"), opt)

    prog = program()
    named = list(prog.named_parameters())
    head, tail = [p for _, p in named[:3]], [p for _, p in named[3:]]
    swapped = torch.optim.AdamW([{"params": tail[:-1]}, {"params": head}, {"params": tail[-1:], "lr": 0.5}], lr=7.0)
    prog.load(str(tmp_path / "ck"), swapped)
    assert [(g["lr"], g["weight_decay"]) for g in swapped.param_groups] == [(1e-2, 1e-2), (1e-4, 0.0), (1e-2, 1e-2)]
    fresh = torch.optim.AdamW([{"params": tail}], lr=3.0)
    fresh.add_param_group({"params": []})
    prog.load(str(tmp_path / "ck"), fresh)
    assert [g["lr"] for g in fresh.param_groups] == [1e-2, 3.0]
    merged = torch.optim.AdamW([{"params": head + tail}])
    with pytest.raises(fxtron.ParallelizeError, match=r"param group 0 of AdamW holds .* another lr \(0\.0001 and 0\.01\)"):
        prog.load(str(tmp_path / "ck"), merged)


class _LoggedAdamW(torch.optim.AdamW):
    """A user's subclass: AdamW's state and hyperparameters."""


def test_damage_since_the_save_and_another_optimizer_are_refused_before_anything_loads(tmp_path):
    """A data file cut short or removed (the commit marker lists every file's size), one
    overwritten with the same size, a damaged index: ParallelizeErrors naming the checkpoint
    (DCP raised its CheckpointException, a BaseException, or an UnpicklingError). AdamW's state
    loaded into SGD (it took AdamW's lr, weight decay and moments, and trained another run) or
    into Adagrad (a KeyError at its step, the weights already replaced): refused naming both. A
    checkpoint saved without an optimizer, loaded with one: said. Nothing of a refused load is
    taken; a damaged safetensors file for load_pretrained is named the same way."""
    import warnings

    def program():
        return fxtron.parallelize(make("gpt"), fxtron.Mesh(1), example_inputs=batch("gpt", 2, 8, seed=0)[0]).program(0)
    prog = program()
    opt = torch.optim.AdamW(prog.parameters(), lr=1e-2)
    prog.train_step(batch("gpt", 2, 8, seed=0)[0], opt)
    ck = tmp_path / "ck"
    prog.save(str(ck), opt)
    other = program()
    before = {k: v.clone() for k, v in other.state_dict().items()}

    def untouched():
        return max_abs_diff(before, other.state_dict())[0] == 0.0
    for cls, kw in ((torch.optim.SGD, {"lr": 0.1}), (torch.optim.Adagrad, {})):
        given = cls(other.parameters(), **kw)
        own = repr(given.state_dict())
        with pytest.raises(fxtron.ParallelizeError, match=rf"holds AdamW's state of .*the optimizer given is {cls.__name__}:"):
            other.load(str(ck), given)
        assert untouched() and repr(given.state_dict()) == own
    data = next(f for f in os.listdir(ck) if f.endswith(".distcp"))
    whole = (ck / data).read_bytes()
    (ck / data).write_bytes(whole[: len(whole) // 2])
    with pytest.raises(fxtron.ParallelizeError, match=rf"is damaged: its file {data} holds {len(whole) // 2} bytes "
                                                      rf"where the save wrote {len(whole)}"):
        other.load(str(ck), torch.optim.AdamW(other.parameters()))
    (ck / data).write_bytes(whole[:64] + bytes(len(whole) - 64))
    with pytest.raises(fxtron.ParallelizeError, match="could not be read .*a file of it is damaged"):
        other.load(str(ck), torch.optim.AdamW(other.parameters()))
    assert untouched()
    (ck / data).write_bytes(whole)
    index = (ck / ".metadata").read_bytes()
    (ck / ".metadata").write_bytes(bytes(len(index)))
    with pytest.raises(fxtron.ParallelizeError, match=r"its index \.metadata is damaged or missing"):
        fxtron.load_full_state_dict(str(ck))
    (ck / ".metadata").write_bytes(index)
    other.load(str(ck), torch.optim.AdamW(other.parameters()))        # as saved: it loads
    # the class by name without its module (a script's class is __main__'s when it saves and
    # __mp_main__'s under fxtron.launch); Adam's state into AdamW is refused (its hyperparameters)
    from fxtron.runtime.checkpoint.dcp import _class_name
    assert _class_name(_LoggedAdamW(other.parameters())) == "_LoggedAdamW"
    with pytest.raises(fxtron.ParallelizeError, match="holds AdamW's state of .*the optimizer given is Adam:"):
        other.load(str(ck), torch.optim.Adam(other.parameters()))
    prog.save(str(tmp_path / "weights"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other.load(str(tmp_path / "weights"), torch.optim.AdamW(other.parameters()))
    assert any("holds no optimizer state" in str(w.message) for w in caught), [str(w.message) for w in caught]
    prog.save_pretrained(str(tmp_path / "hf"))
    st = tmp_path / "hf" / "model.safetensors"
    st.write_bytes(st.read_bytes()[:40])
    with pytest.raises(fxtron.ParallelizeError, match=r"model\.safetensors cannot be read as safetensors .*damaged "
                                                      "or cut short"):
        other.load_pretrained(str(tmp_path / "hf"))


def _unread_kept(rank, mesh, root):
    import warnings
    pm = fxtron.parallelize(make("gpt"), mesh, example_inputs=batch("gpt", 2, 8, seed=0)[0])
    prog = pm.program(rank)
    prog.save(os.path.join(root, "gpt"))
    saved = prog.full_state_dict()
    pm = fxtron.parallelize(make("gpt-unused"), mesh, example_inputs=batch("gpt-unused", 2, 8, seed=0)[0])
    prog = pm.program(rank)
    before = prog.full_state_dict()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prog.load(os.path.join(root, "gpt"))
    return {"saved": saved, "before": before, "after": prog.full_state_dict(),
            "said": [str(w.message) for w in caught if issubclass(w.category, fxtron.ParallelizeWarning)]}


def test_a_pipeline_checkpoint_without_the_weights_no_stage_reads_loads_with_a_warning(tmp_path):
    """Pipeline checkpoints written before the first stage held the parameters the forward never
    reads lack them (here: gpt's checkpoint at pp=2 loaded into gpt-unused, gpt with an unread
    head): the load says so and leaves them as they are; every other weight is the saved one."""
    mesh = fxtron.Mesh(2, pp=2)
    out = run_on_ranks(_unread_kept, mesh, mesh, str(tmp_path), timeout_s=300)[0]
    head = ["unused_head.bias", "unused_head.weight"]
    assert any("has no " + ", ".join(head) in s for s in out["said"]), out["said"]
    for name in head:
        assert torch.equal(out["after"][name], out["before"][name])
    for name, value in out["saved"].items():
        assert torch.equal(out["after"][name], value), name
