"""Passes, context parallel: packed documents balanced document by document (Megatron's THD).

Under cp a rank holds chunks r and 2n-1-r of its sequence (ops/cp.py), which balances causal
attention over one document. A packed row of many documents, attention kept inside each, is
not balanced so: a rank whose chunks hold short documents computes little. Megatron's THD
format splits every document into 2n chunks and gives rank r chunks r and 2n-1-r of each.

fxtron gets the same without padding documents: the runtime reorders each row's tokens by the
chunk of their document they fall in (a token at offset o of a document of L tokens is in
chunk floor(2n o / L)), stably, so each document keeps its order, and splits the reordered row
as always (`document_positions`). Rank r then holds about chunks r and 2n-1-r of every
document. The program runs on the reordered rows as if they were the rows, so it computes the
model's losses only if the model cannot tell: `check_documents` proves that on the traced
graph before anything runs.

The proof. The runtime permutes the sequence of every input; a value that carries the sequence
(a dim whose size involves S) is then permuted the same way if every op on the way treats
tokens alike -- elementwise and row-wise ops, matmuls, lookups by a token's own ids,
reductions and softmaxes over the tokens, attention under a mask that is itself such a value.
What knows the index of a token does not: an arange over the sequence (positions), a table
sliced to it, a scan, shift, slice, concatenation or sort along it, causal attention
(`is_causal`). One pattern is let through, the document mask: a comparison of two aranges
(or a tril/triu) knows only the order of two tokens, and the reordering keeps the order of
two tokens of one document; ANDed with the equality of their document ids it is the mask of
the reordered rows. Anything else that meets the index is a ParallelizeError naming the op
(the traced program returns the loss; an output along the sequence would be one too).
"""
from __future__ import annotations

import operator

import sympy
import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from fxtron.core import meta
from fxtron.errors import ParallelizeError

aten = torch.ops.aten

# what a value is to the proof
CLEAN = "clean"      # permuted with the tokens (or without a sequence dim)
INDEX = "index"      # a token's index in the sequence (an arange over it)
ORDER = "order"      # a boolean of the order of two tokens (a causal mask)
SAME = "same"        # a boolean, false wherever two tokens' documents differ

_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
          aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.expand.default, aten.transpose.int,
          aten.permute.default, aten.t.default, aten.clone.default, aten.contiguous.default, aten.alias.default,
          aten.detach.default, aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.type_as.default,
          aten.lift_fresh_copy.default, aten.expand_as.default, aten.view_as.default, aten.reshape_as.default,
          aten.flatten.using_ints, aten.unflatten.int, aten.movedim.int, aten.swapaxes.default}
_PASS = {operator.getitem, aten._assert_tensor_metadata.default, aten.sym_size.int, aten.sym_numel.default,
         aten._assert_scalar.default, aten.sym_constrain_range_for_size.default}
# ops that treat tokens alike wherever the sequence is, as long as it is not the dim they act along
_ROWWISE = {aten.linear.default, aten.matmul.default, aten.bmm.default, aten.mm.default, aten.addmm.default,
            aten.baddbmm.default, aten.embedding.default, aten.layer_norm.default,
            aten.native_layer_norm.default, aten.rms_norm.default, aten.group_norm.default,
            aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default,
            aten.dropout.default, aten.native_dropout.default, aten.softmax.int, aten._softmax.default,
            aten.log_softmax.int, aten._log_softmax.default, aten.sum.default, aten.sum.dim_IntList,
            aten.mean.default, aten.mean.dim, aten.amax.default, aten.amin.default, aten.max.default,
            aten.min.default, aten.max.dim, aten.min.dim, aten.logsumexp.default, aten.norm.ScalarOpt_dim,
            aten.linalg_vector_norm.default, aten.var.correction, aten.var_mean.correction,
            aten.std.correction, aten.count_nonzero.default, aten.count_nonzero.dim_IntList,
            aten.ones_like.default, aten.zeros_like.default, aten.full_like.default, aten.empty_like.default,
            aten.rand_like.default, aten.randn_like.default, aten.bernoulli.p, aten.gelu.default,
            aten.silu.default, aten.relu.default, aten.tanh.default, aten.sigmoid.default,
            aten.scaled_dot_product_attention.default, aten.any.default, aten.all.default}
