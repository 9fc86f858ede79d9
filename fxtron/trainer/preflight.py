"""Trainer, preflight: what one process can check of a run before any rank starts -- the model
spec (a directory that exists, its config.json), the datasets' prefixes (PREFIX.bin and .idx,
their headers) and split, the data's token ids against the model's vocabulary, the mesh's tp
against the model's head counts, the global batch against dp x microbatches, the sequence
against cp and sequence parallel, the pipeline stages against the model's layers, ep against its
experts, the learning-rate schedule, --load, the device, the paths it
writes to -- so that a
mistake is one message in a second, not one traceback per rank
after spawning and compiling. `fxtron train` and `run` (trainer/loop.py) call `check` before the
launcher starts processes; under torchrun every rank checks and rank 0 alone says why
(cli.py)."""
from __future__ import annotations

import numpy as np

from fxtron.errors import ParallelizeError
from fxtron.trainer.config import TrainConfig

#: token ids read from each dataset to compare with the vocabulary (the whole file when smaller)
SCAN_TOKENS = 1 << 26


def check(cfg: TrainConfig):
    """Raise a ParallelizeError saying what to change where the run `cfg` cannot start; else
    return the resolved model (a TrainModel on the meta device)."""
    from fxtron.trainer.models import key_values, resolve
    tm = resolve(cfg.model.name, cfg.training.seed, key_values(cfg.model.config), cfg.data)
    check_data(cfg, tm.vocab_size, cfg.model.name)
    if cfg.tensor.plan is None:        # a plan of the user's may keep the attention whole on purpose
        check_heads(tm.model, cfg.mesh.tp, cfg.model.name)
    check_layers(tm.model, cfg.mesh.pp, cfg.pipeline.chunks, cfg.model.name)
    check_experts(tm.model, cfg.mesh.ep, cfg.model.name)
    check_run(cfg, tm.vocab_size, tm.model)
    return tm


def check_run(cfg: TrainConfig, vocab_size: int, model=None) -> None:
    """What the workers would refuse at their first step, known from the configuration (and
    the meta `model`) alone: the same refusals, said once before any rank starts."""
    import os

    import torch

    from fxtron.runtime.batch import sequence_unit
    from fxtron.trainer.checkpoint import check_resumable, committed, latest, no_checkpoint, read_state, source_of
    from fxtron.trainer.optim import schedule
    mesh, d, t = cfg.mesh.mesh(), cfg.data, cfg.training
    m = cfg.pipeline.microbatches
    for flag, n in (("--batch", d.batch), ("--seq", d.seq)):
        if n < 2:       # (compiler/trace.py check_example_sizes, on the batch the workers trace with)
            raise ParallelizeError(f"{flag} {n}: the trainer traces the model on its first batch, keeping that dim "
                                   "symbolic, which torch.export cannot do for a size of 1; use 2 or more")
    if d.batch % (mesh.dp * m):
        raise ParallelizeError(f"--batch {d.batch} (the global batch) does not divide over dp={mesh.dp} x "
                               f"microbatches={m}; use a batch that is a multiple of {mesh.dp * m}")
    cp, split = mesh.cp, mesh.tp if cfg.tensor.sequence_parallel else 1
    unit = sequence_unit(cp, split)
    if d.seq % unit:
        why = ([f"context parallel cuts it into 2 x cp = {2 * cp} equal chunks"] if cp > 1 else []) + \
              ([f"sequence parallel cuts {'each cp rank' + chr(39) + 's' if cp > 1 else 'its'} tokens into tp = {split} "
                "parts"] if split > 1 else [])
        raise ParallelizeError(f"--seq {d.seq}: {' and '.join(why)}, so it must be a multiple of {unit}; the "
                               f"nearest are {', '.join(str(n) for n in (d.seq // unit * unit, (d.seq // unit + 1) * unit) if n)}")
    if d.eod_id is not None and d.eod_id >= vocab_size:
        raise ParallelizeError(f"--eod-id {d.eod_id}: the model's vocabulary has ids 0..{vocab_size - 1}, so the data "
                               "cannot hold it; give the end-of-document id the preprocessing appended")
    schedule(cfg)                       # (its warm-up against its decay)
    if t.load is not None and source_of(t) == t.load and (not os.path.isdir(t.load) or latest(t.load) is None):
        raise no_checkpoint(t.load)
    source = source_of(t)
    it = latest(source) if source is not None and os.path.isdir(source) else None
    if it is not None:           # what resuming it would refuse (trainer/checkpoint.py Checkpointer.resume)
        saved = read_state(source, it)
        check_resumable(cfg, committed(source, it), saved)
        if model is not None:        # another model's checkpoint: said before each rank traces and compiles
            from fxtron.runtime.checkpoint.dcp import check_model_of
            check_model_of(committed(source, it), model)
        if "scheduler" in saved:
            schedule(cfg).load_state_dict(saved["scheduler"], override=cfg.optimizer.override_lr_schedule)
    device = cfg.inputs.device
    if device == "cuda" and not torch.cuda.is_available():
        raise ParallelizeError("--device cuda: this machine has no CUDA device torch can use "
                               f"(torch {torch.__version__}, built {'with' if torch.version.cuda else 'without'} "
                               "CUDA); leave --device out to run on the CPU")
    if cfg.codegen.cuda_graphs and cfg.inputs.resolved_device() == "cpu":
        raise ParallelizeError("--cuda-graphs: the programs run on the CPU (no CUDA device here): CUDA graphs "
                               "capture CUDA kernels alone; run on GPUs, or turn cuda_graphs off")
    check_outputs(cfg)
    from fxtron.trainer.data import TrainData, check_split, valid_samples
    if d.path:
        from fxtron.data.gpt import check_sizes
        check_split(cfg)
        check_sizes(d.path, d.split, d.seq, (t.steps * d.batch, valid_samples(cfg, 0, 0), None))
    else:
        TrainData(cfg, vocab_size)      # (the text read and cut: long enough for a sample of each part it uses)


