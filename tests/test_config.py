"""The typed configuration (fxtron/config/; the trainer's sections in fxtron/trainer/config.py):
every option of parallelize, both command lines and the trainer in one tree. Checked here without
processes: a misspelt value of any option is a ParallelizeError naming the field on a one-process
mesh, before anything is traced; the old keywords are shorthand for the fields; TOML and the
generated flags round-trip."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from typing import Literal, get_args, get_origin

import pytest
import torch

import fxtron
from fxtron import config as C
from fxtron.cli import build_parser, main
from fxtron.config import Config
from fxtron.config.fields import _flag, _optional
from fxtron.trainer import config as T
from fxtron.trainer.config import TrainConfig
from fxtron.tools.testing import scaled


class _Untraceable(torch.nn.Module):
    """A model whose trace would fail: an option error must come before tracing."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        raise AssertionError("traced: the options were not checked first")


def _bad_values(tp) -> list:
    """Values the field of type `tp` does not take: a misspelling of each choice, a wrong type."""
    inner, nullable = _optional(tp)
    if get_origin(inner) is Literal:
        choices = get_args(inner)
        if isinstance(choices[0], str):
            return [choices[0][:-1] + "x", choices[0].upper() + "!"]
        return [max(choices) + 1, "1"]
    if inner is bool:
        return ["yes", 1]
    if inner in (int, float):
        return ["2", -1] if inner is int else ["0.5", float("nan")]
    if inner is str:
        return [3]
    if get_origin(inner) is tuple:
        return ["blocks.1"]
    return [["not", "a", "dict"]]


def _every_option():
    hints_of = {name: typing.get_type_hints(cls) for name, cls in C.SECTIONS.items()}
    for short, (section, f) in Config.fields_by_shorthand().items():
        for bad in _bad_values(hints_of[section][f.name]):
            if isinstance(bad, int) and bad == -1 and f.metadata.get("minimum") is None and not f.metadata.get("positive"):
                continue
            yield pytest.param(short, section, f.name, bad, id=f"{short}={bad!r}")


@pytest.mark.parametrize("short,section,name,bad", list(_every_option()))
def test_a_bad_value_of_any_option_names_the_field(short, section, name, bad):
    with pytest.raises(fxtron.ParallelizeError) as err:
        fxtron.parallelize(_Untraceable(), fxtron.Mesh(1), example_inputs=(torch.zeros(2, 4),), **{short: bad})
    msg = str(err.value)
    assert f"{short} must be" in msg and f"{section}.{name}" in msg and repr(bad)[:6] in msg, msg


def test_misspelt_choices_suggest_the_closest():
    with pytest.raises(fxtron.ParallelizeError, match=r"plan_mode must be one of 'override', 'replace', not 'overide' "
                                                      r"\(did you mean 'override'\?\) \(tensor.plan_mode"):
        fxtron.parallelize(_Untraceable(), fxtron.Mesh(1), plan_mode="overide")
    with pytest.raises(fxtron.ParallelizeError, match=r"unknown option schedul='1f1b' \(did you mean 'schedule'\?\)"):
        fxtron.parallelize(_Untraceable(), fxtron.Mesh(1), schedul="1f1b")


def test_the_mesh_is_checked_before_tracing():
    for kw, msg in [(dict(sequence_parallel=True), "needs tensor parallel"),
                    (dict(split_points=["lin"]), "the mesh has pp=1"),
                    (dict(moe_capacity_factor=1.25), "ep=1"),
                    # options that would do nothing on this mesh, as their neighbours above
                    (dict(cp_comm_type="a2a"), r"cp_comm_type='a2a' chooses how context parallel .* the mesh has cp=1"),
                    (dict(cuda_graph_warmup=5), "cuda_graph_warmup=5 sets the eager steps .* cuda_graphs is off"),
                    (dict(cp_documents="document_ids"), "cp_documents='document_ids' balances .* the mesh has cp=1"),
                    (dict(schedule="interleaved", virtual_stages=2, microbatches=3), "use 2 or 4")]:
        mesh = fxtron.Mesh(2, pp=2) if "virtual_stages" in kw else fxtron.Mesh(1)
        with pytest.raises(fxtron.ParallelizeError, match=msg):
            fxtron.parallelize(_Untraceable(), mesh, **kw)


