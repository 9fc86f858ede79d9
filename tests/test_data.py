"""Megatron's token datasets (issue 32, point 2), against megatron-core itself (installed with
--no-deps into the test cache: only its pure-Python dataset code is used) as the independent
reference: the .bin/.idx bytes fxtron writes are Megatron's, each reads the other's; the splits,
document and shuffle orders are megatron-core's own functions' for the same seed; the sample
index and the blend follow megatron's C++ helpers (transcribed here loop for loop)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import fxtron
from fxtron.data import gpt
from fxtron.data.indexed import IndexedDataset, IndexedDatasetWriter
from fxtron.tools.testing import scaled


@pytest.fixture(scope="session")
def megatron(tmp_path_factory):
    """megatron.core's dataset modules (megatron-core 0.16.1, --no-deps, cached beside the venv)."""
    target = os.path.join(os.path.dirname(os.path.dirname(sys.executable)), "megatron-ref")
    if not os.path.exists(os.path.join(target, "megatron", "core")):
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", target,
                        "megatron-core==0.16.1"], check=True, timeout=600)
    sys.path.insert(0, target)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import blended_megatron_dataset_config as config
        from megatron.core.datasets import gpt_dataset, indexed_dataset
    return {"indexed": indexed_dataset, "gpt": gpt_dataset, "config": config}


def _documents(n: int = 40, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.RandomState(seed)
    return [rng.randint(0, 50000, size=rng.randint(0, 60)).astype(np.int64) for _ in range(n)]


def test_indexed_files_are_megatrons_byte_for_byte(megatron, tmp_path):
    """Both ways, with an empty document among them (a text with no tokens: a document of no
    sequence, as Megatron's builder writes it)."""
    import torch
    docs = _documents()
    docs = docs[:3] + [np.zeros(0, dtype=docs[0].dtype)] + docs[3:]
    w = IndexedDatasetWriter(str(tmp_path / "ours"), np.uint16)
    for d in docs:
        w.add_document(d)
    w.finalize()
    theirs = megatron["indexed"].IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np.uint16)
    for d in docs:
        theirs.add_document(torch.from_numpy(d), [len(d)] if len(d) else [])
    theirs.finalize(str(tmp_path / "theirs.idx"))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"theirs{ext}").read_bytes(), ext
    mine, ref = IndexedDataset(str(tmp_path / "theirs")), megatron["indexed"].IndexedDataset(str(tmp_path / "ours"))
    docs = [d for d in docs if len(d)]
    assert len(mine) == len(ref) == len(docs)
    for i, d in enumerate(docs):
        assert np.array_equal(mine.get(i), d) and np.array_equal(ref.get(i), d)
        if len(d) > 5:
            assert np.array_equal(mine.get(i, 2, 3), ref.get(i, offset=2, length=3))
    assert np.array_equal(mine.document_indices, ref.document_indices)


def test_a_missing_or_foreign_dataset_is_named(tmp_path):
    with pytest.raises(fxtron.ParallelizeError, match=r"nowhere.idx does not exist"):
        IndexedDataset(str(tmp_path / "nowhere"))
    (tmp_path / "junk.idx").write_bytes(b"not an index at all, no" * 3)
    (tmp_path / "junk.bin").write_bytes(b"")
    with pytest.raises(fxtron.ParallelizeError, match="not a Megatron indexed dataset"):
        IndexedDataset(str(tmp_path / "junk"))
    w = IndexedDatasetWriter(str(tmp_path / "cut"), np.uint16)
    for d in _documents():
        w.add_document(d)
    w.finalize()
    idx = (tmp_path / "cut.idx").read_bytes()
    (tmp_path / "cut.idx").write_bytes(idx[:60])          # a copy cut short
    with pytest.raises(fxtron.ParallelizeError, match=r"cut.idx has 60 bytes, its header describes"):
        IndexedDataset(str(tmp_path / "cut"))


