"""Ops, context parallel, one attention block: the queries against one block of keys with its
log-sum-exp, its gradients, and the online-softmax merge of blocks -- what every cp attention
(all_gather.py, ring.py, masked.py, hierarchical.py) is computed in.

`_block` runs on a fused kernel that returns the log-sum-exp where one takes the call: on CUDA
the kernel codegen registers as "cp_block" (codegen/attention.py: torch's flash or
memory-efficient attention), on CPU torch's CPU flash kernel; else in plain matmuls (dropout's
keep-mask, float64 on CUDA, head sizes no kernel takes); `_block_backward` is its gradient
given the rows' final output and log-sum-exp ("cp_block_backward" on CUDA; plain matmuls also
for rows that see no key under an additive mask, `norm`);
`_merge` folds a block's (out, lse) into the running ones. Under an additive mask a row that
sees no key (transformers' eager masks add the dtype's lowest value) has softmax uniform over
its keys, which a log-sum-exp cannot carry: `_lowest`, `_keys`, `_floor_keys` and `_floor`
find such rows and the entries that hide their key. `sdpa_like_output` lays out an attention's
output as scaled_dot_product_attention does.
"""
from __future__ import annotations

import torch
from torch import Tensor

from fxtron.ops.kernels import kernel


def sdpa_like_output(q: Tensor, v: Tensor) -> Tensor:
    """An empty (B, H, Sq, Dv) output laid out as scaled_dot_product_attention lays out its own
    ((B, Sq, H, Dv) in memory): the graph may view its transpose without a copy."""
    b, h, s, _ = q.shape
    return q.new_empty((b, s, h, v.shape[-1])).transpose(1, 2)


def _additive(mask: Tensor | None, dtype) -> Tensor | None:
    if mask is None or mask.dtype != torch.bool:
        return None if mask is None else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _acc(q: Tensor) -> torch.dtype:
    """The dtype the ring accumulates in: fp32, or the inputs' if wider (float64 in tests)."""
    return torch.promote_types(q.dtype, torch.float32)


def _fused(q: Tensor, v: Tensor) -> bool:
    """Does a block run on torch's CPU flash kernel (with its log-sum-exp)?"""
    return q.device.type == "cpu" and q.shape[-1] == v.shape[-1]


