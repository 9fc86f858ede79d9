"""Megatron's GPT datasets over indexed token files (megatron/core/datasets/gpt_dataset.py):
train / valid / test splits by sequence, samples of seq + 1 tokens cut across document
boundaries in a seeded shuffle, and blends of several datasets by weight -- the same samples, in
the same order, as megatron.core.datasets' GPTDataset and BlendedDataset build for the same
files, split, seed and sizes.

Sample i of a split is global sample i: the trainer's step k reads samples [k GBS, (k+1) GBS),
whatever the mesh, so a run resumed on another mesh (another dp, other microbatches) sees the
same global batches.
"""
from __future__ import annotations

import math
import re

import numpy as np
import torch

from fxtron.data.indexed import IndexedDataset
from fxtron.errors import ParallelizeError

SPLITS = ("train", "valid", "test")


def parse_split(split: str) -> list[float]:
    """'98,2,0' -> [0.98, 0.02, 0.0] (numbers by regex, as Megatron reads them, padded with zeros
    to three, normalised). A number that is no number ('98.2.0'), a sign, or anything but
    commas, slashes and spaces between the numbers is refused."""
    numbers = re.findall(r"[.0-9]+", split)
    try:
        values = [float(x) for x in numbers]
    except ValueError:
        values = []
    if not re.fullmatch(r"[ ,/]*", re.sub(r"[.0-9]+", "", split)):
        values = []
    if not values or len(values) > 3 or sum(values) <= 0:
        raise ParallelizeError(f"split {split!r}: give up to three non-negative weights for train, valid and test, "
                               "like '98,2,0'")
    values += [0.0] * (3 - len(values))
    total = float(np.sum(np.array(values, dtype=np.float64)))
    return [v / total for v in values]


def split_indices(n: int, split: list[float]) -> list[np.ndarray | None]:
    """Each split's sequence ids of a dataset of n sequences (None where the split is empty).
    megatron-core's builder (BlendedMegatronDatasetBuilder) rounds each split's bookends, the
    running sums of the weights, times n; Megatron's legacy data code rounded each split's size
    and moved the boundaries to end at n, which puts a document on the other side of a boundary
    for some n. fxtron follows megatron-core's (tests/test_data.py, against its split matrix)."""
    bookends = [0.0]
    for w in split:
        bookends.append(bookends[-1] + w)
    out = []
    for lo, hi in zip(bookends[:-1], bookends[1:]):
        beg, end = int(round(lo * n)), int(round(hi * n))
        out.append(np.arange(beg, end, dtype=np.int32) if end > beg and hi > lo else None)
    return out


