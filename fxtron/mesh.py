"""Core: the rank layout, Megatron-LM's parallel state (`megatron/core/parallel_state.py`) as an immutable value.

A `Mesh` says how `world_size` ranks are split into tensor (tp), pipeline (pp), context (cp),
expert (ep) and data (dp) parallel groups, and lists those groups exactly as Megatron's
`initialize_model_parallel` builds them. It is pure Python: no torch, no process groups. The
runtime (`fxtron.runtime.groups`) turns the lists into torch.distributed groups.

Megatron uses two rank layouts over the same ranks, both from `RankGenerator`:

* dense  (attention, embeddings, dense MLP): axes tp, cp, ep=1, dp, pp with
  dp = world_size // (tp*pp*cp);
* expert (MoE experts): axes etp=tp, cp=1, ep, edp, pp with edp = world_size // (tp*ep*pp).
  Context-parallel ranks fold into the expert ep/edp axes there.

Both use the same `order` string; the first axis in `order` varies fastest, i.e.
`rank = sum_i idx_i * stride_i` with strides the prefix products of the axis sizes.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from fxtron.core.axes import MESH_AXES, MeshView
from fxtron.errors import ParallelizeError

#: The axis names `order` may use.
AXES = ("tp", "cp", "ep", "dp", "pp")

#: Megatron's default order (`use_tp_pp_dp_mapping=False`); "tp-cp-ep-pp-dp" is the other one it uses.
DEFAULT_ORDER = "tp-cp-ep-dp-pp"

# Group kind -> RankGenerator token, per layout. The table mirrors the one built by
# Megatron's initialize_model_parallel (megatron/core/parallel_state.py).
_DENSE_TOKENS = {
    "tp": "tp",
    "pp": "pp",
    "dp": "dp",
    "cp": "cp",
    "dp-cp": "dp-cp",
    "tp-pp": "tp-pp",
    "tp-cp": "tp-cp",
    "tp-dp": "tp-dp",
    "tp-dp-cp": "tp-dp-cp",
}
_EXPERT_TOKENS = {
    "ep": "ep",
    "expert-tp": "tp",
    "tp-ep": "tp-ep",
    "tp-ep-pp": "tp-ep-pp",
    "expert-dp": "dp",
}
# Derived from the pipeline groups rather than from a token.
_EMBEDDING_KINDS = ("embedding", "position-embedding")

#: Every kind `Mesh.groups` accepts.
GROUP_KINDS = (*_DENSE_TOKENS, *_EXPERT_TOKENS, *_EMBEDDING_KINDS)


def hsdp_kinds(kind: str, k: int) -> tuple[str, str]:
    """Hybrid sharding (HSDP) of the groups of `kind` into consecutive groups of k ranks: the
    kinds naming those shard groups and the replicate groups across them (the ranks at the
    same place of each), which `Mesh.groups` accepts."""
    return f"{kind}/shard:{k}", f"{kind}/replicate:{k}"


def _split_groups(mesh: "Mesh", kind: str) -> list[list[int]]:
    base, _, part = kind.partition("/")
    mode, _, k = part.partition(":")
    if mode not in ("shard", "replicate") or not k.isdigit() or int(k) < 1:
        raise ParallelizeError(f"unknown group kind {kind!r}: a split kind is '<kind>/shard:<k>' or "
                               f"'<kind>/replicate:<k>'")
    k = int(k)
    out = []
    for g in mesh.groups(base):
        if len(g) % k:
            raise ParallelizeError(f"the {base} groups have {len(g)} ranks, which {k} does not divide: shard over a "
                                   f"divisor of {len(g)}")
        if mode == "shard":
            out += [g[i:i + k] for i in range(0, len(g), k)]
        else:
            out += [g[i::k] for i in range(k)]
    return out


# ---------------------------------------------------------------------------------------------
# Megatron's generate_masked_orthogonal_rank_groups (megatron/core/parallel_state.py), transcribed.


def _prefix_product(sizes: tuple[int, ...]) -> list[int]:
    """[1, a0, a0*a1, ...]: the strides of the axes, plus the total size at the end."""
    out = [1]
    for s in sizes:
        out.append(out[-1] * s)
    return out


def _decompose(index: int, shape: tuple[int, ...], prefix: list[int] | None = None) -> list[int]:
    """Mixed-radix digits of `index` over `shape`, first axis fastest.

    `prefix` may pass in `_prefix_product(shape)` when decomposing many indices.
    """
    prefix = _prefix_product(shape) if prefix is None else prefix
    return [(index // d) % s for s, d in zip(shape, prefix)]


def masked_orthogonal_rank_groups(
    world_size: int, parallel_size: tuple[int, ...], mask: tuple[bool, ...]
) -> list[list[int]]:
    """The rank groups along the masked axes of a mixed-radix layout.

    In: `parallel_size`, the axis sizes in `order` order (first axis fastest; their product is
    `world_size`), and `mask`, True for the axes a group spans.
    Out: one list per combination of the unmasked coordinates (first unmasked axis fastest);
    each list holds its ranks with the masked axes enumerated first-masked-axis fastest.
    """
    stride = _prefix_product(parallel_size)
    masked_shape = tuple(s for s, m in zip(parallel_size, mask) if m)
    unmasked_shape = tuple(s for s, m in zip(parallel_size, mask) if not m)
    masked_stride = [d for d, m in zip(stride, mask) if m]
    unmasked_stride = [d for d, m in zip(stride, mask) if not m]

    masked_prefix, unmasked_prefix = _prefix_product(masked_shape), _prefix_product(unmasked_shape)
    group_size = masked_prefix[-1]
    # Megatron recomputes the in-group part for every group; it does not depend on the group,
    # so it is computed once here (same result, less work).
    offsets = [
        sum(i * d for i, d in zip(_decompose(r, masked_shape, masked_prefix), masked_stride))
        for r in range(group_size)
    ]
    groups = []
    for group_index in range(world_size // group_size):
        digits = _decompose(group_index, unmasked_shape, unmasked_prefix)
        base = sum(i * d for i, d in zip(digits, unmasked_stride))
        groups.append([base + off for off in offsets])
    return groups


@dataclass(frozen=True)
class _RankGenerator:
    """Megatron's RankGenerator with rank_offset=0 and gtp_remat=1.

    `names`/`sizes` are the full order: the user's axes, then every omitted axis (size 1, which
    the Mesh has checked) appended, as Megatron does.
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @classmethod
    def build(cls, order_axes: tuple[str, ...], name_to_size: dict[str, int]) -> "_RankGenerator":
        names = order_axes + tuple(n for n in AXES if n not in order_axes)
        return cls(names, tuple(name_to_size[n] for n in names))

    @property
    def world_size(self) -> int:
        return _prefix_product(self.sizes)[-1]

    def stride(self, name: str) -> int:
        return _prefix_product(self.sizes)[self.names.index(name)]

    def get_ranks(self, token: str) -> list[list[int]]:
        """Groups for a '-'-joined token such as "tp-dp"; the token's name order does not matter."""
        wanted = set(token.split("-"))
        mask = tuple(n in wanted for n in self.names)
        return masked_orthogonal_rank_groups(self.world_size, self.sizes, mask)

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinate of `rank` on every axis of this layout."""
        return dict(zip(self.names, _decompose(rank, self.sizes)))


# ---------------------------------------------------------------------------------------------


def _check_positive_int(name: str, value) -> None:
    # bool is an int subclass; Mesh(tp=True) is a mistake, not tp=1.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ParallelizeError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True, repr=False)
class Mesh:
    """How `world_size` ranks split into tp/pp/cp/ep/dp groups, Megatron-LM style.

    Fields: the world size, the tensor/pipeline/context/expert parallel sizes, and the axis
    `order` (first axis varies fastest; "tp-cp-ep-dp-pp" is Megatron's default and
    "tp-cp-ep-pp-dp" its `--use-tp-pp-dp-mapping`). The data-parallel sizes are derived:
    `dp` for the dense layout and `edp` for the expert layout. Construction validates
    everything Megatron's `initialize_model_parallel` does and raises `ParallelizeError`
    saying what to change. `order` is stored lower-cased.
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    order: str = DEFAULT_ORDER

    # -- validation -------------------------------------------------------------------------

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "cp", "ep"):
            _check_positive_int(name, getattr(self, name))
        w, tp, pp, cp, ep = self.world_size, self.tp, self.pp, self.cp, self.ep

        model = tp * pp * cp
        if w % model:
            raise ParallelizeError(
                f"world_size {w} is not divisible by tp*pp*cp = {model} (tp={tp}, pp={pp}, cp={cp}); "
                f"choose a world size that is a multiple of {model} or change tp/pp/cp"
            )
        expert_model = tp * ep * pp
        if w % expert_model:
            raise ParallelizeError(
                f"world_size {w} is not divisible by tp*ep*pp = {expert_model} (tp={tp}, ep={ep}, pp={pp}), "
                f"the expert layout's tensor*expert*pipeline size (expert tensor parallel size = tp); "
                f"choose a world size that is a multiple of {expert_model} or change tp/ep/pp"
            )

        axes = self._parse_order()
        # frozen dataclass: the normalised order has to be written past __setattr__.
        object.__setattr__(self, "order", "-".join(axes))

        dp, edp = self.dp, self.edp
        sizes = {"tp": tp, "pp": pp, "cp": cp, "ep": ep}
        for name in AXES:
            if name in axes:
                continue
            # Megatron appends omitted axes, which is only sound for size 1. dp has a size in
            # each layout, and both must be 1.
            if name == "dp" and (dp != 1 or edp != 1):
                raise ParallelizeError(
                    f"order {self.order!r} omits 'dp' but the data-parallel sizes are dp={dp} (dense) "
                    f"and {edp} (expert); add 'dp' to the order, e.g. {DEFAULT_ORDER!r}"
                )
            if name != "dp" and sizes[name] != 1:
                raise ParallelizeError(
                    f"order {self.order!r} omits {name!r} but {name}={sizes[name]}; add {name!r} to the "
                    f"order (e.g. {DEFAULT_ORDER!r}) or set {name}=1"
                )

        if not self.order.endswith("pp") and pp > 1 and edp != dp:
            # Megatron: "When not using pp-last rank ordering, the data parallel size of the
            # attention and moe layers must be the same". edp == dp exactly when ep == cp.
            raise ParallelizeError(
                f"order {self.order!r} does not end in 'pp' and pp={pp} > 1, so the dense and expert "
                f"data-parallel sizes must be equal, but dp = {w}/(tp*pp*cp) = {dp} and expert dp = "
                f"{w}/(tp*ep*pp) = {edp}; make ep equal cp (now ep={ep}, cp={cp}) or use an order "
                f"ending in 'pp' such as {DEFAULT_ORDER!r}"
            )

        # Megatron asserts both layouts share their pipeline groups (the pipeline carries dense
        # and expert layers alike). The checks above do not imply it for every order, e.g.
        # "tp-cp-pp-ep-dp" with cp == ep > 1 puts cp and ep on different sides of pp.
        dense_pp, expert_pp = self._dense.get_ranks("pp"), self._expert.get_ranks("pp")
        if dense_pp != expert_pp:
            raise ParallelizeError(
                f"order {self.order!r} gives the dense layout (cp={cp}) and the expert layout (ep={ep}) "
                f"different pipeline groups (first: {dense_pp[0]} vs {expert_pp[0]}); put 'cp' and "
                f"'ep' on the same side of 'pp', e.g. {DEFAULT_ORDER!r}"
            )

    def _parse_order(self) -> tuple[str, ...]:
        """The axes of `order`, lower-cased; unknown or repeated names raise."""
        if not isinstance(self.order, str):
            raise ParallelizeError(f"order must be a string such as {DEFAULT_ORDER!r}, got {self.order!r}")
        axes = tuple(t.strip() for t in self.order.strip().lower().split("-"))
        for t in axes:
            if t not in AXES:
                raise ParallelizeError(
                    f"order {self.order!r} has unknown axis {t!r}; use '-'-separated names from "
                    f"{', '.join(AXES)}, e.g. {DEFAULT_ORDER!r}"
                )
            if axes.count(t) > 1:
                raise ParallelizeError(
                    f"order {self.order!r} lists axis {t!r} {axes.count(t)} times; name each axis once, "
                    f"e.g. {DEFAULT_ORDER!r}"
                )
        return axes

    # -- sizes ------------------------------------------------------------------------------

    @property
    def dp(self) -> int:
        """Dense data-parallel size: world_size // (tp*pp*cp)."""
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def etp(self) -> int:
        """Expert tensor-parallel size; fxtron always uses Megatron's default, tp."""
        return self.tp

    @property
    def edp(self) -> int:
        """Expert data-parallel size: world_size // (etp*ep*pp). Spans dense cp and dp ranks."""
        return self.world_size // (self.etp * self.ep * self.pp)

    # -- the two rank layouts (cached: the dataclass is frozen, so they never go stale) ------

    @functools.cached_property
    def _dense(self) -> _RankGenerator:
        axes = tuple(self.order.split("-"))
        return _RankGenerator.build(axes, {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp})

    @functools.cached_property
    def _expert(self) -> _RankGenerator:
        axes = tuple(self.order.split("-"))
        return _RankGenerator.build(axes, {"tp": self.etp, "cp": 1, "ep": self.ep, "dp": self.edp, "pp": self.pp})

    @functools.cached_property
    def _group_cache(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        # Filled lazily by _groups; private, so the mutable dict does not break immutability.
        return {}

    @functools.cached_property
    def _index_cache(self) -> dict[str, dict[int, int]]:
        # kind -> {rank: index of its group in groups(kind)}, filled lazily by group_of.
        return {}

    # -- groups -----------------------------------------------------------------------------

    def _groups(self, kind: str) -> tuple[tuple[int, ...], ...]:
        """Cached, immutable form of `groups(kind)`."""
        cached = self._group_cache.get(kind)
        if cached is not None:
            return cached
        if kind in _DENSE_TOKENS:
            lists = self._dense.get_ranks(_DENSE_TOKENS[kind])
        elif kind in _EXPERT_TOKENS:
            lists = self._expert.get_ranks(_EXPERT_TOKENS[kind])
        elif kind == "embedding":
            # Megatron's default_embedding_ranks: first and last pipeline stage (tied weights).
            lists = [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in self._groups("pp")]
        elif "/" in kind:
            lists = _split_groups(self, kind)
        elif kind == "position-embedding":
            lists = [[g[0]] for g in self._groups("pp")]
        else:
            raise ParallelizeError(f"unknown group kind {kind!r}; valid kinds: {', '.join(GROUP_KINDS)}")
        result = tuple(tuple(g) for g in lists)
        self._group_cache[kind] = result
        return result

    def groups(self, kind: str) -> list[list[int]]:
        """Every group of `kind` (one of GROUP_KINDS), as Megatron's initialize_model_parallel lists them.

        Out: a fresh list of rank lists. Groups are ordered first-unmasked-axis fastest; ranks
        within a group first-masked-axis (in `order`) fastest, whatever the order of names in
        `kind` ("dp-cp" lists cp fastest under "tp-cp-ep-dp-pp"). All kinds but the embedding
        ones partition range(world_size).
        """
        return [list(g) for g in self._groups(kind)]

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The group of `kind` that contains `rank`.

        Raises ParallelizeError for a rank out of range, and for an embedding kind when `rank`
        is not on a first (or, for "embedding", last) pipeline stage, so belongs to no group.
        """
        groups = self._groups(kind)  # first, so an unknown kind is reported as such
        self._check_rank(rank)
        index = self._index_cache.get(kind)
        if index is None:
            index = {r: i for i, g in enumerate(groups) for r in g}
            self._index_cache[kind] = index
        if rank not in index:
            raise ParallelizeError(
                f"rank {rank} is in no {kind!r} group: those hold only the first"
                f"{' and last' if kind == 'embedding' else ''} pipeline stage of each pipeline "
                f"(pp={self.pp}, this rank is stage {self.coords(rank)['pp']})"
            )
        return list(groups[index[rank]])

    # -- coordinates ------------------------------------------------------------------------

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ParallelizeError(
                f"rank {rank!r} is out of range for world_size {self.world_size} (valid 0..{self.world_size - 1})"
            )

    def coords(self, rank: int) -> dict[str, int]:
        """Where `rank` sits in both layouts.

        Out: dense coordinates tp, cp, dp, pp (each in range of that size) and expert ones ep,
        edp and etp. etp equals tp unless cp precedes tp in `order`; the pipeline stage is the
        same in both layouts (Megatron asserts it, and so does the constructor). A coordinate
        is also the rank's position in its single-axis group (groups("tp"), ...).
        """
        self._check_rank(rank)
        d, e = self._dense.coords(rank), self._expert.coords(rank)
        return {"tp": d["tp"], "cp": d["cp"], "dp": d["dp"], "pp": d["pp"],
                "ep": e["ep"], "edp": e["dp"], "etp": e["tp"]}

    def view(self, rank: int) -> MeshView:
        """The mesh as rank's compilation passes see it: every axis's size and the rank's
        coordinate on it (the dense layout's; ep from the expert layout)."""
        c = self.coords(rank)
        return MeshView(rank, {a: getattr(self, a) for a in MESH_AXES}, {a: c[a] for a in MESH_AXES})

    def rank_of(self, *, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0,
                ep: int | None = None, edp: int | None = None, etp: int | None = None) -> int:
        """The rank at dense coordinates (tp, cp, dp, pp); inverse of `coords`.

        Expert coordinates (ep, edp, etp) are optional so that `rank_of(**mesh.coords(r)) == r`;
        when given they must agree with the rank the dense ones name, else ParallelizeError.
        """
        dense = {"tp": (tp, self.tp), "cp": (cp, self.cp), "dp": (dp, self.dp), "pp": (pp, self.pp)}
        for name, (value, size) in dense.items():
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
                raise ParallelizeError(
                    f"{name} coordinate {value!r} is out of range for {name}={size} (valid 0..{size - 1})"
                )
        rank = sum(value * self._dense.stride(name) for name, (value, _) in dense.items())
        have = self.coords(rank)
        for name, value in (("ep", ep), ("edp", edp), ("etp", etp)):
            if value is not None and value != have[name]:
                raise ParallelizeError(
                    f"{name} coordinate {value!r} does not match the dense coordinates "
                    f"(tp={tp}, cp={cp}, dp={dp}, pp={pp}), which name rank {rank} with {name}={have[name]}"
                )
        return rank

    # -- text -------------------------------------------------------------------------------

    def describe(self, rank: int) -> str:
        """One line, e.g. "rank 5: tp 1/2, pp 1/4, dp 0/2, cp 0/1" (plus ep/edp when ep > 1)."""
        c = self.coords(rank)
        line = f"rank {rank}: tp {c['tp']}/{self.tp}, pp {c['pp']}/{self.pp}, dp {c['dp']}/{self.dp}, cp {c['cp']}/{self.cp}"
        if self.ep > 1:
            line += f", ep {c['ep']}/{self.ep}, edp {c['edp']}/{self.edp}"
        return line

    def format_table(self) -> str:
        """A header line with the sizes and order, then one table row per rank.

        Columns: rank, its tp/cp/dp/pp/ep coordinates, and its tp, dp and pp groups.
        """
        from tabulate import tabulate  # imported here: only the CLI needs it

        def fmt(ranks: list[int]) -> str:
            return "[" + ",".join(map(str, ranks)) + "]"

        rows = []
        for r in range(self.world_size):
            c = self.coords(r)
            rows.append([r, c["tp"], c["cp"], c["dp"], c["pp"], c["ep"],
                         fmt(self.group_of("tp", r)), fmt(self.group_of("dp", r)), fmt(self.group_of("pp", r))])
        header = (f"world_size={self.world_size} tp={self.tp} pp={self.pp} cp={self.cp} ep={self.ep} "
                  f"dp={self.dp} edp={self.edp} order={self.order}")
        table = tabulate(rows, headers=["rank", "tp", "cp", "dp", "pp", "ep", "tp group", "dp group", "pp group"])
        return header + "\n" + table

    def __repr__(self) -> str:
        return (f"Mesh(world_size={self.world_size}, tp={self.tp}, pp={self.pp}, cp={self.cp}, "
                f"ep={self.ep}, dp={self.dp}, order={self.order!r})")

    __str__ = __repr__