def _block(q: Tensor, k: Tensor, v: Tensor, scale: float, mask: Tensor | None,
           causal: bool, fused: bool | None = None, keep: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Attention of q against one block of keys: (out (B,H,Lq,Dv), lse (B,H,Lq)) in fp32 (or
    the inputs' wider dtype); a row that sees no key has lse -inf and out 0. `causal`: the top-left causal mask
    (the diagonal step: the rank's own chunks against themselves). On CPU torch's flash
    kernel, which returns the log-sum-exp; elsewhere (or `fused=False`) the same in plain
    matmuls (fp32), also where the values' head size differs from the queries' (DeepSeek's MLA),
    which the flash kernel does not take. `keep`: attention dropout's mask of the block, scaled
    by 1/(1-p) (`_keep`): the probabilities are dropped, the log-sum-exp is the undropped
    softmax's (plain matmuls). On CUDA the registered "cp_block" kernel, where its choice is
    not "matmul" (`fused=False`: matmuls)."""
    if q.device.type == "cuda" and fused is not False:
        fast = kernel("cp_block")
        if fast.choose(q, k, v, mask, causal, keep) != "matmul":
            return fast.run(q, k, v, scale, mask, causal)
        fused = False
    if keep is None and (_fused(q, v) if fused is None else fused):
        bias = _additive(mask, q.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
        lse = lse.to(_acc(q))
        if bias is not None:        # the kernel gives a row that sees no key lse 0: make it -inf
            dead = torch.isinf(bias).all(-1) & (bias < 0).all(-1)
            lse = lse.masked_fill(dead.expand_as(lse), float("-inf"))
        return torch.where(torch.isinf(lse).unsqueeze(-1), 0.0, out.to(_acc(q))), lse
    acc = _acc(q)
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.to(acc)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    keys = _floor_keys(mask, lse)            # a row that sees no key: the mean of its keys, as the flash kernel's
    if keys is not None:
        p = p / keys.unsqueeze(-1)
    return torch.matmul(p if keep is None else p * keep, v.to(acc)), lse


def _block_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                    mask: Tensor | None, causal: bool, fused: bool | None = None,
                    keep: Tensor | None = None, norm: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of one block, in fp32 (or wider), given the rows' final output and log-sum-exp (the
    block's probabilities are exp(scores - lse): its share of the whole softmax). With dropout's
    scaled mask `keep` (FlashAttention-2's backward): dV = (P*keep)^T dO, and the scores'
    gradient P * ((dO V^T) * keep - rowsum(dO * O)), O the dropped output. `norm` (B, H, Lq): what
    each row's exp(scores - lse) is divided by (`_floor_keys`: a row that sees no key). On CUDA
    the registered "cp_block_backward" kernel, where its choice is not "matmul"."""
    if q.device.type == "cuda" and fused is not False:
        fast = kernel("cp_block_backward")
        if fast.choose(q, k, v, mask, causal, keep, norm) != "matmul":
            return fast.run(dout, q, k, v, out, lse, scale, mask, causal)
        fused = False
    if keep is None and norm is None and (_fused(q, v) if fused is None else fused):
        lse = torch.where(torch.isinf(lse), 0.0, lse)    # a row that sees no key anywhere: no gradient
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.to(q.dtype), q, k, v, out.to(q.dtype), lse.to(q.dtype) if q.dtype == torch.float64 else lse, 0.0,
            causal, attn_mask=_additive(mask, q.dtype), scale=scale)
        return dq.to(_acc(q)), dk.to(_acc(q)), dv.to(_acc(q))
    acc = _acc(q)
    qf, kf, vf, do = q.to(acc), k.to(acc), v.to(acc), dout.to(acc)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.to(acc)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    if norm is not None:
        p = p / norm.to(acc).unsqueeze(-1)
    delta = (do * out.to(acc)).sum(-1, keepdim=True)
    dp = torch.matmul(do, vf.transpose(-1, -2))
    dv = torch.matmul((p if keep is None else p * keep).transpose(-1, -2), do)
    ds = p * ((dp if keep is None else dp * keep) - delta)
    return torch.matmul(ds, kf) * scale, torch.matmul(ds.transpose(-1, -2), qf) * scale, dv


def _merge(out: Tensor, lse: Tensor, o: Tensor, l: Tensor, keys: Tensor | None = None,
           low: float = float("-inf")) -> None:
    """Fold a block's (o, l) into the running (out, lse) in place (online softmax). `keys`: the
    block's keys per row under an additive mask whose lowest value is below `low`: a row whose
    every key is at that value (a query that sees none) has softmax uniform over its keys, but
    its log-sum-exp cannot carry log(keys) at -3.4e38 -- such rows add the blocks' means
    weighted by their keys, divided by the row's keys at the end (`_floor_keys`)."""
    new = torch.logaddexp(lse, l)
    safe = torch.where(torch.isinf(new), 0.0, new)
    a = torch.where(torch.isinf(lse), 0.0, torch.exp(lse - safe))
    b = torch.where(torch.isinf(l), 0.0, torch.exp(l - safe))
    if keys is not None:
        b = torch.where((l <= low) & (new <= low) & ~torch.isinf(l), keys.to(b.dtype), b)
    out.mul_(a.unsqueeze(-1)).add_(o * b.unsqueeze(-1))
    lse.copy_(new)


def _lowest(dtype: torch.dtype) -> float:
    """At or below this an additive mask's entry (or a row's log-sum-exp) is at the dtype's lowest
    value, finfo.min, which transformers' eager masks add: half of it."""
    return torch.finfo(dtype).min / 2


def _keys(mask: Tensor) -> Tensor:
    """Each row's keys under an additive mask: its entries above -inf."""
    return (mask > float("-inf")).sum(-1)


def _floor_keys(mask: Tensor | None, lse: Tensor) -> Tensor | None:
    """Under an additive mask, the rows whose every key is at the mask's lowest value (a query
    that sees no key: softmax is uniform over its keys, transformers' eager masks) get their
    number of keys, the others 1 (B, H, rows); None where there are none. Forward divides
    those rows' summed means by it, backward the probabilities exp(s - lse)."""
    if mask is None or mask.dtype == torch.bool:
        return None
    at_floor = (lse <= _lowest(mask.dtype)) & ~torch.isinf(lse)
    if not bool(at_floor.any()):
        return None
    return torch.where(at_floor, _keys(mask).to(lse.dtype), 1.0)


def _floor(mask: Tensor) -> float:
    """The value at or below which an additive mask's entry hides its key: -inf, and also the
    dtype's lowest (transformers' eager masks add finfo.min) where every query row of the mask
    sees some key above it -- then such an entry's probability is exactly 0 (exp underflows),
    while a row that sees none gets SDPA's uniform weights over its keys, which only computing
    every block gives."""
    if mask.dtype == torch.bool:
        return 0.0
    low = _lowest(mask.dtype)
    return low if bool((mask > low).any(-1).all()) else float("-inf")


def _expand_kv(k: Tensor, heads: int) -> Tensor:
    return k if k.shape[1] == heads else k.repeat_interleave(heads // k.shape[1], dim=1)


__all__ = ["sdpa_like_output"]