@pytest.mark.parametrize("split", ["98.2.0", "98,-2,0", "98,2,.", "1e-3,1,0", "a,b", ""])
def test_a_malformed_split_is_refused(split):
    with pytest.raises(fxtron.ParallelizeError, match="give up to three non-negative weights"):
        gpt.parse_split(split)


@pytest.mark.parametrize("weights", [["0", "1"], ["nan", "1"], ["inf", "1"], ["-1", "2"]])
def test_a_blend_weight_that_is_not_positive_and_finite_is_refused(weights):
    """Megatron's blend asserts every weight > 0: a dataset of weight 0 would still be drawn on a tie."""
    with pytest.raises(fxtron.ParallelizeError, match="give positive, finite weights"):
        gpt.parse_blend([weights[0], "A", weights[1], "B"])


def test_a_split_shorter_than_a_sample(tmp_path):
    """One epoch of a split shorter than a sample (a test split nothing reads): no samples, no
    refusal; samples asked of it: as many epochs as they need (Megatron's _get_num_epochs)."""
    w = IndexedDatasetWriter(str(tmp_path / "ds"), np.uint16)
    docs = [np.arange(10, 20)] + _documents(40, 3)      # a first document of 10 tokens
    for d in docs:
        w.add_document(d)
    w.finalize()
    ds = IndexedDataset(str(tmp_path / "ds"))
    short = np.array([0], dtype=np.int32)
    assert len(gpt.GPTDataset(ds, short, None, 16, 7, "test")) == 0
    asked = gpt.GPTDataset(ds, short, 5, 16, 7, "test")
    assert len(asked) >= 5 and asked.epochs > 1
    stream = np.tile(docs[0], asked.epochs)       # the one document, epoch after epoch
    for k in range(len(asked)):                   # sample j: tokens [16 j, 16 j + 17) of the stream
        j = int(asked.shuffle_index[k])
        assert np.array_equal(asked[k], stream[16 * j:16 * j + 17]), k


