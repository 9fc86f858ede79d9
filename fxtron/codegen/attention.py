"""Codegen, context parallel attention's blocks: the fused kernels one block of the cp ring
(ops/cp/blocks.py `_block`, `_block_backward`) runs on CUDA, registered as "cp_block" and
"cp_block_backward".

A block is the queries against one block of keys, returning its output and log-sum-exp in fp32
(the ring merges blocks through it); its backward gets the rows' *final* output and log-sum-exp
(ring flash attention's contract). torch's fused attention kernels return the log-sum-exp and
take it back in backward, so a block is one of them with the contract's edges around it: a row
that sees no key has lse -inf and out 0, and under an additive mask a row whose every key is at
the mask's lowest value (transformers' eager masks add finfo.min: softmax uniform over its keys)
gets the mean of its keys and the log-sum-exp of its mask, as the matmuls give.

| kernel     | takes (`block_kernel`)                                                              |
|------------|-------------------------------------------------------------------------------------|
| flash      | CUDA, fp16/bf16, no mask (top-left causal only with as many keys as queries), equal  |
|            | head dims, a multiple of 8 up to 256: `_scaled_dot_product_flash_attention`        |
| efficient  | CUDA, fp16/bf16/fp32, a boolean or additive mask (an additive bias to the kernel),   |
|            | top-left causal, head dims multiples of 8 (the values' may differ: MLA):             |
|            | `_scaled_dot_product_efficient_attention`                                          |
| cpu_flash  | CPU, equal head dims: `_scaled_dot_product_flash_attention_for_cpu` (in blocks.py)  |
| matmul     | everything else: dropout's keep-mask, a backward with rows that see no key under an |
|            | additive mask (`norm`), float64, head dims no kernel takes, other devices           |

The ops' schemas (`aten::_scaled_dot_product_{flash,efficient}_attention[_backward]`) are the
same in torch 2.11 and 2.13; the efficient kernel's log-sum-exp may come padded along the
queries to a multiple of 32, and is sliced.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fxtron.ops.cp.blocks import _acc, _lowest
from fxtron.ops.kernels import Kernel, register_kernel

FLASH, EFFICIENT, MATMUL, CPU_FLASH = "flash", "efficient", "matmul", "cpu_flash"
_HALF = (torch.float16, torch.bfloat16)
_BIAS_ALIGN = 16    # the efficient kernel reads its bias in aligned rows (torch's SDPA pads it so)
_LSE_ALIGN = 32     # ... and its log-sum-exp padded along the queries


def mask_kind(mask: Tensor | None) -> str:
    """"none", "bool" or "additive"."""
    return "none" if mask is None else "bool" if mask.dtype == torch.bool else "additive"


def block_kernel(device_type: str, dtype: torch.dtype, mask: str, qk_dim: int, v_dim: int, *,
                 dropout: bool = False, causal: bool = False, lq: int | None = None, lk: int | None = None,
                 norm: bool = False) -> str:
    """Which kernel one cp attention block takes: "flash", "efficient", "cpu_flash" or "matmul".
    A pure function of static facts: the device type, the inputs' dtype, the mask's kind
    ("none", "bool", "additive"; a causal block has no other mask), the queries' and values'
    head dims, dropout, whether the block is the top-left causal one, its query and key
    lengths (None: equal), and (backward) whether rows that see no key under an additive
    mask divide their probabilities (`norm`)."""
    if dropout or norm:
        return MATMUL
    if causal:
        mask = "none"
    if device_type == "cpu":
        return CPU_FLASH if qk_dim == v_dim else MATMUL
    if device_type != "cuda":
        return MATMUL
    square = lq is None or lk is None or lq == lk
    if (dtype in _HALF and mask == "none" and qk_dim == v_dim and qk_dim % 8 == 0 and qk_dim <= 256
            and (square or not causal)):
        return FLASH
    if dtype in _HALF + (torch.float32,) and qk_dim % 8 == 0 and v_dim % 8 == 0:
        return EFFICIENT
    return MATMUL


def choose_forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool,
                   keep: Tensor | None = None) -> str:
    """`block_kernel` for a call of `_block` (reads devices, dtypes and shapes: fake tensors too)."""
    return block_kernel(q.device.type, q.dtype, mask_kind(mask), q.shape[-1], v.shape[-1],
                        dropout=keep is not None, causal=causal, lq=q.shape[-2], lk=k.shape[-2])


def choose_backward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool,
                    keep: Tensor | None = None, norm: Tensor | None = None) -> str:
    """`block_kernel` for a call of `_block_backward`."""
    return block_kernel(q.device.type, q.dtype, mask_kind(mask), q.shape[-1], v.shape[-1],
                        dropout=keep is not None, causal=causal, lq=q.shape[-2], lk=k.shape[-2],
                        norm=norm is not None)


def _unit(t: Tensor) -> Tensor:
    """The kernels read the head dim contiguously."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """blocks.py's `_additive`: a boolean mask as 0 / -inf, an additive one in `dtype`."""
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask.logical_not(), float("-inf"))


