"""Models for the tensor-parallel tests: the shipped GPT and Llama, and transformers' GPT-2
and Llama, all tiny, with head counts that divide tp=4. `make(name)` is deterministic."""
from __future__ import annotations

import torch

from fxtron.models import build
from fxtron.models.llama import Llama, LlamaConfig

# the transformers decoder architectures fxtron is held to (test_zoo.py): architecture -> name
ZOO = {"Llama": "hf-llama", "Mistral": "hf-mistral", "Qwen2": "hf-qwen2", "Qwen3": "hf-qwen3", "Gemma": "hf-gemma",
       "Gemma2": "hf-gemma2", "Gemma3": "hf-gemma3", "OLMo": "hf-olmo", "OLMo2": "hf-olmo2", "OLMoE": "hf-olmoe",
       "Phi": "hf-phi", "Phi-3": "hf-phi3", "GPT-2": "hf-gpt2", "GPT-J": "hf-gptj", "GPT-NeoX": "hf-neox",
       "BLOOM": "hf-bloom", "Falcon": "hf-falcon", "Falcon-40B": "hf-falcon40b", "OPT": "hf-opt", "StableLM": "hf-stablelm",
       "Starcoder2": "hf-starcoder2", "SmolLM3": "hf-smollm3", "Mixtral": "hf-mixtral", "Qwen3-MoE": "hf-qwen3moe",
       "DeepSeek-V3": "hf-deepseekv3", "Cohere": "hf-cohere", "CodeGen": "hf-codegen",
       "GPTBigCode": "hf-bigcode", "DeepSeek-V3.2": "hf-deepseekv32", "Llama4": "hf-llama4", "JetMoE": "hf-jetmoe",
       "GraniteMoE": "hf-granitemoe", "Mamba": "hf-mamba", "Mamba2": "hf-mamba2", "MiniMax": "hf-minimax",
       "Doge": "hf-doge", "CPM-Ant": "hf-cpmant", "LongCat-Flash": "hf-longcat", "Ergo": "hf-ergo",
       "Qwen3-Next": "hf-qwen3next", "Qwen3.5": "hf-qwen3_5"}
VOCAB = {"gpt": 256, "gpt-frozen": 256, "gpt-unused": 256, "llama": 256, "moe": 256, "hf-mixtral-aux": 128, "two-branch-mlp": 64, "cumsum-mlp": 64, "factories-mlp": 64, "gather-mlp": 64, "einsum-attn": 64, "in-place-mlp": 64,
         "nanogpt": 64, "hf-gpt2-eager": 128, "hf-qwen2-tied": 128, **{n: 128 for n in ZOO.values()}}