def _sample_index_cpp(lengths, doc_index, seq, n, extra=1):
    """megatron/core/datasets/helpers.cpp build_sample_idx, loop for loop."""
    out = np.zeros((n + 1, 2), dtype=np.int64)
    sample, doc_i, offset = 0, 0, 0
    out[0] = (0, 0)
    sample = 1
    while sample <= n:
        remaining = seq + extra
        while remaining != 0:
            length = int(lengths[doc_index[doc_i]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - extra
                remaining = 0
            else:
                doc_i += 1
                offset = 0
        out[sample] = (doc_i, offset)
        sample += 1
    return out


def _blend_cpp(weights, size):
    current = [0] * len(weights)
    which, where = [], []
    for k in range(size):
        x = max(float(k), 1.0)
        best, err = 0, weights[0] * x - current[0]
        for d in range(1, len(weights)):
            e = weights[d] * x - current[d]
            if e > err:
                best, err = d, e
        which.append(best)
        where.append(current[best])
        current[best] += 1
    return which, where


@pytest.mark.parametrize("num_samples,seq", [(10, 16), (60, 16), (95, 8), (None, 16), (400, 32)])
def test_gpt_dataset_is_megatrons(megatron, tmp_path, num_samples, seq):
    """Several epochs (the last one shuffled apart or not), samples across document boundaries,
    empty documents: megatron-core's document and shuffle orders for the same seed, its C++
    sample index, and samples of seq + 1 tokens read across documents."""
    docs = _documents(50, seed=3)
    w = IndexedDatasetWriter(str(tmp_path / "d"), np.int32)
    for d in docs:
        w.add_document(d)
    w.finalize()
    ds = IndexedDataset(str(tmp_path / "d"))
    indices = gpt.split_indices(len(ds), gpt.parse_split("90,10,0"))[0]
    mine = gpt.GPTDataset(ds, indices, num_samples, seq, seed=1234)
    lengths = ds.sequence_lengths
    tokens = int(lengths[indices].sum())
    rng = np.random.RandomState(1234)
    epochs = mine.epochs
    separate = False
    if epochs > 1:
        sans = ((epochs - 1) * tokens - 1) // seq
        separate = num_samples - sans < int(0.8 * ((tokens - 1) // seq))
    ref_doc = megatron["gpt"]._build_document_index(indices, epochs, rng, separate)
    assert np.array_equal(mine.document_index, ref_doc)
    n = (epochs * tokens - 1) // seq
    assert np.array_equal(mine.sample_index, _sample_index_cpp(lengths, ref_doc, seq, n))
    ref_shuffle = megatron["gpt"]._build_shuffle_index(sans if separate else n, n, rng)
    assert np.array_equal(mine.shuffle_index, ref_shuffle)
    assert len(mine) == n and (num_samples is None or n >= num_samples)
    stream = np.concatenate([ds.get(int(d)) for d in ref_doc])
    for i in range(len(mine)):
        j = int(ref_shuffle[i])
        assert np.array_equal(mine[i], stream[j * seq:j * seq + seq + 1]), i


def test_splits_and_blends_are_megatrons(megatron):
    cfg = megatron["config"]
    for split in ["98,2,0", "969, 30, 1", "1", "0.7,0.3"]:
        assert gpt.parse_split(split) == cfg.parse_and_normalize_split(split)
    matrix = cfg.convert_split_vector_to_split_matrix(gpt.parse_split("969,30,1"))
    for n in (7, 100, 1001):
        ours = gpt.split_indices(n, gpt.parse_split("969,30,1"))
        for got, bounds in zip(ours, matrix):
            beg, end = int(round(bounds[0] * n)), int(round(bounds[1] * n))
            assert (got is None and end <= beg) or (list(got) == list(range(beg, end)))
    for weights, size in [([0.7, 0.3], 50), ([0.2, 0.5, 0.3], 97), ([0.5, 0.5], 10)]:
        which, where = gpt.blending_indices(weights, size)
        assert (which.tolist(), where.tolist()) == _blend_cpp(weights, size)
    assert gpt.parse_blend(["0.7", "A", "0.3", "B"]) == (["A", "B"], [0.7, 0.3])
    assert gpt.parse_blend(["A"]) == (["A"], None)
    with pytest.raises(fxtron.ParallelizeError, match="pairs 'WEIGHT PREFIX'"):
        gpt.parse_blend(["0.7", "A", "B"])
    with pytest.raises(fxtron.ParallelizeError, match="up to three"):
        gpt.parse_split("1,2,3,4")


def test_build_datasets_blend_sizes(tmp_path):
    for name, seed in (("a", 0), ("b", 1)):
        w = IndexedDatasetWriter(str(tmp_path / name), np.uint16)
        for d in _documents(30, seed):
            w.add_document(d)
        w.finalize()
    train, valid, test = gpt.build_datasets(["0.7", str(tmp_path / "a"), "0.3", str(tmp_path / "b")], "90,10,0",
                                            16, 7, (40, 8, None))
    assert test is None and len(train) == 28 + 12 and len(valid) == 6 + 3
    assert all(len(train[k]) == 17 for k in range(len(train)))
    assert (train.dataset_index == 0).sum() == 28


def test_a_blend_without_weights_is_megatrons(megatron, tmp_path):
    """`--data A B`: one epoch of each dataset's split, blended by their sample counts (not
    their documents'), at most all of them -- megatron-core's builder's own datasets, sample for
    sample; more samples than that is refused naming the way out."""
    import warnings
    rng = np.random.RandomState(0)
    for name, n, lo, hi in (("a", 30, 80, 120), ("b", 60, 10, 30)):   # a: fewer, longer documents
        w = IndexedDatasetWriter(str(tmp_path / name), np.uint16)
        for _ in range(n):
            w.add_document(rng.randint(1, 1000, size=rng.randint(lo, hi)))
        w.finalize()
    prefixes, sizes = [str(tmp_path / "a"), str(tmp_path / "b")], (40, 8, None)
    train, valid, test = gpt.build_datasets(prefixes, "90,10,0", 16, 7, sizes)

    class Tokenizer:
        eod, pad, vocab_size, unique_identifiers = 0, -1, 1000, {"class": "Tokenizer"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        cfg = megatron["gpt"].GPTDatasetConfig(random_seed=7, sequence_length=16, blend=(prefixes, None),
                                               split="90,10,0", tokenizer=Tokenizer(), reset_position_ids=False,
                                               reset_attention_mask=False, eod_mask_loss=False)
        ref = BlendedMegatronDatasetBuilder(megatron["gpt"].GPTDataset, list(sizes), lambda: True, cfg).build()
    assert test is None
    for ours, theirs in ((train, ref[0]), (valid, ref[1])):
        assert len(ours) == len(theirs) and ours.dataset_index.tolist() == theirs.dataset_index.tolist()
        for k in range(len(ours)):
            assert np.array_equal(ours[k][:-1], np.asarray(theirs[k]["tokens"])), k
    assert (train.dataset_index == 0).sum() == 28        # by samples: a has ~4x b's tokens
    with pytest.raises(fxtron.ParallelizeError, match=r"one epoch of each dataset .* are needed: give weights"):
        gpt.build_datasets(prefixes, "90,10,0", 16, 7, (10_000, None, None))
    # the trainer's preflight finds the same from the sequence lengths alone, before any rank starts
    gpt.check_sizes(prefixes, "90,10,0", 16, sizes)
    with pytest.raises(fxtron.ParallelizeError, match=r"one epoch of each dataset .* train samples .* 10000 are needed"):
        gpt.check_sizes(prefixes, "90,10,0", 16, (10_000, None, None))


def _tokenizer(path) -> str:
    """A small byte-level BPE tokenizer.json trained here, with <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["the quick brown fox jumps over the lazy dog " * 3, "pack my box with five dozen liquor jugs"] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"]))
    tok.save(str(path))
    return str(path)


def test_preprocess_writes_what_megatron_reads(megatron, tmp_path):
    """`python -m fxtron preprocess`: .jsonl lines and a .txt file tokenized, an end-of-document
    token after each; megatron-core reads the documents back, ids equal to the tokenizer's."""
    import json as js

    from tokenizers import Tokenizer
    tok = _tokenizer(tmp_path / "tokenizer.json")
    texts = ["the quick brown fox", "pack my box", "", "jumps over the lazy dog"]
    (tmp_path / "a.jsonl").write_text("\n".join(js.dumps({"text": t, "id": i}) for i, t in enumerate(texts)) + "\n")
    (tmp_path / "b.txt").write_text("five dozen liquor jugs")
    out = subprocess.run([sys.executable, "-m", "fxtron", "preprocess", "--input", str(tmp_path / "a.jsonl"),
                          str(tmp_path / "b.txt"), "--tokenizer", tok, "--output-prefix", str(tmp_path / "ds")],
                         capture_output=True, text=True, timeout=scaled(120))
    assert out.returncode == 0, out.stderr
    assert "5 documents" in out.stdout
    ref = megatron["indexed"].IndexedDataset(str(tmp_path / "ds"))
    t = Tokenizer.from_file(tok)
    eod = t.token_to_id("<|endoftext|>")
    # the empty text: a document of no sequence, no end-of-document token (Megatron's preprocess_data.py)
    assert ref.index.dtype == np.uint16 and len(ref) == 4
    assert ref.document_indices.tolist() == [0, 1, 2, 2, 3, 4]
    for i, text in enumerate([x for x in texts if x] + ["five dozen liquor jugs"]):
        assert ref.get(i).tolist() == t.encode(text, add_special_tokens=False).ids + [eod]
    bad = subprocess.run([sys.executable, "-m", "fxtron", "preprocess", "--input", str(tmp_path / "a.jsonl"),
                          "--tokenizer", tok, "--output-prefix", str(tmp_path / "x"), "--json-key", "body"],
                         capture_output=True, text=True, timeout=scaled(120))
    assert bad.returncode == 2 and "no 'body' field" in bad.stderr


def test_packed_documents_are_megatrons(megatron):
    """--reset-position-ids / --reset-attention-mask / --eod-mask-loss: the positions, the
    document of each token (as fxtron's models mask attention with it) and the loss mask are
    megatron.core's _get_ltor_masks_and_position_ids', sample by sample (EOD at the start, at
    the end, twice in a row, and none)."""
    import torch

    from fxtron.models.masks import document_mask
    from fxtron.trainer.models import TrainModel
    eod = 7
    tokens = torch.randint(8, 100, (5, 17), generator=torch.Generator().manual_seed(0))
    tokens[0, [3, 9]] = eod
    tokens[1, [0, 16]] = eod
    tokens[2, [5, 6]] = eod
    tokens[3, 11] = eod
    position, document = gpt.position_and_document_ids(tokens, eod)
    mask = document_mask(document)
    for b in range(tokens.shape[0]):
        ref_mask, loss_mask, ref_pos = megatron["gpt"]._get_ltor_masks_and_position_ids(
            tokens[b], eod, True, True, True, True)
        assert torch.equal(position[b], ref_pos)
        assert torch.equal(mask[b, 0], ~ref_mask[0])                   # Megatron's True = masked
        assert torch.equal((tokens[b] != eod).float(), loss_mask)
    cfg = fxtron.TrainConfig().replace(eod_id=eod, reset_position_ids=True, reset_attention_mask=True,
                                       eod_mask_loss=True)
    sample = torch.cat([tokens, tokens[:, :1]], 1)                     # seq + 1 tokens a sample
    (x, y), kw = TrainModel(None, False, 100, data=cfg.data).inputs(sample)
    assert torch.equal(kw["position_ids"], position) and torch.equal(kw["document_ids"], document)
    assert torch.equal(y == -100, tokens == eod)                       # no loss where the input is an EOD
    _, hf = TrainModel(None, True, 100, data=cfg.data).inputs(sample)
    assert torch.equal(hf["position_ids"], position) and hf["use_cache"] is False and "document_ids" not in hf


def test_text_too_short_for_a_sample_is_refused_up_front(tmp_path):
    """`--text FILE`: the valid part (the last 2%) must hold a sample where the run evaluates,
    the train part always -- refused before the first step, not a torch error at the first evaluation."""
    from fxtron.trainer.data import TrainData
    (tmp_path / "small.txt").write_bytes(bytes(range(32, 127)) * 32)         # 3040 bytes: 60 in the valid part
    base = fxtron.TrainConfig().replace(text=str(tmp_path / "small.txt"), seq=64, batch=8, steps=4)
    data = TrainData(base, 256)                                               # no evaluation: trains
    assert tuple(data.train_batch(0).shape) == (8, 65)
    with pytest.raises(fxtron.ParallelizeError, match=r"the valid part \(the last 2%\) has 61, fewer than one sample"):
        TrainData(base.replace(eval_interval=2), 256)
    with pytest.raises(fxtron.ParallelizeError, match=r"the train part .* fewer than one sample"):
        TrainData(base.replace(seq=4096), 256)


def test_preprocess_refuses_a_text_that_is_not_text(tmp_path):
    import json as js

    from fxtron.data.preprocess import preprocess
    (tmp_path / "a.jsonl").write_text(js.dumps({"text": "fine"}) + "\n" + js.dumps({"text": None}) + "\n")
    with pytest.raises(fxtron.ParallelizeError, match=r"a.jsonl:2: field 'text' is NoneType, not text"):
        preprocess([str(tmp_path / "a.jsonl")], _tokenizer(tmp_path / "tokenizer.json"), str(tmp_path / "out"))