# ops with a dim argument (position, name) that must not be a sequence dim
_ALONG = {aten.cat.default: 1, aten.stack.default: 1, aten.split.Tensor: 2, aten.split_with_sizes.default: 2,
          aten.chunk.default: 2, aten.tensor_split.sections: 2, aten.unbind.int: 1, aten.select.int: 1,
          aten.narrow.default: 1, aten.index_select.default: 1, aten.gather.default: 1, aten.cumsum.default: 1,
          aten.cumprod.default: 1, aten.cummax.default: 1, aten.cummin.default: 1, aten.diff.default: 2,
          aten.sort.default: 1, aten.sort.stable: 2, aten.argsort.default: 1, aten.argsort.stable: 2,
          aten.topk.default: 3, aten.repeat_interleave.self_int: 2, aten.repeat_interleave.self_Tensor: 2,
          aten.scatter.src: 1, aten.scatter.value: 1, aten.scatter_add.default: 1, aten.index_add.default: 1,
          aten.unfold.default: 1, aten.softmax.int: None, aten.roll.default: 2, aten.flip.default: 1}
_SOURCES = {aten.ones.default, aten.zeros.default, aten.full.default, aten.empty.memory_format,
            aten.scalar_tensor.default, aten.new_ones.default, aten.new_zeros.default, aten.new_full.default,
            aten.new_empty.default}
_ARANGES = {aten.arange.default, aten.arange.start, aten.arange.start_step}
_COMPARE = {aten.lt.Tensor, aten.le.Tensor, aten.gt.Tensor, aten.ge.Tensor, aten.eq.Tensor, aten.ne.Tensor}
_AND = {aten.__and__.Tensor, aten.bitwise_and.Tensor, aten.logical_and.default, aten.mul.Tensor}
_OR = {aten.__or__.Tensor, aten.bitwise_or.Tensor, aten.logical_or.default}
_NOT = {aten.bitwise_not.default, aten.logical_not.default}
_TRIANGLES = {aten.tril.default, aten.triu.default}
_ATTENTION = {aten.scaled_dot_product_attention.default}
_INF = 2 ** 62


def documents_input(info: meta.TraceInfo, name: str) -> int:
    """The index among the user's tensor inputs of keyword input `name` (ParallelizeError if the
    model takes none, or it is not a (batch, seq) tensor)."""
    leaves = list(range(len(info.statics)))
    _, kwargs = pytree.tree_unflatten(leaves, info.in_spec)
    if name not in kwargs or not isinstance(kwargs[name], int) or info.statics[kwargs[name]] is not None:
        raise ParallelizeError(
            f"cp_documents={name!r} names the keyword input holding each token's document, but the model was traced "
            f"with the keyword inputs {sorted(kwargs) or 'none'}; pass the document ids as {name}= in example_kwargs "
            f"(and every step), or name the one that holds them")
    index = sum(1 for s in info.statics[:kwargs[name]] if s is None)
    if tuple(info.user_dims[index]) != ("batch", "seq"):
        raise ParallelizeError(
            f"cp_documents={name!r}: the document ids must be a (batch, seq) tensor, one id a token, but {name} has "
            f"dims {info.user_dims[index]}")
    return index


def check_documents(gm: fx.GraphModule, name: str) -> int:
    """Prove that reordering each row's tokens, documents kept in order, changes nothing the
    traced model computes (the module docstring); return the user input index of the document
    ids. ParallelizeError names the first op that would see the difference."""
    info = meta.info(gm)
    index = documents_input(info, name)
    kinds: dict[fx.Node, str] = {}
    seq = None
    for node in gm.graph.nodes:
        spec = meta.get(node, meta.INPUT)
        if node.op == "placeholder" and spec is not None and spec.kind == "user":
            if spec.index == index:
                seq = info.shape(node.meta["val"])[1]
            elif "seq" in spec.dims and "batch" not in spec.dims:
                raise ParallelizeError(
                    f"cp_documents={name!r} reorders each row's tokens by their documents, but input {spec.index} "
                    f"has a sequence dim and no batch dim (dims {spec.dims}), so no row's order applies to it; give "
                    f"it a batch dim, or drop cp_documents")
    if not isinstance(seq, sympy.Symbol):
        raise ParallelizeError(f"cp_documents={name!r}: the trace fixed the sequence length of {name} ({seq}); "
                               "trace with the sequence dim dynamic (seq_dim)")
    proof = _Proof(info, seq, name)
    for node in gm.graph.nodes:
        spec = meta.get(node, meta.INPUT)
        if node.op == "placeholder":
            kinds[node] = CLEAN
            if spec is not None and spec.kind == "user" and spec.index == index:
                proof.documents.add(node)
        elif node.op == "call_function":
            kinds[node] = proof.kind(node, kinds)
        elif node.op == "output":
            for out in pytree.tree_leaves(node.args):
                if isinstance(out, fx.Node) and (kinds.get(out) != CLEAN or proof.carries(out)):
                    raise ParallelizeError(
                        f"cp_documents={name!r}: the model returns {out.name}, of shape {proof.shape(out)}, which keeps "
                        f"the sequence; it would come back in the ranks' reordered order. Return the loss alone (or "
                        f"drop cp_documents)")
        else:
            raise ParallelizeError(f"cp_documents={name!r}: {node.op} {node.name} in the traced graph")
    return index


