"""`fxtron train` as a trainer (issue 32).

Without processes: Megatron's learning-rate formulas (warm-up from 0, linear and cosine decay,
the first step at lr 0, skipped steps not advancing), AdamW's groups (no decay on biases and
norms), the checkpoint directory's latest complete iteration, and the options' checks.

Then, slow: a transformers model directory and a Megatron dataset trained by the command at
tp=2 x pp=2 with warm-up then cosine, clipping, evaluation and checkpoints every 2 steps,
equal to the same run in one process (--compare); its step-4 checkpoint resumed at tp=2 x dp=2
gives the same losses for steps 5-10; --export-hf writes what transformers loads, equal to
the last checkpoint; and the same run under `torchrun --max-restarts 1` with a worker killed
mid-run exits 0 with the uninterrupted run's losses. Packed documents at cp=2: balanced document
by document (THD) and equal to one process."""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import fxtron
from fxtron.trainer import checkpoint as checkpoints
from fxtron.trainer.config import TrainConfig
from fxtron.trainer.optim import param_groups
from fxtron.trainer.schedule import LRSchedule
from fxtron.tools.testing import scaled


def test_learning_rate_is_megatrons():
    s = LRSchedule(max_lr=1e-3, min_lr=1e-4, warmup_steps=2, decay_steps=10, style="cosine", global_batch=8)
    lrs = []
    for _ in range(12):
        lrs.append(s.lr)
        s.step()
    # n = k * GBS samples: warm-up lr = max n / W from 0; then min + 0.5 (cos(pi r) + 1) (max - min)
    want = [0.0, 5e-4, 1e-3] + [1e-4 + 0.5 * (math.cos(math.pi * (k - 2) / 8) + 1) * 9e-4 for k in range(3, 11)] + [1e-4]
    assert max(abs(a - b) for a, b in zip(lrs, want)) < 1e-15, (lrs, want)
    lin = LRSchedule(1.0, 0.0, 0, 4, "linear", 2)
    assert [lin.lr_at(2 * k) for k in range(6)] == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    assert LRSchedule(1.0, 0.0, 3, 4, "constant", 1).lr_at(5) == 1.0
    s2 = LRSchedule(1e-3, 1e-4, 2, 10, "cosine", 8)
    s2.load_state_dict(s.state_dict())
    assert s2.lr == s.lr
    with pytest.raises(fxtron.ParallelizeError, match="max_lr 0.001 in the checkpoint, 0.002 now"):
        LRSchedule(2e-3, 1e-4, 2, 10, "cosine", 8).load_state_dict(s.state_dict())
    with pytest.raises(fxtron.ParallelizeError, match="not below the decay"):
        LRSchedule(1e-3, 0.0, 10, 10, "cosine", 8)


def test_override_lr_schedule_continues_with_this_runs_settings():
    """Megatron's --override-opt_param-scheduler: a run extended from 12 to 16 steps (decay 12 in
    the checkpoint, 16 now) is refused naming the flag; with it, this run's settings from the
    checkpoint's position."""
    old = LRSchedule(1e-3, 1e-4, 2, 12, "cosine", 8)
    for _ in range(12):
        old.step()
    with pytest.raises(fxtron.ParallelizeError,
                       match="decay_steps 12 in the checkpoint, 16 now.*--override-lr-schedule"):
        LRSchedule(1e-3, 1e-4, 2, 16, "cosine", 8).load_state_dict(old.state_dict())
    new = LRSchedule(1e-3, 1e-4, 2, 16, "cosine", 8)
    assert new.load_state_dict(old.state_dict(), override=True) == ["decay_steps 12 in the checkpoint, 16 now"]
    assert new.decay_steps == 16 and new.num_samples == 96 and new.lr == new.lr_at(96) > 1e-4
    assert TrainConfig().replace(override_lr_schedule=True).optimizer.override_lr_schedule
    # a constant lr has no decay: a run extended from 3 to 6 steps (--lr-decay-steps defaults to
    # --steps) continues without the flag; a change of the warm-up or the lr itself is still refused
    const = LRSchedule(1e-3, 0.0, 0, 3, "constant", 8)
    for _ in range(3):
        const.step()
    longer = LRSchedule(1e-3, 1e-4, 0, 6, "constant", 8)
    assert longer.load_state_dict(const.state_dict()) == [] and longer.num_samples == 24 and longer.lr == 1e-3
    with pytest.raises(fxtron.ParallelizeError, match="warmup_steps 0 in the checkpoint, 2 now"):
        LRSchedule(1e-3, 0.0, 2, 6, "constant", 8).load_state_dict(const.state_dict())
    with pytest.raises(fxtron.ParallelizeError, match="decay_steps 3 in the checkpoint, 6 now"):
        LRSchedule(1e-3, 0.0, 0, 6, "cosine", 8).load_state_dict(const.state_dict())


@pytest.mark.slow
def test_the_last_step_is_evaluated(tmp_path):
    """--eval-interval 2 over 3 steps: evaluated at 2 and after the last, 3 (Megatron's evaluation at
    the end of training); each evaluation in its step's record."""
    from fxtron.trainer.loop import train_rank
    (tmp_path / "t.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    cfg = TrainConfig().replace(model="gpt-tiny", batch=2, seq=16, text=str(tmp_path / "t.txt"), steps=3,
                                eval_interval=2, eval_iters=1, log_file=str(tmp_path / "run.jsonl"))
    out = train_rank(0, cfg)
    assert sorted(out["evals"]) == [2, 3]
    assert [k for k, r in _losses(tmp_path / "run.jsonl").items() if "eval_loss" in r] == [2, 3]


