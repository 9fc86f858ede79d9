"""Benchmark peer, Megatron-core tensor parallel: megatron-core 0.16.1's own GPTModel, built in
the shape of a fxtron Llama, loaded with that model's weights in Megatron's layout, trained on
the job's gloo ranks on CPU (the `megatron_tp2` system of bench_tp.py).

The model is `megatron.core.models.gpt.GPTModel` with `get_gpt_layer_local_spec` (Megatron's
own ColumnParallelLinear / RowParallelLinear, DotProductAttention, VocabParallelEmbedding and
vocab-parallel cross entropy; RMSNorm is torch's, Megatron's fallback without Apex), run
through GPTModel.forward itself. megatron-core is written for CUDA; on a CPU-only torch three
of its defaults allocate on the CUDA device, and each is met with Megatron's own means, the
math unchanged:
  - RotaryEmbedding.get_emb moves its inverse frequencies to the CUDA device on first use:
    `CPURotaryEmbedding` below is the same class and formula minus that move;
  - DotProductAttention takes its attention-score buffer from parallel_state's
    GlobalMemoryBuffer, which allocates on the CUDA device: the buffer is handed a CPU tensor of
    the size the step needs before the first step (it only allocates when it has none as large);
  - the CUDA RNG tracker that attention dropout forks: Megatron's inference tracker (its fork
    is a no-op), exact here since dropout is 0;
and the causal mask is passed explicitly (Megatron's default one is built on "cuda"), as
Megatron's pretrain_gpt does (True = masked, filled with -10000 before the softmax).

Weights: the fused linear_qkv holds, per query group g, [the group's n_head/n_kv_head query
heads; key head g; value head g], the rank's shard being its n_kv_head/tp groups; linear_fc1 is
[gate shard; up shard] of the rank (Megatron's GLU chunks the output in two: silu(first) *
second); linear_proj / linear_fc2 take the rank's input columns; the embedding and the output
layer the rank's vocabulary rows.

Megatron's parallel_state is global: `init` initializes it on the job's default process group
and `destroy` tears it down; only the benchmark worker calls them (fxtron does not use it).
"""
from __future__ import annotations

import os
import subprocess
import sys

import torch
import torch.nn.functional as F

MCORE_VERSION = "0.16.1"


def megatron_target() -> str:
    """Where megatron-core is installed (--no-deps), beside the interpreter's environment, as
    tests/test_data.py installs it."""
    return os.path.join(os.path.dirname(os.path.dirname(sys.executable)), "megatron-ref")


def available(install: bool = False) -> str | None:
    """None when megatron.core's GPT path imports (installing megatron-core==0.16.1 into
    `megatron_target()` first when `install` and it is absent), else why not, in words."""
    target = megatron_target()
    try:
        if install and not os.path.exists(os.path.join(target, "megatron", "core")):
            subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", target,
                            f"megatron-core=={MCORE_VERSION}"], check=True, timeout=600,
                           capture_output=True, text=True)
        if target not in sys.path:
            sys.path.insert(0, target)
        _imports()
    except subprocess.CalledProcessError as e:
        return f"pip could not install megatron-core=={MCORE_VERSION} into {target}: {e.stderr.strip()[-300:]}"
    except Exception as e:  # noqa: BLE001 - any import failure leaves the system out, with its reason
        return f"megatron-core's GPTModel cannot be imported ({type(e).__name__}: {e})"
    return None


def _imports():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Apex / Transformer Engine not installed": the fallbacks are used
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig
    return parallel_state, tensor_parallel, RotaryEmbedding, GPTModel, get_gpt_layer_local_spec, TransformerConfig


def init(tp: int) -> None:
    """Megatron's parallel_state over the (already initialized) default process group, tp-way,
    and its RNG tracker without CUDA states."""
    parallel_state, tensor_parallel, *_ = _imports()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def destroy() -> None:
    """Tear Megatron's parallel_state down (its process groups, its global buffers)."""
    parallel_state, *_ = _imports()
    parallel_state.destroy_model_parallel()


def _cpu_rotary_class(RotaryEmbedding):
    class CPURotaryEmbedding(RotaryEmbedding):
        """Megatron's RotaryEmbedding with its inverse frequencies left where they are (get_emb
        moves them to the CUDA device): the same rotate-half table, cat((freqs, freqs))."""

        def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
            freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # (S, hd/2)
            assert not self.rotary_interleaved
            return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]  # (S, 1, 1, hd)
    return CPURotaryEmbedding


