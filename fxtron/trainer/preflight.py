"""Trainer, preflight: what one process can check of a run before any rank starts -- the model
spec (a directory that exists, its config.json), the datasets' prefixes (PREFIX.bin and .idx,
their headers), the data's token ids against the model's vocabulary, the mesh's tp against the
model's head counts -- so that a mistake is one message in a second, not one traceback per rank
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
    return tm


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


__all__ = ["check", "check_data", "check_heads"]