NAMES = ["gpt", "llama", "hf-gpt2", "hf-llama"]
# more transformers decoders (traced layer by layer in test_repeat; test_zoo.py holds all of ZOO
# to Megatron's split): q/k/v biases (Qwen2), parallel residual and
# partial rotary (GPT-NeoX), fused qkv_proj and gate_up_proj (Phi-3), q/k norms over the whole
# width of column-split projections (OLMoE: their weights are cut per rank, their gradients
# exact), norms after each sublayer (OLMo2, Gemma2, Gemma3) with softcapped logits (Gemma2)
# and linears written `x @ self.weight.T` with an in-place parallel residual (Falcon)
MORE_NAMES = ["hf-qwen2", "hf-neox", "hf-phi3", "hf-olmoe", "hf-olmo2", "hf-gemma2", "hf-gemma3", "hf-falcon"]
# small models around single ops: cumsum over a split hidden dim (no sharding rule: it runs
# replicated on gathered inputs, and must still train exactly like one process); new_zeros and
# index_select on split values, gather with an index shaped by expand_as (rules that keep them
# split); a layer written with einsum; a whole buffer written in place (add_, masked_fill_) through
# slices by split values and read afterwards (the buffer stays whole, the values gathered into it)
OP_NAMES = ["cumsum-mlp", "factories-mlp", "gather-mlp", "einsum-attn", "in-place-mlp"]
# ops the sweep of transformers' architectures met with no rule, each on the split width of an
# MLP (tests/test_tp_structure.py: no gather; test_tensor_parallel.py: trains like one process):
# relu^2, tensor_split, a complex rotation, max / min / logsumexp per head, a causal depthwise
# conv (Mamba's), a torch.no_grad region (a sparse-attention indexer's top-k), xIELU's elementwise
# min / max against a scalar tensor (Apertus), token ids whose image tokens a multimodal wrapper
# replaces by the pad id before a tied embedding (Gemma 4), block-diagonal gates per head with
# their bias (RecurrentGemma's RG-LRU: baddbmm(bias[:, None, :], x, W)), rotary pairs stacked and
# reshape_as'd back (RoFormer), an in-place masked_fill_ with a broadcast mask (XLM's scores),
# xLSTM's log_sigmoid gates, concatenate and per-head variance (its multihead norm), LM heads
# stacked on a new dim, each head's logits picked back by select for its own loss (MusicGen's
# head per audio codebook)
RULE_NAMES = ["square-mlp", "tensor-split-mlp", "complex-mlp", "max-lse-mlp", "conv-mlp", "no-grad-mlp",
              "min-other-mlp", "masked-ids-tied", "head-gates-mlp", "reshape-as-mlp", "masked-fill-mlp",
              "log-sigmoid-var-mlp", "stacked-heads"]
VOCAB.update({n: 64 for n in RULE_NAMES})


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


class TwoBranchMLP(torch.nn.Module):
    """One replicated value feeding two column/row-split branches on either side of a
    vocab-parallel lookup (an op a compiled region cannot hold), and the residual add after
    both: the region before the lookup returns the value and tp's f of it (a parallel attention
    and MLP on one norm, Falcon's and Phi's block, has this shape)."""

    def __init__(self, vocab: int = 64, dim: int = 32):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.a_up, self.a_down = torch.nn.Linear(dim, 2 * dim), torch.nn.Linear(2 * dim, dim)
        self.b_up, self.b_down = torch.nn.Linear(dim, 2 * dim), torch.nn.Linear(2 * dim, dim)
        self.emb2 = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, idx, targets):
        x = torch.tanh(self.emb(idx))
        a = self.a_down(torch.relu(self.a_up(x)))
        e2 = self.emb2(idx)
        b = self.b_down(torch.relu(self.b_up(x)))
        x = x + a + b + e2
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


class _MidMLP(CumsumMLP):
    """emb -> up (colwise) -> mid -> down (rowwise) -> head: `mid` runs on the split width."""

    def forward(self, idx, targets):
        x = self.emb(idx)
        x = x + self.down(self.mid(self.up(x)))
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


class SquareMLP(_MidMLP):
    def mid(self, h):
        return torch.square(torch.relu(h))                       # relu^2 (Primer, Nemotron)


class TensorSplitMLP(_MidMLP):
    def mid(self, h):
        a, b = torch.tensor_split(h.unflatten(-1, (8, 8)), 2, dim=-1)    # per head, along the head dim
        return (a * torch.nn.functional.silu(b)).repeat_interleave(2, dim=-1).flatten(-2)


class ComplexMLP(_MidMLP):
    def mid(self, h):
        b, s = h.shape[:2]
        z = torch.view_as_complex(h.float().reshape(b, s, 8, 4, 2))       # Llama 4's rotary
        rot = torch.polar(torch.ones(4, device=h.device), torch.arange(4.0, device=h.device))
        return torch.view_as_real(z * rot).flatten(2)


class MaxLseMLP(_MidMLP):
    def mid(self, h):
        g = h.unflatten(-1, (8, 8))
        m = g.max(dim=-1, keepdim=True).values                   # gpt-oss's sinks: a max per head
        n = g.min(dim=-1).values.unsqueeze(-1)
        return (g - m - torch.logsumexp(g - m, dim=-1, keepdim=True) + 0.1 * n).flatten(-2)