def test_a_sequence_longer_than_the_model_takes_is_named(tmp_path):
    """--seq past llama-tiny's rotary cache (128 positions, sliced to the sequence): torch.export
    fails on a size mismatch; the trainer says which flag, the limit and what sets it."""
    from fxtron.trainer.loop import train_rank
    (tmp_path / "t.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
    cfg = TrainConfig().replace(model="llama-tiny", batch=2, seq=200, text=str(tmp_path / "t.txt"), steps=1)
    with pytest.raises(fxtron.ParallelizeError, match=r"--seq 200: llama-tiny takes at most 128 tokens \(buffer "
                       r"rope_cos is cut to the sequence from 128 positions\); give --seq 128 or less"):
        train_rank(0, cfg)


def test_load_of_another_models_checkpoint_is_refused_before_any_rank_starts(tmp_path):
    """--load of gpt-tiny's checkpoint into llama-tiny: the preflight compares the checkpoint's
    parameters with the meta model's (it was found by each rank's load, after tracing and
    compiling); the model's own checkpoint, tied embedding and all, passes."""
    from fxtron.trainer import preflight
    from fxtron.trainer.loop import train_rank
    (tmp_path / "t.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    base = TrainConfig().replace(model="gpt-tiny", batch=2, seq=16, text=str(tmp_path / "t.txt"))
    train_rank(0, base.replace(steps=1, save=str(tmp_path / "a")))
    preflight.check(base.replace(steps=2, load=str(tmp_path / "a")))
    with pytest.raises(fxtron.ParallelizeError, match=r"iter_0000001 was saved from another model: missing from the "
                                                      r"checkpoint: .*layers\.0\..*not in the model: .*blocks\.0\."):
        preflight.check(base.replace(model="llama-tiny", steps=2, load=str(tmp_path / "a")))


@pytest.mark.slow
def test_a_run_from_load_continues_from_its_own_saves(tmp_path, capsys):
    """--load A --save B: the first start loads A's latest; run again (a torchrun restart, the
    same command), it continues from B's newer checkpoint, not from A again, and says so."""
    from fxtron.trainer.loop import train_rank
    (tmp_path / "t.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    base = TrainConfig().replace(model="gpt-tiny", batch=2, seq=16, text=str(tmp_path / "t.txt"))
    train_rank(0, base.replace(steps=1, save=str(tmp_path / "a")))
    cfg = base.replace(steps=2, load=str(tmp_path / "a"), save=str(tmp_path / "b"), override_lr_schedule=True)
    capsys.readouterr()
    assert train_rank(0, cfg)["resumed_from"] == 1
    assert "this run continued" not in capsys.readouterr().out
    out = train_rank(0, cfg.replace(steps=3))
    assert out["resumed_from"] == 2 and list(out["losses"]) == [3]
    text = capsys.readouterr().out
    assert f"loaded checkpoint {checkpoints.iter_dir(str(tmp_path / 'b'), 2)} from iteration 2" in text, text
    assert "--save's own, newer than --load's latest: this run continued" in text


def test_a_run_resumed_in_a_streak_of_skipped_steps_stops_where_the_uninterrupted_one_does(tmp_path):
    """--max-skipped counts the skipped steps in a row; the streak is in the checkpoint, so a
    run restarted in the middle of one stops at the uninterrupted run's step (it counted from 0
    again: two steps later, and a job restarted in a loop that saves in the streak never stopped)."""
    from fxtron.trainer.loop import train_rank
    (tmp_path / "t.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    base = TrainConfig().replace(model="gpt-tiny", batch=2, seq=16, text=str(tmp_path / "t.txt"), dtype="fp16",
                                 loss_scale=1e30, max_skipped=3)     # every step overflows
    with pytest.raises(fxtron.ParallelizeError, match="step 3: 3 steps in a row"):
        train_rank(0, base.replace(steps=6))
    assert train_rank(0, base.replace(steps=2, save=str(tmp_path / "ck")))["resumed_from"] is None
    with pytest.raises(fxtron.ParallelizeError, match="step 3: 3 steps in a row"):
        train_rank(0, base.replace(steps=6, save=str(tmp_path / "ck")))


def test_checkpoint_events_are_logged_and_an_extended_run_resumes(tmp_path, capsys):
    """One process: a 2-step run's save is a line and a JSONL field; extended to 3 steps it is
    refused naming --override-lr-schedule, then with it (and other AdamW settings) resumes saying
    what it loaded and which settings it kept -- without torch's 'in a single process' warning. Each record holds this
    rank's bytes by kind."""
    import warnings

    from fxtron.trainer.loop import train_rank
    (tmp_path / "t.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    cfg = TrainConfig().replace(model="gpt-tiny", steps=2, batch=2, seq=16, text=str(tmp_path / "t.txt"),
                                lr_decay_style="linear", save=str(tmp_path / "ckpt"), save_interval=1,
                                log_file=str(tmp_path / "run.jsonl"))
    train_rank(0, cfg)
    first = capsys.readouterr().out
    assert "saved checkpoint iter_0000001 in " in first and "saved checkpoint iter_0000002 in " in first, first
    runs = _losses(tmp_path / "run.jsonl")
    assert runs[2]["checkpoint_saved"].endswith("iter_0000002") and runs[2]["checkpoint_save_seconds"] >= 0
    r = runs[1]
    assert r["param_bytes"] > 0 and r["grad_bytes"] > 0 and r["activation_bytes"] > 0
    assert r["optimizer_bytes"] >= 2 * r["param_bytes"] and r["peak_bytes"] == r["memory_bytes"] > 0
    assert "memory: params " in first and "optimizer " in first and "process peak" in first
    with pytest.raises(fxtron.ParallelizeError, match="decay_steps 2 in the checkpoint, 3 now.*--override-lr-schedule"):
        train_rank(0, cfg.replace(steps=3))
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = train_rank(0, cfg.replace(steps=3, override_lr_schedule=True, weight_decay=0.0, adam_beta2=0.999))
    assert not [w for w in caught if "single process" in str(w.message)], [str(w.message) for w in caught]
    assert out["resumed_from"] == 2 and list(out["losses"]) == [3]
    text = capsys.readouterr().out
    print(text)
    assert f"loaded checkpoint {checkpoints.iter_dir(str(tmp_path / 'ckpt'), 2)} from iteration 2 on Mesh(" in text
    assert ("--override-lr-schedule, this run's settings over the checkpoint's: decay_steps 2 in the checkpoint, "
            "3 now") in text
    resumed = _losses(tmp_path / "run.jsonl")[3]
    assert resumed["resumed_from"] == 2 and resumed["checkpoint_loaded"].endswith("iter_0000002")
    assert resumed["lr_schedule_overridden"] == ["decay_steps 2 in the checkpoint, 3 now"]
    # AdamW's settings are this run's, not the checkpoint's (torch's load_state_dict would take its),
    # and each change is said: the decayed group's weight decay, both groups' betas
    assert resumed["optimizer_settings_changed"] == [
        "betas (0.9, 0.95) -> (0.9, 0.999) (group 0)", "weight_decay 0.1 -> 0.0 (group 0)",
        "betas (0.9, 0.95) -> (0.9, 0.999) (group 1)"], resumed["optimizer_settings_changed"]
    assert "optimizer settings: this run's over the checkpoint's: betas (0.9, 0.95) -> (0.9, 0.999)" in text
    # resumed at --steps: nothing trained, and said
    out = train_rank(0, cfg.replace(steps=3, override_lr_schedule=True, weight_decay=0.0, adam_beta2=0.999))
    assert not out["losses"]
    assert "nothing to train: the checkpoint loaded is at iteration 3, --steps is 3" in capsys.readouterr().out
    # this run's decay; logged after step 3 (as Megatron's), the schedule's at 3 x 2 samples
    assert resumed["lr"] == LRSchedule(3e-3, 0.0, 0, 3, "linear", 2).lr_at(6)


def test_weight_decay_leaves_biases_and_norms_out():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Embedding(5, 4))
    decay, plain = param_groups(model.named_parameters())
    assert [p.shape for p in decay["params"]] == [(4, 4), (5, 4)]
    assert len(plain["params"]) == 3 and plain["weight_decay"] == 0.0
    # zero=3 holds flat pieces: the model's own dims decide, not the piece's
    pieces = [(n, torch.zeros(8)) for n, _ in model.named_parameters()]
    dims = {n: p.dim() for n, p in model.named_parameters()}
    decay, plain = param_groups(pieces, dims)
    assert len(decay["params"]) == 2 and len(plain["params"]) == 3


def test_latest_checkpoint_is_the_newest_complete(tmp_path):
    root = str(tmp_path)
    assert checkpoints.latest(root) is None
    for it, done in [(2, True), (4, True), (6, False)]:
        os.makedirs(checkpoints.iter_dir(root, it))
        if done:
            open(os.path.join(checkpoints.iter_dir(root, it), ".fxtron-complete"), "w").close()
    assert checkpoints.latest(root) == 4                # 6 was never completed
    checkpoints.write_tracker(root, 2)
    assert checkpoints.latest(root) == 2                # the tracker names a complete one
    checkpoints.write_tracker(root, 6)
    assert checkpoints.latest(root) == 4
    assert checkpoints.prune(root, 1) == [2] and checkpoints.complete(root) == [4]


@pytest.mark.parametrize("left", [".replaced", ".saving"])
def test_a_save_killed_while_putting_a_checkpoint_in_place_loses_nothing(tmp_path, left):
    """A save over an existing iteration moves the old one aside (.replaced), then the new,
    complete one (.saving) into place; killed between the two renames, the iteration is at one
    of them: the resume loads it (the new one where complete), where it fell back to an older
    iteration, and pruning removes it whole."""
    from fxtron.trainer.loop import train_rank
    (tmp_path / "t.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    base = TrainConfig().replace(model="gpt-tiny", batch=2, seq=16, text=str(tmp_path / "t.txt"),
                                 save=str(tmp_path / "ck"), save_interval=1)
    train_rank(0, base.replace(steps=2))
    two = checkpoints.iter_dir(str(tmp_path / "ck"), 2)
    os.rename(two, two + left)
    assert checkpoints.complete(str(tmp_path / "ck")) == [1, 2] and checkpoints.latest(str(tmp_path / "ck")) == 2
    out = train_rank(0, base.replace(steps=3))
    assert out["resumed_from"] == 2 and list(out["losses"]) == [3]
    assert checkpoints.prune(str(tmp_path / "ck"), 1) == [1, 2] and not os.path.exists(two + left)


def test_keep_last_after_a_rollback_keeps_the_run_s_own_saves(tmp_path):
    """A run rolled back (its tracker set to 4 of 2, 4, 6, 8) saves 5 with --keep-last 2: 4 and 5
    are kept, 2 removed; 6 and 8 (the abandoned run's) are left, and the tracker's 5 is what a
    restart resumes -- pruning by number alone removed 5 itself and sent it back to 8."""
    root = str(tmp_path)

    def save(it):
        os.makedirs(checkpoints.iter_dir(root, it))
        open(os.path.join(checkpoints.iter_dir(root, it), ".fxtron-complete"), "w").close()
    for it in (2, 4, 6, 8):
        save(it)
    checkpoints.write_tracker(root, 4)
    assert checkpoints.latest(root) == 4
    save(5)
    checkpoints.write_tracker(root, 5)
    assert checkpoints.prune(root, 2, saved=5) == [2]
    assert checkpoints.complete(root) == [4, 5, 6, 8] and checkpoints.latest(root) == 5


def test_options_are_checked():
    with pytest.raises(fxtron.ParallelizeError, match="save_interval needs training.save"):
        TrainConfig().replace(save_interval=2)
    with pytest.raises(fxtron.ParallelizeError, match="min_lr = 0.1 is above optimizer.lr"):
        TrainConfig().replace(lr=1e-3, min_lr=0.1)
    from fxtron.trainer.models import key_values, resolve
    with pytest.raises(fxtron.ParallelizeError, match="unknown model 'nope'"):
        resolve("nope")
    small = resolve("hf:llama", overrides=key_values(["num_hidden_layers=2", "hidden_size=64", "vocab_size=300"]))
    assert small.transformers and small.vocab_size == 300 and len(small.model.model.layers) == 2
    assert all(p.is_meta for p in small.model.parameters())
    with pytest.raises(fxtron.ParallelizeError, match="no field 'num_hiden_layers' \\(did you mean 'num_hidden_layers'"):
        resolve("hf:llama", overrides=key_values(["num_hiden_layers=2"]))
    with pytest.raises(fxtron.ParallelizeError, match="sets fields of an hf:<architecture>'s config; 'gpt-tiny'"):
        resolve("gpt-tiny", overrides={"n_layer": 2})
    # packed documents: the end-of-document id is needed; the model must take what is passed
    with pytest.raises(fxtron.ParallelizeError, match="--reset-position-ids, --eod-mask-loss find the documents.*--eod-id"):
        TrainConfig().replace(reset_position_ids=True, eod_mask_loss=True)
    packed = TrainConfig().replace(eod_id=0, reset_position_ids=True, reset_attention_mask=True).data
    assert resolve("llama-tiny", data=packed).data is packed and resolve("gpt-tiny", data=packed)
    with pytest.raises(fxtron.ParallelizeError, match="moe-tiny: packed documents pass position_ids, document_ids="):
        resolve("moe-tiny", data=packed)
    with pytest.raises(fxtron.ParallelizeError, match="--reset-position-ids and --reset-attention-mask go together"):
        resolve("hf:llama", data=TrainConfig().replace(eod_id=0, reset_attention_mask=True).data)


class _Scaled(torch.nn.Module):
    """loss = scale x sum((x W)^2): a scale of inf makes the step's gradients non-finite."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(4, 4, bias=False)

    def forward(self, x, scale):
        return (self.w(x) ** 2).mean() * scale.mean()


def test_a_non_finite_step_leaves_the_weights_and_is_said():
    torch.manual_seed(0)
    x, one = torch.randn(2, 3, 4), torch.ones(2, 3)
    prog = fxtron.parallelize(_Scaled(), fxtron.Mesh(1), example_inputs=(x, one)).program(0)
    prog.skip_nonfinite = True
    opt = torch.optim.AdamW(prog.parameters(), lr=0.1)
    prog.train_step((x, one), opt)
    assert not prog.last_step_skipped and math.isfinite(prog.last_grad_norm)
    before = {k: v.clone() for k, v in prog.state_dict().items()}
    prog.train_step((x, one * float("inf")), opt)
    assert prog.last_step_skipped and not math.isfinite(prog.last_grad_norm)
    assert all(torch.equal(before[k], v) for k, v in prog.state_dict().items())
    prog.train_step((x, one), opt)
    assert not prog.last_step_skipped and not torch.equal(before["w.weight"], prog.state_dict()["w.weight"])


def test_a_skipped_steps_non_finite_figures_are_strict_json(tmp_path):
    """--log-file's records are strict JSON: a skipped step's NaN loss and infinite grad norm are
    null there (json would write NaN and Infinity, which jq and JavaScript refuse), its
    step_skipped says why; the figures of the steps around it are kept as they are."""
    import json

    from fxtron.trainer.metrics import Metrics

    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    cfg = TrainConfig().replace(model="gpt-tiny", steps=3, log_interval=10, log_file=str(tmp_path / "run.jsonl"))
    m = Metrics(cfg, writer=True, world=1, flops=1.0, resumed_from=None)
    for step, (loss, norm) in enumerate([(2.5, 1.25), (float("nan"), float("inf")), (2.25, 0.5)], 1):
        m.step({"step": step, "loss": loss, "lr": 1e-3, "grad_norm": norm, "step_time": 0.1, "consumed_samples": step,
                "skipped": int(step > 1), "step_skipped": step == 2})
    m.close()
    records = [json.loads(line, parse_constant=refuse) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert [(r["loss"], r["grad_norm"], r["step_skipped"]) for r in records] == \
        [(2.5, 1.25, False), (None, None, True), (2.25, 0.5, False)]


# ----------------------------------------------------------------------------- slow: the command
ARGS = ["--data", "{dir}/tokens", "--split", "90,10,0", "--batch", "8", "--seq", "16", "--steps", "10", "--lr", "1e-3",
        "--min-lr", "1e-4", "--lr-warmup-steps", "2", "--lr-decay-style", "cosine", "--clip-grad", "1.0",
        "--eval-interval", "2", "--eval-iters", "1", "--microbatches", "2", "--save-interval", "2"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A transformers Llama directory and a Megatron dataset of 400 documents of its tokens."""
    import transformers

    from fxtron.data.indexed import IndexedDatasetWriter
    d = tmp_path_factory.mktemp("trainer")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(d / "llama"))
    rng = np.random.RandomState(0)
    w = IndexedDatasetWriter(str(d / "tokens"), np.uint16)
    for _ in range(400):
        w.add_document(rng.randint(0, 127, size=rng.randint(5, 80)))
    w.finalize()
    return d


def _train(d, *extra, torchrun: bool = False, timeout: int = 600):
    args = ["--model", str(d / "llama")] + [a.format(dir=d) for a in ARGS] + list(extra)
    cmd = [sys.executable, "-m", "fxtron", "train"] + args
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--max-restarts", "1",
               "-m", "fxtron", "train"] + args
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _losses(path) -> dict[int, dict]:
    out = {}
    for line in open(path):
        r = json.loads(line)
        out[r["step"]] = r                      # a resumed run's records come later and win
    return out


