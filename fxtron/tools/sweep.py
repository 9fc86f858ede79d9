"""Tools, sweep: every causal LM transformers ships, built tiny and parallelized compile-only
at tp (rank 0's program, no processes), each classified by what fxtron does with it.

`tiny_config(model_type)` shrinks the library's default config of an architecture (widths,
layers, heads, intermediate sizes, vocabulary, experts, state sizes, windows; nested
sub-configs of multimodal wrappers too, a wrapper's type taken by the text or decoder sub-config
its causal LM reads) keeping head counts divisible by 4 so tp=2 and tp=4 split them, per-layer
lists and the relations a config's validator checks kept consistent with the shrunk depth
(generic where the config says it, `_OVERRIDES` where only the architecture knows);
`build(model_type)` makes the model and checks that it runs forward in one process on
`example(config)`: token ids and labels (MusicGen's one row per audio codebook, GIT's image
too). A causal-LM class that is no standalone LM (a speculative-decoding drafter) is "not
built" with that reason. `classify(model_type, tp)` parallelizes it and says which of these it is:

- ``clean``: every layer linear split (the only whole ones those Megatron keeps whole:
  routers, low-rank down-projections, linears under torch.no_grad), no all-gather in forward,
  no op run replicated for want of a rule, no parameter held whole for want of a rule;
- ``replicated``: split, with what stays whole or gathered listed with its reason (the
  ParallelizeWarnings: linears left whole, ops without a rule, forced gathers, parameters
  no rule splits);
- ``refused``: a ParallelizeError, with its message;
- ``not built``: the tiny model cannot be made or run forward in one process (the reason);
- ``crashed``: any other exception while parallelizing (a defect);
- ``silent``: something whole or gathered that no warning names, or parameters the
  summary's accounting misses (a defect).

`sweep(types, workers)` runs many in a process pool; `tally(results)` counts them.
`python -m fxtron.tools.sweep [--tp 2] [--workers 2] [types...]` prints the table.
"""
from __future__ import annotations

import math
import os
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field

STATUSES = ("clean", "replicated", "refused", "not built", "crashed", "silent")

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, LAYERS = 64, 4, 2, 16, 64, 128, 2
BATCH, SEQ = 2, 8
# attribute -> the tiny value, where the default config has one (sizes of the same role share one)
_SIZES = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "n_embed", "embed_dim", "model_dim", "dim",
                     "hidden_dim", "word_embed_proj_dim", "d_embed", "emb_dim", "embedding_size",
                     "text_hidden_size", "audio_hidden_size", "embedding_dim", "hidden_size_global"), HIDDEN),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads",
                     "encoder_attention_heads", "attention_heads", "num_attn_heads"), HEADS),
    **dict.fromkeys(("head_dim", "kv_channels", "attention_head_size", "d_head", "d_kv", "qk_head_dim",
                     "v_head_dim", "value_head_dim", "key_head_dim"), HEAD_DIM),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "d_ff", "ffn_hidden_size", "decoder_ffn_dim",
                     "encoder_ffn_dim", "d_inner", "inner_hidden_size", "ffn_intermediate_size",
                     "dense_intermediate_size", "mlp_hidden_size", "filter_size"), FFN),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size",
                     "moe_ffn_hidden_size", "shared_intermediate_size", "moe_shared_expert_intermediate_size",
                     "expert_hidden_size", "moe_hidden_size", "ffn_hidden_size_moe"), 32),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_decoder_layers",
                     "decoder_layers", "num_hidden_blocks", "num_blocks"), LAYERS),
    **dict.fromkeys(("encoder_layers", "num_encoder_layers"), 1),
    **dict.fromkeys(("vocab_size", "text_vocab_size", "decoder_vocab_size", "vocab_size_per_layer_input"), VOCAB),
    **dict.fromkeys(("hidden_size_per_layer_input",), 16), **dict.fromkeys(("num_kv_shared_layers",), 0),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_moe_experts",
                     "ffn_config_moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_k", "top_k_experts",
                     "num_selected_experts", "moe_top_k", "topk"), 2),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"), 1),
    **dict.fromkeys(("n_group", "topk_group", "num_expert_group"), 1),
    **dict.fromkeys(("q_lora_rank",), 32), **dict.fromkeys(("kv_lora_rank", "index_head_dim"), 16),
    **dict.fromkeys(("qk_nope_head_dim", "qk_rope_head_dim", "index_n_heads", "index_topk"), 8),
    **dict.fromkeys(("state_size", "ssm_state_size", "mamba_d_state", "d_state", "linear_key_head_dim",
                     "linear_value_head_dim"), 8),
    **dict.fromkeys(("mamba_head_dim", "mamba_d_head", "mamba_headdim"), 16),
    **dict.fromkeys(("mamba_n_heads", "n_mamba_heads"), 8),
    **dict.fromkeys(("mamba_d_ssm",), 8 * 16),                      # the heads times their width
    **dict.fromkeys(("linear_num_value_heads", "linear_num_key_heads", "mamba_n_groups",
                     "n_groups", "num_key_value_heads_linear"), 4),
    **dict.fromkeys(("time_step_rank", "mamba_dt_rank", "dt_rank"), 8),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length",
                     "seq_length", "max_length", "block_size"), 64),
    **dict.fromkeys(("sliding_window", "attention_window", "window_size", "local_window_size"), 16),
    **dict.fromkeys(("rotary_dim",), 8),
    **dict.fromkeys(("first_k_dense_replace", "num_dense_layers", "first_k_dense", "n_dense_layers"), 1),
    **dict.fromkeys(("decoder_sparse_step", "moe_layer_freq"), 1),
}
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num", "n_head_kv")
# lists of per-layer choices: the distinct kinds kept (the layer count follows)
_LAYER_LISTS = ("layer_types", "layers_block_type", "block_types", "attn_type_list", "layer_group_types")