class MinOtherMLP(_MidMLP):
    def __init__(self):
        super().__init__()
        self.register_buffer("eps", torch.tensor(-1e-6))

    def mid(self, h):
        return torch.expm1(torch.min(h, self.eps)) - h + 0.5 * torch.max(h, self.eps)     # xIELU (Apertus)


class HeadGatesMLP(_MidMLP):
    """RecurrentGemma's RG-LRU gate: per head a (width, width) matrix and a bias, one baddbmm
    over the heads (block-diagonal), sigmoid, gating the input."""

    def __init__(self):
        super().__init__()
        self.gate_weight = torch.nn.Parameter(torch.randn(8, 8, 8) * 0.3)
        self.gate_bias = torch.nn.Parameter(torch.randn(8, 8) * 0.3)

    def mid(self, h):
        b, s, w = h.shape
        x = h.reshape(b * s, 8, 8).permute(1, 0, 2)
        gate = torch.sigmoid(torch.baddbmm(self.gate_bias[:, None, :], x, self.gate_weight).transpose(0, 1)
                             .reshape(b, s, w))
        return h * gate


class ReshapeAsMLP(_MidMLP):
    def mid(self, h):
        x = h.unflatten(-1, (8, 8))                                  # RoFormer's rotary, per head
        pairs = torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).reshape_as(x)
        angle = torch.arange(8.0, device=h.device) * 0.3
        return (x * torch.cos(angle) + pairs * torch.sin(angle)).flatten(-2)


class MaskedFillMLP(_MidMLP):
    def mid(self, h):
        keep = torch.arange(64, device=h.device) % 3 != 0          # XLM's scores.masked_fill_(mask, min)
        return torch.relu((h * 2.0).masked_fill_((~keep).view(1, 1, 64).expand_as(h), -0.5))


class InPlaceMLP(_MidMLP):
    def mid(self, h):
        buf = h.new_zeros(h.shape[0], h.shape[1], 96)               # whole: not the split width
        buf[..., 16:80].add_(torch.relu(h))                          # written in place through slices
        buf[..., 16:80].masked_fill_(h < -1.0, 0.5)
        return buf[..., 16:80] * 2.0 + buf[..., :16].sum(-1, keepdim=True)     # the buffer read afterwards


class LogSigmoidVarMLP(_MidMLP):
    def mid(self, h):
        g = h.unflatten(-1, (8, 8))                                   # xLSTM's mLSTM, per head
        gates = torch.nn.functional.logsigmoid(g)
        g = torch.concatenate([g[..., :4] + gates[..., 4:], g[..., 4:]], dim=-1)
        v = torch.var(g, dim=-1, unbiased=False, keepdim=True)
        return ((g - g.mean(dim=-1, keepdim=True)) / torch.sqrt(v + 1e-5)).flatten(-2)


class MaskedIdsTied(CumsumMLP):
    """The embedding tied to the head, looked up with ids whose "image token" (63) is replaced
    by the pad id 0, as Gemma 4's wrapper does."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(32, 64, bias=False)
        self.head.weight = self.emb.weight
        torch.nn.init.normal_(self.emb.weight, std=0.1)     # an LM's scale (N(0, 1) logits: losses of 20)

    def forward(self, idx, targets):
        x = self.emb(torch.where(idx == 63, 0, idx))
        # the pad row put at the image tokens, a value Gemma 4's wrapper computes for text and drops
        torch.where((idx == 63)[..., None], self.emb.weight[0].view(1, 1, -1), x)
        x = x + self.down(torch.nn.functional.gelu(self.up(x)))
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


class StackedHeads(torch.nn.Module):
    """An MLP block, then three LM heads whose logits are stacked on dim 1 (B, heads, S, V);
    each head's slice (select) goes to its own cross_entropy (its targets shifted by the head's
    index), the losses averaged: MusicGen's head per audio codebook."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 3):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.up = torch.nn.Linear(dim, 2 * dim)
        self.down = torch.nn.Linear(2 * dim, dim)
        self.heads = torch.nn.ModuleList(torch.nn.Linear(dim, vocab) for _ in range(heads))

    def forward(self, idx, targets):
        x = self.emb(idx)
        x = x + self.down(torch.nn.functional.gelu(self.up(x)))
        logits = torch.stack([head(x) for head in self.heads], dim=1)
        losses = [torch.nn.functional.cross_entropy(logits[:, k].contiguous().view(-1, logits.shape[-1]),
                                                    targets.roll(k, dims=1).flatten()) for k in range(len(self.heads))]
        return sum(losses) / len(losses)