def test_shorthand_and_config_are_one_thing():
    cfg = Config(pipeline=C.PipelineConfig(microbatches=4, schedule="interleaved", virtual_stages=2),
                 precision=C.PrecisionConfig(dtype="bf16"))
    same = Config().replace(microbatches=4, schedule="interleaved", virtual_stages=2, dtype=torch.bfloat16)
    assert cfg == same and same.precision.torch_dtype == torch.bfloat16
    # shorthand over a config: the keyword wins, the rest stays
    over = cfg.replace(microbatches=8)
    assert over.pipeline.microbatches == 8 and over.pipeline.schedule == "interleaved"
    # every shorthand names one field; the options read back by shorthand
    assert set(Config().options()) == set(Config.fields_by_shorthand())
    assert Config().replace(recompute="full").recompute.resolved() == ("full", "uniform", 1)
    # what was not given stays unset, so the granularity can change later
    assert Config().replace(recompute="full").replace(recompute="selective").recompute.resolved() == ("selective", None, None)
    with pytest.raises(fxtron.ParallelizeError, match="zb-h1.*gradient_accumulation_fusion"):
        Config().replace(schedule="zb-h1", gradient_accumulation_fusion=False)


def test_parallelize_takes_a_config(tmp_path):
    from fxtron.models import build, example_inputs
    cfg = Config().replace(microbatches=2, schedule="gpipe", strict=True)
    pm = fxtron.parallelize(build("gpt-tiny"), fxtron.Mesh(2, pp=2), example_inputs=example_inputs("gpt-tiny", 2, 16),
                            config=cfg, schedule="1f1b")
    assert pm.config.pipeline == C.PipelineConfig(microbatches=2, schedule="1f1b")
    assert pm.config.debug.strict and pm.config.inputs.device in ("cpu", "cuda")
    assert "schedule 1f1b: pp=2, m=2" in pm.summary()
    with pytest.raises(fxtron.ParallelizeError, match="config must be a fxtron.config.Config"):
        fxtron.parallelize(build("gpt-tiny"), fxtron.Mesh(1), config={"schedule": "1f1b"})


def test_environment_sets_the_debug_defaults(monkeypatch):
    monkeypatch.setenv("FXTRON_VERIFY", "0")
    monkeypatch.setenv("FXTRON_CHECK_COLLECTIVES", "yes")
    monkeypatch.setenv("FXTRON_SHM", "off")
    monkeypatch.setenv("FXTRON_FLIGHT_DIR", "/tmp/flight")
    d = C.DebugConfig()
    assert (d.verify, d.check_collectives, d.shm, d.p2p_tags, d.flight_dir) == (False, True, False, True, "/tmp/flight")
    assert C.DebugConfig(shm=True).shm          # a field given wins over the variable
    from fxtron.ops import ledger
    from fxtron.passes import verify
    from fxtron.runtime import groups
    from fxtron.runtime.pp import p2p
    assert ledger.check_default() and not groups.shm_default() and not verify.enabled() and p2p.match_by_tag_default()
    monkeypatch.delenv("FXTRON_VERIFY")
    assert C.DebugConfig().verify and verify.enabled()    # the verifier is on unless turned off


def test_toml_round_trip_and_errors(tmp_path):
    cfg = TrainConfig().replace(tp=2, world_size=4, scatter_gather=True, dtype="bf16", recompute="full",
                                recompute_layers=2, split_points=["blocks.1"], seq_dim=None, pp=2, plan={"lm_head": "replicate"},
                                steps=7, lr=1e-3, data="corpus.txt", moe_capacity_factor=1.25, zero=1)
    path = tmp_path / "run.toml"
    path.write_text(cfg.to_toml())
    assert TrainConfig.from_toml(str(path)) == cfg
    assert 'seq_dim = "none"' in path.read_text()      # a None whose default is not None
    for text, msg in [("[pipelin]\nschedule = '1f1b'\n", r"section \[pipelin\] \(did you mean 'pipeline'\?\)"),
                      ("[pipeline]\nschedul = '1f1b'\n", r"\[pipeline\] has no field 'schedul' \(did you mean 'schedule'"),
                      ("[pipeline]\nschedule = '1fb1'\n", r"schedule must be one of .* \(did you mean '1f1b'\?\)"),
                      ("[data_parallel]\nzero = \"1\"\n", r"zero must be one of 0, 1, 2, 3, not '1' \(give 1, without quotes\)"),
                      ("steps = 3\n", r"sets steps = 3 outside any section; it is a field of \[training\]"),
                      ("[pipeline\n", "not valid TOML")]:
        path.write_text(text)
        with pytest.raises(fxtron.ParallelizeError, match=msg):
            TrainConfig.from_toml(str(path))
    with pytest.raises(fxtron.ParallelizeError, match="does not exist"):
        TrainConfig.from_toml(str(tmp_path / "missing.toml"))
    with pytest.raises(fxtron.ParallelizeError, match="TOML cannot write"):
        Config().replace(plan={"lm_head": fxtron.passes.tp_plan.Colwise(gather_output=True)}).to_toml()