@pytest.fixture(scope="module")
def first_run(workdir):
    """The run at tp=2 x pp=2, with --compare and --export-hf."""
    p = _train(workdir, "--world-size", "4", "--tp", "2", "--pp", "2", "--save", str(workdir / "ckpt"),
               "--log-file", str(workdir / "run.jsonl"), "--export-hf", str(workdir / "hf"), "--compare",
               "--tensorboard-dir", str(workdir / "tb"))
    out, _ = p.communicate(timeout=scaled(900))
    assert p.returncode == 0, out[-4000:]
    return out


@pytest.mark.slow
def test_a_model_directory_and_a_megatron_dataset_train_like_one_process(workdir, first_run):
    line = next(x for x in first_run.splitlines() if "loss difference" in x)
    print(line)
    assert float(line.split("largest ")[1].split()[0]) < 1e-5, line
    runs = _losses(workdir / "run.jsonl")
    assert sorted(runs) == list(range(1, 11))
    assert [k for k, r in runs.items() if "eval_loss" in r] == [2, 4, 6, 8, 10]
    # warm-up from 0 over 2 steps, then cosine; logged as Megatron's, the schedule's after the step
    assert abs(runs[1]["lr"] - 5e-4) < 1e-12 and abs(runs[2]["lr"] - 1e-3) < 1e-12 and runs[3]["lr"] < 1e-3
    assert all(r["grad_norm"] > 0 and r["tokens_per_s"] > 0 for r in runs.values())
    assert checkpoints.complete(str(workdir / "ckpt")) == [2, 4, 6, 8, 10]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(workdir / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 11))
    assert [e.step for e in events.Scalars("valid/loss")] == [2, 4, 6, 8, 10]
    assert open(workdir / "ckpt" / checkpoints.TRACKER).read().strip() == "10"
    # --export-hf: what transformers loads, equal to the last checkpoint
    import transformers
    back = transformers.AutoModelForCausalLM.from_pretrained(str(workdir / "hf")).state_dict()
    last = fxtron.load_full_state_dict(checkpoints.iter_dir(str(workdir / "ckpt"), 10))
    assert max((back[k] - v).abs().max().item() for k, v in last.items()) == 0.0