def check_outputs(cfg: TrainConfig) -> None:
    """Where the run writes -- --save, --export-hf, --tensorboard-dir, --trace, --flight-dir,
    --dump (directories it makes) and --log-file (a file it appends to) -- can be written: a path that cannot would
    fail the run at its first save or log line, after training (a directory is made here, as
    the run would)."""
    import os
    import tempfile
    t = cfg.training
    wanted = [(flag, path, True) for flag, path in (("--save", t.save), ("--export-hf", t.export_hf),
                                                     ("--tensorboard-dir", t.tensorboard_dir), ("--trace", t.trace),
                                                     ("--flight-dir", cfg.debug.flight_dir), ("--dump", cfg.debug.dump))
              if path is not None]
    if t.log_file is not None:
        wanted.append(("--log-file", t.log_file, False))
    for flag, path, is_dir in wanted:
        where = path if is_dir else (os.path.dirname(os.path.abspath(path)))
        try:
            if not is_dir and os.path.isdir(path):
                raise IsADirectoryError(f"{path} is a directory")
            os.makedirs(where, exist_ok=True)
            with tempfile.TemporaryFile(dir=where):
                pass
        except OSError as e:
            raise ParallelizeError(f"{flag} {path}: the run cannot write there ({e.strerror or e}); give "
                                   f"{'a directory' if is_dir else 'a file'} it can write") from None


def check_data(cfg: TrainConfig, vocab_size: int, spec: str) -> None:
    """Every dataset of --data opens (its .bin and .idx, their headers) and holds no token id
    the model's vocabulary lacks; without --data, the text exists and the vocabulary holds bytes."""
    d = cfg.data
    if not d.path:
        import os
        if d.text and not os.path.exists(d.text):
            raise ParallelizeError(f"--text {d.text}: no such file")
        if vocab_size < 256:
            raise ParallelizeError(f"byte-level text needs a vocabulary of 256 tokens, the model {spec} has "
                                   f"{vocab_size}; give --data (a Megatron dataset of its tokenizer)")
        return
    from fxtron.data.gpt import parse_blend
    from fxtron.data.indexed import IndexedDataset
    prefixes, _ = parse_blend(d.path)
    for prefix in prefixes:
        ds = IndexedDataset(prefix)          # the files and headers (a ParallelizeError naming what is wrong)
        n = min(ds.tokens, SCAN_TOKENS)
        if n == 0:
            raise ParallelizeError(f"dataset {prefix} holds no tokens")
        tokens = np.frombuffer(ds._bin, dtype=ds.dtype, count=n, offset=int(ds.sequence_pointers[0]))
        top = int(tokens.max())
        if top >= vocab_size:
            raise ParallelizeError(
                f"dataset {prefix} holds token id {top}, but the model {spec} has a vocabulary of {vocab_size} "
                f"(ids 0..{vocab_size - 1}): the data was tokenized with a larger vocabulary than the model's; "
                "preprocess it with the model's tokenizer (fxtron preprocess --tokenizer MODEL_DIR)")