class _Proof:
    def __init__(self, info: meta.TraceInfo, seq: sympy.Symbol, name: str):
        self.info, self.seq, self.name = info, seq, name
        self.documents: set[fx.Node] = set()     # the document ids and views of them
        self.aranges: dict[fx.Node, tuple] = {}   # an INDEX value -> its arange's (start, end, step)

    def shape(self, node: fx.Node) -> tuple:
        val = node.meta.get("val")
        return self.info.shape(val) if isinstance(val, torch.Tensor) else ()

    def seq_dims(self, node) -> list[int]:
        return [d for d, s in enumerate(self.shape(node)) if self.seq in s.free_symbols] \
            if isinstance(node, fx.Node) else []

    def carries(self, node) -> bool:
        return bool(self.seq_dims(node))

    def refuse(self, node: fx.Node, why: str):
        where = meta.get(node, meta.MODULE) or "the model"
        return ParallelizeError(
            f"cp_documents={self.name!r} reorders each row's tokens by their documents (THD load balancing), but "
            f"{node.target} ({node.name} in {where}) {why}, so the reordered rows would not compute the model's "
            f"numbers. Build the mask from the document ids (fxtron.models.masks.document_mask), pass positions as an "
            f"input (position_ids=), or drop cp_documents (the plain load-balanced split)")

    def kind(self, node: fx.Node, kinds: dict) -> str:
        args = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, fx.Node)]
        got = [kinds.get(a, CLEAN) for a in args]
        t = node.target
        if t in _PASS:
            return got[0] if got and t is operator.getitem else CLEAN
        if t in _VIEWS:
            self._check_view(node)
            if node.args[0] in self.documents:
                self.documents.add(node)
            if node.args[0] in self.aranges:
                self.aranges[node] = self.aranges[node.args[0]]
            return got[0]
        if not self.carries(node) and not any(self.carries(a) for a in args) and all(k == CLEAN for k in got):
            return CLEAN                              # nothing here sees the sequence
        if t in _ARANGES:
            self.aranges[node] = self._range(node)
            return INDEX
        if t in _SOURCES:
            return CLEAN                              # a constant: every order of it is itself
        pair = self._pair(node)
        if t in _TRIANGLES and self._ordered(node) and pair and self._pair(args[0]) == pair:
            if got == [CLEAN]:
                return ORDER                          # x & (i >= j)
            if got == [SAME]:
                return CLEAN                          # (same document) & (i >= j)
        if t in _TRIANGLES and not self._ordered(node):
            raise self.refuse(node, "keeps the band of a diagonal other than the main one (the tokens' distance, "
                                    "which the reordering changes)")
        if t in _COMPARE and len(args) == 2 and pair and self._lands(args, node) == pair:
            if got == [INDEX, INDEX] and self.aranges[args[0]] == self.aranges[args[1]]:
                return ORDER                          # one arange against itself: the order of i and j
            if t is aten.eq.Tensor and all(a in self.documents for a in args) and self._rows_kept(args, node):
                return SAME
        if t in _AND and len(got) == 2 and all(k in (CLEAN, ORDER, SAME) for k in got):
            if ORDER in got and not (pair and all(self._lands([a], node) == pair for a, k in zip(args, got)
                                                  if k != CLEAN)):
                raise self.refuse(node, "combines a mask of the tokens' order with values whose sequence dims are "
                                        "not its own")
            if SAME in got:
                return CLEAN if ORDER in got else SAME
            return ORDER if ORDER in got else CLEAN
        if t in _OR | _NOT and all(k in (CLEAN, ORDER, SAME) for k in got):
            if ORDER in got:
                return ORDER
            # two documents' masks or'ed stay inside the documents; not of one holds the pairs across them
            return SAME if t in _OR and all(k == SAME for k in got) else CLEAN
        if INDEX in got:
            raise self.refuse(node, "computes with the tokens' positions in the sequence (an arange over it)")
        if ORDER in got:
            raise self.refuse(node, "takes a mask of the tokens' order (a causal mask) not ANDed with the documents' "
                                    "equality (document_ids[:, :, None] == document_ids[:, None, :])")
        # from here on every input is permuted with the tokens (a SAME is one too)
        if t in _ATTENTION:
            if node.kwargs.get("is_causal") or (len(node.args) > 5 and node.args[5]):
                raise self.refuse(node, "is causal attention (is_causal=True), a mask of the tokens' positions")
            return CLEAN
        if not any(self.carries(a) for a in args):
            raise self.refuse(node, f"makes a value of shape {self.shape(node)} along the sequence from none "
                                    "(a table sliced to the sequence's length)")
        if t in _ALONG:
            self._check_along(node, _ALONG[t])
        elif t is aten.slice.Tensor:
            self._check_slice(node)
        elif t is aten.index.Tensor:
            dims = self.seq_dims(node.args[0])
            indexed = [d for d, i in enumerate(node.args[1]) if i is not None]
            if set(dims) & set(indexed):
                raise self.refuse(node, "indexes the sequence dim")
        elif t is aten.repeat.default:
            x, reps = node.args[0], list(node.args[1])
            if any(reps[d + len(reps) - x.meta["val"].dim()] != 1 for d in self.seq_dims(x)):
                raise self.refuse(node, "repeats the sequence")
        elif t in (aten.constant_pad_nd.default, aten.pad.default):
            x, pad = node.args[0], list(node.args[1])
            n = x.meta["val"].dim()
            if any(pad[2 * (n - 1 - d):2 * (n - 1 - d) + 2] not in ([], [0, 0]) for d in self.seq_dims(x)):
                raise self.refuse(node, "pads the sequence")
        elif t in _ROWWISE or (isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags):
            self._check_rows(node)
        else:
            raise self.refuse(node, "has no rule for reordered tokens")
        return CLEAN

    def _range(self, node: fx.Node) -> tuple:
        """An arange's (start, end, step), sizes as expressions: two aranges alike index alike."""
        def value(a):
            return self.info.expr(a.meta["val"]) if isinstance(a, fx.Node) and "val" in a.meta else a
        args = [value(a) for a in node.args]
        if node.target is aten.arange.default:
            args = [0] + args[:1] + [1]
        elif node.target is aten.arange.start:
            args = args[:2] + [1]
        return tuple(args[:3]) + (str(node.kwargs.get("dtype")),)

    @staticmethod
    def _ordered(node: fx.Node) -> bool:
        """tril / triu keeping i >= j, i > j (tril, diagonal 0 or -1) or i <= j, i < j (triu, 0
        or 1): the order of two tokens, where another diagonal reads their distance."""
        diagonal = node.args[1] if len(node.args) > 1 else node.kwargs.get("diagonal", 0)
        return diagonal in ((0, -1) if node.target is aten.tril.default else (0, 1))

    def _pair(self, node) -> tuple[int, int] | None:
        """The value's two sequence dims (i, j) when it has exactly two, else None."""
        dims = self.seq_dims(node)
        return tuple(dims) if len(dims) == 2 else None

    def _lands(self, args: list, node: fx.Node) -> tuple[int, ...]:
        """The output dims the inputs' sequence dims broadcast to (right-aligned)."""
        n = node.meta["val"].dim()
        return tuple(sorted({n - a.meta["val"].dim() + d for a in args for d in self.seq_dims(a)}))

    def _rows_kept(self, args: list, node: fx.Node) -> bool:
        """The two views of the document ids keep their batch dim at one output dim (row b's
        tokens compared with row b's) and their sequence dims apart."""
        n = node.meta["val"].dim()
        batch = meta.BATCH
        rows = set()
        for a in args:
            shape = self.shape(a)
            seq = self.seq_dims(a)
            rows |= {n - len(shape) + d for d, s in enumerate(shape) if s == batch}
            if len(seq) != 1 or sum(1 for s in shape if s == batch) != 1:
                return False
        return len(rows) == 1

    def _check_rows(self, node: fx.Node) -> None:
        """Rows are permuted each by its own order: an op that sums over the batch while the
        sequence stays (row b's token i with row b''s token i) would mix them."""
        t = node.target
        batch = meta.BATCH
        if t in (aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default, aten.max.dim,
                 aten.min.dim, aten.logsumexp.default, aten.var.correction, aten.std.correction,
                 aten.var_mean.correction, aten.count_nonzero.dim_IntList, aten.softmax.int, aten._softmax.default,
                 aten.log_softmax.int, aten._log_softmax.default) and self.carries(node):
            x = node.args[0]
            dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
            dims = [dims] if isinstance(dims, int) else list(dims or range(x.meta["val"].dim()))
            if any(self.shape(x)[d] == batch for d in dims):
                raise self.refuse(node, "sums over the batch while keeping the sequence (each row is reordered "
                                        "by its own documents)")
        if t in (aten.linear.default, aten.matmul.default, aten.mm.default, aten.bmm.default, aten.addmm.default,
                 aten.baddbmm.default):
            x = node.args[1] if t in (aten.addmm.default, aten.baddbmm.default) else node.args[0]
            last = self.shape(x)[-1] if self.shape(x) else None
            if last is not None and last == batch and self.carries(node):
                raise self.refuse(node, "contracts the batch while keeping the sequence")
            if t is aten.linear.default and last is not None and self.seq in last.free_symbols:
                raise self.refuse(node, "contracts the sequence with a weight")

    def _check_view(self, node: fx.Node) -> None:
        """A view keeps the sequence whole, as one dim's factor with the same elements inside it:
        (B, S, h) <-> (B*S, h) <-> (B, S, n, d); splitting S or moving what lies inside it is an
        error."""
        t = node.target
        if t not in (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
                     aten.unflatten.int, aten.view_as.default, aten.reshape_as.default):
            return
        x = node.args[0]
        if not isinstance(x, fx.Node) or not self.carries(x):
            return
        ins, outs = self.shape(x), self.shape(node)

        def inner(shape):
            dims = [d for d, s in enumerate(shape) if self.seq in s.free_symbols]
            if len(dims) != 1 or sympy.degree(shape[dims[0]], self.seq) != 1:
                return None
            rest = sympy.cancel(shape[dims[0]] / self.seq)          # the dim is S x rest, rest a whole number
            if self.seq in rest.free_symbols or sympy.fraction(rest)[1] != 1:
                return None
            return sympy.simplify(sympy.Mul(*shape[dims[0] + 1:]))
        a, b = inner(ins), inner(outs)
        if a is None or b is None or sympy.simplify(a - b) != 0:
            raise self.refuse(node, f"reshapes {ins} to {outs}, which does not keep each token's elements together")

    def _check_along(self, node: fx.Node, at) -> None:
        if at is None:
            return
        x = node.args[0]
        if isinstance(x, (list, tuple)):
            x = x[0]
        n = x.meta["val"].dim()
        if node.target in (aten.flip.default,):
            dims = list(node.args[1])
        elif node.target in (aten.roll.default,):
            dims = list(node.args[2]) if len(node.args) > 2 else list(range(n))
        else:
            dims = [node.args[at] if len(node.args) > at else node.kwargs.get("dim", 0)]
        dims = [d % n for d in dims if d is not None] if all(d is not None for d in dims) else list(range(n))
        if set(dims) & set(self.seq_dims(x)):
            raise self.refuse(node, "acts along the sequence dim (it depends on the tokens' order)")

    def _check_slice(self, node: fx.Node) -> None:
        x, dim = node.args[0], node.args[1] if len(node.args) > 1 else 0
        start = node.args[2] if len(node.args) > 2 else None
        end = node.args[3] if len(node.args) > 3 else None
        step = node.args[4] if len(node.args) > 4 else 1
        if dim % x.meta["val"].dim() not in self.seq_dims(x):
            return
        whole = (start in (None, 0) and step == 1
                 and (end is None or (isinstance(end, int) and end >= _INF)
                      or self.info.expr(node.meta["val"].shape[dim]) == self.info.expr(x.meta["val"].shape[dim])))
        if not whole:
            raise self.refuse(node, "slices the sequence")


__all__ = ["check_documents", "documents_input"]