@pytest.mark.slow
def test_step4_checkpoint_resumes_on_another_mesh(workdir, first_run):
    resumed = workdir / "resume"
    shutil.rmtree(resumed, ignore_errors=True)
    os.makedirs(resumed)
    shutil.copytree(checkpoints.iter_dir(str(workdir / "ckpt"), 4), checkpoints.iter_dir(str(resumed), 4))
    checkpoints.write_tracker(str(resumed), 4)
    p = _train(workdir, "--world-size", "4", "--tp", "2", "--save", str(resumed),
               "--log-file", str(workdir / "resume.jsonl"))
    out, _ = p.communicate(timeout=scaled(900))
    assert p.returncode == 0, out[-4000:]
    assert "resumed from step 4" in out
    a, b = _losses(workdir / "run.jsonl"), _losses(workdir / "resume.jsonl")
    assert sorted(b) == list(range(5, 11)) and b[5]["resumed_from"] == 4
    worst = max(abs(a[s]["loss"] - b[s]["loss"]) for s in b)
    worst_eval = max(abs(a[s]["eval_loss"] - b[s]["eval_loss"]) for s in b if "eval_loss" in b[s])
    print(f"tp2xpp2 -> tp2xdp2 resumed at step 4: steps 5-10 loss difference {worst:.2e}, eval {worst_eval:.2e}")
    assert worst < 5e-6 and worst_eval < 5e-6


