"""Tests for fxtron.mesh: Megatron-LM's rank layout and process groups, checked against the
examples in Megatron's docstrings and against an independent brute-force reference."""
from __future__ import annotations

import dataclasses
import itertools
import pickle

import pytest

from fxtron.errors import ParallelizeError
from fxtron.mesh import GROUP_KINDS, Mesh, masked_orthogonal_rank_groups

DEFAULT = "tp-cp-ep-dp-pp"
PP_BEFORE_DP = "tp-cp-ep-pp-dp"  # Megatron's --use-tp-pp-dp-mapping


# ---------------------------------------------------------------------------------------------
# Megatron's documented examples


def test_megatron_docstring_16_ranks_tp2_pp4():
    m = Mesh(16, tp=2, pp=4)
    assert m.dp == 2
    assert m.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert m.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert m.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert m.groups("embedding") == [[0, 12], [1, 13], [2, 14], [3, 15]]
    assert m.groups("position-embedding") == [[0], [1], [2], [3]]
    assert m.groups("tp-pp") == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]


def test_megatron_cp_docstring_8_ranks_tp4_cp2():
    m = Mesh(8, tp=4, cp=2)
    assert m.dp == 1
    assert m.groups("cp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert m.groups("tp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert m.groups("tp-cp") == [list(range(8))]


def test_spec_mask_example_sizes_2_3_4():
    # generate_masked_orthogonal_rank_groups(24, [2, 3, 4], [F, T, F]) docstring example.
    raw = masked_orthogonal_rank_groups(24, (2, 3, 4), (False, True, False))
    assert raw[0] == [0, 2, 4] and raw[1] == [1, 3, 5] and raw[7] == [19, 21, 23]
    # The same layout as a mesh: axes tp=2, cp=3, dp=4 (ep and pp omitted: size 1).
    m = Mesh(24, tp=2, cp=3, order="tp-cp-dp")
    assert m.groups("cp") == raw


def test_spec_tp_pp_dp_order_example():
    m = Mesh(8, tp=2, pp=2, order="tp-pp-dp")
    assert m.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_pp_before_dp_order_makes_contiguous_pipeline_blocks():
    m = Mesh(16, tp=2, pp=4, order=PP_BEFORE_DP)
    # rank = tp + 2*(pp + 4*dp): a pipeline lives inside one block of tp*pp = 8 ranks.
    assert m.groups("pp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert m.groups("dp") == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    assert m.groups("tp") == Mesh(16, tp=2, pp=4).groups("tp")
    assert m.groups("embedding") == [[0, 6], [1, 7], [8, 14], [9, 15]]
    assert m.coords(6) == {"tp": 0, "cp": 0, "dp": 0, "pp": 3, "ep": 0, "edp": 0, "etp": 0}


def test_token_name_order_does_not_matter_masked_axes_in_order_order():
    # rank = tp + 2*(cp + 2*dp): "dp-cp" lists cp fastest because cp precedes dp in `order`.
    m = Mesh(8, tp=2, cp=2)
    assert m.groups("dp-cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert m._dense.get_ranks("dp-cp") == m._dense.get_ranks("cp-dp")
    assert m.groups("tp-dp-cp") == [list(range(8))]


def test_expert_layout_folds_cp_into_ep_and_edp():
    # Dense: rank = cp + 2*dp (dp=4). Expert (cp=1): rank = ep + 4*edp (edp=2).
    m = Mesh(8, cp=2, ep=4)
    assert (m.dp, m.edp, m.etp) == (4, 2, 1)
    assert m.groups("cp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert m.groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]  # spans cp x dp ranks
    assert m.groups("expert-dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert m.groups("expert-tp") == [[r] for r in range(8)]
    assert m.coords(5) == {"tp": 0, "cp": 1, "dp": 2, "pp": 0, "ep": 1, "edp": 1, "etp": 0}


def test_expert_groups_with_tp_and_pp():
    m = Mesh(16, tp=2, pp=2, ep=2)
    # Expert: rank = etp + 2*(ep + 2*(edp + 2*pp)), edp = 2.
    assert m.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert m.groups("tp-ep") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert m.groups("tp-ep-pp") == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]
    assert m.groups("expert-dp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]


# ---------------------------------------------------------------------------------------------
# Independent brute-force reference: enumerate coordinate tuples, rank = sum_i idx_i * stride_i.

# kind -> (layout, axes the group spans)
KIND_AXES = {
    "tp": ("dense", {"tp"}), "pp": ("dense", {"pp"}), "dp": ("dense", {"dp"}), "cp": ("dense", {"cp"}),
    "dp-cp": ("dense", {"dp", "cp"}), "tp-pp": ("dense", {"tp", "pp"}), "tp-cp": ("dense", {"tp", "cp"}),
    "tp-dp": ("dense", {"tp", "dp"}), "tp-dp-cp": ("dense", {"tp", "dp", "cp"}),
    "ep": ("expert", {"ep"}), "expert-tp": ("expert", {"tp"}), "tp-ep": ("expert", {"tp", "ep"}),
    "tp-ep-pp": ("expert", {"tp", "ep", "pp"}), "expert-dp": ("expert", {"dp"}),
}


def layout_sizes(world, tp, pp, cp, ep):
    dense = {"tp": tp, "cp": cp, "ep": 1, "dp": world // (tp * pp * cp), "pp": pp}
    expert = {"tp": tp, "cp": 1, "ep": ep, "dp": world // (tp * ep * pp), "pp": pp}
    return {"dense": dense, "expert": expert}


def reference_points(order, sizes):
    """[(coords dict, rank)] for every point of the layout; `order` names all five axes."""
    names = order.split("-")
    strides, acc = {}, 1
    for n in names:
        strides[n], acc = acc, acc * sizes[n]
    points = []
    for idx in itertools.product(*(range(sizes[n]) for n in names)):
        c = dict(zip(names, idx))
        points.append((c, sum(c[n] * strides[n] for n in names)))
    return points


def reference_groups(order, points, spanned):
    """Groups over the `spanned` axes: ranks sharing all other coordinates, listed by the rule
    (groups: first unmasked axis of `order` fastest; inside: first masked axis fastest)."""
    names = order.split("-")
    masked = [n for n in names if n in spanned]
    unmasked = [n for n in names if n not in spanned]
    by_key = {}
    for c, rank in points:
        # Sort keys list the last axis first, so that it is the most significant.
        key = tuple(c[n] for n in reversed(unmasked))
        by_key.setdefault(key, []).append((tuple(c[n] for n in reversed(masked)), rank))
    return [[rank for _, rank in sorted(by_key[key])] for key in sorted(by_key)]


def reference_all(world, tp, pp, cp, ep, order, points=None):
    """Every kind's groups; `points` ({layout: reference_points}) may be passed in to reuse."""
    if points is None:
        sizes = layout_sizes(world, tp, pp, cp, ep)
        points = {layout: reference_points(order, sizes[layout]) for layout in sizes}
    out = {kind: reference_groups(order, points[layout], axes) for kind, (layout, axes) in KIND_AXES.items()}
    out["embedding"] = [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in out["pp"]]
    out["position-embedding"] = [[g[0]] for g in out["pp"]]
    return out


def reference_valid(world, tp, pp, cp, ep, order):
    """Megatron's acceptance rule, restated on the reference layouts."""
    if world % (tp * pp * cp) or world % (tp * ep * pp):
        return False
    sizes = layout_sizes(world, tp, pp, cp, ep)
    if not order.endswith("pp") and pp > 1 and sizes["dense"]["dp"] != sizes["expert"]["dp"]:
        return False
    dense, expert = (reference_points(order, sizes[layout]) for layout in ("dense", "expert"))
    return reference_groups(order, dense, {"pp"}) == reference_groups(order, expert, {"pp"})


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


ORDERS = [DEFAULT, PP_BEFORE_DP]
# Exotic orders (pp first, cp before tp, cp and ep on different sides of pp) on one size.
EXOTIC_ORDERS = ["pp-dp-ep-cp-tp", "cp-tp-ep-dp-pp", "tp-cp-pp-ep-dp"]


def factorizations(world):
    """Every (tp, pp, cp, ep) with tp*pp*cp dividing world and ep dividing world; some of them
    violate the expert-layout rules on purpose, to test rejection."""
    for tp, pp, cp, ep in itertools.product(divisors(world), repeat=4):
        if world % (tp * pp * cp) == 0:
            yield tp, pp, cp, ep


def check_against_reference(world, tp, pp, cp, ep, order):
    """Mesh accepts exactly the layouts Megatron accepts, and lists exactly the reference groups."""
    label = f"world={world} tp={tp} pp={pp} cp={cp} ep={ep} order={order}"
    if not reference_valid(world, tp, pp, cp, ep, order):
        with pytest.raises(ParallelizeError):
            Mesh(world, tp=tp, pp=pp, cp=cp, ep=ep, order=order)
        return
    m = Mesh(world, tp=tp, pp=pp, cp=cp, ep=ep, order=order)
    sizes = layout_sizes(world, tp, pp, cp, ep)
    points = {layout: reference_points(order, sizes[layout]) for layout in sizes}
    coords = {layout: {rank: c for c, rank in points[layout]} for layout in sizes}
    ref = reference_all(world, tp, pp, cp, ep, order, points)
    for kind in GROUP_KINDS:
        got = m.groups(kind)
        # Same groups, as sets ...
        assert {frozenset(g) for g in got} == {frozenset(g) for g in ref[kind]}, (label, kind)
        # ... and the same listing: inside a group the masked axes vary in `order` order,
        # first masked axis fastest; groups likewise over the unmasked axes.
        assert got == ref[kind], (label, kind)
        if kind in KIND_AXES:
            layout, axes = KIND_AXES[kind]
            masked = [n for n in order.split("-") if n in axes]
            for g in got:
                keys = [tuple(coords[layout][r][n] for n in masked)[::-1] for r in g]
                assert keys == sorted(keys), (label, kind, g)
            # Every non-embedding kind partitions the ranks.
            assert sorted(r for g in got for r in g) == list(range(world)), (label, kind)


def test_reference_covers_every_kind():
    assert set(GROUP_KINDS) == set(reference_all(1, 1, 1, 1, 1, DEFAULT))


# One test per (order, world size), looping over its factorizations: thousands of meshes in
# all, so a per-mesh parametrization would spend more time in pytest than in the checks.
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("world", range(1, 17))
def test_groups_match_brute_force_reference(world, order):
    for tp, pp, cp, ep in factorizations(world):
        check_against_reference(world, tp, pp, cp, ep, order)


@pytest.mark.parametrize("order", EXOTIC_ORDERS)
@pytest.mark.parametrize("world", [12])
def test_exotic_orders_match_brute_force_reference(world, order):
    for tp, pp, cp, ep in factorizations(world):
        check_against_reference(world, tp, pp, cp, ep, order)


# ---------------------------------------------------------------------------------------------
# Sizes, partitions, coordinates


MESHES = [
    Mesh(1),
    Mesh(16, tp=2, pp=4),
    Mesh(16, tp=2, pp=4, order=PP_BEFORE_DP),
    Mesh(16, tp=2, cp=2, ep=4),
    Mesh(16, tp=2, pp=2, cp=2, ep=2, order=PP_BEFORE_DP),
    Mesh(12, tp=3, pp=2, ep=2),
    Mesh(16, tp=2, cp=2, ep=2, order="cp-tp-ep-dp-pp"),  # cp before tp: etp coordinate != tp
    Mesh(32, tp=2, pp=2, cp=2, ep=4),
]


@pytest.mark.parametrize("m", MESHES, ids=repr)
def test_group_sizes_and_partitions(m):
    expected = {
        "tp": m.tp, "pp": m.pp, "dp": m.dp, "cp": m.cp, "dp-cp": m.dp * m.cp, "tp-pp": m.tp * m.pp,
        "tp-cp": m.tp * m.cp, "tp-dp": m.tp * m.dp, "tp-dp-cp": m.tp * m.dp * m.cp, "ep": m.ep,
        "expert-tp": m.etp, "tp-ep": m.etp * m.ep, "tp-ep-pp": m.etp * m.ep * m.pp, "expert-dp": m.edp,
    }
    for kind, size in expected.items():
        groups = m.groups(kind)
        assert all(len(g) == size for g in groups), kind
        assert sorted(r for g in groups for r in g) == list(range(m.world_size)), kind
        for g in groups:
            for r in g:
                assert m.group_of(kind, r) == g
    assert len(m.groups("embedding")) == m.world_size // m.pp
    assert all(len(g) == min(2, m.pp) for g in m.groups("embedding"))


@pytest.mark.parametrize("m", MESHES, ids=repr)
def test_coords_round_trip_and_group_positions(m):
    seen = set()
    for r in range(m.world_size):
        c = m.coords(r)
        assert set(c) == {"tp", "cp", "dp", "pp", "ep", "edp", "etp"}
        assert m.rank_of(**c) == r
        assert m.rank_of(tp=c["tp"], cp=c["cp"], dp=c["dp"], pp=c["pp"]) == r
        seen.add((c["tp"], c["cp"], c["dp"], c["pp"]))
        # A coordinate is the rank's position in its single-axis group.
        for key, kind in [("tp", "tp"), ("cp", "cp"), ("dp", "dp"), ("pp", "pp"),
                          ("ep", "ep"), ("edp", "expert-dp"), ("etp", "expert-tp")]:
            assert m.group_of(kind, r).index(r) == c[key], (m, r, key)
    assert len(seen) == m.world_size
    assert m.rank_of() == 0


def test_expert_tp_coordinate_follows_the_expert_layout():
    # Dense: rank = cp + 2*(tp + 2*dp); expert (cp=1): rank = etp + 2*(ep + 2*edp).
    m = Mesh(16, tp=2, cp=2, ep=2, order="cp-tp-ep-dp-pp")
    assert m.coords(1) == {"tp": 0, "cp": 1, "dp": 0, "pp": 0, "ep": 0, "edp": 0, "etp": 1}
    assert m.groups("tp")[0] == [0, 2] and m.groups("expert-tp")[0] == [0, 1]


def test_derived_sizes():
    m = Mesh(32, tp=2, pp=2, cp=2, ep=4)
    assert (m.dp, m.etp, m.edp) == (4, 2, 2)


# ---------------------------------------------------------------------------------------------
# Validation: every error is a ParallelizeError that names the numbers and what to change


@pytest.mark.parametrize("kwargs, fragments", [
    (dict(world_size=10, tp=2, pp=2), ["world_size 10", "tp*pp*cp = 4", "tp=2, pp=2, cp=1", "multiple of 4"]),
    (dict(world_size=12, tp=2, cp=4), ["world_size 12", "tp*pp*cp = 8", "cp=4", "multiple of 8"]),
    (dict(world_size=12, tp=2, ep=4), ["world_size 12", "tp*ep*pp = 8", "ep=4", "multiple of 8"]),
    (dict(world_size=0), ["world_size", "positive int", "0"]),
    (dict(world_size=8, tp=0), ["tp", "positive int", "0"]),
    (dict(world_size=8, pp=-2), ["pp", "positive int", "-2"]),
    (dict(world_size=8, cp=2.0), ["cp", "positive int", "2.0"]),
    (dict(world_size=8, ep=True), ["ep", "positive int", "True"]),
    (dict(world_size=8, order="tp-xp-dp-pp"), ["unknown axis 'xp'", "tp, cp, ep, dp, pp"]),
    (dict(world_size=8, order="tp-cp-ep-dp-pp-tp"), ["'tp'", "2 times"]),
    (dict(world_size=8, order="tp--dp"), ["unknown axis ''"]),
    (dict(world_size=8, order=3), ["order must be a string", "3"]),
    (dict(world_size=8, pp=2, order="tp-cp-ep-dp"), ["omits 'pp'", "pp=2", "set pp=1"]),
    (dict(world_size=8, tp=2, order="cp-ep-dp-pp"), ["omits 'tp'", "tp=2"]),
    (dict(world_size=8, cp=2, order="tp-ep-dp-pp"), ["omits 'cp'", "cp=2"]),
    (dict(world_size=8, ep=2, order="tp-cp-dp-pp"), ["omits 'ep'", "ep=2"]),
    (dict(world_size=8, tp=2, order="tp-cp-ep-pp"), ["omits 'dp'", "dp=4", "4 (expert)"]),
    (dict(world_size=16, pp=2, ep=2, order=PP_BEFORE_DP),
     ["does not end in 'pp'", "pp=2", "dp = 16/(tp*pp*cp) = 8", "expert dp = 16/(tp*ep*pp) = 4", "ep=2, cp=1"]),
    (dict(world_size=16, pp=2, cp=2, order=PP_BEFORE_DP), ["dp = 16/(tp*pp*cp) = 4", "expert dp = 16/(tp*ep*pp) = 8"]),
    (dict(world_size=8, pp=2, cp=2, ep=2, order="tp-cp-pp-ep-dp"), ["different pipeline groups", "[0, 2]", "[0, 1]"]),
])
def test_validation_errors(kwargs, fragments):
    with pytest.raises(ParallelizeError) as info:
        Mesh(**kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_ep_and_cp_together_are_allowed():
    # Megatron's one-generator assert (ep == 1 or cp == 1) never fires: dense has ep=1, expert cp=1.
    m = Mesh(16, cp=2, ep=2, pp=2, order=PP_BEFORE_DP)
    assert (m.dp, m.edp) == (4, 4)


def test_pp1_any_order_and_omitted_size1_axes():
    assert Mesh(8, ep=2, order=PP_BEFORE_DP).groups("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    m = Mesh(8, tp=2, order="tp-dp")
    assert m.order == "tp-dp"
    assert m.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert m.groups("pp") == [[r] for r in range(8)]


def test_order_is_lower_cased():
    m = Mesh(16, tp=2, pp=4, order="TP-CP-EP-DP-PP")
    assert m.order == DEFAULT
    assert m == Mesh(16, tp=2, pp=4)
    assert hash(m) == hash(Mesh(16, tp=2, pp=4))


@pytest.mark.parametrize("call, fragments", [
    (lambda m: m.groups("tensor"), ["unknown group kind 'tensor'", "tp-ep-pp", "position-embedding"]),
    (lambda m: m.group_of("nope", 0), ["unknown group kind 'nope'"]),
    (lambda m: m.coords(16), ["rank 16", "world_size 16", "0..15"]),
    (lambda m: m.coords(-1), ["rank -1", "0..15"]),
    (lambda m: m.group_of("tp", 99), ["rank 99"]),
    (lambda m: m.describe(16), ["rank 16"]),
    (lambda m: m.rank_of(tp=2), ["tp coordinate 2", "tp=2", "0..1"]),
    (lambda m: m.rank_of(pp=4), ["pp coordinate 4", "pp=4", "0..3"]),
    (lambda m: m.rank_of(dp=-1), ["dp coordinate -1"]),
    (lambda m: m.rank_of(cp=1), ["cp coordinate 1", "cp=1", "0..0"]),
    (lambda m: m.rank_of(tp=1, ep=1), ["ep coordinate 1", "rank 1", "ep=0"]),
    (lambda m: m.group_of("embedding", 5), ["rank 5", "'embedding'", "first and last", "stage 1"]),
    (lambda m: m.group_of("position-embedding", 12), ["rank 12", "first pipeline stage", "stage 3"]),
])
def test_lookup_errors(call, fragments):
    m = Mesh(16, tp=2, pp=4)
    with pytest.raises(ParallelizeError) as info:
        call(m)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


# ---------------------------------------------------------------------------------------------
# Value semantics and text


def test_groups_are_fresh_copies_and_cached():
    m = Mesh(16, tp=2, pp=4)
    got = m.groups("tp")
    got[0].append(99)
    got.clear()
    assert m.groups("tp")[0] == [0, 1]
    assert m._groups("tp") is m._groups("tp")
    g = m.group_of("dp", 3)
    g.append(42)
    assert m.group_of("dp", 3) == [1, 3]


def test_frozen_pickle_and_replace():
    m = Mesh(16, tp=2, pp=4)
    m.groups("pp")  # fill the caches first
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.tp = 4
    clone = pickle.loads(pickle.dumps(m))
    assert clone == m and clone.groups("pp") == m.groups("pp")
    wider = dataclasses.replace(m, tp=4)
    assert wider.dp == 1 and wider.groups("tp")[0] == [0, 1, 2, 3]
    with pytest.raises(ParallelizeError):
        dataclasses.replace(m, tp=3)


def test_repr_and_str():
    m = Mesh(16, tp=2, pp=4)
    expected = "Mesh(world_size=16, tp=2, pp=4, cp=1, ep=1, dp=2, order='tp-cp-ep-dp-pp')"
    assert repr(m) == expected and str(m) == expected


def test_describe():
    m = Mesh(16, tp=2, pp=4)
    assert m.describe(5) == "rank 5: tp 1/2, pp 1/4, dp 0/2, cp 0/1"
    assert m.describe(15) == "rank 15: tp 1/2, pp 3/4, dp 1/2, cp 0/1"
    assert Mesh(8, cp=2, ep=4).describe(5) == "rank 5: tp 0/1, pp 0/1, dp 2/4, cp 1/2, ep 1/4, edp 1/2"


def test_format_table():
    m = Mesh(16, tp=2, pp=4)
    text = m.format_table()
    lines = text.splitlines()
    assert "world_size=16" in lines[0] and "tp=2" in lines[0] and "pp=4" in lines[0]
    assert "order=tp-cp-ep-dp-pp" in lines[0]
    header = lines[1].split()
    assert header[:6] == ["rank", "tp", "cp", "dp", "pp", "ep"]
    rows = lines[3:]  # title, column header, rule
    assert len(rows) == 16
    row5 = rows[5].split()
    assert row5[:6] == ["5", "1", "0", "0", "1", "0"]
    assert row5[6:] == ["[4,5]", "[5,7]", "[1,5,9,13]"]
