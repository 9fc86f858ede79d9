"""Ops, context parallel: the sequence split over the cp ranks with Megatron's load balancing,
and attention across the split, one module per job.

- layout.py: the layout. A sequence of F tokens over n cp ranks is viewed as 2n equal chunks
  and rank r holds chunks r and 2n-1-r, in that order (Megatron's get_batch_on_this_cp_rank):
  under a causal mask chunk i attends to i+1 chunks, so every rank's queries see 2n+1 chunks of
  keys. `zigzag` reorders a dim so that a plain split over n ranks gives this layout (chunks in
  the order 0, 2n-1, 1, 2n-2, ...), and its inverse restores the natural order after an
  all-gather. A dim of k blocks (batch and sequence folded into one) is reordered block by
  block. It moves no data between ranks. Packed documents are split the same way after each
  row is put in the order of its documents' chunks (`document_order`).
- all_gather.py: attention with the keys gathered (cp_comm_type="all_gather", Llama 3's
  choice). `attention_all_gather(q, k, v, ...)` takes this rank's queries (its two chunks) and
  the whole sequence's keys and values in natural order, and computes causal attention of each
  query chunk against only the keys before it: the rank's score elements are (2n+1) c^2 for
  chunks of c tokens, equal on every rank. The keys' gather before it is
  `gather_from_sequence`, whose backward reduce-scatters dK and dV.
- blocks.py: one attention block (the queries against one block of keys, with its
  log-sum-exp, on a fused kernel -- codegen/attention.py's on CUDA, the CPU flash kernel on
  CPU -- or in plain matmuls), its gradients, and the
  online-softmax merge of blocks that every attention here is computed in.
- pieces.py: which parts of a key block a rank computes: Megatron's causal plan per ring
  step, or under an explicit mask one piece per run of rows that see the same keys (a document
  mask's block document by document), none where the block is empty.
- ring.py: the ring (cp_comm_type="p2p"): the keys and values stay split and travel around
  the cp group while the block in hand is computed; attention dropout's masks per block.
- masked.py: all_gather under an explicit mask (a document mask): the ring's blocks over the
  gathered keys, without the ring.
- ulysses.py: attention over a head split (cp_comm_type="a2a", DeepSpeed-Ulysses):
  `cp_all_to_all` turns q, k and v from the rank's sequence chunks of every head into every
  token of 1/n of the heads; the sequence is put in natural order (zigzag), attention runs as
  the model wrote it, and the inverse all-to-all brings the rank's chunks of every head back.
- hierarchical.py: a2a+p2p (Megatron's hierarchical cp): Ulysses inside groups of k
  consecutive cp ranks, the ring across the groups.

Importing the package imports every module, which registers the torch.ops.fxtron ops (zigzag,
ring_attention, masked_attention, cp_all_to_all, hierarchical_attention); a name is imported
from the module that owns it.
"""
# in the order they build on each other, which is the order the ops register in
from fxtron.ops.cp import layout, blocks, pieces, all_gather, ring, masked, ulysses, hierarchical  # noqa: F401

__all__ = ["all_gather", "blocks", "hierarchical", "layout", "masked", "pieces", "ring", "ulysses"]