@pytest.mark.slow
def test_torchrun_restart_after_a_killed_worker_gives_the_same_losses(workdir, first_run):
    root = workdir / "elastic"
    shutil.rmtree(root, ignore_errors=True)
    p = _train(workdir, "--tp", "2", "--pp", "2", "--save", str(root), "--log-file", str(workdir / "elastic.jsonl"),
               torchrun=True)
    deadline = time.monotonic() + scaled(600)
    while not os.path.isdir(checkpoints.iter_dir(str(root), 2)):
        assert p.poll() is None and time.monotonic() < deadline, "the run ended before its step-2 checkpoint"
        time.sleep(0.05)
    workers = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 4, workers
    os.kill(int(workers[2]), signal.SIGKILL)
    out, _ = p.communicate(timeout=scaled(900))
    assert p.returncode == 0, out[-4000:]
    assert "resumed from step" in out
    a, b = _losses(workdir / "run.jsonl"), _losses(workdir / "elastic.jsonl")
    assert sorted(b) == list(range(1, 11))
    assert max(abs(a[s]["loss"] - b[s]["loss"]) for s in b) == 0.0


def test_a_resume_whose_steps_reshuffle_the_data_says_so(tmp_path, capsys):
    """One process, Megatron data: a run extended past what its checkpoint's shuffle was built for
    (another epoch) continues -- Megatron's index changes alike -- with a warning and a record
    field saying that the samples after the checkpoint come in another order; extended within the
    same epochs it says nothing."""
    import warnings

    from fxtron.data.indexed import IndexedDatasetWriter
    from fxtron.trainer.loop import train_rank
    rng = np.random.RandomState(0)
    w = IndexedDatasetWriter(str(tmp_path / "docs"), np.uint16)
    for _ in range(40):                        # ~1000 tokens: 60 samples of 17 an epoch
        w.add_document(rng.randint(1, 255, size=rng.randint(10, 40)))
    w.finalize()
    cfg = TrainConfig().replace(model="gpt-tiny", steps=2, batch=2, seq=16, data=[str(tmp_path / "docs")],
                                split="100,0,0", save=str(tmp_path / "ckpt"), log_file=str(tmp_path / "run.jsonl"),
                                override_lr_schedule=True)
    train_rank(0, cfg)
    for steps, changed in ((4, False), (60, True)):     # 8 samples: one epoch as saved; 120: three
        capsys.readouterr()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train_rank(0, cfg.replace(steps=steps, save=str(tmp_path / f"ckpt{steps}"), load=str(tmp_path / "ckpt")))
        said = [str(x.message) for x in caught if "another order" in str(x.message)]
        record = _losses(tmp_path / "run.jsonl")[3]
        assert bool(said) == changed and record.get("sample_order_changed", False) == changed, (steps, said, record)
    assert "asks 120 train samples" in said[0] and "the samples after its 4 come in another order" in said[0], said


def test_the_log_line_averages_its_interval_as_megatron(tmp_path, capsys):
    """--log-interval 2: each printed line's lm loss and time per iteration are the means over
    the two steps it closes (Megatron's training_log), the JSON records each step's own."""
    import re

    from fxtron.trainer.loop import train_rank
    cfg = TrainConfig().replace(model="gpt-tiny", steps=4, batch=2, seq=16, max_bytes=100_000, log_interval=2,
                                log_file=str(tmp_path / "run.jsonl"))
    capsys.readouterr()
    train_rank(0, cfg)
    lines = [x for x in capsys.readouterr().out.splitlines() if "| lm loss:" in x]
    records = _losses(tmp_path / "run.jsonl")
    assert len(lines) == 2, lines
    for line, last in zip(lines, (2, 4)):
        loss = float(re.search(r"lm loss: (\S+)", line).group(1))
        ms = float(re.search(r"elapsed time per iteration \(ms\): (\S+)", line).group(1))
        steps = [records[last - 1], records[last]]
        assert abs(loss - sum(r["loss"] for r in steps) / 2) < 1e-6 * abs(loss), (line, steps)
        assert abs(ms - 1e3 * sum(r["step_time"] for r in steps) / 2) < 0.06, (line, steps)