def document_index(documents: np.ndarray, epochs: int, rng: np.random.RandomState, separate_final: bool) -> np.ndarray:
    """The documents of every epoch in a shuffled order (Megatron's _build_document_index)."""
    if not separate_final or epochs == 1:
        index = np.mgrid[0:epochs, 0:len(documents)][1]
        index[:] = documents
        index = index.reshape(-1).astype(np.int32)
        rng.shuffle(index)
        return index
    first = document_index(documents, epochs - 1, rng, False)
    last = document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def shuffle_index(num_samples: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of the samples (the final epoch's shuffled apart: _build_shuffle_index)."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(0, num_samples, 1, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total:
        return first
    last = np.arange(num_samples, total, 1, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def sample_index(lengths: np.ndarray, doc_index: np.ndarray, seq: int, n: int, extra: int = 1) -> np.ndarray:
    """(n + 1, 2) rows of (position in doc_index, token offset): sample i runs from row i to row
    i + 1 with one extra token (Megatron's build_sample_idx): row i is where token i * seq of the
    documents in doc_index order lies."""
    ends = np.cumsum(lengths[doc_index].astype(np.int64))
    starts = ends - lengths[doc_index]
    positions = np.arange(n + 1, dtype=np.int64) * seq
    where = np.searchsorted(ends, positions, side="right")
    rows = np.empty((n + 1, 2), dtype=np.int64)
    rows[:, 0] = where
    rows[:, 1] = positions - starts[np.minimum(where, len(ends) - 1)]
    dtype = np.int32 if max(len(doc_index), int(lengths.max(initial=0))) <= np.iinfo(np.int32).max else np.int64
    return rows.astype(dtype)


class GPTDataset:
    """Megatron's GPTDataset over `indexed` restricted to sequence ids `indices`: at least
    `num_samples` samples (None: one epoch) of seq + 1 tokens, shuffled with `seed`."""

    def __init__(self, indexed: IndexedDataset, indices: np.ndarray, num_samples: int | None, seq: int, seed: int,
                 name: str = "train"):
        self.indexed, self.seq, self.name = indexed, seq, name
        extra = 1
        lengths = np.asarray(indexed.sequence_lengths)
        tokens_per_epoch = int(lengths[indices].sum(dtype=np.int64))
        # samples asked of a split whose epoch is shorter than a sample: more epochs (Megatron's
        # _get_num_epochs); one epoch (num_samples None, a split nothing reads) of it: no samples
        if tokens_per_epoch == 0 and num_samples:
            raise ParallelizeError(f"dataset {indexed.prefix} ({name} split): no tokens, {num_samples} samples asked; "
                                   "give more data or a larger split")
        epochs = 1
        if num_samples is not None:
            while epochs * tokens_per_epoch < num_samples * seq + extra:
                epochs += 1
        separate = False
        sans_final = None
        if epochs > 1:
            sans_final = ((epochs - 1) * tokens_per_epoch - extra) // seq
            from_final = num_samples - sans_final
            per_epoch = (tokens_per_epoch - extra) // seq
            separate = from_final < int(0.80 * per_epoch)
        rng = np.random.RandomState(seed)
        self.document_index = document_index(indices, epochs, rng, separate)
        n = (epochs * tokens_per_epoch - extra) // seq
        self.sample_index = sample_index(lengths, self.document_index, seq, n, extra)
        self.shuffle_index = shuffle_index(sans_final if separate else n, n, rng)
        self.epochs = epochs
        #: what the order of the samples depends on beyond the files, split and seed: the epochs
        #: the samples asked need, and whether the last is shuffled apart (a checkpoint keeps it)
        self.order = [epochs, bool(separate)]

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def __getitem__(self, i: int) -> np.ndarray:
        """Sample i: seq + 1 tokens (int64)."""
        j = int(self.shuffle_index[i])
        (d0, o0), (d1, o1) = self.sample_index[j], self.sample_index[j + 1]
        d0, o0, d1, o1 = int(d0), int(o0), int(d1), int(o1)
        if d0 == d1:
            parts = [self.indexed.get(int(self.document_index[d0]), o0, o1 - o0 + 1)]
        else:
            parts = [self.indexed.get(int(self.document_index[d0]), o0)]
            parts += [self.indexed.get(int(self.document_index[d])) for d in range(d0 + 1, d1)]
            parts.append(self.indexed.get(int(self.document_index[d1]), 0, o1 + 1))
        return np.concatenate(parts).astype(np.int64)


def blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset of each blended sample, its index in that dataset): sample k comes from the
    dataset furthest behind its share, w_d max(k, 1) - taken_d (the first on a tie)."""
    w = np.asarray(weights, dtype=np.float64)
    taken = np.zeros(len(w), dtype=np.int64)
    which = np.empty(size, dtype=np.int16)
    where = np.empty(size, dtype=np.int64)
    for k in range(size):
        d = int(np.argmax(w * max(k, 1) - taken))
        which[k], where[k] = d, taken[d]
        taken[d] += 1
    return which, where


class BlendedDataset:
    """Megatron's BlendedDataset: `size` samples drawn from `datasets` by `weights`."""

    def __init__(self, datasets: list[GPTDataset], weights: list[float], size: int):
        self.datasets = datasets
        self.dataset_index, self.dataset_sample_index = blending_indices(weights, size)
        self.order = [d.order for d in datasets]     # (the blend's own order is a prefix: the same for any size)
        for d, ds in enumerate(datasets):
            need = int((self.dataset_index == d).sum())
            if need > len(ds):
                raise ParallelizeError(f"blend: dataset {ds.indexed.prefix} gives {len(ds)} samples, {need} are drawn")

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, k: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[k])][int(self.dataset_sample_index[k])]


def parse_blend(items: list[str] | tuple[str, ...]) -> tuple[list[str], list[float] | None]:
    """['0.7', 'A', '0.3', 'B'] -> (['A', 'B'], [0.7, 0.3]); ['A', 'B'] -> (['A', 'B'], None)."""
    items = list(items)
    if not items:
        raise ParallelizeError("--data names no dataset; give PREFIX, or a blend 'W1 PREFIX1 W2 PREFIX2'")

    def number(x: str) -> bool:
        try:
            float(x)
            return True
        except ValueError:
            return False
    if len(items) % 2 == 0 and all(number(items[i]) for i in range(0, len(items), 2)):
        weights = [float(items[i]) for i in range(0, len(items), 2)]
        if not all(math.isfinite(w) and w > 0 for w in weights):
            raise ParallelizeError(f"blend weights {weights}: give positive, finite weights (Megatron's blend "
                                   "asserts each > 0); leave out a dataset that should give no samples")
        return [items[i] for i in range(1, len(items), 2)], weights
    if any(number(x) for x in items):
        raise ParallelizeError(f"--data {' '.join(items)}: give prefixes alone, or pairs 'WEIGHT PREFIX'")
    return items, None


