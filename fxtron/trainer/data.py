"""The trainer's batches: global batch k is samples [first, first + GBS) of the train split, the
same on every rank and on every mesh (the position, `consumed_train_samples`, is Megatron's and
is saved with the checkpoint). From Megatron datasets (`--data`, fxtron.data.gpt) or, without
them, byte-level text (`--text`, default Python's standard library sources) whose samples are
drawn at seeded offsets -- the demo's data, on every machine offline."""
from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import torch

from fxtron.errors import ParallelizeError
from fxtron.trainer.config import TrainConfig


def load_text(path: str | None, max_bytes: int) -> torch.Tensor:
    """Bytes of `path`, or of the standard library's .py files (sorted, so every process and
    every run reads the same), as a uint8 tensor."""
    if path:
        if not Path(path).exists():
            raise ParallelizeError(f"--text {path}: no such file")
        data = Path(path).read_bytes()[:max_bytes]
    else:
        root = Path(sysconfig.get_paths()["stdlib"])
        chunks, total = [], 0
        for f in sorted(root.glob("*.py")):
            b = f.read_bytes()
            chunks.append(b)
            total += len(b)
            if total >= max_bytes:
                break
        data = b"".join(chunks)[:max_bytes]
    if len(data) < 1024:
        raise ParallelizeError(f"training text has only {len(data)} bytes; give a longer file")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


class TextSamples:
    """Samples of seq + 1 bytes at offsets drawn from (seed, sample index)."""

    def __init__(self, data: torch.Tensor, seq: int, seed: int):
        self.data, self.seq, self.seed = data, seq, seed

    def __len__(self) -> int:
        return 1 << 62

    def __getitem__(self, i: int) -> np.ndarray:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        start = int(torch.randint(0, len(self.data) - self.seq - 1, (1,), generator=g))
        return self.data[start:start + self.seq + 1].numpy().astype(np.int64)


def check_split(cfg: TrainConfig) -> None:
    """--split leaves the run a train split, and a valid one where it evaluates."""
    from fxtron.data.gpt import parse_split
    d, t = cfg.data, cfg.training
    fractions = parse_split(d.split)
    if fractions[0] == 0:
        raise ParallelizeError(f"--split {d.split} leaves no train split")
    if t.eval_interval and fractions[1] == 0:
        raise ParallelizeError(f"--eval-interval needs a valid split; --split {d.split} gives none")


def valid_samples(cfg: TrainConfig, iteration: int, consumed: int) -> int | None:
    """The valid samples a run evaluating from `iteration` on, `consumed` of them read before,
    needs (Megatron's eval_iters x (train_iters // eval_interval + 1) x global batch, from the
    start); None without evaluations."""
    t = cfg.training
    if not t.eval_interval:
        return None
    return consumed + ((t.steps - iteration) // t.eval_interval + 1) * t.eval_iters * cfg.data.batch


class TrainData:
    """Train and valid samples of the run `cfg`, for a model of `vocab_size` tokens."""

    def __init__(self, cfg: TrainConfig, vocab_size: int):
        d, t = cfg.data, cfg.training
        self.batch, self.vocab_size = d.batch, vocab_size
        if d.path:
            from fxtron.data.gpt import build_datasets
            check_split(cfg)
            self._sizes = (t.steps * d.batch, valid_samples(cfg, 0, 0))
            self.train, self.valid, _ = build_datasets(d.path, d.split, d.seq, t.seed, (*self._sizes, None))
            self.source = " + ".join(d.path)
            #: what the train samples' order depends on beyond the data, split and seed (the
            #: epochs --steps x --batch needs): kept with a checkpoint, compared on resume
            self.sample_order = self.train.order
        else:
            if vocab_size < 256:
                raise ParallelizeError(f"byte-level text needs a vocabulary of 256 tokens, the model has {vocab_size}; "
                                       "give --data (a Megatron dataset of its tokenizer)")
            text = load_text(d.text, d.max_bytes)
            cut = len(text) * 98 // 100
            for part, n in (("train", cut), ("valid", len(text) - cut)):
                if n < d.seq + 2 and (part == "train" or t.eval_interval):
                    raise ParallelizeError(f"--text {d.text or '(the standard library)'}: {len(text)} bytes, of which the "
                                           f"{part} part ({'the first 98%' if part == 'train' else 'the last 2%'}) has "
                                           f"{n}, fewer than one sample of --seq {d.seq} + 1 bytes at two offsets; "
                                           "give a longer file or a shorter --seq")
            self.train = TextSamples(text[:cut], d.seq, t.seed)
            self.valid = TextSamples(text[cut:], d.seq, t.seed + 1)
            self.source = d.text or "Python's standard library sources (bytes)"
            self.sample_order = None          # (drawn at seeded offsets: the same for any --steps)

    def cover_valid(self, cfg: TrainConfig, iteration: int, consumed: int) -> None:
        """A run resumed at `iteration` whose checkpoint consumed `consumed` valid samples
        (another --eval-interval or --eval-iters before): a valid split of a Megatron dataset
        long enough for this run's evaluations from there."""
        need = valid_samples(cfg, iteration, consumed)
        if cfg.data.path and need is not None and need > len(self.valid):
            from fxtron.data.gpt import build_datasets
            d, t = cfg.data, cfg.training
            _, self.valid, _ = build_datasets(d.path, d.split, d.seq, t.seed, (self._sizes[0], need, None))

    def _batch(self, ds, first: int, what: str) -> torch.Tensor:
        if first + self.batch > len(ds):
            raise ParallelizeError(f"the {what} split has {len(ds)} samples; batch at {first} needs {self.batch} more")
        out = torch.from_numpy(np.stack([ds[first + i] for i in range(self.batch)]))
        top = int(out.max())
        if top >= self.vocab_size:
            raise ParallelizeError(f"the {what} data holds token id {top}, the model's vocabulary has {self.vocab_size}; "
                                   "preprocess the data with the model's tokenizer")
        return out

    def train_batch(self, first: int) -> torch.Tensor:
        """(GBS, seq + 1) int64: train samples [first, first + GBS)."""
        return self._batch(self.train, first, "train")

    def valid_batch(self, first: int) -> torch.Tensor:
        return self._batch(self.valid, first, "valid")


__all__ = ["TextSamples", "TrainData", "check_split", "load_text"]
