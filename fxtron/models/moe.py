"""Shipped models: a Mixtral style mixture-of-experts decoder -- Llama's attention, and in every
layer a router, top-k routing renormalised over the chosen experts, E SwiGLU experts run as one
grouped GEMM, an optional shared expert, and the Switch load-balancing loss added to the
language-model loss.

Like the other shipped models it knows nothing about parallelism and traces with
`torch.export.export(..., strict=False)` with batch and sequence dynamic. The experts are two
3-D parameters per layer, as transformers' MoE models hold them:
    layers.{i}.mlp.router           Linear(dim, n_experts)          replicated (Megatron too)
    layers.{i}.mlp.experts.gate_up  [n_experts, 2 * ffn_dim, dim]   gate rows, then up rows
    layers.{i}.mlp.experts.down     [n_experts, dim, ffn_dim]
    layers.{i}.mlp.shared.w1/w3/w2  a SwiGLU of shared_ffn_dim (when shared_ffn_dim > 0)

Routing (per token t of T = B x S): p = softmax(router(x_t)) over the E experts; the k largest
p_e are kept and renormalised to sum to 1; the token's output is the sum over its k experts of
weight x expert(x_t), plus the shared expert's. The computation is dropless: tokens are sorted
by expert (the k copies of each), counted per expert (`histc`), and the experts run as one
grouped GEMM over the sorted rows (`grouped_mm`: rows offs[e-1]:offs[e] by expert e's weight),
then put back in token order (the inverse permutation), weighted and summed over each token's k
copies.

Switch load-balancing loss of a layer (Fedus et al. 2021; Megatron's switch_load_balancing_loss):
    aux = E * sum_e f_e * P_e,   f_e = (copies routed to e) / (T * k),   P_e = mean_t p_e
(1 when routing is uniform); the model's loss is cross_entropy + aux_loss_coef x the mean of
the layers' aux. `model.last_aux` holds the layers' aux values of the last forward (outside
tracing), and `model.last_tokens_per_expert` the copies each expert received per layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fxtron.models.llama import FeedForward, Llama, LlamaConfig, TransformerBlock

__all__ = ["MoEConfig", "MoETransformer", "SparseMoE", "grouped_mm", "switch_aux_loss"]


@dataclass(frozen=True)
class MoEConfig(LlamaConfig):
    """Hyperparameters of `MoETransformer`: LlamaConfig's, with ffn_dim each expert's hidden
    size, and n_experts, top_k (experts per token), shared_ffn_dim (0: no shared expert) and
    aux_loss_coef (the Switch loss's weight alpha)."""

    n_experts: int = 8
    top_k: int = 2
    shared_ffn_dim: int = 0
    aux_loss_coef: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"MoEConfig: top_k={self.top_k} must be in [1, n_experts={self.n_experts}]")


# ---------------------------------------------------------------------------------------------
# the grouped GEMM: torch._grouped_mm's contract, for every dtype and device


@torch.library.custom_op("fxtron::grouped_mm", mutates_args=())
def grouped_mm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """x (S, K) rows sorted by group, w (G, K, N), offs (G,) int cumulative row ends: row r of
    group g (offs[g-1] <= r < offs[g]) is x[r] @ w[g]; rows past offs[-1] are zero. (S, N).
    torch._grouped_mm computes the same where it has a kernel (CUDA bf16); this one runs any
    dtype, exports (its fake kernel takes float32) and has a backward."""
    out = x.new_zeros((x.shape[0], w.shape[2]))
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ w[g]
        start = end
    return out


@grouped_mm.register_fake
def _(x, w, offs):
    return x.new_empty((x.shape[0], w.shape[2]))


