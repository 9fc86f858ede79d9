"""Pretrained models in and out (issue 31, points 2-4): `prog.load_pretrained` reads a directory
transformers' save_pretrained wrote in several files, each rank only its own slices;
`prog.save_pretrained` and `python -m fxtron export` write directories transformers loads back,
the trainer's --export-hf and the export with the model directory's tokenizer files.

Without processes: a one-rank program gets every weight (Mixtral's per-expert keys through
transformers' own conversion table), a wrapper's prefix is stripped or added, a checkpoint that
does not fit is one ParallelizeError naming the missing, unexpected and mis-shaped tensors, and
the directory save_pretrained writes has transformers' keys and loads back equal. Then a gloo
job of 4: Llama, Qwen2 (biases, tied) and GPT-2 (Conv1D, tied) at tp=2 x pp=2, tp=2 with
sequence parallel (dp=2) and tp=2 x dp=2 with zero=1, and Mixtral at ep=2 x tp=2, each built on
meta, loaded, trained three AdamW steps equal to the saved model in one process, then saved by
every rank into a directory transformers loads equal to the program's full state."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

import fxtron
from fxtron.tools.testing import (adamw, assert_trains_like, cases_fixture, max_abs_diff, ranks_of, reference_training,
                                  scaled, shared_dir, shared_dir_path)
from tp_models import batch, make


def _saved(name: str, path: str) -> torch.nn.Module:
    torch.manual_seed(123)                  # other weights than make()'s: the load must replace them all
    model = make(name)
    with torch.no_grad():                   # and biases that are not zeros
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.02)
    model.save_pretrained(path, max_shard_size="60KB")   # several files and an index
    return model


def _meta(name: str) -> torch.nn.Module:
    with torch.device("meta"):
        return make(name)


def _program(name: str, mesh=None, rank: int = 0, **options):
    import warnings
    args, kw = batch(name, 4, 8, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxtron.parallelize(_meta(name), mesh or fxtron.Mesh(1), example_inputs=args, example_kwargs=kw,
                                  **options).program(rank)


def _keys(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return sorted(json.load(f)["weight_map"])
    from safetensors import safe_open
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return sorted(f.keys())


def _loaded(path: str) -> dict:
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    return {k: v for k, v in model.state_dict().items()}


def test_one_rank_loads_every_weight_and_refuses_what_does_not_fit(tmp_path):
    saved = _saved("hf-llama", str(tmp_path / "llama"))
    assert (tmp_path / "llama" / "model.safetensors.index.json").exists()
    prog = _program("hf-llama")
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
    with pytest.raises(fxtron.ParallelizeError, match="no such file"):
        prog.load_pretrained(str(tmp_path / "nowhere"))


def test_prefix_strips_or_adds_a_wrappers_and_finds_the_base_models(tmp_path):
    saved = _saved("hf-llama", str(tmp_path / "llama"))
    sd = saved.state_dict()
    prog = _program("hf-llama")
    # a wrapper's checkpoint: every key under "backbone."
    save_file({"backbone." + k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "wrapped.safetensors"))
    prog.load_pretrained(str(tmp_path / "wrapped.safetensors"), prefix="backbone.")
    assert max_abs_diff(prog.full_state_dict(), sd)[0] == 0.0
    with pytest.raises(fxtron.ParallelizeError, match="unexpected 21: backbone."):
        prog.load_pretrained(str(tmp_path / "wrapped.safetensors"))
    # a base model's checkpoint (LlamaModel: no "model.") into the causal LM: transformers' base prefix
    base = {k[len("model."):]: v.contiguous() for k, v in sd.items() if k.startswith("model.")}
    save_file({**base, "lm_head.weight": sd["lm_head.weight"].contiguous()}, str(tmp_path / "base.safetensors"))
    prog.load_pretrained(str(tmp_path / "base.safetensors"))
    assert max_abs_diff(prog.full_state_dict(), sd)[0] == 0.0


@pytest.mark.parametrize("name", ["hf-mixtral", "hf-qwen3moe", "hf-qwen2-tied", "hf-gpt2"])
def test_one_rank_round_trip_is_transformers_own(name, tmp_path):
    """transformers writes a fused expert weight as one key per expert (Mixtral renames its
    module too): the load reads them, save_pretrained writes the same keys and files
    transformers loads back equal; a tied weight is written once."""
    saved = _saved(name, str(tmp_path / "in"))
    prog = _program(name)
    prog.load_pretrained(str(tmp_path / "in"))
    assert max_abs_diff(prog.full_state_dict(), saved.state_dict())[0] == 0.0
    prog.save_pretrained(str(tmp_path / "out"), max_shard_size="60KB")
    assert _keys(str(tmp_path / "out")) == _keys(str(tmp_path / "in"))
    assert (tmp_path / "out" / "config.json").exists() and (tmp_path / "out" / "generation_config.json").exists()
    assert max_abs_diff(_loaded(str(tmp_path / "out")), saved.state_dict())[0] == 0.0
    # bf16 on request, one file when it fits
    prog.save_pretrained(str(tmp_path / "bf16"), dtype=torch.bfloat16)
    assert sorted(os.listdir(tmp_path / "bf16")) == ["config.json", "generation_config.json", "model.safetensors"]
    back = _loaded(str(tmp_path / "bf16"))
    assert max_abs_diff({k: v.float() for k, v in back.items()},
                        {k: v.bfloat16().float() for k, v in saved.state_dict().items()})[0] == 0.0
    # config.json records the dtype written, as transformers' save_pretrained does: from_pretrained loads in it
    for out, dtype in (("out", torch.float32), ("bf16", torch.bfloat16)):
        with open(tmp_path / out / "config.json") as f:
            assert json.load(f)["dtype"] == str(dtype).split(".")[1], out
    assert {v.dtype for v in back.values() if v.is_floating_point()} == {torch.bfloat16}


def test_a_saved_config_records_the_dtype_of_the_weights_written(tmp_path):
    """A hub config says bfloat16 while the model is built (and trained) in fp32: the saved
    config says float32, so transformers reloads the fp32 weights unrounded."""
    saved = _saved("hf-llama", str(tmp_path / "in"))
    import warnings
    meta = _meta("hf-llama")
    meta.config.dtype = "bfloat16"
    args, kw = batch("hf-llama", 4, 8, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = fxtron.parallelize(meta, fxtron.Mesh(1), example_inputs=args, example_kwargs=kw).program(0)
    prog.load_pretrained(str(tmp_path / "in"))
    prog.save_pretrained(str(tmp_path / "out"))
    back = _loaded(str(tmp_path / "out"))
    assert {v.dtype for v in back.values() if v.is_floating_point()} == {torch.float32}
    assert max_abs_diff(back, saved.state_dict())[0] == 0.0


def test_tied_keys_of_different_values_and_a_misshaped_buffer_are_refused(tmp_path):
    """A file holding a tied model's embedding and LM head with different values cannot load into
    its one parameter (transformers unties them): refused naming both; with equal values it
    loads. A persistent buffer of another shape is refused (torch's load_state_dict does), not
    broadcast into the model's."""
    saved = _saved("hf-qwen2-tied", str(tmp_path / "in"))
    sd = {k: v.contiguous() for k, v in saved.state_dict().items()}
    prog = _program("hf-qwen2-tied")
    emb = sd["model.embed_tokens.weight"]
    save_file({**sd, "lm_head.weight": emb.clone()}, str(tmp_path / "same.safetensors"))
    prog.load_pretrained(str(tmp_path / "same.safetensors"))
    assert max_abs_diff(prog.full_state_dict(), saved.state_dict())[0] == 0.0
    save_file({**sd, "lm_head.weight": emb + 1e-3}, str(tmp_path / "two.safetensors"))
    with pytest.raises(fxtron.ParallelizeError, match=r"hold model.embed_tokens.weight and lm_head.weight with "
                                                      r"different values.*tie_word_embeddings=False"):
        prog.load_pretrained(str(tmp_path / "two.safetensors"))

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.register_buffer("scale", torch.ones(8))

        def forward(self, x):
            return ((self.lin(x) * self.scale) ** 2).mean()
    m = Scaled()
    small = fxtron.parallelize(m, fxtron.Mesh(1), example_inputs=(torch.randn(4, 8),)).program(0)
    state = {k: v.detach().clone().contiguous() for k, v in m.state_dict().items()}
    save_file({**state, "scale": torch.tensor([3.0])}, str(tmp_path / "scale.safetensors"))
    with pytest.raises(fxtron.ParallelizeError, match=r"mis-shaped 1: scale \(1,\) \(the model's scale is \(8,\)\)"):
        small.load_pretrained(str(tmp_path / "scale.safetensors"))


def test_a_converted_key_layout_that_does_not_fit_is_named(tmp_path):
    saved = _saved("hf-mixtral", str(tmp_path / "in"))
    sd = {k: v.contiguous() for k, v in saved.state_dict().items()}
    from transformers.core_model_loading import revert_weight_conversion
    legacy = dict(revert_weight_conversion(saved, sd))
    del legacy["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(legacy, str(tmp_path / "gap.safetensors"))
    prog = _program("hf-mixtral")
    with pytest.raises(fxtron.ParallelizeError, match=r"mis-shaped 1: model.layers.1.mlp.experts.gate_up_proj: the "
                                                      r"experts' keys are not 0..3"):
        prog.load_pretrained(str(tmp_path / "gap.safetensors"))


def test_export_writes_a_directory_transformers_loads(tmp_path):
    """`python -m fxtron export CKPT OUT --like DIR`: an fxtron checkpoint written in one
    process as transformers' directory (checkpoints of tp, pp and ep meshes: the slow test)."""
    saved = _saved("hf-mixtral", str(tmp_path / "in"))
    full = {k: v.clone() for k, v in saved.state_dict().items()}
    prog = _program("hf-mixtral")
    prog.load_pretrained(str(tmp_path / "in"))
    prog.save(str(tmp_path / "ckpt"))
    out = subprocess.run([sys.executable, "-m", "fxtron", "export", str(tmp_path / "ckpt"), str(tmp_path / "out"),
                          "--like", str(tmp_path / "in"), "--max-shard-size", "60KB"],
                         capture_output=True, text=True, timeout=scaled(300))
    assert out.returncode == 0, out.stderr
    assert _keys(str(tmp_path / "out")) == _keys(str(tmp_path / "in"))
    assert max_abs_diff(_loaded(str(tmp_path / "out")), full)[0] == 0.0
    bad = subprocess.run([sys.executable, "-m", "fxtron", "export", str(tmp_path / "nope"), str(tmp_path / "o2"),
                          "--like", str(tmp_path / "in")], capture_output=True, text=True, timeout=scaled(300))
    assert bad.returncode != 0 and "nope" in bad.stderr


def test_exports_carry_the_model_directorys_tokenizer(tmp_path):
    """--export-hf and `fxtron export` copy the model directory's tokenizer files and
    generation_config.json: AutoTokenizer loads the export and encodes like the original."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from fxtron.runtime.checkpoint.hf import export
    from fxtron.trainer.config import TrainConfig
    from fxtron.trainer.loop import train_rank
    d = tmp_path / "llama"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(str(d))
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, max_new_tokens=7).save_pretrained(str(d))
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train_from_iterator(["the quick brown fox", "jumps over the lazy dog", "hello world"] * 10,
                            trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<s>", "</s>"]))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>",
                                               unk_token="<unk>")
    tok.save_pretrained(str(d))
    (tmp_path / "t.txt").write_text("the quick brown fox " * 200)
    cfg = TrainConfig().replace(model=str(d), steps=1, batch=2, seq=16, text=str(tmp_path / "t.txt"),
                                export_hf=str(tmp_path / "hf"), save=str(tmp_path / "ckpt"))
    train_rank(0, cfg)
    export(os.path.join(str(tmp_path / "ckpt"), "iter_0000001"), str(tmp_path / "exported"), like=str(d))
    text = "the quick hello fox jumps"
    for out in ("hf", "exported"):
        back = transformers.AutoTokenizer.from_pretrained(str(tmp_path / out))
        assert back(text).input_ids == tok(text).input_ids and back.eos_token == "</s>", out
        assert transformers.GenerationConfig.from_pretrained(str(tmp_path / out)).max_new_tokens == 7, out
        assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(tmp_path / out)), out


CASES = {"llama-tp2-pp2": ("hf-llama", dict(tp=2, pp=2), dict(microbatches=2)),
         "llama-tp2-sp": ("hf-llama", dict(tp=2), dict(sequence_parallel=True)),
         "qwen2-tp2-pp2": ("hf-qwen2-tied", dict(tp=2, pp=2), dict(microbatches=2)),
         "qwen2-tp2-sp": ("hf-qwen2-tied", dict(tp=2), dict(sequence_parallel=True)),
         "qwen2-tp2-dp2-zero": ("hf-qwen2-tied", dict(tp=2), dict(zero=1)),
         "gpt2-tp2-pp2": ("hf-gpt2", dict(tp=2, pp=2), dict(microbatches=2)),
         "gpt2-tp2-sp": ("hf-gpt2", dict(tp=2), dict(sequence_parallel=True)),
         "gpt2-tp2-dp2-zero": ("hf-gpt2", dict(tp=2), dict(zero=1)),
         "mixtral-ep2-tp2": ("hf-mixtral", dict(tp=2, ep=2), dict(sequence_parallel=True))}


def _dir(*parts: str) -> str:
    """Where the ranks and the test meet (testing.shared_dir), removed after the module."""
    return os.path.join(shared_dir_path("pretrained"), *parts)


@pytest.fixture(scope="module", autouse=True)
def _shared():
    with shared_dir("pretrained"):
        yield


def _steps(name: str) -> list:
    return [batch(name, 4, 8, seed=s) for s in (1, 2, 3)]


def _run(rank: int, mesh: fxtron.Mesh, key: str) -> dict:
    import torch.distributed as dist
    from fxtron.tools.testing import train_program
    name, _, options = CASES[key]
    path = _dir(name)
    if rank == 0 and not os.path.exists(os.path.join(path, "model.safetensors.index.json")):
        _saved(name, path)
    dist.barrier()
    prog = _program(name, mesh, rank, **options)
    prog.load_pretrained(path)
    got = train_program(prog, _steps(name), adamw(1e-3)(prog.parameters()))
    prog.save_pretrained(_dir("out", key), max_shard_size="60KB")
    prog.save(_dir("ckpt", key))
    return got


trained = cases_fixture({4: [(fxtron.Mesh(4, **CASES[k][1]), [k]) for k in CASES]}, _run)


@pytest.mark.slow
@pytest.mark.parametrize("key", list(CASES))
def test_every_rank_reads_its_slices_and_writes_back(trained, key, tmp_path):
    name, axes, _ = CASES[key]
    ref = reference_training(_saved(name, str(tmp_path / name)), _steps(name), adamw(1e-3))
    got = ranks_of(trained, fxtron.Mesh(4, **axes), key)
    for rank, g in enumerate(got):
        assert_trains_like(g, ref, rank=rank)
    out = _dir("out", key)
    assert _keys(out) == _keys(str(tmp_path / name))
    assert max_abs_diff(_loaded(out), got[0]["state"])[0] == 0.0
    # the mesh's fxtron checkpoint exported in one process: the same directory
    from fxtron.runtime.checkpoint.hf import export
    export(_dir("ckpt", key), str(tmp_path / "exported"), like=str(tmp_path / name),
           max_shard_size="60KB")
    assert _keys(str(tmp_path / "exported")) == _keys(out)
    assert max_abs_diff(_loaded(str(tmp_path / "exported")), got[0]["state"])[0] == 0.0


# ----------------------------------------------------------------------------- memory (point 5)
BIG = dict(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
           num_key_value_heads=8, max_position_embeddings=64)


def _rss() -> tuple[int, int]:
    """(resident, peak resident since the last reset) bytes of this process (Linux)."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def _memory(rank: int, mesh: fxtron.Mesh, key: str) -> dict:
    import gc
    import warnings

    import torch.distributed as dist
    import transformers
    path = _dir("big")
    if rank == 0 and not os.path.exists(os.path.join(path, "model.safetensors.index.json")):
        torch.manual_seed(0)
        big = transformers.LlamaForCausalLM(transformers.LlamaConfig(**BIG))
        big.save_pretrained(path, max_shard_size="100MB")
        del big
        gc.collect()
    dist.barrier()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**BIG))
    ids = torch.randint(0, BIG["vocab_size"], (4, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = fxtron.parallelize(model, mesh, example_kwargs={"input_ids": ids, "labels": ids},
                                  microbatches=2).program(rank)
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                      # the peak resident size starts again from now
    except OSError as e:
        return {"skip": f"cannot reset the peak resident size: {e}"}
    before, _ = _rss()
    prog.load_pretrained(path)
    _, peak = _rss()
    files = pretrained_files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    from safetensors import safe_open
    largest = 0
    for f in pretrained_files:
        with safe_open(os.path.join(path, f), "pt") as h:
            for k in h.keys():
                sl = h.get_slice(k)
                largest = max(largest, 4 * int(torch.tensor(sl.get_shape()).prod()))
    shard = sum(p.numel() * p.element_size() for p in prog.parameters())
    whole = sum(os.path.getsize(os.path.join(path, f)) for f in files)
    return {"before": before, "peak": peak, "shard": shard, "whole": whole, "largest": largest}


memory = cases_fixture({4: [(fxtron.Mesh(4, tp=2, pp=2), ["big"])]}, _memory)


@pytest.mark.slow
def test_loading_holds_a_shard_and_a_slice_not_the_model(memory):
    """A ~440 MB Llama at tp=2 x pp=2 (each rank ~1/4 of it): while loading, a rank's resident
    memory grows by at most twice the largest tensor (the pages read of one tensor, and its
    slice) plus 32 MB -- never by the model, nor by its stage."""
    for rank, got in enumerate(ranks_of(memory, fxtron.Mesh(4, tp=2, pp=2), "big")):
        if "skip" in got:
            pytest.skip(got["skip"])
        grew = got["peak"] - got["before"]
        print(f"rank {rank}: shard {got['shard'] / 2**20:.0f} MiB of a {got['whole'] / 2**20:.0f} MiB model, "
              f"largest tensor {got['largest'] / 2**20:.1f} MiB; resident {got['before'] / 2**20:.0f} MiB before "
              f"loading, peak {got['peak'] / 2**20:.0f} MiB (+{grew / 2**20:.1f} MiB)")
        assert got["whole"] > 3 * got["shard"]
        assert grew < 2 * got["largest"] + 32 * 2**20, (rank, grew)


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_a_16bit_models_optimizer_state_resumes_in_its_dtype(opt, tmp_path):
    """A model built in bf16 (its parameters, and so AdamW's moments and SGD's momentum, bf16):
    prog.save / prog.load keep the state's dtype, and the resumed run continues the uninterrupted
    one bit for bit (the state read as fp32 made AdamW's step fail and SGD's drift)."""
    import warnings

    def program():
        torch.manual_seed(0)
        args, kw = batch("hf-llama", 4, 8, seed=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fxtron.parallelize(make("hf-llama").to(torch.bfloat16), fxtron.Mesh(1), example_inputs=args,
                                      example_kwargs=kw).program(0)

    def optimizer(prog):
        return (torch.optim.AdamW(prog.parameters(), lr=1e-2) if opt == "adamw"
                else torch.optim.SGD(prog.parameters(), lr=0.5, momentum=0.9))
    steps = [batch("hf-llama", 4, 8, seed=s) for s in range(4)]
    a = program()
    oa = optimizer(a)
    for args, kw in steps[:2]:
        a.train_step(args, oa, kwargs=kw)
    a.save(str(tmp_path / "ck"), oa)
    b = program()
    ob = optimizer(b)
    b.load(str(tmp_path / "ck"), ob)
    dtypes = {v.dtype for st in ob.state.values() for k, v in st.items() if k != "step"}
    assert dtypes == {torch.bfloat16}, dtypes
    la = [a.train_step(args, oa, kwargs=kw) for args, kw in steps[2:]]
    lb = [b.train_step(args, ob, kwargs=kw) for args, kw in steps[2:]]
    assert la == lb
    assert max_abs_diff(a.full_state_dict(), b.full_state_dict())[0] == 0.0
