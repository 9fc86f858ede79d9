"""Models for the tensor-parallel tests: the shipped GPT and Llama, and transformers' GPT-2
and Llama, all tiny, with head counts that divide tp=4. `make(name)` is deterministic."""
from __future__ import annotations

import torch

from fxtron.models import build
from fxtron.models.llama import Llama, LlamaConfig

VOCAB = {"gpt": 256, "llama": 256, "hf-gpt2": 128, "hf-llama": 128,
         "hf-qwen2": 128, "hf-neox": 128, "hf-phi3": 128, "hf-olmoe": 128, "hf-olmo2": 128, "hf-gemma2": 128, "hf-gemma3": 128, "hf-falcon": 128,
         "cumsum-mlp": 64, "factories-mlp": 64}
NAMES = ["gpt", "llama", "hf-gpt2", "hf-llama"]
# more transformers decoders, checked at tp=2: q/k/v biases (Qwen2), parallel residual and
# partial rotary (GPT-NeoX), fused qkv_proj and gate_up_proj (Phi-3), q/k norms over the whole
# width of column-split projections (OLMoE: their weights are cut per rank, their gradients
# exact), norms after each sublayer (OLMo2, Gemma2, Gemma3) with softcapped logits (Gemma2)
# and linears written `x @ self.weight.T` with an in-place parallel residual (Falcon)
MORE_NAMES = ["hf-qwen2", "hf-neox", "hf-phi3", "hf-olmoe", "hf-olmo2", "hf-gemma2", "hf-gemma3", "hf-falcon"]
# small models around single ops: cumsum over a split hidden dim (no sharding rule: it runs
# replicated on gathered inputs, and must still train exactly like one process); new_zeros and
# index_select on split values (rules that keep them split)
OP_NAMES = ["cumsum-mlp", "factories-mlp"]


class CumsumMLP(torch.nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.up = torch.nn.Linear(dim, 2 * dim)
        self.down = torch.nn.Linear(2 * dim, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, idx, targets):
        x = self.emb(idx)
        h = torch.cumsum(torch.nn.functional.gelu(self.up(x)), dim=-1) / 8
        x = x + self.down(h)
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


class FactoriesMLP(CumsumMLP):
    def forward(self, idx, targets):
        x = self.emb(idx)
        h = torch.nn.functional.gelu(self.up(x))
        h = h + h.new_ones(h.shape) * 0.5                         # a new tensor of h's (global) shape
        order = torch.arange(h.shape[1] - 1, -1, -1, device=h.device)
        h = h.index_select(1, order)                              # the sequence reversed
        x = x + self.down(h)
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def make(name: str, dropout: float = 0.0, layers: int = 2) -> torch.nn.Module:
    """The model `name` with `layers` transformer layers (pipeline tests use 4 and 8)."""
    torch.manual_seed(0)
    if name == "gpt":
        if layers == 2 and dropout == 0:
            return build("gpt-tiny", seed=0)
        return _gpt(dropout, layers)
    if name == "cumsum-mlp":
        return CumsumMLP()
    if name == "factories-mlp":
        return FactoriesMLP()
    if name == "llama":
        return Llama(LlamaConfig(vocab_size=256, max_seq_len=64, n_layer=layers, n_head=8, n_kv_head=4,
                                 dim=64, ffn_dim=96, dropout=dropout))
    import transformers
    if name == "hf-gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=128, n_positions=64, n_embd=32, n_layer=layers, n_head=4, resid_pdrop=dropout,
            embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0))
    if name == "hf-llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64))
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                  num_attention_heads=8, max_position_embeddings=64)
    if name == "hf-qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, num_key_value_heads=4))
    if name == "hf-neox":
        return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**common))
    if name == "hf-phi3":
        return transformers.Phi3ForCausalLM(transformers.Phi3Config(**common, num_key_value_heads=4, pad_token_id=0))
    ids = dict(eos_token_id=0, pad_token_id=0, bos_token_id=0)
    if name == "hf-olmo2":
        return transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**common, num_key_value_heads=4, **ids))
    if name == "hf-gemma2":
        return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**common, num_key_value_heads=4, head_dim=8,
                                                                         **ids))
    if name == "hf-gemma3":
        return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**common, num_key_value_heads=4,
                                                                             head_dim=8, **ids))
    if name == "hf-falcon":
        return transformers.FalconForCausalLM(transformers.FalconConfig(
            vocab_size=128, hidden_size=64, num_hidden_layers=layers, num_attention_heads=8, parallel_attn=True,
            new_decoder_architecture=False, multi_query=False, bias=False, **ids))
    if name == "hf-olmoe":
        return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
            **{**common, "intermediate_size": 32}, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2,
            eos_token_id=0, pad_token_id=0, bos_token_id=0))
    raise KeyError(name)


def _gpt(p: float, layers: int):
    from fxtron.models.gpt import GPT, GPTConfig
    return GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=layers, n_head=4, n_embd=64, dropout=p))


def batch(name: str, b: int, s: int, seed: int) -> dict | tuple:
    """(args, kwargs) of one global batch: shipped models take (idx, targets), transformers'
    take input_ids= and labels= (they shift the labels themselves)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB[name], (b, s + 1), generator=g)
    if name.startswith("hf-"):
        return (), {"input_ids": ids[:, :-1].clone(), "labels": ids[:, :-1].clone()}
    return (ids[:, :-1].clone(), ids[:, 1:].clone()), {}


def loss_of(model, args, kwargs) -> torch.Tensor:
    out = model(*args, **kwargs)
    return out if isinstance(out, torch.Tensor) else out.loss
