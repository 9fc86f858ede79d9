"""The command line: `python -m fxtron mesh` and `python -m fxtron train`."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

import fxtron
from fxtron.cli import main
from fxtron.trainer.config import TrainConfig
from fxtron.trainer.loop import run
from fxtron.tools.testing import scaled


def test_mesh_table_is_megatrons_example(capsys):
    assert main(["mesh", "--world-size", "16", "--tp", "2", "--pp", "4"]) == 0
    out = capsys.readouterr().out
    assert "tp=2" in out and "pp=4" in out and "dp=2" in out
    row5 = next(line for line in out.splitlines() if line.split()[:1] == ["5"])
    assert "[4,5]" in row5 and "[5,7]" in row5 and "[1,5,9,13]" in row5


def test_mesh_error_says_what_to_change():
    proc = subprocess.run([sys.executable, "-m", "fxtron", "mesh", "--world-size", "10", "--tp", "4"],
                          capture_output=True, text=True, timeout=scaled(120))
    assert proc.returncode == 2
    assert "ParallelizeError" in proc.stderr and "10" in proc.stderr


@pytest.mark.slow     # two processes
def test_train_matches_one_process(capsys, tmp_path):
    cfg = TrainConfig().replace(model="gpt-tiny", world_size=2, steps=4, batch=4, seq=32, max_bytes=200_000,
                                trace=str(tmp_path), compare=True)
    out = run(cfg)
    assert sorted(out["losses"]) == [1, 2, 3, 4] and out["tokens_per_s"] > 0
    # early steps, before AdamW compounds round-off: equal to float32 precision
    assert out["max_loss_diff"] < 1e-4, out
    assert "loss difference" in capsys.readouterr().out
    # --trace: the last step of both ranks as a Chrome trace (passes as spans, memory as
    # counters: activations saved in forward, given back by backward) and a picture
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    for rank in (0, 1):
        spans = [e["name"] for e in events if e["pid"] == rank and e["ph"] == "X"]
        assert spans == ["F 0", "B 0"], spans
        memory = [e["args"]["activations"] for e in events if e["pid"] == rank and e["ph"] == "C"]
        assert memory[0] == 0 and memory[1] > 100 * memory[2], memory      # start, after F, after B
    assert (tmp_path / "schedule.png").stat().st_size > 0


@pytest.mark.slow     # two processes
def test_train_a_mixture_of_experts_over_ep_shows_the_load(capsys):
    cfg = TrainConfig().replace(model="moe-tiny", world_size=2, ep=2, steps=3, batch=4, seq=32, max_bytes=200_000,
                                compare=True)
    out = run(cfg)
    # the load-balancing loss over the whole batch, as the one-process reference computes it
    assert out["max_loss_diff"] < 1e-4, out
    local = run(cfg.replace(moe_aux_loss="local"))
    # each dp rank's over its own tokens (Megatron's default): the reference trains the ranks' pieces
    assert local["max_loss_diff"] < 1e-4 and local["losses"] != out["losses"], (local, out)
    assert len(out["imbalance"]) == 3 and all(x >= 1.0 for x in out["imbalance"])
    assert "busiest expert over the mean" in capsys.readouterr().out


# ----------------------------------------------------------------------------- a new user's mistakes
@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    """A transformers Qwen2 directory (its config: 8 heads, 4 key/value heads, 128 tokens), two
    Megatron datasets: one of its tokens, one of a larger vocabulary's, and a checkpoint of a
    2-step gpt-tiny run (--batch 4 --seq 32)."""
    import numpy as np
    import transformers

    from fxtron.data.indexed import IndexedDatasetWriter
    d = tmp_path_factory.mktemp("user")
    cfg = transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)
    cfg.architectures = ["Qwen2ForCausalLM"]
    cfg.save_pretrained(str(d / "qwen"))
    rng = np.random.RandomState(0)
    for name, top in (("tokens", 128), ("wide", 1000)):
        w = IndexedDatasetWriter(str(d / name), np.uint16)
        for _ in range(50):
            w.add_document(rng.randint(0, top, size=40))
        w.finalize()
    from fxtron.trainer.loop import train_rank
    train_rank(0, TrainConfig().replace(model="gpt-tiny", steps=2, batch=4, seq=32, max_bytes=100_000,
                                        save=str(d / "ckpt")))
    return d


@pytest.fixture
def no_launch(monkeypatch):
    """A refused run starts no process: the launcher fails the test if called."""
    import fxtron
    import fxtron.runtime.launch

    def launch(*args, **kwargs):
        raise AssertionError("a run that preflight refuses must not start processes")
    monkeypatch.setattr(fxtron.runtime.launch, "launch", launch)
    monkeypatch.setattr(fxtron, "launch", launch)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


REFUSALS = {
    "missing model dir": (["--model", "{d}/nope", "--data", "{d}/tokens"], "model directory {d}/nope does not exist"),
    "missing data prefix": (["--model", "{d}/qwen", "--data", "{d}/nonexistent"],
                            "dataset {d}/nonexistent: {d}/nonexistent.idx does not exist"),
    "vocabulary too large": (["--model", "{d}/qwen", "--data", "{d}/wide"],
                             "dataset {d}/wide holds token id 999, but the model {d}/qwen has a vocabulary of 128"),
    "heads vs tp": (["--model", "{d}/qwen", "--data", "{d}/tokens", "--world-size", "3", "--tp", "3"],
                    "--tp 3 does not divide the model {d}/qwen's head counts (num_attention_heads=8, "
                    "num_key_value_heads=4): attention cannot be cut between heads; choose a tp that divides them "
                    "(2, 4)"),
    # what a worker would refuse at its first step, known from the configuration
    "batch vs dp": (["--model", "gpt-tiny", "--batch", "3", "--world-size", "2"],
                    "--batch 3 (the global batch) does not divide over dp=2 x microbatches=1; use a batch that is a "
                    "multiple of 2"),
    "a batch of one": (["--model", "gpt-tiny", "--batch", "1", "--world-size", "1"],
                       "--batch 1: the trainer traces the model on its first batch, keeping that dim symbolic"),
    "batch vs microbatches": (["--model", "gpt-tiny", "--microbatches", "3", "--world-size", "1"],
                              "--batch 8 (the global batch) does not divide over dp=1 x microbatches=3"),
    "seq vs cp": (["--model", "gpt-tiny", "--cp", "2", "--seq", "62", "--world-size", "2"],
                  "--seq 62: context parallel cuts it into 2 x cp = 4 equal chunks, so it must be a multiple of 4; "
                  "the nearest are 60, 64"),
    "seq vs sp": (["--model", "gpt-tiny", "--tp", "2", "--sequence-parallel", "--seq", "63", "--world-size", "2"],
                  "--seq 63: sequence parallel cuts its tokens into tp = 2 parts, so it must be a multiple of 2"),
    "warm-up vs decay": (["--model", "gpt-tiny", "--lr-warmup-steps", "5", "--lr-decay-style", "cosine", "--steps",
                          "2"], "lr_warmup_steps = 5 is not below the decay's 2 steps"),
    # what the passes would refuse on every rank once they traced the model, known from the model
    "stages vs layers": (["--model", "gpt-tiny", "--pp", "4", "--world-size", "4"],
                         "4 pipeline stages (pp=4) but the model gpt-tiny has 2 layers (blocks.0 .. blocks.1)"),
    "chunks vs layers": (["--model", "gpt-tiny", "--pp", "2", "--world-size", "2", "--schedule", "interleaved",
                          "--virtual-stages", "2", "--microbatches", "2"],
                         "4 pipeline stages (pp=2 x 2 chunks per rank) but the model gpt-tiny has 2 layers"),
    "ep on a dense model": (["--model", "gpt-tiny", "--ep", "2", "--world-size", "2"],
                            "--ep 2: the model gpt-tiny has no mixture-of-experts layer"),
    "ep vs experts": (["--model", "moe-tiny", "--ep", "3", "--world-size", "3"],
                      "--ep 3 does not divide the 4 experts of the model moe-tiny (n_experts=4); use an ep that divides "
                      "them (2, 4)"),
    # what resuming a checkpoint would refuse, known from its state
    "resume with another batch": (["--model", "gpt-tiny", "--load", "{d}/ckpt", "--steps", "4", "--seq", "32"],
                                  "{d}/ckpt/iter_0000002 was trained with --batch 4 --seq 32; resume with the same"),
    "resume with another schedule": (["--model", "gpt-tiny", "--load", "{d}/ckpt", "--steps", "4", "--batch", "4",
                                      "--seq", "32", "--lr", "1e-3"],
                                     "the checkpoint's learning-rate schedule differs from this run's: max_lr"),
    "load without checkpoint": (["--model", "gpt-tiny", "--load", "{d}/noload"],
                                "--load {d}/noload: no complete checkpoint there"),
    "text too short": (["--model", "gpt-tiny", "--max-bytes", "100"], "training text has only 100 bytes"),
    "split without train": (["--model", "{d}/qwen", "--data", "{d}/tokens", "--split", "0,1,0"],
                            "--split 0,1,0 leaves no train split"),
    "eod id past the vocabulary": (["--model", "{d}/qwen", "--data", "{d}/tokens", "--eod-id", "500",
                                    "--reset-position-ids", "--reset-attention-mask"], "--eod-id 500: the model's vocabulary has ids 0..127"),
    "beta of 1.5": (["--model", "gpt-tiny", "--adam-beta1", "1.5"],
                    "optimizer.adam_beta1 = 1.5: AdamW's betas are in [0, 1)"),
    # where the run writes, which it would find out at its first save or log line, after training
    "save where nothing can be written": (["--model", "gpt-tiny", "--save", "/proc/fxtron-save"],
                                          "--save /proc/fxtron-save: the run cannot write there"),
    "flight recorder where nothing can be written": (["--model", "gpt-tiny", "--flight-dir", "/proc/fxtron-flight"],
                                                    "--flight-dir /proc/fxtron-flight: the run cannot write there"),
    "log file that is a directory": (["--model", "gpt-tiny", "--log-file", "{d}"],
                                     "--log-file {d}: the run cannot write there ({d} is a directory); give a file"),
    # flags that would do nothing
    "keep-last without save": (["--model", "gpt-tiny", "--keep-last", "2"],
                               "training.keep_last prunes the checkpoints of training.save: it needs --save DIR"),
    "eval-iters without evaluation": (["--model", "gpt-tiny", "--eval-iters", "5"],
                                      "training.eval_iters = 5 sets how many batches an evaluation takes, but this "
                                      "run does not evaluate"),
    "split of the text": (["--model", "gpt-tiny", "--split", "1,0,0"],
                          "data.split = '1,0,0' splits Megatron datasets (--data)"),
    "text and data": (["--model", "{d}/qwen", "--data", "{d}/tokens", "--text", "{d}/nothere.txt"],
                      "data.path ({d}/tokens) and data.text ({d}/nothere.txt) are two sources of training data"),
    "device without CUDA": (["--model", "gpt-tiny", "--device", "cuda"],
                            "--device cuda: this machine has no CUDA device torch can use"),
    "CUDA graphs on the CPU": (["--model", "gpt-tiny", "--cuda-graphs"], "--cuda-graphs: the programs run on the CPU"),
}
#: refusals of a machine without a GPU
WITHOUT_GPU = {"device without CUDA", "CUDA graphs on the CPU"}


@pytest.mark.parametrize("case", [pytest.param(k, marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU "
                                                                            "is here")) if k in WITHOUT_GPU else k
                                  for k in REFUSALS])
def test_a_mistake_is_refused_before_any_process_starts(case, user_dir, no_launch, capsys):
    import time
    args, message = REFUSALS[case]
    start = time.monotonic()
    assert main(["train"] + [a.format(d=user_dir) for a in args]) == 2
    elapsed = time.monotonic() - start
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"fxtron train: ParallelizeError: {message.format(d=user_dir)}"), \
        captured.err
    assert "Traceback" not in captured.err + captured.out
    assert elapsed < 60, elapsed         # no spawning, no compiling (a few seconds on a loaded machine)


def test_under_torchrun_rank_0_alone_says_why(user_dir, no_launch, monkeypatch, capsys):
    import fxtron.cli
    monkeypatch.setattr(fxtron.cli, "REFUSED_GRACE_S", 0.0)
    args = ["train", "--model", str(user_dir / "qwen"), "--data", str(user_dir / "nonexistent")]
    for rank, said in ((1, False), (0, True)):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        assert main(args) == 2
        err = capsys.readouterr().err
        assert (err.count("nonexistent.idx does not exist") == 1) is said and ("Traceback" not in err), err
        if not said:
            assert err == ""


def test_a_misspelt_flag_suggests_the_nearest_under_its_command(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--micro-batches", "2"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: fxtron train ")
    assert err.rstrip().splitlines()[-1] == \
        "fxtron train: error: unrecognized argument: --micro-batches (did you mean --microbatches?)"
    with pytest.raises(SystemExit):
        main(["inspect", "gpt-tiny", "--no-grpah"])
    err = capsys.readouterr().err
    assert err.startswith("usage: fxtron inspect ") and "--no-grpah (did you mean --no-graph?)" in err
    # a Megatron user's flag: fxtron's name for it, not the nearest spelling (--train-iters is not --eval-iters)
    for megatron, ours in (("--train-iters", "--steps"), ("--global-batch-size", "--batch"), ("--seq-length", "--seq"),
                           ("--micro-batch-size", "--microbatches, a count per data-parallel rank")):
        with pytest.raises(SystemExit):
            main(["train", megatron, "2"])
        assert f"{megatron} (Megatron's name; fxtron's: {ours}" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--gpu-memory", "80XB"], "argument --gpu-memory: '80XB' is no size"),
    (["--global-batch", "0"], "argument --global-batch: 0 must be above 0"),
    (["--seq", "0"], "argument --seq: 0 must be above 0")])
def test_inspect_refuses_a_value_out_of_range_in_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["inspect", "gpt-tiny", "--what-if", "--world-size", "2"] + args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.rstrip().splitlines()[-1].startswith(f"fxtron inspect: error: {message}"), err
    assert "Traceback" not in err


def test_inspect_evaluates_at_a_length_the_model_takes_and_what_if_takes_no_mesh_flags(capsys):
    """gpt-tiny's position table has 128 rows: inspect's default --seq (2048) reported bytes for
    sequences it cannot take, and --what-if ranked meshes at --pp 2 / --zero 3 as without them."""
    assert main(["inspect", "gpt-tiny", "--no-graph", "--world-size", "1", "--json"]) == 0
    out = capsys.readouterr()
    assert "figures at 128 tokens" in out.err and json.loads(out.out)
    assert main(["inspect", "gpt-tiny", "--no-graph", "--world-size", "1", "--seq", "1000"]) == 2
    assert "--seq 1000: the model takes at most 128 tokens (the position table wpe.weight has 128 rows)" in \
        capsys.readouterr().err
    assert main(["inspect", "gpt-tiny", "--what-if", "--world-size", "2", "--pp", "2", "--zero", "3"]) == 2
    assert "--pp, --zero would be ignored: drop them" in capsys.readouterr().err
    # a drawing into a directory that does not exist: before compiling (matplotlib's own error after it)
    assert main(["inspect", "gpt-tiny", "--svg", "/nonexistent-dir/x.svg"]) == 2
    assert "--svg /nonexistent-dir/x.svg: the directory /nonexistent-dir does not exist" in capsys.readouterr().err


def test_model_config_values_take_the_fields_type(capsys):
    import fxtron
    from fxtron.trainer.models import key_values, resolve
    small = ["num_hidden_layers=1", "hidden_size=64", "intermediate_size=96", "num_attention_heads=4",
             "num_key_value_heads=2", "vocab_size=128"]
    tm = resolve("hf:qwen2", overrides=key_values(small + ["tie_word_embeddings=False", "rms_norm_eps=1"]))
    c = tm.model.config
    assert c.tie_word_embeddings is False and c.num_hidden_layers == 1
    assert isinstance(c.rms_norm_eps, float) and c.rms_norm_eps == 1.0
    assert resolve("hf:qwen2", overrides=key_values(small + ["tie_word_embeddings=true"])).model.config.tie_word_embeddings is True
    with pytest.raises(fxtron.ParallelizeError, match="tie_word_embeddings=maybe: the field is a bool"):
        resolve("hf:qwen2", overrides=key_values(["tie_word_embeddings=maybe"]))
    with pytest.raises(fxtron.ParallelizeError, match="num_hidden_layers=two: the field is an int"):
        resolve("hf:qwen2", overrides=key_values(["num_hidden_layers=two"]))
    # inspect: the raw string reached transformers' strict config before
    assert main(["inspect", "hf:qwen2", "--model-config", *small, "tie_word_embeddings=False", "--world-size", "1",
                 "--no-graph", "--seq", "16"]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_model_config_fields_derived_from_the_ones_given_follow_them():
    """The config is built from the fields given, as transformers builds it: Llama's head_dim
    follows hidden_size / num_attention_heads, num_key_value_heads follows num_attention_heads
    (set on the default config, they kept 128 and 32: a silently larger model, or a trace that
    failed on the key-value heads), and a combination the config refuses is a ParallelizeError."""
    import fxtron
    from fxtron.trainer.models import hf_config
    c = hf_config("llama", {"num_hidden_layers": "8", "hidden_size": "2048"})
    assert (c.head_dim, c.num_key_value_heads) == (64, 32)
    c = hf_config("llama", {"hidden_size": 256, "num_attention_heads": 8})
    assert (c.head_dim, c.num_key_value_heads) == (32, 8)
    assert hf_config("llama", {"hidden_size": 256, "num_attention_heads": 8, "head_dim": 64}).head_dim == 64
    with pytest.raises(fxtron.ParallelizeError, match=r"--model-config hidden_size=250, num_attention_heads=8: "
                                                      r"LlamaConfig refuses it: .*not a multiple"):
        hf_config("llama", {"hidden_size": 250, "num_attention_heads": 8})
    with pytest.raises(fxtron.ParallelizeError, match=r"knows no architecture 'lama' \(did you mean 'llama'"):
        hf_config("lama")


def test_the_planner_shows_progress_on_a_terminal_only(capsys):
    from fxtron.tools import planner
    dims = planner.ModelDims(layers=4, hidden=64, heads=8, vocab=128, params=300_000)
    hw = planner.Hardware()
    quiet = planner.candidates(dims, hw, world=8, global_batch=16, seq=64)       # stderr is no terminal here
    assert capsys.readouterr().err == ""
    shown = planner.candidates(dims, hw, world=8, global_batch=16, seq=64, progress=True)
    assert "planning" in capsys.readouterr().err and shown == quiet


@pytest.mark.slow     # one process, traced and compiled
def test_start_up_says_what_it_does(capfd):
    assert main(["train", "--model", "gpt-tiny", "--world-size", "1", "--steps", "2", "--batch", "4", "--seq", "32",
                 "--max-bytes", "200000"]) == 0
    out = capfd.readouterr().out
    import re
    lines = [line for line in out.splitlines() if line.startswith("start-up:")]
    assert len(lines) == 4, out
    assert lines[0] == "start-up: tracing gpt-tiny (torch.export) ..."
    assert re.fullmatch(r"start-up: traced in \d+\.\d s; compiling rank 0's program for .* \.\.\.", lines[1]), lines
    assert re.fullmatch(r"start-up: compiled in \d+\.\d s; running the first step \.\.\.", lines[2]), lines
    assert re.fullmatch(r"start-up: first step in \d+\.\d s; ready \d+\.\d s after tracing began", lines[3]), lines
    assert out.index(lines[3]) < out.index("iteration        1/")      # before the first step's log line


@pytest.mark.slow     # torchrun and two processes
def test_torchrun_refusal_is_said_once(tmp_path):
    import os
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "fxtron", "train", "--data", str(tmp_path / "nonexistent")],
                          capture_output=True, text=True, timeout=scaled(300), env=env)
    out = proc.stdout + proc.stderr
    assert out.count("nonexistent.idx does not exist") == 1, out
    assert "fxtron train: ParallelizeError: dataset" in out
    # the ranks exit 2; torchrun itself reports a failed child (its own exit code, its own block)
    assert proc.returncode != 0 and "exitcode  : 2" in out, out
    package = str(pathlib.Path(fxtron.__file__).parent) + os.sep      # this checkout's fxtron/, not a path that
    assert not [line for line in out.splitlines() if 'File "' in line and package in line], out   # merely holds "fxtron"


def test_a_flag_is_never_taken_for_the_longer_one_it_begins(capsys):
    """argparse took --dp for --dp-shard (zero=3's HSDP groups) and failed with a zero=3 message;
    abbreviations are off, as in Megatron's parser, and --dp says how dp is set."""
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--model", "gpt-tiny", "--dp", "2", "--steps", "1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized argument: --dp (dp is what the world leaves: --world-size / (tp x pp x cp)" in err, err