def _bias(bias: Tensor, q: Tensor, k: Tensor) -> Tensor:
    """An additive bias (in q's dtype) as the efficient kernel reads it: a fresh tensor whose rows
    are aligned (padded, then sliced back, before the broadcast dims are expanded: no copy per
    head), expanded to (B, H, Lq, Lk)."""
    bias = bias.reshape((1,) * (4 - bias.ndim) + tuple(bias.shape))
    lk = bias.shape[-1]
    pad = -lk % _BIAS_ALIGN
    padded = F.pad(bias, (0, pad)) if pad else bias.clone(memory_format=torch.contiguous_format)
    return padded.narrow(-1, 0, lk).expand(q.shape[0], q.shape[1], q.shape[-2], k.shape[-2])


def _rows(mask: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor | None, Tensor]:
    """(dead, floor, bias): the rows that see no key (every entry False or -inf), under an
    additive mask those whose every key is at the mask's lowest value (None for a boolean
    mask), and the bias the kernel gets in `dtype`: a dead row all 0 (the kernel computes
    nothing undefined; its row is replaced after), a floor row 0 on its keys and -inf elsewhere
    (with its query zeroed: the mean of its keys)."""
    seen = mask if mask.dtype == torch.bool else mask > float("-inf")
    bias, floor = _additive(mask, dtype), None
    dead = seen.any(-1).logical_not()
    if mask.dtype != torch.bool:
        floor = (mask <= _lowest(mask.dtype)).all(-1) & dead.logical_not()
        bias = torch.where(floor.unsqueeze(-1), _additive(seen, dtype), bias)
    return dead, floor, bias.masked_fill(dead.unsqueeze(-1), 0.0)


def block_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, mask: Tensor | None,
                  causal: bool) -> tuple[Tensor, Tensor]:
    """`_block` on a fused CUDA kernel (the call's `choose_forward` is "flash" or "efficient"):
    (out (B,H,Lq,Dv), lse (B,H,Lq)) in fp32."""
    which = choose_forward(q, k, v, mask, causal)
    acc, lq = _acc(q), q.shape[-2]
    q, k, v = _unit(q), _unit(k), _unit(v)
    if which == FLASH:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        return out.to(acc), lse.narrow(-1, 0, lq).to(acc)
    if which != EFFICIENT:
        raise ValueError(f"cp_block: this call takes {which!r}, not a fused CUDA kernel")
    if causal or mask is None:
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale)[:2]
        return out.to(acc), lse.narrow(-1, 0, lq).to(acc)
    dead, floor, bias = _rows(mask, q.dtype)
    if floor is not None:
        q = q.masked_fill(floor.unsqueeze(-1), 0.0)      # scores 0 on its keys: their mean
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, _bias(bias, q, k), True, 0.0, False, scale=scale)[:2]
    out, lse = out.to(acc), lse.narrow(-1, 0, lq).to(acc)
    if floor is not None:       # the matmuls' log-sum-exp: the scores vanish beside the floor
        lse = torch.where(floor, torch.logsumexp(mask.to(acc), -1), lse)
    return out.masked_fill(dead.unsqueeze(-1), 0.0), lse.masked_fill(dead, float("-inf"))


def block_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                   mask: Tensor | None, causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """`_block_backward` on a fused CUDA kernel, given the rows' final output and log-sum-exp:
    (dq, dk, dv) in fp32."""
    which = choose_backward(q, k, v, mask, causal)
    acc, lq, lk = _acc(q), q.shape[-2], k.shape[-2]
    lse = torch.where(torch.isinf(lse), 0.0, lse).float()    # a row that sees no key anywhere: no gradient
    q, k, v = _unit(q), _unit(k), _unit(v)
    dout, out = _unit(dout.to(q.dtype)), _unit(out.to(q.dtype))
    rng = torch.empty((), dtype=torch.int64, device=q.device)  # no dropout: never read
    if which == FLASH:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), None, None, lq, lk, 0.0, causal, rng, rng, scale=scale)
    elif which == EFFICIENT:
        # the mask as it is: a row hidden in this block (or at its floor here) has p = 0 here
        bias = None if causal or mask is None else _bias(_additive(mask, q.dtype), q, k)
        lse = F.pad(lse, (0, -(-lq // _LSE_ALIGN) * _LSE_ALIGN - lq))
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, bias, out, lse, rng, rng, 0.0, [True, True, True, False], causal, scale=scale)
    else:
        raise ValueError(f"cp_block_backward: this call takes {which!r}, not a fused CUDA kernel")
    del dout, out, lse
    grads = [dq, dk, dv]
    del dq, dk, dv
    for i in range(3):      # one at a time: each 16-bit gradient is freed as its fp32 copy is made
        grads[i] = grads[i].to(acc)
    return tuple(grads)


register_kernel(Kernel("cp_block", run=block_forward, choose=choose_forward))              # ops/cp/blocks.py _block
register_kernel(Kernel("cp_block_backward", run=block_backward, choose=choose_backward))   # ... _block_backward

__all__ = ["block_kernel", "mask_kind", "choose_forward", "choose_backward", "block_forward", "block_backward",
           "FLASH", "EFFICIENT", "MATMUL", "CPU_FLASH"]