def _shrunk(default, layers: int) -> dict:
    """The config keyword arguments that make `default` (a config's to_dict) tiny."""
    out: dict = {}
    n_layers = layers
    depth = next((default[k] for k in _LAYER_KEYS if isinstance(default.get(k), int)), None)
    per_layer = [k for k, v in default.items() if isinstance(v, (list, tuple)) and v
                 and (k in _LAYER_LISTS or (len(v) == depth and all(isinstance(x, str) for x in v)))]
    for key in per_layer:
        n_layers = max(n_layers, len(dict.fromkeys(default[key])))
    for key in per_layer:           # a list of per-layer kinds: each distinct kind kept, in order
        distinct = list(dict.fromkeys(default[key]))
        out[key] = (distinct * n_layers)[:n_layers]
    for key in per_layer:           # the ids of the layers of one kind (Zamba2's hybrid_layer_ids) follow
        for kind in dict.fromkeys(out[key]):
            if isinstance(default.get(f"{kind}_layer_ids"), list):
                out[f"{kind}_layer_ids"] = [i for i, k in enumerate(out[key]) if k == kind]
    mla = isinstance(default.get("qk_rope_head_dim"), int)
    moe = any(isinstance(default.get(k), int) for k in ("moe_intermediate_size", *_EXPERTS))
    for key, value in default.items():
        if key in _PER_LAYER_TABLES and isinstance(value, dict):
            out[key] = {}                                          # overrides of layers past the tiny depth
        elif (key.endswith(("_token_id", "_token_index")) and isinstance(value, int) and value >= VOCAB) or \
                (key.endswith("_token_id") and isinstance(value, list) and any(v >= VOCAB for v in value)):
            out[key] = VOCAB - 1                                   # a special token outside the example's ids
        elif key == "head_dim" and mla:
            out[key] = _SIZES["qk_rope_head_dim"]                  # MLA: the rotary part's width
        elif key == "rope_parameters" and value == {} and per_layer:
            out[key] = {kind: {"rope_type": "default", "rope_theta": 10000.0}  # per-kind rope left empty
                        for key_ in per_layer for kind in default[key_]}
        elif key in _EXPERTS and value is None and moe:
            out[key] = _SIZES[key]
        elif key in ("head_dim", *_KV_HEADS) and value is None:
            out[key] = HEAD_DIM if key == "head_dim" else KV_HEADS
        elif key not in per_layer and isinstance(value, list) and len(value) == depth and depth and \
                all(isinstance(v, (int, float)) for v in value):
            out[key] = [_SIZES[key]] * n_layers if key in _SIZES else value[:n_layers]
        elif isinstance(value, dict) and any(k in value for k in ("hidden_size", "vocab_size", "num_hidden_layers",
                                                                 "d_model", "n_embd")):
            out[key] = {**value, **_shrunk(value, layers)}          # a nested sub-config (text, vision, audio)
        elif key in _SIZES and isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            out[key] = n_layers if _SIZES[key] == LAYERS and key in _LAYER_KEYS else _SIZES[key]
        elif key in _KV_HEADS and isinstance(value, int) and value > 0:
            heads = next((default[h] for h in ("num_attention_heads", "n_head", "num_heads", "n_heads")
                          if isinstance(default.get(h), int)), None)
            out[key] = 1 if value == 1 else (HEADS if heads == value else KV_HEADS)
        elif key in ("mlp_only_layers",) and isinstance(value, list):
            out[key] = []
        elif key in ("attn_layer_period", "expert_layer_period") and isinstance(value, int):
            out[key] = 2
        elif key in ("attn_layer_offset", "expert_layer_offset") and isinstance(value, int):
            out[key] = 1
        elif key in ("hybrid_override_pattern",) and isinstance(value, str):
            out[key] = "".join(dict.fromkeys(value.replace("-", "")))[:4] or value[:2]
            n_layers = len(out[key])
    for key in _LAYER_KEYS:
        if key in out and not isinstance(out[key], dict):
            out[key] = n_layers
    return out