def check_heads(model, tp: int, spec: str) -> None:
    """tp divides every head count the model's configuration states (fxtron.api.head_counts):
    attention cannot be cut between heads."""
    if tp <= 1:
        return
    from math import gcd

    from fxtron.api import head_counts
    heads = head_counts(model)
    bad = {n: v for n, v in heads.items() if v % tp}
    if not bad:
        return
    g = gcd(*heads.values())
    works = [t for t in range(2, g + 1) if g % t == 0]
    fields = ", ".join(f"{n}={v}" for n, v in heads.items())
    raise ParallelizeError(f"--tp {tp} does not divide the model {spec}'s head counts ({fields}): attention cannot be "
                           "cut between heads; " + (f"choose a tp that divides them ({', '.join(map(str, works))})"
                                                    if works else "no tp > 1 divides them: use tp=1"))


def check_layers(model, pp: int, chunks: int, spec: str) -> None:
    """pp x chunks stages fit the model's repeated layers. The pipeline pass cuts between the
    numbered children of one module (blocks.0, blocks.1, ...) that the traced graph runs; no
    module of the model has more numbered children than the largest such list, so more stages
    than that are refused here, as the pass would refuse them on every rank after spawning."""
    stages = pp * chunks
    if stages <= 1:
        return
    lists = {name: sum(c.isdigit() for c, _ in m.named_children()) for name, m in model.named_modules()}
    name, most = max(lists.items(), key=lambda kv: kv[1], default=("", 0))
    if most == 0:
        raise ParallelizeError(f"--pp {pp}: pipeline parallel cuts between the model's repeated layers (a ModuleList "
                               f"such as blocks.0, blocks.1, ...), and the model {spec} has none; use --pp 1")
    if stages > most:
        what = f"pp={pp} x {chunks} chunks per rank" if chunks > 1 else f"pp={pp}"
        raise ParallelizeError(f"{stages} pipeline stages ({what}) but the model {spec} has {most} layers "
                               f"({name}.0 .. {name}.{most - 1}); every stage needs at least one whole layer: lower "
                               "--pp" + (" or --virtual-stages" if chunks > 1 else ""))


#: configuration fields transformers' mixture-of-experts models (and fxtron's MoEConfig) give their
#: expert count by
EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "n_experts")


def check_experts(model, ep: int, spec: str) -> None:
    """ep > 1 needs expert weights to split: a model without a parameter of three or more dims
    (the experts' stacked weights) has no mixture of experts fxtron can dispatch, and an expert
    count its configuration states must divide over ep -- both refused here, as the expert
    pass would on every rank after spawning."""
    if ep <= 1:
        return
    if not any(p.dim() >= 3 for p in model.parameters()):
        raise ParallelizeError(f"--ep {ep}: the model {spec} has no mixture-of-experts layer (no expert weights "
                               "stacked in a 3-D tensor): there is nothing to split over ep; use --ep 1")
    config = getattr(model, "config", None)
    for field in EXPERT_FIELDS:
        n = getattr(config, field, None)
        if isinstance(n, int) and n > 0:
            if n % ep:
                works = [e for e in range(2, n + 1) if n % e == 0]
                raise ParallelizeError(f"--ep {ep} does not divide the {n} experts of the model {spec} ({field}={n}); "
                                       f"use an ep that divides them ({', '.join(map(str, works))})")
            return


__all__ = ["check", "check_data", "check_experts", "check_heads", "check_layers", "check_outputs", "check_run"]