class ConvMLP(_MidMLP):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(64, 64, 4, groups=64, padding=3)     # Mamba's causal depthwise conv

    def mid(self, h):
        s = h.shape[1]
        return torch.nn.functional.silu(self.conv(h.transpose(1, 2))[..., :s]).transpose(1, 2)


class NoGradMLP(_MidMLP):
    def __init__(self):
        super().__init__()
        self.indexer = torch.nn.Linear(32, 64)

    def forward(self, idx, targets):
        x = self.emb(idx)
        with torch.no_grad():                                    # DeepSeek-V3.2's indexer: top-k, no gradient
            top = self.indexer(x).topk(4, dim=-1).indices
        keep = torch.zeros(x.shape[0], x.shape[1], 64, device=x.device).scatter(-1, top, 1.0)
        x = x + self.down(torch.nn.functional.gelu(self.up(x)) * (0.5 + keep))
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


class GatherMLP(CumsumMLP):
    def forward(self, idx, targets):
        x = self.emb(idx)
        h = torch.nn.functional.gelu(self.up(x))
        order = torch.arange(h.shape[1] - 1, -1, -1, device=h.device).view(1, -1, 1).expand_as(h)
        h = h.gather(1, order)                                    # the sequence reversed, per feature
        x = x + self.down(h)
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


class EinsumAttention(torch.nn.Module):
    """A layer written with einsum: causal attention over a fused qkv viewed (B, S, 3, heads, d)
    and unbound (the head dim split, the scores' einsum keeps it), an output projection and an
    MLP whose weights are bare parameters contracted by einsum (nn.Linear's layout for the
    output projection, Conv1D's for the MLP)."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.emb = torch.nn.Embedding(vocab, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.w_o = torch.nn.Parameter(torch.randn(dim, dim) / dim ** 0.5)           # (out, in)
        self.w_up = torch.nn.Parameter(torch.randn(dim, 2 * dim) / dim ** 0.5)      # (in, out)
        self.w_down = torch.nn.Parameter(torch.randn(2 * dim, dim) / (2 * dim) ** 0.5)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, idx, targets):
        x = self.emb(idx)
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        att = torch.einsum("bqhd,bkhd->bhqk", q, k) / (d // self.heads) ** 0.5
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = torch.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, d)
        x = x + torch.einsum("bsi,oi->bso", y, self.w_o)
        x = x + torch.einsum("...f,fd->...d", torch.nn.functional.gelu(torch.einsum("bsd,df->bsf", x, self.w_up)),
                             self.w_down)
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


class NanoGPT(torch.nn.Module):
    """nanoGPT's attention written out: learned positions, a registered causal `bias` buffer
    sliced to the sequence, scores masked_fill'ed where it is 0, softmax, times v."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, block: int = 64, layers: int = 2):
        super().__init__()
        self.heads = heads
        self.wte = torch.nn.Embedding(vocab, dim)
        self.wpe = torch.nn.Embedding(block, dim)
        self.attn = torch.nn.ModuleList(torch.nn.Linear(dim, 3 * dim) for _ in range(layers))
        self.proj = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(layers))
        self.register_buffer("bias", torch.tril(torch.ones(block, block)).view(1, 1, block, block))
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, idx, targets):
        b, t = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for qkv, proj in zip(self.attn, self.proj):
            q, k, v = qkv(x).split(x.shape[-1], dim=2)
            q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
            att = (q @ k.transpose(-2, -1)) * (1.0 / k.shape[-1] ** 0.5)
            att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf")).softmax(dim=-1)
            x = x + proj((att @ v).transpose(1, 2).contiguous().view(b, t, -1))
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100)


