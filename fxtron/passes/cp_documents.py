"""Passes, context parallel: packed documents balanced document by document (Megatron's THD).

Under cp a rank holds chunks r and 2n-1-r of its sequence (ops/cp/layout.py), which balances causal
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

from fxtron.core import meta, opsets
from fxtron.errors import ParallelizeError

aten = torch.ops.aten

# what a value is to the proof
CLEAN = "clean"      # permuted with the tokens (or without a sequence dim)
INDEX = "index"      # a token's index in the sequence (an arange over it)
ORDER = "order"      # a boolean of the order of two tokens (a causal mask)
SAME = "same"        # a boolean, false wherever two tokens' documents differ

_RESHAPES = opsets.RESHAPES | opsets.FOLDS | opsets.RESHAPES_AS
_MOVES = opsets.UNSQUEEZES | opsets.EXPANDS | opsets.TRANSPOSES
_COPIES = opsets.COPIES
_CASTS = opsets.CASTS
_VIEWS = _RESHAPES | _MOVES | _COPIES | _CASTS
_PASS = {operator.getitem, aten._assert_tensor_metadata.default, aten.sym_size.int, aten.sym_numel.default,
         aten._assert_scalar.default, aten.sym_constrain_range_for_size.default}
# ops that treat tokens alike wherever the sequence is, as long as it is not a dim they act along
_ROWWISE = {aten.linear.default, aten.matmul.default, aten.bmm.default, aten.mm.default, aten.addmm.default,
            aten.baddbmm.default, aten.embedding.default, aten.layer_norm.default,
            aten.native_layer_norm.default, aten.rms_norm.default, aten.group_norm.default,
            aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default,
            aten.dropout.default, aten.native_dropout.default, aten.sum.default, aten.mean.default,
            aten.amax.default, aten.amin.default, aten.max.default, aten.min.default, aten.count_nonzero.default,
            aten.ones_like.default, aten.zeros_like.default, aten.full_like.default, aten.empty_like.default,
            aten.rand_like.default, aten.randn_like.default, aten.bernoulli.p, aten.gelu.default,
            aten.silu.default, aten.relu.default, aten.tanh.default, aten.sigmoid.default, aten.stack.default,
            aten.scaled_dot_product_attention.default, aten.any.default, aten.all.default}
# reductions and normalisations over `dim`: over the sequence a token's value is the same sum, over
# the batch they would mix rows reordered each its own way
_OVER = {aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default, aten.logsumexp.default,
         aten.var.correction, aten.std.correction, aten.var_mean.correction, aten.count_nonzero.dim_IntList,
         aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default,
         aten.norm.ScalarOpt_dim, aten.linalg_vector_norm.default, aten.any.dim, aten.all.dim, aten.prod.dim_int}
# ops acting along `dim` (their schema's argument), which must be neither the sequence nor the batch
_ALONG = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.tensor_split.sections,
          aten.unbind.int, aten.select.int, aten.narrow.default, aten.index_select.default, aten.gather.default,
          aten.cumsum.default, aten.cumprod.default, aten.cummax.default, aten.cummin.default, aten.diff.default,
          aten.sort.default, aten.sort.stable, aten.argsort.default, aten.argsort.stable, aten.topk.default,
          aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default, aten.kthvalue.default,
          aten.median.dim, aten.mode.default, aten.repeat_interleave.self_int,
          aten.repeat_interleave.self_Tensor, aten.scatter.src, aten.scatter.value, aten.scatter_add.default,
          aten.index_add.default, aten.unfold.default, aten.roll.default, aten.flip.default}
_SOURCES = {aten.ones.default, aten.zeros.default, aten.full.default, aten.empty.memory_format,
            aten.scalar_tensor.default, aten.new_ones.default, aten.new_zeros.default, aten.new_full.default,
            aten.new_empty.default}
_ARANGES = {aten.arange.default, aten.arange.start, aten.arange.start_step}
_EXACT = (None, torch.int32, torch.int64, torch.float64)      # dtypes an arange over any sequence is exact in
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


def _arg(node: fx.Node, name: str):
    """Argument `name` of an aten call as the op takes it (its schema's default when not given)."""
    for i, a in enumerate(node.target._schema.arguments):
        if a.name == name:
            if not a.kwarg_only and i < len(node.args):
                return node.args[i]
            return node.kwargs.get(name, a.default_value if a.has_default_value() else None)
    raise KeyError(f"{node.target} takes no argument {name!r}")


class _Proof:
    def __init__(self, info: meta.TraceInfo, seq: sympy.Symbol, name: str):
        self.info, self.seq, self.name = info, seq, name
        self.documents: set[fx.Node] = set()     # the document ids and views of them
        self.aranges: dict[fx.Node, tuple] = {}   # an INDEX value -> its arange's (start, end, step, dtype)
        # where the sequence (S) and the batch (B) lie inside a dim that folds them with other factors:
        # (node, dim) -> {atom: the product of the factors inside it in that dim}
        self.folds: dict[tuple[fx.Node, int], dict] = {}

    # ------------------------------------------------------------------ shapes
    def shape(self, node) -> tuple:
        val = node.meta.get("val") if isinstance(node, fx.Node) else None
        return self.info.shape(val) if isinstance(val, torch.Tensor) else ()

    def seq_dims(self, node) -> list[int]:
        return [d for d, s in enumerate(self.shape(node)) if self.seq in s.free_symbols]

    def batch_dims(self, node) -> list[int]:
        return [d for d, s in enumerate(self.shape(node)) if meta.BATCH in s.free_symbols]

    def carries(self, node) -> bool:
        return bool(self.seq_dims(node))

    def atoms(self, node, d: int) -> dict:
        """{S or B: the product inside it} for dim d of node (None where not known)."""
        size = self.shape(node)[d]
        got = self.folds.get((node, d), {})
        return {a: got.get(a, 1 if size == a else None) for a in (self.seq, meta.BATCH) if a in size.free_symbols}

    def refuse(self, node: fx.Node, why: str):
        where = meta.get(node, meta.MODULE) or "the model"
        return ParallelizeError(
            f"cp_documents={self.name!r} reorders each row's tokens by their documents (THD load balancing), but "
            f"{node.target} ({node.name} in {where}) {why}, so the reordered rows would not compute the model's "
            f"numbers. Build the mask from the document ids (fxtron.models.masks.document_mask), pass positions as an "
            f"input (position_ids=), or drop cp_documents (the plain load-balanced split)")

    # ------------------------------------------------------------------ the rules
    def kind(self, node: fx.Node, kinds: dict) -> str:
        args = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, fx.Node)]
        got = [kinds.get(a, CLEAN) for a in args]
        t = node.target
        if t in _PASS:
            return got[0] if got and t is operator.getitem else CLEAN
        seq_in = [a for a in args if self.carries(a)]
        if seq_in:
            self._check_rows_kept(node, seq_in)
        if t in _VIEWS:
            self._view(node)
            x = node.args[0]
            if x in self.documents and t not in _CASTS:
                self.documents.add(node)
            if x in self.aranges and (t not in _CASTS or node.meta["val"].dtype in _EXACT):
                self.aranges[node] = self.aranges[x]
            return got[0]
        self._carry_folds(node, args)
        if not self.carries(node) and not seq_in and all(k == CLEAN for k in got):
            return CLEAN                              # nothing here sees the sequence
        if t in _ARANGES:
            if node.kwargs.get("dtype") in _EXACT:
                self.aranges[node] = self._range(node)
            return INDEX
        if t in _SOURCES:
            return CLEAN                              # a constant: every order of it is itself
        pair = self._pair(node)
        n = node.meta["val"].dim() if isinstance(node.meta.get("val"), torch.Tensor) else 0
        if t in _TRIANGLES:
            if not self._ordered(node):
                raise self.refuse(node, "keeps the band of a diagonal other than the main one (the tokens' "
                                        "distance, which the reordering changes)")
            if pair == (n - 2, n - 1) and self._pair(args[0]) == pair:
                if got == [CLEAN]:
                    return ORDER                      # x & (i >= j)
                if got == [SAME]:
                    return CLEAN                      # (same document) & (i >= j)
        if t in _COMPARE and len(args) == 2 and pair and self._lands(args, node) == pair:
            ranges = [self.aranges.get(a) for a in args]
            if got == [INDEX, INDEX] and ranges[0] is not None and ranges[0] == ranges[1]:
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
            if _arg(node, "is_causal"):
                raise self.refuse(node, "is causal attention (is_causal=True), a mask of the tokens' positions")
            return CLEAN
        if not seq_in:
            raise self.refuse(node, f"makes a value of shape {self.shape(node)} along the sequence from none "
                                    "(a table sliced to the sequence's length)")
        self._check_sizes(node)
        if t in _ALONG:
            self._check_along(node)
        elif t in _OVER:
            self._check_over(node)
        elif t is aten.cat.default:
            dim = _arg(node, "dim")
            for x in node.args[0]:
                if isinstance(x, fx.Node) and dim % max(x.meta["val"].dim(), 1) in self.seq_dims(x):
                    raise self.refuse(node, "concatenates along the sequence")
        elif t is aten.slice.Tensor:
            self._check_slice(node)
        elif t is aten.index.Tensor:
            x, indices = node.args[0], node.args[1]
            if any(isinstance(i, fx.Node) and i.meta["val"].dtype in (torch.bool, torch.uint8) for i in indices):
                raise self.refuse(node, "selects by a mask (which tokens, and their order, depend on the layout)")
            indexed = [d for d, i in enumerate(indices) if i is not None]
            if set(self.seq_dims(x) + self.batch_dims(x)) & set(indexed):
                raise self.refuse(node, "indexes the sequence or the batch dim")
        elif t is aten.repeat.default:
            x, reps = node.args[0], list(node.args[1])
            if any(reps[d + len(reps) - x.meta["val"].dim()] != 1 for d in self.seq_dims(x) + self.batch_dims(x)):
                raise self.refuse(node, "repeats the sequence or the batch")
        elif t in (aten.constant_pad_nd.default, aten.pad.default):
            x, pad = node.args[0], list(node.args[1])
            m = x.meta["val"].dim()
            if any(pad[2 * (m - 1 - d):2 * (m - 1 - d) + 2] not in ([], [0, 0]) for d in self.seq_dims(x)):
                raise self.refuse(node, "pads the sequence")
        elif t in _ROWWISE or (isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags):
            self._check_rowwise(node)
        else:
            raise self.refuse(node, "has no rule for reordered tokens")
        return CLEAN

    def _range(self, node: fx.Node) -> tuple:
        """An arange's (start, end, step, dtype), sizes as expressions: two alike index alike."""
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
        diagonal = _arg(node, "diagonal")
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
        rows = set()
        for a in args:
            shape = self.shape(a)
            if len(self.seq_dims(a)) != 1 or sum(1 for s in shape if s == meta.BATCH) != 1:
                return False
            rows |= {n - len(shape) + d for d, s in enumerate(shape) if s == meta.BATCH}
        return len(rows) == 1

    def _check_rows_kept(self, node: fx.Node, seq_in: list) -> None:
        """A value along the sequence of some rows may not lose its rows (x[0], a sum over the
        batch): each row is reordered its own way, and a token of one would meet another's."""
        if any(self.batch_dims(a) for a in seq_in) and self.carries(node) and not self.batch_dims(node):
            raise self.refuse(node, "takes a value along the sequence out of its batch rows (each row is reordered "
                                    "by its own documents)")

    def _check_sizes(self, node: fx.Node) -> None:
        known = {self.seq, meta.BATCH}
        if any(s.free_symbols - known for s in self.shape(node)):
            raise self.refuse(node, f"has a size that depends on the values ({self.shape(node)}), as the tokens it "
                                    "keeps do")

    def _check_along(self, node: fx.Node) -> None:
        t = node.target
        x = node.args[0]
        n = x.meta["val"].dim()
        name = "dims" if t in (aten.roll.default, aten.flip.default) else "dimension" \
            if t is aten.unfold.default else "dim"
        dims = _arg(node, name)
        dims = list(range(n)) if dims is None or dims == [] else [dims] if isinstance(dims, int) else list(dims)
        if set(d % max(n, 1) for d in dims) & set(self.seq_dims(x) + self.batch_dims(x)):
            raise self.refuse(node, "acts along the sequence or the batch (it depends on the tokens' order)")

    def _check_over(self, node: fx.Node) -> None:
        """A reduction or softmax over the batch that keeps the sequence mixes rows' orders."""
        x = node.args[0]
        n = x.meta["val"].dim()
        dims = _arg(node, "dim")
        dims = list(range(n)) if dims is None or dims == [] else [dims] if isinstance(dims, int) else list(dims)
        over = {d % max(n, 1) for d in dims}
        softmax = node.target in (aten.softmax.int, aten._softmax.default, aten.log_softmax.int,
                                  aten._log_softmax.default)
        if over & set(self.batch_dims(x)) and (softmax or self.carries(node)):
            raise self.refuse(node, "reduces over the batch while keeping the sequence (each row is reordered by "
                                    "its own documents)")

    def _check_rowwise(self, node: fx.Node) -> None:
        t = node.target
        if t in (aten.linear.default, aten.matmul.default, aten.mm.default, aten.bmm.default, aten.addmm.default,
                 aten.baddbmm.default):
            x = node.args[1] if t in (aten.addmm.default, aten.baddbmm.default) else node.args[0]
            last = self.shape(x)[-1] if self.shape(x) else None
            if last is not None and meta.BATCH in last.free_symbols and self.carries(node):
                raise self.refuse(node, "contracts the batch while keeping the sequence")
            if t is aten.linear.default and last is not None and self.seq in last.free_symbols:
                raise self.refuse(node, "contracts the sequence with a weight")
        if t is aten.embedding.default and self.carries(node.args[0]):
            raise self.refuse(node, "looks ids up in a table along the sequence")
        if t in (aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default):
            x = node.args[0]
            classes = 1 if x.meta["val"].dim() >= 2 else 0
            if classes in self.seq_dims(x) + self.batch_dims(x):
                raise self.refuse(node, "takes the sequence as its classes (a target picks a position)")

    def _check_slice(self, node: fx.Node) -> None:
        x, dim = node.args[0], _arg(node, "dim")
        start, end, step = _arg(node, "start"), _arg(node, "end"), _arg(node, "step")
        dim = dim % x.meta["val"].dim()
        if dim not in self.seq_dims(x) + self.batch_dims(x):
            return
        whole = (start in (None, 0) and step == 1
                 and (end is None or (isinstance(end, int) and end >= _INF)
                      or self.info.expr(node.meta["val"].shape[dim]) == self.info.expr(x.meta["val"].shape[dim])))
        if not whole:
            raise self.refuse(node, "slices the sequence or the batch")

    # ------------------------------------------------------------------ views and folds
    def _view(self, node: fx.Node) -> None:
        """Where a view puts S and B: moved dims carry their folds; a reshape keeps each inside
        one dim with the same factors inside it -- (B, S, h) <-> (B*S, h) <-> (B, S, n, d),
        (B, n, S, S) <-> (B*n, S, S) -- and anything else (S cut into parts, a fold read back
        in another order, B and n swapped by a reshape) is an error."""
        t, x = node.target, node.args[0]
        if not isinstance(x, fx.Node) or not isinstance(x.meta.get("val"), torch.Tensor):
            return
        n_in, n_out = x.meta["val"].dim(), node.meta["val"].dim()
        if t in _COPIES | _CASTS or t in (aten.expand.default, aten.expand_as.default):
            mapping = {d + n_out - n_in: d for d in range(n_in)}
        elif t in (aten.transpose.int, aten.swapaxes.default, aten.t.default):
            a, b = (0, 1) if t is aten.t.default else (node.args[1] % n_in, node.args[2] % n_in)
            mapping = {d: (b if d == a else a if d == b else d) for d in range(n_in)}
        elif t is aten.permute.default:
            mapping = {i: d % n_in for i, d in enumerate(node.args[1])}
        elif t is aten.movedim.int:
            order = list(range(n_in))
            order.insert(node.args[2] % n_in, order.pop(node.args[1] % n_in))
            mapping = dict(enumerate(order))
        elif t is aten.unsqueeze.default:
            at = node.args[1] % n_out
            mapping = {i: (i if i < at else i - 1) for i in range(n_out) if i != at}
        elif t in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
            kept = [d for d, s in enumerate(self.shape(x)) if s != 1 or d not in self._squeezed(node, n_in)]
            mapping = dict(enumerate(kept))
        else:
            return self._reshape(node, x)
        for out, d in mapping.items():
            if (x, d) in self.folds:
                self.folds[(node, out)] = self.folds[(x, d)]

    @staticmethod
    def _squeezed(node: fx.Node, n: int) -> set[int]:
        if node.target is aten.squeeze.default:
            return set(range(n))
        dims = node.args[1]
        return {d % n for d in ([dims] if isinstance(dims, int) else dims)}

    def _reshape(self, node: fx.Node, x: fx.Node) -> None:
        ins = [(d, s) for d, s in enumerate(self.shape(x)) if s != 1]
        outs = [(d, s) for d, s in enumerate(self.shape(node)) if s != 1]
        atoms = (self.seq, meta.BATCH)
        if not any(a in s.free_symbols for _, s in ins for a in atoms):
            return
        bad = lambda why: self.refuse(node, f"reshapes {self.shape(x)} to {self.shape(node)}: {why}")  # noqa: E731
        i = j = 0
        while i < len(ins) or j < len(outs):
            if i == len(ins) or j == len(outs):
                raise bad("its sizes do not pair up")
            a, b = [ins[i]], [outs[j]]
            pa, pb = ins[i][1], outs[j][1]
            i, j = i + 1, j + 1
            while sympy.simplify(pa - pb) != 0:
                if sympy.fraction(sympy.cancel(pb / pa))[1] == 1 and i < len(ins):
                    a.append(ins[i])
                    pa, i = pa * ins[i][1], i + 1
                elif j < len(outs):
                    b.append(outs[j])
                    pb, j = pb * outs[j][1], j + 1
                else:
                    raise bad("its sizes do not pair up")
            if not any(s in pa.free_symbols for s in atoms):
                continue
            if len(a) > 1 and len(b) > 1:
                raise bad("it reads dims holding the sequence or the batch in another order")
            # where each of S and B lies: the product of the factors inside it, across the block
            inside: dict = {}
            for k, (d, size) in enumerate(a):
                after = sympy.Mul(*[sz for _, sz in a[k + 1:]])
                for atom, q in self.atoms(x, d).items():
                    inside[atom] = None if q is None else q * after
            for k, (d, size) in enumerate(b):
                after = sympy.Mul(*[sz for _, sz in b[k + 1:]])
                here = {}
                for atom in atoms:
                    if atom not in size.free_symbols:
                        continue
                    q = inside.get(atom)
                    if q is None:
                        raise bad("where the sequence or the batch lies inside a folded dim is not known")
                    q = sympy.cancel(q / after)
                    outer = sympy.cancel(size / (atom * q))
                    if sympy.fraction(q)[1] != 1 or sympy.fraction(outer)[1] != 1 or \
                            sympy.degree(size, atom) != 1:
                        raise bad("it cuts the sequence or the batch into parts")
                    here[atom] = q
                self.folds[(node, d)] = here

    def _carry_folds(self, node: fx.Node, args: list) -> None:
        """An op's output dims hold S and B as the input dims of the same size they broadcast from."""
        out = self.shape(node)
        for d, size in enumerate(out):
            if size in (self.seq, meta.BATCH):       # S or B alone: nothing inside it (`atoms`)
                continue
            for a in args:
                shape = self.shape(a)
                k = d - len(out) + len(shape)
                if 0 <= k < len(shape) and sympy.simplify(shape[k] - size) == 0 and (a, k) in self.folds:
                    self.folds[(node, d)] = self.folds[(a, k)]
                    break


__all__ = ["check_documents", "documents_input"]