_PER_LAYER_TABLES = ("per_layer_config",)
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok",
            "n_shared_experts", "n_group", "topk_group")
# Qwen4-Exp's indexed-attention layers build a token indexer whose sizes default to None
_QSA = dict(indexer_n_heads=HEADS, indexer_kv_heads=1, indexer_head_dim=HEAD_DIM, indexer_budget=8,
            indexer_compress_ratio=4)
# what the generic shrinking cannot know: sizes an architecture's own checks tie together
_OVERRIDES = {
    "mamba2": dict(num_heads=8, head_dim=16, n_groups=1),
    "zamba2": dict(attention_hidden_size=2 * HIDDEN, attention_head_dim=2 * HIDDEN // HEADS, num_query_groups=HEADS),
    "dots3_note": dict(head_dim=16), "dots3_note_text": dict(head_dim=16),
    "reformer": dict(is_decoder=True, axial_pos_shape=[2, 4], axial_pos_embds_dim=[32, 32], local_attn_chunk_length=4,
                     lsh_attn_chunk_length=4), "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "zaya": dict(num_experts_per_tok=1),
    **dict.fromkeys(("qwen4_exp", "qwen4_exp_text"), _QSA),
    # the library's attention reads a field its config lacks, and clamps by clip_qkv (None by default)
    "dbrx": dict(attn_config=dict(rope_theta=10000.0, clip_qkv=8.0)),
    # one shared transformer tied over the hybrid layers: the library refuses a single one (nothing to tie)
    "zamba": dict(num_hidden_layers=3, layers_block_type=["linear_attention", "hybrid", "hybrid"],
                  attention_hidden_size=2 * HIDDEN, attention_head_dim=2 * HIDDEN // HEADS),
    # the indexer layers are a subset of the indexed-attention ones; its heads at most those of a key head
    "kolibri1_1": dict(index_layers=[1], index_num_heads=2, index_pool_size=16, index_compression=4,
                       index_num_local_tokens=4, index_num_sink_tokens=2),
    "blt": dict(encoder_hash_byte_group_vocab=VOCAB),     # the byte n-gram hash table (500k rows)
    "git": dict(vision_config=dict(image_size=16, patch_size=8)),     # an image of 4 patches
    # its to_dict interleaves an "mlp" entry after each layer (doubled counts): the layers given plainly
    "dory": dict(num_hidden_layers=3, n_input_layers=1, n_recurrent_layers=1, n_output_layers=1,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
}
_LAYER_KEYS = tuple(k for k, v in _SIZES.items() if v == LAYERS and k not in ("encoder_layers", "num_encoder_layers"))


def model_class(model_type: str):
    """transformers' causal-LM class for a model type."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def causal_lm_types() -> list[str]:
    """Every model type transformers maps to a causal LM."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(model_type: str, layers: int = LAYERS):
    """The library's default config of `model_type`, made tiny (see the module's docstring)."""
    from transformers import AutoConfig
    default = AutoConfig.for_model(model_type)
    wanted = model_class(model_type).config_class
    if not isinstance(default, wanted):     # a wrapper's type mapped to its text model's (decoder's) causal LM
        inner = [getattr(default, k, None) for k in ("text_config", *getattr(default, "sub_configs", {}))]
        default = next((c for c in inner if isinstance(c, wanted)), default)
    kwargs = _shrunk(default.to_dict(), layers)
    for key, value in _OVERRIDES.get(model_type, {}).items():    # a nested sub-config's overrides merge
        kwargs[key] = {**kwargs.get(key, {}), **value} if isinstance(value, dict) and key.endswith("_config") else value
    for drop in ("architectures", "transformers_version", "model_type", "_name_or_path"):
        kwargs.pop(drop, None)
    config = type(default)(**{**_plain(default), **kwargs})
    for attr in ("use_cache", "return_dict"):
        if hasattr(config, attr):
            setattr(config, attr, attr == "return_dict")
    for attr, value in config.to_dict().items():      # every dropout rate, whatever the family names it
        if ("dropout" in attr or attr.endswith("pdrop")) and isinstance(value, float):     # (Seed-OSS: residual_dropout)
            setattr(config, attr, 0.0)
    return config


def _plain(config) -> dict:
    """A config's own arguments (to_dict less the bookkeeping keys)."""
    d = config.to_dict()
    for key in ("architectures", "transformers_version", "model_type", "_name_or_path", "dtype", "torch_dtype"):
        d.pop(key, None)
    return d


# captioners whose causal LM reads an image first (GIT: the loss drops the image's token positions)
_IMAGE_FIRST = ("git",)
# types whose causal-LM class is no standalone language model (the reason why)
_NOT_STANDALONE = dict.fromkeys(
    ("gemma4_assistant", "gemma4_unified_assistant"),
    "not a standalone LM: a speculative-decoding drafter whose forward reads the target model's "
    "inputs_embeds and shared_kv_states and returns no loss")


class NotBuilt(Exception):
    """The tiny model cannot be made or run forward in one process."""


def example(config, batch: int = BATCH, seq: int = SEQ) -> dict:
    """Token ids and labels for a causal LM of `config` (keywords)."""
    import torch
    vocab = getattr(config, "vocab_size", None) or getattr(getattr(config, "text_config", None), "vocab_size", VOCAB)
    g = torch.Generator().manual_seed(0)
    codebooks = getattr(config, "num_codebooks", None) if hasattr(config, "audio_channels") else None
    if codebooks:     # a decoder over audio codebooks (MusicGen): ids a row per codebook, labels one per step
        ids = torch.randint(1, min(vocab, VOCAB) - 1, (batch, codebooks, seq), generator=g)
        return dict(input_ids=ids.reshape(batch * codebooks, seq), labels=ids.transpose(1, 2).contiguous())
    ids = torch.randint(1, min(vocab, VOCAB) - 1, (batch, seq), generator=g)
    if config.model_type in _IMAGE_FIRST:     # its loss skips the image's tokens: it needs an image
        v = config.vision_config
        pixels = torch.randn(batch, v.num_channels, v.image_size, v.image_size, generator=g)
        return dict(input_ids=ids, pixel_values=pixels, labels=ids.clone())
    return dict(input_ids=ids, labels=ids.clone())


def build(model_type: str, layers: int = LAYERS):
    """(tiny model, example kwargs), checked to run forward in one process with a finite loss;
    NotBuilt with the reason otherwise."""
    import torch
    if model_type in _NOT_STANDALONE:
        raise NotBuilt(_NOT_STANDALONE[model_type])
    try:
        config = tiny_config(model_type, layers)
    except Exception as e:       # noqa: BLE001 -- any failure of the library's config is the reason
        raise NotBuilt(f"config: {_short(e)}") from None
    try:
        torch.manual_seed(0)
        model = model_class(model_type)(config).train()
        if getattr(config, "languages", None) and hasattr(model, "set_default_language"):
            model.set_default_language(config.languages[0])   # X-MOD: a language adapter per input language
    except Exception as e:       # noqa: BLE001
        raise NotBuilt(f"model: {_short(e)}") from None
    kwargs = example(config)
    try:
        with torch.no_grad():
            out = model(**kwargs)
    except Exception as e:       # noqa: BLE001
        raise NotBuilt(f"forward: {_short(e)}") from None
    loss = getattr(out, "loss", None)
    if loss is None or not torch.isfinite(loss).all():
        raise NotBuilt(f"forward: no finite loss ({loss})")
    return model, kwargs


def _short(e: BaseException, n: int = 160) -> str:
    text = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return text if len(text) <= n else text[:n - 3] + "..."


@dataclass
class Result:
    """One architecture's outcome: `status` (one of STATUSES) and the reasons behind it."""

    model_type: str
    status: str
    reasons: list[str] = field(default_factory=list)
    split_share: float | None = None       # the share of the parameters split over tp
    unread_share: float = 0.0              # ... held whole because the traced forward never reads them
    seconds: float = 0.0


def _warning_kind(message: str) -> str:
    for kind, words in (("linears left whole", "stay replicated"), ("ops without a rule", "no sharding rule"),
                        ("forced all-gathers", "all-gather(s)"), ("parameters no rule splits", "no rule that splits"),
                        ("heads", "head")):
        if words in message:
            return kind
    return "other"


def classify(model_type: str, tp: int = 2, verify: bool = True) -> Result:
    """Build `model_type` tiny, parallelize it compile-only at tp (rank 0's program) and
    classify it (see the module's docstring); `verify=False` skips the verifier between
    passes (a third of the compile time)."""
    import fxtron
    from fxtron.compiler import report
    from fxtron.errors import ParallelizeError, ParallelizeWarning
    from fxtron.passes.tp_plan import router_weights, unused_weights

    start = time.perf_counter()
    try:
        model, kwargs = build(model_type)
    except NotBuilt as e:
        return Result(model_type, "not built", [str(e)], seconds=time.perf_counter() - start)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            pm = fxtron.parallelize(model, fxtron.Mesh(tp, tp=tp), example_kwargs=kwargs, verify=verify)
            local = pm.compiled(0).local
            recs = pm.collectives(0)
            fell, gathers, unsplit = pm.fallbacks(0), pm.gathers(0), pm.tp_plan.unsplit()
            total, held = report.held_whole(local, pm.tp_plan, router_weights(pm.traced), unused_weights(pm.traced))
        except ParallelizeError as e:
            return Result(model_type, "refused", [_short(e, 400)], seconds=time.perf_counter() - start)
        except Exception as e:   # noqa: BLE001 -- a defect, reported with where it happened
            where = traceback.extract_tb(e.__traceback__)[-1]
            return Result(model_type, "crashed", [f"{_short(e, 300)} ({os.path.basename(where.filename)}:"
                                                  f"{where.lineno})"], seconds=time.perf_counter() - start)
    told = [str(w.message) for w in caught if issubclass(w.category, ParallelizeWarning)]
    seconds = time.perf_counter() - start
    split = sum(math.prod(lp.full_shape) for lp in local.values() if any(s.axis in ("tp", "ep") for s in lp.shards))
    share = split / total if total else 0.0
    defects = []
    n_model = sum(p.numel() for p in model.parameters())
    if total != n_model or split + sum(h.numel for h in held) != total:
        defects.append(f"the accounting misses parameters: {split} split + {sum(h.numel for h in held)} held "
                       f"!= {total} (the model: {n_model})")
    fwd_gathers = [r for r in recs if r.kind == "all_gather" and r.phase == "forward"]
    unruled = [h for h in held if h.why == report.NO_RULE]
    problems = {"linears left whole": bool(unsplit), "ops without a rule": bool(fell),
                "forced all-gathers": bool(gathers) or bool(fwd_gathers),
                "parameters no rule splits": bool(unruled)}
    told_kinds = {_warning_kind(m) for m in told}
    for kind, present in problems.items():
        if present and kind not in told_kinds and not (kind == "forced all-gathers" and not gathers and told):
            defects.append(f"{kind} with no warning naming it")
    if fwd_gathers and not gathers and not told:
        defects.append(f"{len(fwd_gathers)} forward all-gather(s) no report names")
    if defects:
        return Result(model_type, "silent", defects, share, seconds=seconds)
    unread = sum(h.numel for h in held if h.why == report.UNUSED) / total if total else 0.0
    if not any(problems.values()):
        return Result(model_type, "clean", [], share, unread, seconds)
    reasons = [f"{_warning_kind(m)}: {m}" for m in told if _warning_kind(m) in problems and problems[_warning_kind(m)]]
    return Result(model_type, "replicated", reasons, share, unread, seconds)


def _classify_quiet(args) -> Result:
    """classify(*args) with torch on one thread and the library's and fxtron's warnings
    caught (classify reads fxtron's); the verifier off (compile-only: the zoo runs it)."""
    import torch
    torch.set_num_threads(1)
    import transformers
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    return classify(*args, verify=False)


def sweep(types: list[str] | None = None, tp: int = 2, workers: int = 2, each=None) -> list[Result]:
    """classify() every causal-LM type (or `types`) at tp, in a pool of `workers` processes
    (each builds its models in turn); results in the order of `types`, each also handed to
    `each` as it comes."""
    import multiprocessing as mp
    types = list(types) if types else causal_lm_types()
    jobs = [(t, tp) for t in types]
    if workers <= 1:
        return [r for r in map(_classify_quiet, jobs) if each is None or each(r) or True]
    # fresh workers now and then: a model's modules and compiled graphs are not all freed; each
    # is forked from a server that imported torch, fxtron and transformers once (seconds a
    # worker saved), the one fxtron.launch's ranks fork from (one server a process, whoever starts it)
    from fxtron.runtime.launch import _PRELOAD
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    with ctx.Pool(workers, maxtasksperchild=20) as pool:
        return [r for r in pool.imap(_classify_quiet, jobs, chunksize=1) if each is None or each(r) or True]


def tally(results: list[Result]) -> dict[str, int]:
    """How many of each status."""
    return {s: sum(r.status == s for r in results) for s in STATUSES}


def format_result(r: Result) -> str:
    """An architecture's line, and its reasons indented below."""
    share = f" {100 * r.split_share:.0f}% split" if r.split_share is not None else ""
    share += f", {100 * r.unread_share:.0f}% unread" if r.unread_share else ""
    return "\n".join([f"{r.model_type:28s} {r.status:10s}{share} ({r.seconds:.1f}s)"]
                     + [f"    {reason[:400]}" for reason in r.reasons])


def format_tally(results: list[Result]) -> str:
    """The tally's line."""
    counts = tally(results)
    built = sum(counts.values()) - counts["not built"]
    return f"{len(results)} causal LMs, {built} built: " + ", ".join(f"{counts[s]} {s}" for s in STATUSES)


def main(argv: list[str] | None = None) -> int:
    """`python -m fxtron.tools.sweep [--tp N] [--workers N] [types...]`: print each and the tally."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m fxtron.tools.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("types", nargs="*", help="model types (default: every causal LM transformers maps)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args(argv)
    start = time.perf_counter()
    results = sweep(args.types or None, args.tp, args.workers, each=lambda r: print(format_result(r), flush=True))
    print(format_tally(results))
    print(f"{time.perf_counter() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