def test_compare_refuses_another_training_and_says_when_it_differs(capsys):
    """--compare holds a run to the same training in one process: refused, before anything runs,
    where the reference would train otherwise (a resumed run: it starts from the initial weights;
    dropout: it draws other masks), and a difference above round-off is said to be one."""
    from fxtron.trainer import compare
    base = TrainConfig().replace(model="gpt-tiny", steps=3, batch=2, seq=16, max_bytes=100_000, compare=True)
    with pytest.raises(fxtron.ParallelizeError, match="--load ckpt .the reference trains from the initial weights"):
        compare.check(base.replace(load="ckpt"))
    tiny_gpt2 = ("n_layer=1", "n_embd=32", "n_head=2", "vocab_size=256", "n_positions=64")
    with pytest.raises(fxtron.ParallelizeError, match=r"dropout \(transformer.drop \(p=0.1\)"):
        compare.check(base.replace(model="hf:gpt2", model_config=tiny_gpt2))
    compare.check(base.replace(model="hf:gpt2", model_config=tiny_gpt2 + ("resid_pdrop=0.0", "embd_pdrop=0.0",
                                                                           "attn_pdrop=0.0", "summary_first_dropout=0.0")))
    ref = compare.reference(base)
    same = compare.compare(base, {s: ref[s - 1] + 1e-6 for s in (1, 2, 3)})
    assert same["agrees"] and "float32 round-off" in capsys.readouterr().out
    off = compare.compare(base, {s: ref[s - 1] + 0.05 * (s == 2) for s in (1, 2, 3)})
    assert not off["agrees"] and "DIFFERS" in capsys.readouterr().out and off["max_loss_diff"] > 0.04


def _eod_documents(path, n: int = 40, seed: int = 0) -> str:
    """A Megatron dataset of `n` documents of 3-30 tokens, each ended by the EOD id 0: packed
    samples whose counted labels (--eod-mask-loss) differ from sample to sample."""
    from fxtron.data.indexed import IndexedDatasetWriter
    rng = np.random.RandomState(seed)
    w = IndexedDatasetWriter(str(path), np.uint16)
    for _ in range(n):
        w.add_document(np.concatenate([rng.randint(1, 255, size=rng.randint(3, 30)), [0]]))
    w.finalize()
    return str(path)


def test_losses_over_several_batches_are_token_means_of_them_all(tmp_path):
    """With --eod-mask-loss the samples count different numbers of labels. --compare's one-process
    run in the run's microbatches is the token mean over the global batch (its microbatches'
    means weighted by their counted labels) -- it was their plain mean, 2e-3 off the parallel run,
    which is right, and called it DIFFERS --; and the evaluation over --eval-iters batches is the
    token mean over all of them (Megatron's evaluate), not the mean of the batches' means."""
    from fxtron.trainer import compare
    from fxtron.trainer.data import TrainData
    from fxtron.trainer.loop import train_rank
    from fxtron.trainer.models import resolve
    cfg = TrainConfig().replace(model="gpt-tiny", steps=3, batch=4, seq=32, data=[_eod_documents(tmp_path / "docs")],
                                split="70,30,0", eod_id=0, eod_mask_loss=True, lr=1e-2, seed=3)
    whole = compare.reference(cfg)                         # one forward on each global batch
    pieces = compare.reference(cfg.replace(microbatches=2))
    print(f"--compare's reference, 2 microbatches against one: {max(abs(a - b) for a, b in zip(whole, pieces)):.2e}")
    assert max(abs(a - b) for a, b in zip(whole, pieces)) < 1e-6, (whole, pieces)

    run = cfg.replace(steps=1, eval_interval=1, eval_iters=2, save=str(tmp_path / "ckpt"))
    got = train_rank(0, run)["evals"][1]
    tm = resolve("gpt-tiny", run.training.seed, (), run.data)
    model = compare._whole(tm, run.training.seed)
    model.load_state_dict(fxtron.load_full_state_dict(str(tmp_path / "ckpt" / "iter_0000001")), strict=False)
    data = TrainData(run, tm.vocab_size)
    args, _ = tm.inputs(torch.cat([data.valid_batch(0), data.valid_batch(run.data.batch)]))
    counts = [tm.counted(*tm.inputs(data.valid_batch(k * run.data.batch))) for k in range(2)]
    with torch.no_grad():
        want = float(model.eval()(*args))
    print(f"evaluation over 2 batches (counted labels {counts}): {abs(got - want):.2e} from one process's token mean")
    assert counts[0] != counts[1] and abs(got - want) < 1e-6, (got, want)


MIXTRAL = ("output_router_logits=true", "router_aux_loss_coef=0.1", "num_hidden_layers=1", "hidden_size=32",
           "intermediate_size=64", "num_attention_heads=2", "num_key_value_heads=1", "vocab_size=256",
           "num_local_experts=4", "num_experts_per_tok=2")


