"""Megatron's indexed token datasets: PREFIX.bin (every document's tokens, concatenated) and
PREFIX.idx (the index), byte for byte as Megatron's tools/preprocess_data.py writes them and
megatron.core.datasets.indexed_dataset reads them,
read with numpy memmaps; megatron is not a dependency.

.idx, little-endian, packed: magic b"MMIDIDX\\x00\\x00", u64 version 1, u8 dtype code, u64
sequence count S, u64 document count D (documents + 1), int32 sequence_lengths[S], int64
sequence_pointers[S] (byte offsets into .bin), int64 document_indices[D] (0, then the sequences
so far after each document).
"""
from __future__ import annotations

import os
import struct

import numpy as np

from fxtron.errors import ParallelizeError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
#: Megatron's dtype codes
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}


def token_dtype(vocab_size: int) -> type:
    """The dtype preprocess_data.py stores tokens in: uint16 below 65500 tokens, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


class IndexedDataset:
    """PREFIX.idx / PREFIX.bin memory-mapped: `len(ds)` sequences, `ds.get(i, offset, length)`
    a sequence's tokens (a numpy view of the mapped file)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx, binf = prefix + ".idx", prefix + ".bin"
        for f in (idx, binf):
            if not os.path.exists(f):
                raise ParallelizeError(f"dataset {prefix}: {f} does not exist; give the prefix Megatron's "
                                       "preprocess_data.py or `python -m fxtron preprocess` wrote (PREFIX.bin, PREFIX.idx)")
        with open(idx, "rb") as fh:
            header = fh.read(34)
        if len(header) < 34 or header[:9] != MAGIC:
            raise ParallelizeError(f"{idx} is not a Megatron indexed dataset index (magic {header[:9]!r}, "
                                   f"expected {MAGIC!r})")
        version, = struct.unpack("<Q", header[9:17])
        if version != VERSION:
            raise ParallelizeError(f"{idx}: index version {version}, only {VERSION} is read")
        code = header[17]
        if code not in DTYPES:
            raise ParallelizeError(f"{idx}: unknown token dtype code {code}")
        self.dtype = np.dtype(DTYPES[code])
        self.sequence_count, self.document_count = struct.unpack("<QQ", header[18:34])
        self._idx = np.memmap(idx, mode="r", dtype=np.uint8)
        s, d = self.sequence_count, self.document_count
        need = 34 + 12 * s + 8 * d
        if len(self._idx) < need:
            raise ParallelizeError(f"{idx} has {len(self._idx)} bytes, its header describes {s} sequences and {d} "
                                   f"documents ({need} bytes): a truncated or foreign index")
        self.sequence_lengths = np.frombuffer(self._idx, dtype=np.int32, count=s, offset=34)
        self.sequence_pointers = np.frombuffer(self._idx, dtype=np.int64, count=s, offset=34 + 4 * s)
        self.document_indices = np.frombuffer(self._idx, dtype=np.int64, count=d, offset=34 + 12 * s)
        if d == 0 or self.document_indices[-1] != s:
            raise ParallelizeError(f"{idx}: document_indices end at {self.document_indices[-1] if d else None}, "
                                   f"not at the {s} sequences: a truncated or foreign index")
        size = os.path.getsize(binf)
        need = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize if s else 0
        if size < need:
            raise ParallelizeError(f"{binf} has {size} bytes, the index points to {need}: a truncated dataset")
        self._bin = np.memmap(binf, mode="r", dtype=np.uint8) if size else np.zeros(0, dtype=np.uint8)

    def __len__(self) -> int:
        return self.sequence_count

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence i (to its end when length is None)."""
        if length is None:
            length = int(self.sequence_lengths[i]) - offset
        start = int(self.sequence_pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=start)

    @property
    def tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))


class IndexedDatasetWriter:
    """Writes PREFIX.bin / PREFIX.idx as preprocess_data.py does: `add_document(tokens)` (one
    sequence a document; an empty one a document of no sequence, as Megatron's builder writes
    an empty text), then `finalize()`. Written to temporary names and renamed, so a
    failed run leaves no half dataset under the prefix."""

    def __init__(self, prefix: str, dtype=np.int32):
        self.prefix, self.dtype = prefix, np.dtype(dtype)
        if self.dtype not in CODES:
            raise ParallelizeError(f"token dtype {self.dtype} is not one of Megatron's ({sorted(map(str, CODES))})")
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._bin = open(prefix + ".bin.partial", "wb")
        self.lengths: list[int] = []
        self.documents: list[int] = [0]

    def add_document(self, tokens) -> None:
        arr = np.asarray(tokens, dtype=self.dtype)
        if len(arr):
            self._bin.write(arr.tobytes(order="C"))
            self.lengths.append(len(arr))
        self.documents.append(len(self.lengths))

    def finalize(self) -> None:
        self._bin.close()
        lengths = np.asarray(self.lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        with open(self.prefix + ".idx.partial", "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", CODES[self.dtype]))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(self.documents)))
            f.write(lengths.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(np.asarray(self.documents, dtype=np.int64).tobytes(order="C"))
        os.replace(self.prefix + ".bin.partial", self.prefix + ".bin")
        os.replace(self.prefix + ".idx.partial", self.prefix + ".idx")


__all__ = ["CODES", "DTYPES", "IndexedDataset", "IndexedDatasetWriter", "token_dtype"]