def build_datasets(data: list[str] | tuple[str, ...], split: str, seq: int, seed: int,
                   sizes: tuple[int | None, int | None, int | None]) -> list:
    """The train, valid and test datasets (None where a split is empty) of a prefix or a blend,
    of at least `sizes` samples each, as Megatron's BlendedMegatronDatasetBuilder builds them."""
    prefixes, weights = parse_blend(data)
    fractions = parse_split(split)
    indexed = [IndexedDataset(p) for p in prefixes]
    if len(indexed) == 1 and weights is None:
        ranges = split_indices(len(indexed[0]), fractions)
        return [GPTDataset(indexed[0], r, size, seq, seed, name) if r is not None else None
                for r, size, name in zip(ranges, sizes, SPLITS)]
    if weights is None:
        return [_unweighted_blend(indexed, fractions, s, size, seq, seed, split) for s, size in enumerate(sizes)]
    total = sum(weights)
    weights = [w / total for w in weights]
    out = []
    for s, (size, name) in enumerate(zip(sizes, SPLITS)):
        if fractions[s] == 0 or size is None:
            out.append(None)
            continue
        parts = []
        for d, w in zip(indexed, weights):
            r = split_indices(len(d), fractions)[s]
            if r is None:
                raise ParallelizeError(f"dataset {d.prefix} has no {name} sequences at split {split}")
            parts.append(GPTDataset(d, r, int(math.ceil(math.ceil(size * w) * 1.005)), seq, seed, name))
        out.append(BlendedDataset(parts, weights, sum(int(math.ceil(size * w)) for w in weights)))
    return out


def _unweighted_blend(indexed: list, fractions, s: int, size: int | None, seq: int, seed: int, split: str):
    """Megatron's blend of prefixes without weights, split `s`: one epoch of each dataset's
    part, blended by their sample counts, `size` samples of it (at most all of them)."""
    if fractions[s] == 0 or size is None:
        return None
    lengths = _epoch_samples(indexed, fractions, s, seq, split)
    _check_epoch(lengths, size, seq, SPLITS[s])
    parts = [GPTDataset(d, split_indices(len(d), fractions)[s], None, seq, seed, SPLITS[s]) for d in indexed]
    lengths = [len(p) for p in parts]        # (the same counts, by construction)
    return BlendedDataset(parts, [n / sum(lengths) for n in lengths], size)


def _epoch_samples(indexed: list, fractions, s: int, seq: int, split: str) -> list[int]:
    """The samples of seq + 1 tokens in one epoch of each dataset's part `s` (GPTDataset's
    count, from the sequence lengths alone)."""
    out = []
    for d in indexed:
        r = split_indices(len(d), fractions)[s]
        if r is None:
            raise ParallelizeError(f"dataset {d.prefix} has no {SPLITS[s]} sequences at split {split}")
        out.append(max(0, (int(np.asarray(d.sequence_lengths)[r].sum(dtype=np.int64)) - 1) // seq))
    return out


def _check_epoch(lengths: list[int], size: int, seq: int, name: str) -> None:
    total = sum(lengths)
    if size > total:
        raise ParallelizeError(
            f"a blend without weights is one epoch of each dataset ({' + '.join(map(str, lengths))} = {total} {name} "
            f"samples of {seq + 1} tokens, as Megatron builds it); {size} are needed: give weights ('W1 PREFIX1 "
            f"W2 PREFIX2 ...': more epochs as needed), fewer --steps or a smaller --batch")


def check_sizes(data: list[str] | tuple[str, ...], split: str, seq: int,
                sizes: tuple[int | None, int | None, int | None]) -> None:
    """What build_datasets refuses of a blend without weights too short for `sizes`, found
    from the files' sequence lengths alone, no sample index built (the trainer's preflight)."""
    prefixes, weights = parse_blend(data)
    if len(prefixes) == 1 or weights is not None:
        return
    fractions = parse_split(split)
    indexed = [IndexedDataset(p) for p in prefixes]
    for s, size in enumerate(sizes):
        if fractions[s] and size is not None:
            _check_epoch(_epoch_samples(indexed, fractions, s, seq, split), size, seq, SPLITS[s])


def position_and_document_ids(tokens: torch.Tensor, eod: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's _get_ltor_masks_and_position_ids on (B, s) input tokens, as indices: the
    positions, restarting at 0 after each end-of-document token at i (from i+1;
    --reset-position-ids), and each token's document -- the end-of-document tokens strictly
    before it -- so that rows after i lose the columns up to i (--reset-attention-mask)."""
    at = tokens == eod
    document = at.long().cumsum(1) - at.long()
    idx = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    last = torch.where(at, idx, torch.full_like(idx, -1)).cummax(1).values      # the last EOD at or before
    before = torch.cat([torch.full_like(last[:, :1], -1), last[:, :-1]], 1)    # ... strictly before
    return idx - before - 1, document


__all__ = ["BlendedDataset", "GPTDataset", "blending_indices", "build_datasets", "check_sizes", "document_index", "parse_blend",
           "parse_split", "position_and_document_ids", "sample_index", "shuffle_index", "split_indices"]