def test_print_config_round_trip_and_a_flag_overrides_the_file(tmp_path, capsys):
    assert main(["train", "--print-config", "--tp", "2", "--world-size", "4", "--sequence-parallel", "--dtype", "bf16",
                 "--recompute", "selective", "--schedule", "gpipe", "--zero", "1", "--steps", "3"]) == 0
    first = capsys.readouterr().out
    path = tmp_path / "run.toml"
    path.write_text(first)
    assert main(["train", "--config", str(path), "--print-config"]) == 0
    assert capsys.readouterr().out == first
    cfg = TrainConfig.from_toml(str(path))
    assert (cfg.mesh.tp, cfg.tensor.sequence_parallel, cfg.precision.dtype, cfg.data_parallel.zero) == (2, True, "bf16", 1)
    # a flag over the file changes that field and nothing else
    assert main(["train", "--config", str(path), "--print-config", "--schedule", "1f1b", "--no-sequence-parallel"]) == 0
    over = TrainConfig.from_toml(str(_write(tmp_path / "over.toml", capsys.readouterr().out)))
    assert over == cfg.replace(schedule="1f1b", sequence_parallel=False)


def _write(path, text):
    path.write_text(text)
    return path


def _flags(parser, command: str) -> set[str]:
    sub = next(a for a in parser._actions if isinstance(a, __import__("argparse")._SubParsersAction))
    return {s for a in sub.choices[command]._actions for s in a.option_strings}


def test_train_and_inspect_take_the_same_shared_options():
    parser = build_parser()
    train, inspect = _flags(parser, "train"), _flags(parser, "inspect")
    shared = {"--tp", "--pp", "--cp", "--ep", "--world-size", "--sequence-parallel", "--zero", "--recompute",
              "--recompute-method", "--recompute-layers", "--schedule", "--virtual-stages", "--microbatches",
              "--cp-comm-type", "--dtype", "--config", "--strict", "--clip-grad", "--moe-aux-loss"}
    assert shared <= train and shared <= inspect, (shared - train, shared - inspect)
    # every parallelize option with a flag is on both command lines
    for short, (_, f) in Config.fields_by_shorthand().items():
        if f.metadata.get("cli", True):
            assert _flag(f) in train and _flag(f) in inspect, short


def test_inspect_reads_the_options(capsys):
    assert main(["inspect", "gpt-tiny", "--tp", "2", "--pp", "2", "--world-size", "4", "--schedule", "gpipe",
                 "--microbatches", "4", "--dtype", "bf16", "--json"]) == 0
    import json
    out = json.loads(capsys.readouterr().out)
    assert out["pipeline"]["schedule"] == "gpipe" and out["pipeline"]["microbatches"] == 4


@pytest.mark.slow     # three interpreters
def test_a_bad_flag_exits_2_naming_it():
    proc = subprocess.run([sys.executable, "-m", "fxtron", "train", "--schedule", "1fb1"], capture_output=True,
                          text=True, timeout=scaled(120))
    assert proc.returncode == 2 and "--schedule" in proc.stderr and "1f1b" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "fxtron", "train", "--tp", "2", "--sequence-parallel", "--tp", "1",
                           "--print-config"], capture_output=True, text=True, timeout=scaled(120))
    assert proc.returncode == 0          # printing checks the values, not the mesh
    proc = subprocess.run([sys.executable, "-m", "fxtron", "train", "--sequence-parallel", "--steps", "1"],
                          capture_output=True, text=True, timeout=scaled(120))
    assert proc.returncode == 2 and "sequence_parallel=True needs tensor parallel" in proc.stderr


def test_every_field_is_documented_and_typed():
    for cls in [*C.SECTIONS.values(), T.MeshConfig, T.ModelConfig, T.DataConfig, T.OptimizerConfig, T.TrainingConfig]:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help"
            assert hints[f.name] is not typing.Any
    TrainConfig.fields_by_shorthand()     # the shorthands are unique over the trainer's tree too


