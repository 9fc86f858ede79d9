"""`python -m fxtron preprocess`: text into Megatron's indexed dataset (PREFIX.bin / PREFIX.idx),
as Megatron's tools/preprocess_data.py writes it: one document per JSON line (its `--json-key`
field, default "text") of a .jsonl file, or per .txt file; tokenized by a tokenizer.json
(transformers' `tokenizers`), an end-of-document token appended to each document; tokens stored
as uint16 below 65,500 tokens of vocabulary, else int32."""
from __future__ import annotations

import json
import os

from fxtron.data.indexed import IndexedDatasetWriter, token_dtype
from fxtron.errors import ParallelizeError

#: end-of-document tokens looked for when neither --eod-token nor tokenizer_config.json names one
EOD_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "[SEP]")


def load_tokenizer(path: str):
    """A `tokenizers.Tokenizer` from a tokenizer.json (or the directory holding it)."""
    from tokenizers import Tokenizer
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.exists(file):
        raise ParallelizeError(f"tokenizer {path}: {file} does not exist; give a tokenizer.json (transformers' "
                               "tokenizers format) or the directory holding it")
    return Tokenizer.from_file(file)


def eod_id(tokenizer, path: str, eod_token: str | None) -> int:
    """The end-of-document token's id: `eod_token`, else tokenizer_config.json's eos_token
    beside the tokenizer, else the first of EOD_NAMES the vocabulary has."""
    names = [eod_token] if eod_token else []
    if not names:
        config = os.path.join(path if os.path.isdir(path) else os.path.dirname(path), "tokenizer_config.json")
        if os.path.exists(config):
            with open(config) as f:
                eos = json.load(f).get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if eos:
                names = [eos]
        names += list(EOD_NAMES)
    for name in names:
        i = tokenizer.token_to_id(name)
        if i is not None:
            return i
    raise ParallelizeError(f"the tokenizer at {path} has none of the end-of-document tokens {names[:6]}; give "
                           "--eod-token")


def documents(inputs: list[str], json_key: str):
    """Each document's text, file by file: .jsonl lines' `json_key`, a .txt file whole."""
    for path in inputs:
        if not os.path.exists(path):
            raise ParallelizeError(f"preprocess input {path} does not exist")
        if path.endswith((".jsonl", ".json")):
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ParallelizeError(f"{path}:{n}: not a JSON line ({e})") from e
                    if not isinstance(record, dict) or json_key not in record:
                        raise ParallelizeError(f"{path}:{n}: no {json_key!r} field (it has "
                                               f"{sorted(record)[:5] if isinstance(record, dict) else type(record).__name__}); "
                                               "give --json-key")
                    if not isinstance(record[json_key], str):
                        raise ParallelizeError(f"{path}:{n}: field {json_key!r} is {type(record[json_key]).__name__}, "
                                               "not text")
                    yield record[json_key]
        elif path.endswith(".txt"):
            with open(path, encoding="utf-8") as f:
                yield f.read()
        else:
            raise ParallelizeError(f"preprocess input {path}: give .jsonl (one JSON document a line) or .txt files")


def preprocess(inputs: list[str], tokenizer: str, output_prefix: str, *, json_key: str = "text",
               eod_token: str | None = None, append_eod: bool = True, batch: int = 256) -> dict:
    """Write OUTPUT_PREFIX.bin / .idx; returns the counts (documents, tokens)."""
    tok = load_tokenizer(tokenizer)
    eod = eod_id(tok, tokenizer, eod_token) if append_eod else None
    writer = IndexedDatasetWriter(output_prefix, token_dtype(tok.get_vocab_size()))
    counts = {"documents": 0, "tokens": 0}
    pending: list[str] = []

    def flush():
        for enc in tok.encode_batch(pending, add_special_tokens=False):
            # an empty text: a document of no sequence, no end-of-document token (Megatron's
            # preprocess_data.py appends it only to a document with tokens)
            ids = list(enc.ids) + ([eod] if eod is not None and enc.ids else [])
            writer.add_document(ids)
            counts["documents"] += 1
            counts["tokens"] += len(ids)
        pending.clear()
    for text in documents(inputs, json_key):
        pending.append(text)
        if len(pending) >= batch:
            flush()
    flush()
    writer.finalize()
    return counts


__all__ = ["EOD_NAMES", "documents", "eod_id", "load_tokenizer", "preprocess"]
