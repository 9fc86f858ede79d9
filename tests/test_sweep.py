"""The sweep over every causal LM transformers ships (fxtron/tools/sweep.py): each built tiny,
run forward in one process, then parallelized compile-only at tp=2 (rank 0's program) and
classified clean, replicated with its reasons, refused with a ParallelizeError, not built,
crashed or silent.

The fast tier checks the tiny configs themselves; the slow one runs the whole sweep in a pool
of two processes and holds it to: nothing crashed, nothing silent (every parameter split or
held whole with its reason, the shares adding to the model's count; everything gathered or
replicated named by a warning), and at least CLEAN_FLOOR clean -- the count reached when this
was written, a floor against regressions (README.md's tally says which are which).
"""
from __future__ import annotations

import pytest

from fxtron.tools import sweep

# the clean count at tp=2 with transformers 5.25 (README.md, "Every causal LM of transformers"); the
# sweep's 200 take about 4 minutes on 2 idle cores (102 of them took 129 s), 24 on cores shared
# with a dozen other jobs
CLEAN_FLOOR = 171


def test_tiny_config_shrinks_widths_layers_and_per_layer_lists():
    config = sweep.tiny_config("llama")
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.vocab_size) == \
        (sweep.HIDDEN, sweep.LAYERS, sweep.HEADS, sweep.VOCAB)
    assert config.num_key_value_heads == sweep.HEADS and config.intermediate_size == sweep.FFN   # multi-head kept
    assert sweep.tiny_config("mistral").num_key_value_heads == sweep.KV_HEADS                     # grouped kept
    # DeepSeek-V3.2: per-layer kinds (dense then sparse MLPs) keep one layer of each kind
    config = sweep.tiny_config("deepseek_v32")
    assert config.num_hidden_layers == 2 and config.mlp_layer_types == ["dense", "sparse"]
    assert config.n_routed_experts == 4 and config.index_topk == 8
    # a multimodal wrapper: its text config tiny too
    config = sweep.tiny_config("gemma3")
    assert config.text_config.hidden_size == sweep.HIDDEN and config.text_config.num_hidden_layers == sweep.LAYERS


def test_tiny_config_keeps_the_relations_an_architecture_checks():
    """Config-driven relations the shrinking must keep (types that did not build before)."""
    # a wrapper's causal LM is its decoder sub-config (MusicGen), whose example is a row per codebook
    config = sweep.tiny_config("musicgen")
    assert type(config) is sweep.model_class("musicgen").config_class and config.hidden_size == sweep.HIDDEN
    ex = sweep.example(config)
    assert ex["input_ids"].shape == (sweep.BATCH * config.num_codebooks, sweep.SEQ)
    assert ex["labels"].shape == (sweep.BATCH, sweep.SEQ, config.num_codebooks)
    # the ids of one kind's layers follow the shrunk kinds (Zamba2's shared blocks are keyed by them)
    config = sweep.tiny_config("zamba2")
    assert config.hybrid_layer_ids == [i for i, k in enumerate(config.layers_block_type) if k == "hybrid"] != []
    # per-layer-kind rope left empty by the default gets one entry per kind kept
    config = sweep.tiny_config("cohere_compass_text")
    assert set(config.rope_parameters) == set(config.layer_types)
    # a width another sub-config must equal (BLT's hidden_size_global is its global model's width)
    config = sweep.tiny_config("blt")
    assert config.encoder_config.hidden_size_global == config.global_config.hidden_size == sweep.HIDDEN
    # a drafter is named as no standalone LM, not built
    with pytest.raises(sweep.NotBuilt, match="standalone"):
        sweep.build("gemma4_assistant")


def test_classify_says_clean_and_refused():
    """Llama splits cleanly; a tp that does not divide its heads is refused with the reason."""
    r = sweep.classify("llama", tp=2)
    assert r.status == "clean" and r.split_share > 0.9, r
    r = sweep.classify("llama", tp=3)
    assert r.status == "refused" and "tp=3" in r.reasons[0], r


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_every_causal_lm():
    results = sweep.sweep(workers=2)
    counts = sweep.tally(results)
    report = "\n".join(sweep.format_result(r) for r in results if r.status in ("crashed", "silent"))
    assert counts["crashed"] == 0 and counts["silent"] == 0, report
    assert counts["clean"] >= CLEAN_FLOOR, sweep.format_tally(results)