def build(model: torch.nn.Module, tp: int, batch: int, seq: int):
    """Megatron-core's tp-way GPTModel of the fxtron Llama `model`'s shape, holding this rank's
    shards of `model`'s weights (call `init(tp)` first). Returns (gpt, step_fn): step_fn(tokens,
    targets) is the forward returning the mean token loss, as `model(tokens, targets)` does."""
    parallel_state, _, RotaryEmbedding, GPTModel, get_gpt_layer_local_spec, TransformerConfig = _imports()
    cfg = model.config
    rank = parallel_state.get_tensor_model_parallel_rank()
    if cfg.n_kv_head % tp or cfg.ffn_dim % tp or cfg.vocab_size % tp:
        raise ValueError(f"Megatron's tp={tp} needs kv heads ({cfg.n_kv_head}), ffn ({cfg.ffn_dim}) and "
                         f"vocabulary ({cfg.vocab_size}) divisible by it")
    tcfg = TransformerConfig(
        num_layers=cfg.n_layer, hidden_size=cfg.dim, num_attention_heads=cfg.n_head,
        num_query_groups=cfg.n_kv_head, ffn_hidden_size=cfg.ffn_dim, kv_channels=cfg.head_dim,
        normalization="RMSNorm", layernorm_epsilon=cfg.norm_eps, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, params_dtype=torch.float32, use_cpu_initialization=True,
        perform_initialization=False,  # every parameter is copied from `model` below
        gradient_accumulation_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        cross_entropy_loss_fusion=False)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    gpt = GPTModel(tcfg, spec, vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_seq_len,
                   position_embedding_type="rope", rotary_percent=1.0, rotary_base=int(cfg.rope_theta),
                   share_embeddings_and_output_weights=False, parallel_output=True)
    gpt.rotary_pos_emb.__class__ = _cpu_rotary_class(RotaryEmbedding)  # same module, CPU tables
    _load(gpt, model, tp, rank)
    # the attention-score buffer DotProductAttention fills with baddbmm: (b * local heads, s, s)
    n = batch * (cfg.n_head // tp) * seq * seq
    parallel_state.get_global_memory_buffer().buffer[("mpu", torch.float32)] = torch.empty(n)
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]  # True = masked

    def forward(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = gpt(tokens, None, causal[..., :tokens.shape[1], :tokens.shape[1]], labels=targets)  # (B, T)
        return loss.mean()
    return gpt, forward


@torch.no_grad()
def _load(gpt, model, tp: int, rank: int) -> None:
    """Copy `model`'s weights into `gpt` (Megatron's layout, this rank's shards); every
    parameter of `gpt` is written exactly once."""
    cfg = model.config
    hd, rep = cfg.head_dim, cfg.n_head // cfg.n_kv_head
    groups = range(rank * cfg.n_kv_head // tp, (rank + 1) * cfg.n_kv_head // tp)
    f, v = cfg.ffn_dim // tp, cfg.vocab_size // tp

    def rows(w, size):
        return w[rank * size:(rank + 1) * size]

    def cols(w, size):
        return w[:, rank * size:(rank + 1) * size]

    src = {"embedding.word_embeddings.weight": rows(model.tok_embeddings.weight, v),
           "decoder.final_layernorm.weight": model.norm.weight,
           "output_layer.weight": rows(model.output.weight, v)}
    for i, layer in enumerate(model.layers):
        a, m, p = layer.attn, layer.mlp, f"decoder.layers.{i}."
        qkv = []
        for g in groups:
            qkv += [a.wq.weight[g * rep * hd:(g + 1) * rep * hd], a.wk.weight[g * hd:(g + 1) * hd],
                    a.wv.weight[g * hd:(g + 1) * hd]]
        src[p + "self_attention.linear_qkv.weight"] = torch.cat(qkv)
        src[p + "self_attention.linear_proj.weight"] = cols(a.wo.weight, cfg.n_head // tp * hd)
        src[p + "input_layernorm.weight"] = layer.attn_norm.weight
        src[p + "pre_mlp_layernorm.weight"] = layer.ffn_norm.weight
        src[p + "mlp.linear_fc1.weight"] = torch.cat([rows(m.w1.weight, f), rows(m.w3.weight, f)])
        src[p + "mlp.linear_fc2.weight"] = cols(m.w2.weight, f)
    params = dict(gpt.named_parameters())
    if set(params) != set(src):
        raise ValueError(f"Megatron's GPTModel parameters differ from the copied ones: only Megatron's "
                         f"{sorted(set(params) - set(src))}, only copied {sorted(set(src) - set(params))}")
    for name, t in src.items():
        if params[name].shape != t.shape:
            raise ValueError(f"{name}: Megatron's shard {tuple(params[name].shape)}, copied {tuple(t.shape)}")
        params[name].copy_(t)