@pytest.mark.parametrize("model, config", [("moe-tiny", ()), ("hf:mixtral", MIXTRAL)], ids=["moe-tiny", "hf-mixtral"])
def test_compare_averages_a_load_balancing_loss_over_microbatches_that_count_different_labels(tmp_path, model, config):
    """An MoE, 2 microbatches of samples counting different labels (--eod-mask-loss): the run's
    loss is the token mean over the global batch plus the load-balancing loss of each microbatch
    averaged over them (passes/statistics.py). --compare's reference weighted the whole of each
    microbatch's loss by its labels, the load-balancing term too (here moe-tiny 1.7e-3 off after
    4 steps, transformers' Mixtral 2.1e-4; at dp=2 with moe_aux_loss='local' 6e-4 and DIFFERS); it
    weights the cross entropy alone (fxtron's model called again for its logits, transformers'
    output's own)."""
    from fxtron.trainer import compare
    from fxtron.trainer.loop import train_rank
    cfg = TrainConfig().replace(model=model, model_config=config, steps=4, batch=4, seq=32,
                                data=[_eod_documents(tmp_path / "docs")], split="100,0,0", eod_id=0,
                                eod_mask_loss=True, microbatches=2, lr=3e-2, seed=3)
    got = train_rank(0, cfg)["losses"]
    ref = compare.reference(cfg)
    diff = max(abs(got[s] - ref[s - 1]) for s in got)
    print(f"{model}, 2 microbatches, --eod-mask-loss: the run against --compare's reference {diff:.2e}")
    assert diff < 1e-6, (got, ref)