def test_inspect_gives_an_hf_architecture_its_configuration(capsys):
    import json
    assert main(["inspect", "hf:llama", "--model-config", "num_hidden_layers=2", "hidden_size=256",
                 "intermediate_size=512", "num_attention_heads=4", "num_key_value_heads=4", "vocab_size=1000",
                 "--tp", "2", "--seq", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["memory"]["parameters"] < 4 * 2 * 1000 * 256 + 4 * 2 * 256 * 1536    # the small model, not 7B
    # the spelling: --config key=value,... (a TOML file path still reads the configuration)
    assert main(["inspect", "hf:llama", "--config", "num_hidden_layers=2,hidden_size=256,intermediate_size=512,"
                 "num_attention_heads=4,num_key_value_heads=4,vocab_size=1000", "--tp", "2", "--seq", "64",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["memory"] == out["memory"]
    assert main(["inspect", "hf:llama", "--model-config", "num_hiden_layers=2"]) == 2
    assert "did you mean 'num_hidden_layers'" in capsys.readouterr().err
    assert main(["inspect", "gpt-tiny", "--model-config", "n_layer=2"]) == 2
    assert "for hf:<architecture> models" in capsys.readouterr().err


def test_a_file_sets_what_it_names_and_no_more(tmp_path, capsys):
    # recomputation: full's defaults are not written into the tree, so a flag may change the granularity
    assert main(["train", "--recompute", "full", "--print-config"]) == 0
    path = _write(tmp_path / "full.toml", capsys.readouterr().out)
    assert main(["train", "--config", str(path), "--recompute", "selective", "--print-config"]) == 0
    assert TrainConfig.from_toml(str(_write(tmp_path / "sel.toml", capsys.readouterr().out))).recompute.resolved() == \
        ("selective", None, None)
    # inspect's 2 x pp microbatches unless the flags or the file set them
    import json
    pp = _write(tmp_path / "pp.toml", "[mesh]\npp = 2\nworld_size = 2\n")
    assert main(["inspect", "gpt-tiny", "--config", str(pp), "--json", "--seq", "32"]) == 0
    assert json.loads(capsys.readouterr().out)["pipeline"]["microbatches"] == 4
    three = _write(tmp_path / "m3.toml", "[mesh]\npp = 2\nworld_size = 2\n[pipeline]\nmicrobatches = 3\n")
    assert main(["inspect", "gpt-tiny", "--config", str(three), "--json", "--seq", "32"]) == 0
    assert json.loads(capsys.readouterr().out)["pipeline"]["microbatches"] == 3
    # a bad value in a file names the file; a string field keeps the word "none"
    bad = _write(tmp_path / "bad.toml", "[data_parallel]\nbucket_size = 0\n")
    with pytest.raises(fxtron.ParallelizeError, match=r"bad.toml: bucket_size must be a positive int"):
        TrainConfig.from_toml(str(bad))
    assert TrainConfig.from_dict({"training": {"trace": "none"}}).training.trace == "none"
    # each command's world size: 8 for mesh and inspect, 4 for train, where the model-parallel sizes divide it
    assert main(["train", "--print-config", "--tp", "2"]) == 0
    assert "world_size = 4" in capsys.readouterr().out
    assert main(["train", "--print-config", "--tp", "3"]) == 0
    assert "world_size = 3" in capsys.readouterr().out


def test_what_parallelize_cannot_apply_is_said():
    from fxtron.models import build, example_inputs
    with pytest.warns(fxtron.ParallelizeWarning, match="check_collectives take effect where the process groups"):
        fxtron.parallelize(build("gpt-tiny"), fxtron.Mesh(1), example_inputs=example_inputs("gpt-tiny", 2, 16),
                           check_collectives=True)
    with pytest.raises(fxtron.ParallelizeError, match="give them to launch"):
        fxtron.parallelize(_Untraceable(), fxtron.Mesh(1), shm=False, strict=True)


def test_the_trainer_refuses_a_comparison_it_cannot_make():
    from fxtron.trainer.loop import run
    for kw, what in [(dict(dtype="bf16"), "dtype=bf16"), (dict(grad_reduce_dtype="bf16"), "grad_reduce_dtype")]:
        with pytest.raises(fxtron.ParallelizeError, match=f"does not model {what}.*Drop --compare"):
            run(TrainConfig().replace(world_size=1, compare=True, **kw))


def test_a_16_bit_gradient_reduction_is_said_in_the_summary():
    """grad_reduce_dtype=bf16 (Megatron's --grad-reduce-in-bf16) changes the model's math by
    design: the summary says so; fp32 main_grad's summary says nothing."""
    from fxtron.models import build, example_inputs
    inputs = example_inputs("gpt-tiny", 2, 16)
    said = fxtron.parallelize(build("gpt-tiny"), fxtron.Mesh(2), example_inputs=inputs, dtype="bf16",
                              grad_reduce_dtype=torch.bfloat16).summary()
    assert "gradients: accumulated and reduced in bf16" in said and "a change of the model's math" in said
    plain = fxtron.parallelize(build("gpt-tiny"), fxtron.Mesh(2), example_inputs=inputs, dtype="bf16").summary()
    assert "gradients: accumulated and reduced" not in plain


def test_clip_grad_0_turns_clipping_off_as_megatrons():
    """Megatron clips only where --clip-grad > 0 (0 was refused as not positive here)."""
    from fxtron.config import Config
    assert Config().replace(clip_grad=0).data_parallel.clip_grad is None
    assert Config().replace(clip_grad=0.5).data_parallel.clip_grad == 0.5
    with pytest.raises(fxtron.ParallelizeError, match=r"clip_grad must be a number of at least 0.0 or None, not -1"):
        Config().replace(clip_grad=-1)
