"""Runtime: the distributed optimizer (ZeRO stage 1, Megatron's DistributedOptimizer; stage 2).

The gradient buffer's buckets are reduce-scattered over data parallel, so dp rank r holds the
averaged gradient of the r-th 1/dp of every bucket. The parameters become views of one fp32
parameter buffer laid out like the gradient buffer; each rank's optimizer sees only its shard
of it (the pieces of parameters that fall in its shard of each bucket), so optimizer state
(AdamW's two moments) takes 1/dp of the memory. After the step each bucket's updated shard is
all-gathered over data parallel, bucket by bucket, and the step waits for them before it returns
(Megatron's default): what the user reads or writes of the parameters between steps is the
updated whole. With overlap_param_gather the gathers stay in flight past the step and each layer's
forward in the next step waits only for its own buckets (the graph's param_wait nodes, `ready`),
as Megatron overlaps them: between steps the parameters are current once `prog.settle()` or a
reader of fxtron's (state_dict, save, eval_step, the program's forward) has waited for them.

Under zero=2 the rank keeps, after the reduce-scatter, copies of its shards of the gradients
only: the whole buffer's memory is released between steps and allocated again when the next
step's backward begins (during backward the buffer is whole, as under zero=1).

With expert parallel the program has two gradient buffers -- the dense parameters' over dp and
the expert weights' over expert-dp (Megatron's expert distributed optimizer) --; each is
sharded over its own group the same way, and one optimizer steps the shards of both.

The user's optimizer is a template: its class, defaults and param groups (hyperparameters,
which parameters are in which group) are mirrored onto the shards, and its groups' current
hyperparameters (an lr schedule's lr, say) are copied over before every step. Its
`state_dict()` reports the shards' state gathered into each parameter's (`template_state`, a
collective over data parallel), and a state loaded into it replaces the shards' at the next
step (runtime/optim.py speak_for).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fxtron.core.records import ZERO_WAITED
from fxtron.errors import ParallelizeError
from fxtron.ops import ledger
from fxtron.runtime.optim import loaded_state, rebuild, speak_for
from fxtron.runtime.precision import compute_copy


class _Part:
    """One gradient buffer's side: the fp32 parameter buffer laid out like it, and this rank's
    pieces of each of its buckets, (parameter name, [lo, hi) in the buffer)."""

    def __init__(self, buf, params: dict):
        self.buf = buf
        self.dp, self.rank = buf.dp, buf.dp_rank
        self.bytes_gathered = 0                 # sent by this rank's all-gathers (ring), since reset
        first = next(iter(params.values()))
        self.param_data = torch.zeros(buf.data.numel(), dtype=first.dtype, device=first.device)
        for n in buf.offsets:
            p = params[n]
            off, k = buf.offsets[n]
            self.param_data[off:off + k].copy_(p.detach().reshape(-1))
            p.data = self.param_data[off:off + k].view_as(p)
        self.pieces: list[tuple[str, int, int]] = []
        for b in buf.buckets:
            s0, s1 = buf.shard(b, self.rank)
            for n in b.params:
                off, k = buf.offsets[n]
                lo, hi = max(off, s0), min(off + k, s1)
                if lo < hi:
                    self.pieces.append((n, lo, hi))

    def gather(self, flat: torch.Tensor, works: list | None = None) -> None:
        """Every rank's shard of each bucket of `flat` (laid out like the buffer) to every rank:
        asynchronously into `works` (as (part, bucket index, work, source)), or now."""
        if self.dp == 1:
            return
        group = self.buf.group
        for b in self.buf.buckets:
            s0, s1 = self.buf.shard(b, self.rank)
            src = flat[s0:s1].clone()
            self.bytes_gathered += src.numel() * src.element_size() * (self.dp - 1)
            if works is None:
                with ledger.collective(group, "all_gather", src):
                    dist.all_gather_into_tensor(flat[b.start:b.end], src, group=group)
            else:
                e = ledger.issue(group, "all_gather", src)
                works.append((self, b.index, ledger.started(e, dist.all_gather_into_tensor(
                    flat[b.start:b.end], src, group=group, async_op=True)), src))


def _elementwise(v, shard: torch.Tensor) -> bool:
    """Whether optimizer state `v` of `shard` is elementwise (shaped like it: gathered as the
    parameters are), not a scalar (a step count)."""
    return isinstance(v, torch.Tensor) and v.shape == shard.shape and v.dim() > 0


def _portable(v):
    """A scalar of optimizer state as another rank can take it: a tensor as its value and dtype."""
    if isinstance(v, torch.Tensor):
        return ("tensor", v.tolist(), v.dtype, v.device.type)
    return ("value", v)


def _restored(v, device: torch.device):
    if v[0] == "tensor":
        _, value, dtype, kind = v
        return torch.tensor(value, dtype=dtype, device=device if kind != "cpu" else "cpu")
    return v[1]


def _all_ranks(part, mine: dict) -> list[dict]:
    """`mine` from every rank of `part`'s data-parallel group (this rank's alone without one)."""
    if part.dp == 1:
        return [mine]
    every: list = [None] * part.dp
    with ledger.collective(part.buf.group, "all_gather_object"):
        dist.all_gather_object(every, mine, group=part.buf.group)
    return every


class ZeroOne:
    """The distributed optimizer over a program's gradient buffers (`buffers`, by group kind)
    and its parameters (`params`, by name), which become views of the fp32 parameter buffers."""

    def __init__(self, buffers: dict, params: dict[str, nn.Parameter], *, release: bool = False,
                 gradless: frozenset = frozenset()):
        self.params = params
        #: zero=2: after the reduce-scatter the rank keeps only its shards of the gradients (copies);
        #: the whole buffer's memory is released until the next step's backward
        self.release = release
        #: the parameters no gradient of the loss reaches: their shards keep .grad None
        self.gradless = gradless
        self.parts = [_Part(buf, params) for buf in buffers.values() if buf.offsets]
        self._part_of = {n: part for part in self.parts for n in part.buf.offsets}
        # this rank's pieces, every buffer's: (part, parameter name, [lo, hi) in that buffer)
        self.pieces = [(part, n, lo, hi) for part in self.parts for n, lo, hi in part.pieces]
        # the optimizer's parameters: views of the rank's shard, so its updates land in place
        self.shards = [nn.Parameter(part.param_data[lo:hi]) for part, _, lo, hi in self.pieces]
        self._inner: torch.optim.Optimizer | None = None
        self._template = None
        self._layout: list[list[int]] = []      # the template's groups (parameter ids) the shards' mirror
        self._works: list = []
        self.dtype = None            # the compute dtype (mixed precision), set by the program
        #: overlap_param_gather: the next step's forward waits for the gathers (set by the program);
        #: else the step waits for them before it returns
        self.overlap = False
        self.waited: list[int] = []  # bucket indices waited for by forwards since the step (overlap_param_gather)
        self.last_waited: list[int] = []   # ... in the last step's forwards

    # ------------------------------------------------------------------ the optimizer
    def optimizer_for(self, template: torch.optim.Optimizer) -> list[nn.Parameter]:
        """The shard parameters, with an optimizer over them mirroring `template`."""
        names = {id(p): n for n, p in self.params.items()}

        def shard_group(g: dict) -> dict:
            mine = {names[id(p)] for p in g["params"] if id(p) in names}
            hyper = {k: v for k, v in g.items() if k != "params"}
            return {**hyper, "params": [s for s, (_, n, _, _) in zip(self.shards, self.pieces) if n in mine]}
        layout = [[id(p) for p in g["params"]] for g in template.param_groups]
        first = self._inner is None or self._template is not template
        if first:
            self._inner = rebuild(template, [shard_group(g) for g in template.param_groups])
            self._template, self._layout = template, layout
            speak_for(template, self)
        elif layout != self._layout:
            # groups added since (add_param_group: unfreezing in stages) join the shards' optimizer;
            # any other change of the groups would leave its state on the wrong shards
            if layout[:len(self._layout)] != self._layout:
                raise ParallelizeError(f"the param groups of {type(template).__name__} changed after its first step "
                                       "(other than add_param_group); the distributed optimizer holds its state by "
                                       "shard: build a new optimizer")
            for g in template.param_groups[len(self._layout):]:
                self._inner.add_param_group(shard_group(g))
            self._layout = layout
        loaded = loaded_state(template, first=first)     # (the user's load_state_dict: replaces the shards' state)
        if loaded is not None:
            self._inner.state.clear()
            self._set_state({names[id(p)]: st for p, st in loaded.items() if id(p) in names})
        return self.shards

    @property
    def template(self) -> torch.optim.Optimizer | None:
        """The user's optimizer the shards' optimizer mirrors."""
        return self._template

    def template_state(self) -> dict:
        """Each parameter's state shaped like it, by the template's parameter (gathered_state)."""
        return {self.params[n]: st for n, st in self.gathered_state().items()}

    @property
    def bytes_gathered(self) -> int:
        """Bytes this rank sent in the last step's all-gathers of the updated parameters."""
        return sum(part.bytes_gathered for part in self.parts)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer over this rank's shards (its state is 1/dp of the whole)."""
        return self._inner

    def set_grads(self) -> None:
        for s, (part, n, lo, hi) in zip(self.shards, self.pieces):
            if n in self.gradless:      # no gradient in the model: .grad None, the optimizer skips it
                s.grad = None
                continue
            g = part.buf.data[lo:hi]
            s.grad = g.clone() if self.release and g.dtype == s.dtype else g if g.dtype == s.dtype else g.to(s.dtype)
        if self.release:
            for part in self.parts:
                part.buf.release()

    def shard_grads(self):
        for s, (_, n, _, _) in zip(self.shards, self.pieces):
            if s.grad is not None:
                yield s.grad, n

    def shard_starts(self):
        """Per shard of shard_grads: where it starts in its parameter's flat local tensor."""
        for s, (part, n, lo, _) in zip(self.shards, self.pieces):
            if s.grad is not None:
                yield lo - part.buf.offsets[n][0]

    def step(self, template: torch.optim.Optimizer) -> None:
        self.optimizer_for(template)
        for mine, theirs in zip(self._inner.param_groups, template.param_groups):
            for k, v in theirs.items():
                if k != "params":
                    mine[k] = v
        type(self._inner).step(self._inner)     # (the class's step: nothing an instance wraps it in)
        self.wait_params()         # (none left in flight before new ones start)
        self.last_waited, self.waited = self.waited, []
        for part in self.parts:    # every rank's updated shard to every rank, bucket by bucket
            part.bytes_gathered = 0
            part.gather(part.param_data, self._works)
        if not self.overlap:
            self.wait_params()

    def wait_params(self) -> None:
        """Wait for the all-gathers of the last step's updated parameters."""
        works, self._works = self._works, []
        for _, _, work, _ in works:
            work.wait()

    def wait_for(self, names) -> None:
        """Wait only for the all-gathers of the buckets holding parameters `names` (in the order
        they were started: every rank waits alike)."""
        want = set()
        for n in names:
            part = self._part_of.get(n)
            if part is None:
                continue
            off, k = part.buf.offsets[n]
            want.update((id(part), b.index) for b in part.buf.buckets if b.start < off + k and off < b.end)
        if not want:
            return
        keep = []
        for entry in self._works:
            if (id(entry[0]), entry[1]) in want:
                entry[2].wait()
                self.waited.append(entry[1])
            else:
                keep.append(entry)
        self._works = keep

    def ready(self, unit: str, params: list) -> list:
        """overlap_param_gather (ops/fsdp.py param_wait): a layer's parameters once their
        buckets have arrived, as the graph computes with them (16-bit copies under mixed
        precision, carrying their main_grad)."""
        waited = [ZERO_WAITED.get(p) for p in params]     # (written by runtime/program.py)
        self.wait_for([w.name for w in waited if w is not None])
        return [compute_copy(p, self.dtype) for p in params]

    def full_grad_data(self) -> dict[str, torch.Tensor]:
        """Every parameter's whole averaged gradient (flat), gathered from every rank's shards
        of its buffer."""
        out = {}
        for part in self.parts:
            data = torch.zeros(part.buf.data.numel(), dtype=part.buf.dtype, device=part.buf.data.device)
            for s, (owner, _, lo, hi) in zip(self.shards, self.pieces):
                if owner is part and s.grad is not None:
                    data[lo:hi].copy_(s.grad)
            part.gather(data)
            for n, (off, k) in part.buf.offsets.items():
                out[n] = data[off:off + k]
        return out

    def gathered_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The optimizer state per parameter, shaped like the parameter, gathered over data
        parallel from every rank's shards (for checkpoints): for the parameters that have
        state (one the optimizer never stepped -- frozen, or in no group -- has none, as in one
        process), each its own scalars (`step`: a group added later has stepped fewer times),
        read from the rank holding its first piece. The ranks first agree on what there is to
        gather (a rank whose shards hold no state gathers with the others all the same)."""
        if self._inner is None:
            return {}
        out = {}
        params = self.params
        for part in self.parts:
            mine = {}        # parameter -> (where its piece starts, {tensor key: dtype}, {scalar key: value})
            for s, (owner, n, lo, _) in zip(self.shards, self.pieces):
                st = self._inner.state.get(s, {}) if owner is part else {}
                if st:
                    mine[n] = (lo, {k: v.dtype for k, v in st.items() if _elementwise(v, s)},
                               {k: _portable(v) for k, v in st.items() if not _elementwise(v, s)})
            kinds: dict[str, dict] = {}
            scalars: dict[str, tuple[int, dict]] = {}
            for theirs in _all_ranks(part, mine):
                for n, (lo, tensors, values) in theirs.items():
                    kinds.setdefault(n, {}).update(tensors)
                    if n not in scalars or lo < scalars[n][0]:
                        scalars[n] = (lo, values)
            flat = {(key, dtype): torch.zeros_like(part.param_data, dtype=dtype)
                    for key, dtype in sorted({kv for t in kinds.values() for kv in t.items()}, key=str)}
            for s, (owner, _, lo, _) in zip(self.shards, self.pieces):
                if owner is part:
                    for k, v in self._inner.state.get(s, {}).items():
                        if _elementwise(v, s):
                            flat[k, v.dtype][lo:lo + v.numel()].copy_(v)
            for t in flat.values():           # (every rank: the same keys, in the same order)
                part.gather(t)
            for n in part.buf.offsets:
                if n not in kinds:
                    continue
                off, k = part.buf.offsets[n]
                out[n] = {key: flat[key, dtype][off:off + k].view_as(params[n]).clone() for key, dtype in kinds[n].items()}
                out[n].update({key: _restored(v, part.param_data.device) for key, v in scalars[n][1].items()})
        return out

    def load_state(self, template: torch.optim.Optimizer, state: dict[str, dict]) -> None:
        """Set the shards' optimizer state from per-parameter state (a loaded checkpoint)."""
        self.optimizer_for(template)
        self._set_state(state)
        for mine, theirs in zip(self._inner.param_groups, template.param_groups):
            for k, v in theirs.items():
                if k != "params":
                    mine[k] = v

    def _set_state(self, state: dict[str, dict]) -> None:
        """Each shard's piece of its parameter's state (`state`: by name, shaped like the
        parameter or flat; a tensor of another shape is a ParallelizeError, not a misplaced
        slice: a (b, a) state of an (a, b) parameter, the same size, was taken element by
        element)."""
        for s, (part, n, lo, hi) in zip(self.shards, self.pieces):
            if n not in state:
                continue
            off, k = part.buf.offsets[n]
            st = {}
            for key, v in state[n].items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    if v.shape != self.params[n].shape and tuple(v.shape) != (k,):
                        raise ParallelizeError(
                            f"optimizer state {key!r} of {n} has shape {tuple(v.shape)}, and the parameter here "
                            f"{tuple(self.params[n].shape)}: a state saved on another layout (tp, ep) loads through "
                            "prog.save / prog.load, which reshard it")
                    st[key] = v.reshape(-1)[lo - off:hi - off].clone()
                else:
                    st[key] = v.clone() if isinstance(v, torch.Tensor) else v
            self._inner.state[s] = st

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        if self._inner is None:
            return 0
        return sum(t.numel() * t.element_size() for st in self._inner.state.values()
                   for t in st.values() if isinstance(t, torch.Tensor))