@torch.library.custom_op("fxtron::grouped_mm_backward", mutates_args=())
def _grouped_mm_backward(x: Tensor, w: Tensor, offs: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    gx, gw = torch.zeros_like(x), torch.zeros_like(w)
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            gx[start:end] = grad[start:end] @ w[g].transpose(0, 1)
            gw[g] = x[start:end].transpose(0, 1) @ grad[start:end]
        start = end
    return gx, gw


@_grouped_mm_backward.register_fake
def _(x, w, offs, grad):
    return torch.empty_like(x), torch.empty_like(w)


def _setup(ctx, inputs, output):
    x, w, offs = inputs
    ctx.save_for_backward(x, w, offs)


def _backward(ctx, grad):
    x, w, offs = ctx.saved_tensors
    gx, gw = torch.ops.fxtron.grouped_mm_backward(x, w, offs, grad.contiguous())
    return gx, gw, None


grouped_mm.register_autograd(_backward, setup_context=_setup)


# ---------------------------------------------------------------------------------------------


def switch_aux_loss(probs: Tensor, tokens_per_expert: Tensor, top_k: int) -> Tensor:
    """E * sum_e f_e * P_e for router probabilities probs (T, E) and the copies each expert
    received (E,): f_e = tokens_per_expert_e / (T * k), P_e = mean over tokens of probs[:, e]."""
    E = probs.shape[1]
    counts = tokens_per_expert.to(probs.dtype)
    f = counts / counts.sum()          # = / (T * k) when dropless; no arithmetic on symbolic sizes
    return E * (f * probs.mean(0)).sum()


class Experts(nn.Module):
    """E SwiGLU experts as two 3-D weights, run by the grouped GEMM on rows sorted by expert.

    forward(x (S, dim) sorted by expert, offs (E,)) -> (S, dim)."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        E, h, f = config.n_experts, config.dim, config.ffn_dim
        self.gate_up = nn.Parameter(torch.empty(E, 2 * f, h))
        self.down = nn.Parameter(torch.empty(E, h, f))

    def forward(self, x: Tensor, offs: Tensor) -> Tensor:
        gate, up = grouped_mm(x, self.gate_up.transpose(1, 2), offs).chunk(2, dim=-1)   # 2 x (S, f)
        return grouped_mm(F.silu(gate) * up, self.down.transpose(1, 2), offs)          # (S, dim)


class SparseMoE(nn.Module):
    """Router, top-k, experts (dropless), optional shared expert.

    forward(x (B, T, dim)) -> (y (B, T, dim), aux (scalar Switch loss), tokens per expert (E,))."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k = config.n_experts, config.top_k
        self.router = nn.Linear(config.dim, config.n_experts, bias=False)
        self.experts = Experts(config)
        self.shared = (FeedForward(LlamaConfig(**{**_llama_fields(config), "ffn_dim": config.shared_ffn_dim}))
                       if config.shared_ffn_dim > 0 else None)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, T, h = x.shape
        tokens = x.reshape(-1, h)                                           # (N, h), N = B*T
        logits = self.router(tokens)                                        # (N, E), softmax in >= 32 bits
        probs = F.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)             # (N, k) each
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        flat = chosen.reshape(-1)                                           # (N*k,) expert of each copy
        order = torch.argsort(flat, stable=True)                            # copies sorted by expert
        counts = torch.histc(flat.float(), bins=self.n_experts, min=0, max=self.n_experts - 1)   # (E,)
        offs = torch.cumsum(counts, dim=0).to(torch.int32)
        out = self.experts(tokens[order // self.top_k], offs)               # (N*k, h), sorted by expert
        back = out[torch.argsort(order)].view(-1, self.top_k, h)            # (N, k, h): each token's copies
        y = (back * weights.unsqueeze(-1)).sum(1)                           # weighted and summed per token
        if self.shared is not None:
            y = y + self.shared(tokens)
        return y.view(B, T, h), switch_aux_loss(probs, counts.detach(), self.top_k), counts


def _llama_fields(config: MoEConfig) -> dict:
    return {k: getattr(config, k) for k in LlamaConfig.__dataclass_fields__}


class MoEBlock(TransformerBlock):
    """Llama's pre-norm block with the MoE as its mlp: x + attn(attn_norm(x)), then +
    moe(ffn_norm(x)); also returns the loss's aux term so far (the `aux` given plus
    aux_loss_coef / n_layer x this layer's Switch loss), the layer's tokens per expert and its
    Switch loss."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__(config, mlp=SparseMoE(config))
        self.aux_scale = config.aux_loss_coef / config.n_layer

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, aux: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        y, mine, counts = self.mlp(self.ffn_norm(x))
        # the loss's aux term, summed through the layers: nothing runs between two layers (fxtron
        # traces one and repeats it), and one scalar crosses a pipeline cut
        return x + y, aux + self.aux_scale * mine, counts, mine


class MoETransformer(Llama):
    """A Mixtral style mixture-of-experts language model (see the module docstring).

    forward(idx, targets=None): idx (B, T) int64 ids; returns logits (B, T, V) without targets,
    else the scalar cross entropy + aux_loss_coef x mean over layers of the Switch loss.
    """

    def __init__(self, config: MoEConfig) -> None:
        super().__init__(config)
        self.layers = nn.ModuleList(MoEBlock(config) for _ in range(config.n_layer))
        self.last_aux: list[Tensor] = []
        self.last_tokens_per_expert: list[Tensor] = []
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Llama's (normal(0, 0.02) for linears and embeddings, ones for norms), and
        normal(0, 0.02) for the experts' 3-D weights."""
        super().init_weights()
        for module in self.modules():
            if isinstance(module, Experts):
                nn.init.normal_(module.gate_up, mean=0.0, std=0.02)
                nn.init.normal_(module.down, mean=0.0, std=0.02)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:
        _, T = idx.shape
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.tok_embeddings(idx)
        total = x.new_zeros((), dtype=torch.float32)
        auxes, counts = [], []
        for layer in self.layers:
            x, total, c, aux = layer(x, cos, sin, total)
            auxes.append(aux)
            counts.append(c)
        if not torch.compiler.is_compiling() and not _tracing(idx):
            self.last_aux = [a.detach() for a in auxes]
            self.last_tokens_per_expert = [c.detach() for c in counts]
        logits = self.output(self.norm(x))
        if targets is None:
            return logits
        V = self.config.vocab_size
        lm = F.cross_entropy(logits.view(-1, V), targets.view(-1))
        return lm + total


def _tracing(t: Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(t, FakeTensor) or t.device.type == "meta"