class Case:
    """A test case of a job: a model name and parallelize's options, keyed for run_cases."""

    def __init__(self, name: str, **kw):
        self.name, self.kw = name, kw

    @property
    def key(self) -> str:
        return f"{self.name}:" + ",".join(f"{k}={v}" for k, v in sorted(self.kw.items()))


def make(name: str, dropout: float = 0.0, layers: int = 2) -> torch.nn.Module:
    """The model `name` with `layers` transformer layers (pipeline tests use 4 and 8)."""
    torch.manual_seed(0)
    if name == "gpt":
        if layers == 2 and dropout == 0:
            return build("gpt-tiny", seed=0)
        return _gpt(dropout, layers)
    if name == "gpt-frozen":     # fine-tuning: the first layer, the position table and the tied embedding frozen
        model = make("gpt", dropout, layers)
        for n, p in model.named_parameters():
            if n.startswith(("blocks.0.", "wpe.", "wte.")):
                p.requires_grad_(False)
        return model
    if name == "gpt-unused":     # parameters its forward never reads (a head kept for another task)
        model = make("gpt", dropout, layers)
        model.unused_head = torch.nn.Linear(8, 4)
        model.register_buffer("unused_counts", torch.arange(4.0))
        return model
    if name == "two-branch-mlp":
        return TwoBranchMLP()
    if name == "cumsum-mlp":
        return CumsumMLP()
    if name == "factories-mlp":
        return FactoriesMLP()
    if name == "gather-mlp":
        return GatherMLP()
    if name == "einsum-attn":
        return EinsumAttention()
    rules = {"square-mlp": SquareMLP, "tensor-split-mlp": TensorSplitMLP, "complex-mlp": ComplexMLP,
             "max-lse-mlp": MaxLseMLP, "conv-mlp": ConvMLP, "no-grad-mlp": NoGradMLP, "min-other-mlp": MinOtherMLP,
             "masked-ids-tied": MaskedIdsTied, "head-gates-mlp": HeadGatesMLP,
             "reshape-as-mlp": ReshapeAsMLP, "masked-fill-mlp": MaskedFillMLP,
             "log-sigmoid-var-mlp": LogSigmoidVarMLP, "stacked-heads": StackedHeads, "in-place-mlp": InPlaceMLP}
    if name in rules:
        return rules[name]()
    if name == "nanogpt":
        return NanoGPT(layers=layers)
    if name == "moe":                     # fxtron's own: argsort by expert, a shared expert, the Switch loss
        from fxtron.models.moe import MoEConfig, MoETransformer
        return MoETransformer(MoEConfig(vocab_size=256, max_seq_len=64, n_layer=layers, n_head=4, n_kv_head=2, dim=32,
                                        ffn_dim=48, n_experts=4, top_k=2, shared_ffn_dim=32, aux_loss_coef=0.05))
    if name == "llama":
        return Llama(LlamaConfig(vocab_size=256, max_seq_len=64, n_layer=layers, n_head=8, n_kv_head=4,
                                 dim=64, ffn_dim=96, dropout=dropout))
    import transformers
    if name in ("hf-gpt2", "hf-gpt2-eager"):
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=128, n_positions=64, n_embd=32, n_layer=layers, n_head=4, resid_pdrop=dropout,
            embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0,
            attn_implementation="eager" if name.endswith("eager") else None))
    if name == "hf-llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64))
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                  num_attention_heads=8, max_position_embeddings=64)
    if name == "hf-qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, num_key_value_heads=4))
    if name == "hf-qwen2-tied":          # biases on q, k, v and the embedding tied to the LM head
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, num_key_value_heads=4,
                                                                       tie_word_embeddings=True))
    if name == "hf-neox":
        return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**common))
    if name == "hf-phi3":
        return transformers.Phi3ForCausalLM(transformers.Phi3Config(**common, num_key_value_heads=4, pad_token_id=0))
    ids = dict(eos_token_id=0, pad_token_id=0, bos_token_id=0)
    kv = dict(num_key_value_heads=4)
    T = transformers
    zoo = {
        "hf-mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**common, **kv)),
        "hf-qwen3": lambda: T.Qwen3ForCausalLM(T.Qwen3Config(**common, **kv, head_dim=8)),
        "hf-gemma": lambda: T.GemmaForCausalLM(T.GemmaConfig(**common, **kv, head_dim=8, **ids)),
        "hf-olmo": lambda: T.OlmoForCausalLM(T.OlmoConfig(**common, **kv, **ids)),
        "hf-phi": lambda: T.PhiForCausalLM(T.PhiConfig(**common, **kv, **ids)),
        "hf-gptj": lambda: T.GPTJForCausalLM(T.GPTJConfig(vocab_size=128, n_positions=64, n_embd=64, n_layer=layers,
                                                         n_head=8, rotary_dim=4, **ids)),
        "hf-bloom": lambda: T.BloomForCausalLM(T.BloomConfig(vocab_size=128, hidden_size=64, n_layer=layers, n_head=8,
                                                             **ids)),
        "hf-opt": lambda: T.OPTForCausalLM(T.OPTConfig(vocab_size=128, hidden_size=64, ffn_dim=96, num_hidden_layers=layers,
                                                       num_attention_heads=8, max_position_embeddings=64,
                                                       word_embed_proj_dim=64, dropout=0.0, **ids)),
        # Falcon-40B/180B's layout: grouped kv heads fused as (groups, q per group + 2, d), broadcast
        "hf-falcon40b": lambda: T.FalconForCausalLM(T.FalconConfig(
            vocab_size=128, hidden_size=64, num_hidden_layers=layers, num_attention_heads=8, num_kv_heads=4,
            new_decoder_architecture=True, parallel_attn=True, bias=False, **ids)),
        "hf-stablelm": lambda: T.StableLmForCausalLM(T.StableLmConfig(**common, **kv)),
        "hf-starcoder2": lambda: T.Starcoder2ForCausalLM(T.Starcoder2Config(**common, **kv, **ids)),
        "hf-smollm3": lambda: T.SmolLM3ForCausalLM(T.SmolLM3Config(**common, **kv, **ids)),
        # experts: 3-D weights (experts, out, in), run by transformers' grouped GEMM
        "hf-mixtral": lambda: T.MixtralForCausalLM(T.MixtralConfig(**{**common, "intermediate_size": 32}, **kv,
                                                                   num_local_experts=4, num_experts_per_tok=2)),
        # ... with its load-balancing loss in the loss (router logits of every token, every layer)
        "hf-mixtral-aux": lambda: T.MixtralForCausalLM(T.MixtralConfig(
            **{**common, "intermediate_size": 32}, **kv, num_local_experts=4, num_experts_per_tok=2,
            output_router_logits=True, router_aux_loss_coef=0.1)),
        "hf-qwen3moe": lambda: T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(
            **common, **kv, head_dim=8, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
            decoder_sparse_step=1, mlp_only_layers=[])),
        # attention and MLP in parallel from one norm, joined with the residual in one sum; logits scaled
        "hf-cohere": lambda: T.CohereForCausalLM(T.CohereConfig(**common, **kv, logit_scale=0.5, **ids)),
        # qkv fused in model-parallel-blocked order (4 blocks of [q | v | k]), parallel attention and MLP
        "hf-codegen": lambda: T.CodeGenForCausalLM(T.CodeGenConfig(vocab_size=128, n_positions=64, n_ctx=64, n_embd=64,
                                                                   n_layer=layers, n_head=8, rotary_dim=4, **ids)),
        # multi-query attention: one key and value head, fused with the query heads in c_attn
        "hf-bigcode": lambda: T.GPTBigCodeForCausalLM(T.GPTBigCodeConfig(vocab_size=128, n_positions=64, n_embd=64,
                                                                         n_layer=layers, n_head=8, multi_query=True,
                                                                         resid_pdrop=0.0, embd_pdrop=0.0,
                                                                         attn_pdrop=0.0, **ids)),
        # experts as a bmm over (experts, tokens, hidden) @ (experts, hidden, 2 x ffn) on every token, a
        # shared expert beside them; a dense layer, then a mixture of experts (interleave_moe_layer_step=2)
        "hf-llama4": lambda: T.Llama4ForCausalLM(T.Llama4TextConfig(
            **{**common, "intermediate_size": 32}, **kv, head_dim=8, intermediate_size_mlp=48, num_local_experts=4,
            num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=64, **ids)),
        # ParallelExperts: one F.linear per expert's group of rows (split by the experts' counts), in
        # the MLP and in the attention (a mixture of query/output projections over shared keys)
        "hf-jetmoe": lambda: T.JetMoeForCausalLM(T.JetMoeConfig(
            vocab_size=128, hidden_size=64, num_hidden_layers=layers, num_key_value_heads=4, kv_channels=8,
            intermediate_size=32, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2, **ids)),
        # 3-D experts (experts, out, in) under transformers' grouped GEMM, the router a bare weight
        "hf-granitemoe": lambda: T.GraniteMoeForCausalLM(T.GraniteMoeConfig(
            **{**common, "intermediate_size": 32}, **kv, num_local_experts=4, num_experts_per_tok=2, **ids)),
        # Gated DeltaNet linear attention (a fused in_proj_qkvz viewed per key-head group, q, k, v
        # joined again for a causal depthwise conv, A_log / dt_bias per value head, a gated norm per
        # head) then full attention with an output gate; routed experts and a gated shared expert
        # (use_cache=False: training fills no conv or recurrent state)
        "hf-qwen3next": lambda: T.Qwen3NextForCausalLM(T.Qwen3NextConfig(
            **common, **kv, head_dim=8, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8,
            linear_value_head_dim=8, linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"],
            moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
            decoder_sparse_step=1, mlp_only_layers=[], use_cache=False, **ids)),
        # Qwen3.5's Gated DeltaNet: one in_proj_qkv through the causal conv, then split into q, k, v
        "hf-qwen3_5": lambda: T.Qwen3_5ForCausalLM(T.Qwen3_5TextConfig(
            **common, **kv, head_dim=8, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8,
            linear_value_head_dim=8, linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"],
            use_cache=False, **ids)),
        # multi-latent attention (low-rank q and kv), a dense first layer, routed and shared experts
        "hf-deepseekv3": lambda: T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
            **common, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
            first_k_dense_replace=1, n_group=1, topk_group=1, **ids)),
        # DeepSeek's sparse attention: an indexer run under torch.no_grad picks each query's top-k keys
        "hf-deepseekv32": lambda: T.DeepseekV32ForCausalLM(T.DeepseekV32Config(
            **common, num_key_value_heads=8, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
            first_k_dense_replace=1, n_group=1, topk_group=1, index_n_heads=4, index_head_dim=16,
            index_topk=4, **ids)),
        # Mamba-1 (transformers' slow path): in_proj fused [x | z] cut by chunk, a causal depthwise conv,
        # x_proj -> [dt | B | C], dt_proj written dt_proj.weight @ dt, -exp(A_log), the scan over channels
        "hf-mamba": lambda: T.MambaForCausalLM(T.MambaConfig(
            vocab_size=128, hidden_size=64, state_size=8, num_hidden_layers=layers, expand=2, conv_kernel=4,
            time_step_rank=8, use_mambapy=False, **ids)),
        # Mamba-2 (transformers' torch path): in_proj fused [z | xBC | dt], xBC through the depthwise conv
        # cut again into [x | B | C] (2 groups: each rank its own, as Megatron requires), the chunked
        # scan over the sequence padded to the chunk size, the gated norm per group, out_proj by rows (no
        # inference cache: its conv state, a copy into a whole buffer, is not training)
        "hf-mamba2": lambda: T.Mamba2ForCausalLM(T.Mamba2Config(
            vocab_size=128, hidden_size=64, num_heads=8, head_dim=16, expand=2, n_groups=2, state_size=8,
            num_hidden_layers=layers, chunk_size=8, conv_kernel=4, use_cache=False, **ids)),
        # softmax attention, then lightning (linear) attention with its output gate, each residual
        # joined as `residual * alpha + sublayer * beta` (the residual scaled after the sublayer)
        "hf-minimax": lambda: T.MiniMaxForCausalLM(T.MiniMaxConfig(
            **{**common, "intermediate_size": 32}, **kv, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
            layer_types=["full_attention", "linear_attention"], full_attn_alpha_factor=0.5,
            full_attn_beta_factor=2.0, linear_attn_alpha_factor=0.75, linear_attn_beta_factor=1.5,
            mlp_alpha_factor=0.5, mlp_beta_factor=1.25, **ids)),
        # dynamic mask attention (dt_proj of the values biases each head's scores), residuals scaled
        # by learned per-feature weights (`post_attention_residual * residual + attention`)
        "hf-doge": lambda: T.DogeForCausalLM(T.DogeConfig(**common, **kv, **ids)),
        # a relative position bias of the scores' own shape added before the softmax (no residual)
        "hf-cpmant": lambda: T.CpmAntForCausalLM(T.CpmAntConfig(
            vocab_size=128, hidden_size=64, num_attention_heads=8, dim_head=8, dim_ff=96, num_hidden_layers=layers,
            dropout_p=0.0, position_bias_num_buckets=32, position_bias_max_distance=64, prompt_types=4,
            prompt_length=4, segment_types=4, init_std=0.02, use_cache=False)),
        # two attentions and two dense MLPs a layer beside a mixture of experts with zero (identity)
        # experts, multi-latent attention, outputs scaled before the residual
        "hf-longcat": lambda: T.LongcatFlashForCausalLM(T.LongcatFlashConfig(
            vocab_size=128, hidden_size=64, num_layers=layers, num_attention_heads=8, num_key_value_heads=8,
            max_position_embeddings=64, ffn_hidden_size=96, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=4, head_dim=4, v_head_dim=8, qk_head_dim=12, moe_topk=2, n_routed_experts=4,
            zero_expert_num=2, expert_ffn_hidden_size=32, routed_scaling_factor=2.0, **ids)),
        # qkv fused and viewed per head, cut into 8 query, 4 key and 4 value heads (2:1:1), the
        # residual mixed in by a gate computed from a weight, the logits of float32 copies
        "hf-ergo": lambda: T.ErgoForCausalLM(T.ErgoConfig(
            vocab_size=128, hidden_size=64, num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
            first_dense_intermediate_size=96, num_dense_blocks=layers, max_position_embeddings=64,
            sliding_window=64, layer_types=["sliding_attention", "full_attention"][:layers] * (layers // 2 or 1),
            mlp_layer_types=["dense"] * layers, **ids)),
    }
    if name in zoo:
        return zoo[name]()
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


def batches(name: str, b: int, seqs, seed: int) -> list:
    """One global batch per step, as `batch` makes them: step i of sequence length seqs[i],
    drawn with seed + i."""
    return [batch(name, b, s, seed + i) for i, s in enumerate(seqs)]


def loss_of(model, args, kwargs) -> torch.Tensor:
    out = model(*args, **kwargs)
    return out if isinstance(out, torch.Tensor) else out.loss