def test_a_resume_with_another_seed_is_said_and_a_stale_staging_file_does_not_block_the_save(tmp_path):
    """Resuming with another --seed trains on other samples (the text's are drawn by seed and
    index): said, as a warning and in the JSONL, where it was silent. And a plain file where a
    save stages its directory (iter_N.saving, left by something else than a killed save, which
    leaves a directory) is cleared as a directory is, where every save to it failed."""
    from fxtron.trainer.loop import train_rank
    (tmp_path / "t.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    ckpt = tmp_path / "ckpt"
    cfg = TrainConfig().replace(model="gpt-tiny", steps=2, batch=2, seq=16, text=str(tmp_path / "t.txt"),
                                save=str(ckpt), log_file=str(tmp_path / "run.jsonl"), lr_decay_steps=4)
    train_rank(0, cfg)
    (ckpt / "iter_0000004.saving").write_text("not a save's")
    with pytest.warns(UserWarning, match="train data: --seed 1, where the checkpoint's run had --seed 0: the train "
                                         "samples from here on are drawn for seed 1"):
        train_rank(0, cfg.replace(steps=4, seed=1, load=str(ckpt)))
    assert (ckpt / "iter_0000004").is_dir() and not (ckpt / "iter_0000004.saving").exists()
    records = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert [r.get("seed_changed") for r in records if r.get("step") == 3] == [True], records


def test_an_extended_run_evaluates_as_the_run_that_never_stopped(tmp_path):
    """One process, Megatron data with a valid split: the evaluation after a run's last step comes
    after its checkpoint (Megatron's order), so a run extended from it evaluates the same valid
    batches as the run that never stopped (it read the next ones); a checkpoint whose evaluations
    read more of the valid split (another --eval-interval) gets a split long enough to go on."""
    from fxtron.data.indexed import IndexedDatasetWriter
    from fxtron.trainer.loop import train_rank
    rng = np.random.RandomState(0)
    w = IndexedDatasetWriter(str(tmp_path / "docs"), np.uint16)
    for _ in range(40):                        # ~1000 tokens: 60 samples of 17, 12 of them the valid split's
        w.add_document(rng.randint(1, 255, size=rng.randint(10, 40)))
    w.finalize()
    cfg = TrainConfig().replace(model="gpt-tiny", steps=8, batch=2, seq=16, data=[str(tmp_path / "docs")],
                                split="80,20,0", eval_interval=3, eval_iters=1, lr_decay_steps=8)
    whole = train_rank(0, cfg)["evals"]
    train_rank(0, cfg.replace(steps=4, save=str(tmp_path / "a")))
    extended = train_rank(0, cfg.replace(load=str(tmp_path / "a"), save=str(tmp_path / "b")))["evals"]
    assert set(whole) == {3, 6, 8} and set(extended) == {6, 8}, (whole, extended)
    assert all(extended[s] == whole[s] for s in extended), (whole, extended)
    # 4 evaluations of 4 samples: 16 read of the 12 the uninterrupted run's split holds
    train_rank(0, cfg.replace(steps=4, eval_interval=1, eval_iters=2, save=str(tmp_path / "c")))
    got = train_rank(0, cfg.replace(eval_iters=2, load=str(tmp_path / "c"), save=str(tmp_path / "d")))["evals"]
    assert set(got) == {6, 8}, got


@pytest.mark.slow
def test_packed_documents_at_cp_are_balanced_document_by_document(tmp_path):
    """The trainer's packed samples (Megatron's --reset-position-ids --reset-attention-mask) of a
    shipped model at cp=2 go through THD (cp_documents: each row reordered by its documents
    before the split) and train like one process."""
    from fxtron.data.indexed import IndexedDatasetWriter
    rng = np.random.RandomState(0)
    w = IndexedDatasetWriter(str(tmp_path / "docs"), np.uint16)
    for _ in range(300):                       # documents of 4-40 tokens, each ended by the EOD id 0
        w.add_document(np.concatenate([rng.randint(1, 255, size=rng.randint(3, 40)), [0]]))
    w.finalize()
    out = subprocess.run([sys.executable, "-m", "fxtron", "train", "--model", "llama-tiny", "--data",
                          str(tmp_path / "docs"), "--split", "100,0,0", "--eod-id", "0", "--reset-position-ids",
                          "--reset-attention-mask", "--eod-mask-loss", "--world-size", "2", "--cp", "2", "--batch", "4",
                          "--seq", "64", "--steps", "4", "--compare"],
                         capture_output=True, text=True, timeout=scaled(600), cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "balanced document by document (Megatron's THD): each row reordered by document_ids" in out.stdout
    line = next(x for x in out.stdout.splitlines() if "loss difference" in x)
    assert float(line.split("largest ")[1].split()[0]) < 1e-5, line


@pytest.mark.slow
def test_memory_by_kind_at_zero3_is_a_quarter_of_zero0s_at_dp4(tmp_path):
    """gpt-tiny at dp=4: the JSONL's parameter and optimizer bytes at zero=3 are a quarter of
    zero=0's (within the flat pieces' padding); the step's peak activations are seen at both."""
    (tmp_path / "t.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
    procs = {z: subprocess.Popen([sys.executable, "-m", "fxtron", "train", "--model", "gpt-tiny", "--world-size", "4",
                                  "--zero", str(z), "--steps", "1", "--batch", "8", "--seq", "32", "--text",
                                  str(tmp_path / "t.txt"), "--log-file", str(tmp_path / f"zero{z}.jsonl")],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
             for z in (0, 3)}
    for z, p in procs.items():
        out, _ = p.communicate(timeout=scaled(900))
        assert p.returncode == 0, out[-4000:]
        print(next(x for x in out.splitlines() if "memory: " in x))
    r0, r3 = (_losses(tmp_path / f"zero{z}.jsonl")[1] for z in (0, 3))
    for k in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "peak_bytes"):
        print(f"{k}: zero=0 {r0[k]}, zero=3 {r3[k]} ({r3[k] / r0[k]:.4f})")
    assert r0["loss"] == pytest.approx(r3["loss"], abs=1e-5)
    for k in ("param_bytes", "optimizer_bytes", "grad_bytes"):
        assert r0[k] / 4 <= r3[k] <= r0[k] / 4 * 1.02, (k, r0[k], r3[k])     # a quarter, padded to 4 pieces
    assert r0["activation_bytes"] > 0 and r3["activation_bytes"] > 0


@pytest.mark.slow     # four processes a run, 20-40 s each; the fast tier checks the cause in process (below)
@pytest.mark.parametrize("torchrun,zero", [(False, 3), (True, 3), (True, 1)],
                         ids=["launch", "torchrun", "torchrun-zero1-in-flight"])
def test_zero3_runs_whose_work_is_done_exit_0(tmp_path, torchrun, zero):
    """A zero=3 dp=4 run that checkpoints ends with exit code 0: before, the program's units,
    buffers and process groups outlived the run (held through its parameters' hooks and
    records), their gloo threads alive into interpreter exit, and a torchrun job was seen to
    abort there, 1 run in 5, after its last checkpoint ('terminate called without an active
    exception', torchrun: FAILED). zero=1 with overlap_param_gather and no checkpoint ends its
    last step with the updated parameters' all-gathers in flight, which the trainer waits for
    before the groups go. (One run each, for the suite's time; what is in flight and the
    threads are checked directly in test_a_finished_run_leaves_nothing_in_flight_nor_a_thread.)"""
    args = ["--model", "gpt-tiny", "--zero", str(zero), "--steps", "4", "--save", str(tmp_path / "run"),
            "--save-interval", "2"]
    if zero == 1:             # no checkpoint: one after the last step would wait for the all-gathers itself
        args = ["--model", "gpt-tiny", "--zero", "1", "--overlap-param-gather", "--steps", "4"]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--standalone",
               "-m", "fxtron", "train"] + args
    else:
        cmd = [sys.executable, "-m", "fxtron", "train", "--world-size", "4"] + args
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=scaled(900))
    assert p.returncode == 0, f"exit code {p.returncode}\n{p.stdout[-4000:]}"
    assert "terminate called" not in p.stdout, p.stdout[-4000:]
    assert checkpoints.latest(str(tmp_path / "run")) == (4 if zero == 3 else None)


# the runs of test_a_finished_run_leaves_nothing_in_flight_nor_a_thread at world 2: (name, options,
# whether it checkpoints). zero=1 with overlap_param_gather saves nothing: a checkpoint after the
# last step would wait for that step's all-gathers itself
_SETTLED = [("dp2-zero1-overlap", dict(zero=1, overlap_param_gather=True), False), ("dp2-zero3", dict(zero=3), True),
            ("tp2-sp", dict(tp=2, sequence_parallel=True), True), ("pp2", dict(pp=2), True)]


def _settled(rank, root):
    """Each run of _SETTLED trained and checkpointed by the trainer on this rank: what is still in
    flight after `train()` returned (zero=1's all-gathers of the updated parameters, started
    for a next step that never comes; zero=3's gathers), whether anything holds the program
    once the Trainer is dropped, and, once fxtron's groups are destroyed, the process's threads."""
    import gc
    import weakref

    from fxtron.runtime import groups as G
    from fxtron.trainer.loop import Trainer
    out = {}
    for name, options, saves in _SETTLED:
        if saves:
            options = dict(options, save=os.path.join(root, name), save_interval=2)
        cfg = TrainConfig().replace(model="gpt-tiny", world_size=2, steps=2, batch=4, seq=32, max_bytes=200_000,
                                    **options)
        mesh = cfg.mesh.mesh()
        groups = G.groups_for(mesh) or G.init_distributed(mesh)
        t = Trainer(rank, cfg, groups)
        t.train()
        prog = t.prog
        in_flight = len(prog.zero._works) if prog.zero is not None else 0
        if prog.fsdp is not None:
            in_flight += sum(u.pending is not None for u in prog.fsdp.units.values())
        held = weakref.ref(prog)
        del t, prog
        gc.collect()
        out[name] = {"in_flight": in_flight, "held": held() is not None,
                     "saved": checkpoints.latest(os.path.join(root, name)) if saves else None}
    G.destroy()
    out["threads"] = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads the process's threads from /proc")
def test_a_finished_run_leaves_nothing_in_flight_nor_a_thread(tmp_path):
    """What a rank can still run when its interpreter exits is what aborts a job whose work is
    done: a gloo worker that completes a collective (or drops its last tensors) then needs the
    GIL of an interpreter being finalized ('terminate called without an active exception',
    SIGABRT). So after the trainer's run, on every mesh and zero level: no collective in flight
    (zero=1 with overlap_param_gather ends its last step with the updated parameters' all-gathers
    started), nothing holding the program (its groups), and once the groups are destroyed, no
    gloo thread (pt_gloo_runloop, gloo_tcp_loop) left in the process."""
    from fxtron.tools.testing import run_on_ranks
    for rank, out in enumerate(run_on_ranks(_settled, 2, str(tmp_path), timeout_s=300)):
        for name, _, saves in _SETTLED:
            want = {"in_flight": 0, "held": False, "saved": 2 if saves else None}
            assert out[name] == want, f"rank {rank}, {name}: {out[name]}"
        threads = out["threads"]
        assert not [t for t in threads if "gloo" in t], f"rank {rank}: threads left after destroy: {threads}"
