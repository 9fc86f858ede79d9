"""The communicating ops (fxtron.ops.tp, fxtron.ops.vocab) and the shard layout: the interleaved
layout on explicit tensors, every fxtron:: op on gloo (tp=2 and tp=4) against a single-process
float64 computation (values and the gradients autograd gives through the ops), the cross
entropy's three all-reduces, the op registry's table against the collectives the ops really
issue, and the fake (shape-only) implementations. One 4-rank job runs every distributed case over its tp=4 group (through its
shared-memory channel, then once more through gloo) and over two tp=2 groups (gloo)."""
from __future__ import annotations

import contextlib
import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import fxtron
from fxtron.errors import ParallelizeError
from fxtron.ops import registry, transport
from fxtron.ops import sp as SP
from fxtron.ops import tp as C
from fxtron.ops.vocab import vocab_parallel_embedding
from fxtron.core import layout as shard_math
from fxtron.ops import shm
from fxtron.runtime.groups import groups_for
from fxtron.core.layout import check_divisible, shard, unshard
from fxtron.tools.testing import run_on_ranks

ops = torch.ops.fxtron
V = 16          # CE / embedding vocabulary
IGNORE = -100


# ---------------------------------------------------------------------------------------------
# shard.py


def test_interleaved_layout_explicit():
    x = torch.arange(12)
    assert shard(x, 0, 2, 0, interleave=3).tolist() == [0, 1, 4, 5, 8, 9]
    assert shard(x, 0, 2, 1, interleave=3).tolist() == [2, 3, 6, 7, 10, 11]
    assert shard(x, 0, 2, 1).tolist() == [6, 7, 8, 9, 10, 11]
    assert [shard(x, 0, 3, r, interleave=2).tolist() for r in range(3)] == [[0, 1, 6, 7], [2, 3, 8, 9], [4, 5, 10, 11]]
    # a fused [q|k|v] weight [3*4, 2]: splitting rank 1's rows in three gives rows 2-3 of each of q, k, v
    w = torch.arange(24).view(12, 2)
    q, k, v = shard(w, 0, 2, 1, interleave=3).chunk(3)
    assert torch.equal(q, w[2:4]) and torch.equal(k, w[6:8]) and torch.equal(v, w[10:12])
    assert unshard([torch.tensor([0, 1, 4, 5, 8, 9]), torch.tensor([2, 3, 6, 7, 10, 11])], 0, 3).tolist() == list(range(12))


def test_unequal_fused_blocks_give_each_rank_its_slice_of_each():
    """Phi-3's [q|k|v] under grouped-query attention: q twice k and v (proportions 2:1:1)."""
    w = torch.arange(32).view(16, 2)                      # q rows 0-7, k rows 8-11, v rows 12-15
    q, k, v = shard(w, 0, 2, 1, interleave=(2, 1, 1)).split([4, 2, 2])
    assert torch.equal(q, w[4:8]) and torch.equal(k, w[10:12]) and torch.equal(v, w[14:16])
    assert shard(torch.arange(8), 0, 2, 0, (4, 2, 2)).tolist() == [0, 1, 4, 6]   # (4,2,2) is (2,1,1)
    assert shard_math.normalize((3, 3)) == 2 and shard_math.normalize((4, 2, 2)) == (2, 1, 1)
    assert shard_math.block_sizes(64, (2, 1, 1)) == [32, 16, 16] and shard_math.block_sizes(12, 3) == [4, 4, 4]
    with pytest.raises(fxtron.ParallelizeError, match="fused blocks of 8, 4, 4.*divides 4"):
        check_divisible(16, 8, (2, 1, 1), "qkv")
    with pytest.raises(ValueError):
        shard_math.normalize((2, 0))


@pytest.mark.parametrize("shape,dim,world,k", [((12,), 0, 2, 3), ((4, 12, 3), 1, 4, 3), ((4, 12, 3), -2, 2, 2),
                                               ((8, 6), 0, 4, 1), ((8, 6), -1, 3, 1), ((6, 2), 0, 1, 2),
                                               ((16, 3), 0, 2, (2, 1, 1)), ((3, 24), 1, 4, (1, 2)),
                                               ((3, 24), -1, 1, (1, 2))])
def test_shard_unshard_round_trip(shape, dim, world, k):
    full = torch.randn(shape)
    pieces = [shard(full, dim, world, r, k) for r in range(world)]
    d = dim % len(shape)
    for p in pieces:
        assert p.is_contiguous() and p.shape[d] == shape[d] // world
        assert p.data_ptr() != full.data_ptr()           # a copy, even for world == 1
    assert torch.equal(unshard(pieces, dim, k), full)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_blocks_held_whole_beside_split_ones(world):
    """Multi-query attention's fused [q | k | v] (8 query heads, one key and one value head of
    4): each rank holds its slice of q and all of k and v."""
    full = torch.arange(40 * 3).view(40, 3).float()
    pieces = [shard(full, 0, world, r, (8, 1, 1), whole=(1, 2)) for r in range(world)]
    for r, p in enumerate(pieces):
        q = 32 // world
        assert p.shape == (q + 8, 3) == (shard_math.local_size(40, world, (8, 1, 1), (1, 2)), 3)
        assert torch.equal(p[:q], full[r * q:(r + 1) * q]) and torch.equal(p[q:], full[32:])
        assert shard_math.blocks_of_piece(p.shape[0], world, (8, 1, 1), (1, 2)) == [q, 4, 4]
    assert torch.equal(unshard(pieces, 0, (8, 1, 1), whole=(1, 2)), full)


def test_check_divisible_names_what_and_the_fix():
    check_divisible(12, 2, 3, "w")
    with pytest.raises(ParallelizeError, match=r"'mlp.fc1' weight dim 0.*size 10.*multiple of 4.*tp size"):
        check_divisible(10, 4, 1, "'mlp.fc1' weight dim 0")
    with pytest.raises(ParallelizeError, match=r"qkv dim 0.*3 interleaved blocks.*multiple of 12.*divides 6"):
        check_divisible(18, 4, 3, "qkv dim 0")
    with pytest.raises(ParallelizeError, match=r"dim 0 of a tensor of shape \(10, 2\)"):
        shard(torch.zeros(10, 2), 0, 4, 0)


# ---------------------------------------------------------------------------------------------
# data shared by the ranks and the single-process reference


def _data(tp: int) -> dict:
    g = torch.Generator().manual_seed(1234)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return {
        "X": rnd(3, 8), "Wrow": rnd(5, 8), "Grow": rnd(3, 5),                 # row-parallel linear
        "A": rnd(12, 8), "Gcol": rnd(3, 12),                                  # fused (x3) column linear
        "S": rnd(8, 2, 4), "A2": rnd(8, 4), "B2": rnd(4, 8), "Gsp": rnd(8, 2, 4),  # SP MLP [s, b, h]
        "R": rnd(tp, 3, 8), "Gr": rnd(tp, 3, 8 // tp),                        # reduce-scatter on dim 1
        "E": rnd(V, 4), "ids": torch.tensor([[0, 5, 15, 5], [9, 3, 12, 0]]), "Ge": rnd(2, 4, 4),
        "L": 3 * rnd(6, V), "T": torch.tensor([3, IGNORE, 15, 0, 8, IGNORE]), "Gce": rnd(6),
    }


# (reduction, label_smoothing, ignore_index, logits dtype)
CE_CASES = [(red, ls, IGNORE, torch.float64) for red in (0, 1, 2) for ls in (0.0, 0.1)] + [
    (1, 0.0, 3, torch.float64),      # ignore_index inside rank 0's vocabulary range
    (1, 0.0, IGNORE, torch.bfloat16), (0, 0.1, IGNORE, torch.float32)]


def _targets(d, ignore_index):
    """The CE targets, with the ignored positions set to `ignore_index`."""
    return d["T"].masked_fill(d["T"] == IGNORE, ignore_index)


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


class _Count:
    """Counts calls of functions of a module while active; calls made inside a counted call
    (gloo's reduce-scatter runs an all-reduce) are not counted again."""

    def __init__(self, module, names):
        self.module, self.names, self.calls, self._depth = module, names, [], threading.local()

    @contextlib.contextmanager
    def active(self):
        saved = {n: getattr(self.module, n) for n in self.names}

        def wrap(name, fn):
            def counted(*a, **kw):
                depth = getattr(self._depth, "n", 0)
                if depth == 0:
                    op = kw.get("op", a[2] if name == "all_reduce" and len(a) > 2 else None)
                    self.calls.append((name, getattr(op, "name", op)))
                self._depth.n = depth + 1
                try:
                    return fn(*a, **kw)
                finally:
                    self._depth.n = depth
            return counted

        for n, fn in saved.items():
            setattr(self.module, n, wrap(n, fn))
        try:
            yield self
        finally:
            for n, fn in saved.items():
                setattr(self.module, n, fn)

    def take(self):
        out, self.calls = self.calls, []
        return out


def _cases(pg, one_rank_group: str) -> dict:
    """Every distributed case over the tp group `pg`; returns what the parent compares."""
    torch.manual_seed(0)
    tp, r, group = pg.size(), dist.get_rank(pg), pg.group_name
    d = _data(tp)
    out = {}

    # row-parallel linear: scatter the input (Megatron's input_is_parallel=False), g after the
    # GEMM; input features and weight columns split alike, with interleave 2
    X, W = _leaf(d["X"]), _leaf(shard(d["Wrow"], 1, tp, r, 2))
    y = C.all_reduce(C.scatter(X, -1, [2], tp, group) @ W.T, group)
    (y * d["Grow"]).sum().backward()
    out["row"] = (y.detach(), X.grad, W.grad)

    # column-parallel fused [q|k|v] linear: f before it, all-gather (interleave 3) after it
    X, A = _leaf(d["X"]), _leaf(shard(d["A"], 0, tp, r, 3))
    y = C.all_gather(C.copy_to_region(X, group) @ A.T, -1, [3], tp, group)
    (y * d["Gcol"]).sum().backward()
    out["col"] = (y.detach(), X.grad, A.grad)

    # sequence-parallel MLP: AG(seq) -> column -> row -> RS(seq)
    xs, A2, B2 = _leaf(shard(d["S"], 0, tp, r)), _leaf(shard(d["A2"], 0, tp, r)), _leaf(shard(d["B2"], 1, tp, r))
    y = SP.reduce_scatter(SP.gather_from_sequence(xs, 0, tp, group) @ A2.T @ B2.T, 0, tp, group)
    (y * shard(d["Gsp"], 0, tp, r)).sum().backward()
    out["sp"] = (y.detach(), xs.grad, A2.grad, B2.grad)

    # reduce-scatter of a different tensor on every rank, along dim 1
    R = _leaf(d["R"][r])
    y = SP.reduce_scatter(R, 1, tp, group)
    (y * d["Gr"][r]).sum().backward()
    out["rs1"] = (y.detach(), R.grad)

    # vocab-parallel embedding + g
    E = _leaf(shard(d["E"], 0, tp, r))
    y = C.all_reduce(vocab_parallel_embedding(E, d["ids"], r * V // tp), group)
    (y * d["Ge"]).sum().backward()
    out["emb"] = (y.detach(), E.grad)

    # vocab-parallel cross entropy
    out["ce"] = []
    for red, ls, ii, dtype in CE_CASES:
        lg = _leaf(shard(d["L"], -1, tp, r).to(dtype))
        loss = ops.vocab_parallel_cross_entropy(lg, _targets(d, ii), r * V // tp, ii, red, ls, group)
        (loss * (d["Gce"] if red == 0 else torch.tensor(0.7)).float()).sum().backward()
        out["ce"].append((loss.detach(), lg.grad))

    # the cross entropy's torch.distributed calls: 3 all-reduces (MAX, SUM, SUM) forward, none
    # backward (through a shared-memory channel: 3 of its collectives, and no torch.distributed call)
    names = ["all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
             "all_to_all_single", "send", "recv"]
    counter = _Count(dist, names)
    comm = shm.channel(group)
    out["transport"] = "shm" if comm is not None else "gloo"
    out["ce_calls"] = []
    with counter.active():
        for ls in (0.0, 0.1):
            lg = _leaf(shard(d["L"], -1, tp, r).float())
            ops0 = comm.ops if comm is not None else 0
            loss = ops.vocab_parallel_cross_entropy(lg, d["T"], r * V // tp, IGNORE, 1, ls, group)
            fwd, ops1 = counter.take(), comm.ops if comm is not None else 0
            loss.backward()
            out["ce_calls"].append((fwd, counter.take(), ops1 - ops0, (comm.ops if comm is not None else 0) - ops1))

    # every op's collectives, to compare with the registry
    x8 = torch.randn(8, 4, dtype=torch.float64)
    cases = {
        "copy_to_region": lambda: C.copy_to_region(_leaf(x8), group),
        "all_reduce": lambda: C.all_reduce(_leaf(x8), group),
        "all_gather": lambda: C.all_gather(_leaf(x8), 0, [1], tp, group),
        "scatter": lambda: C.scatter(_leaf(x8), 0, [1], tp, group),
        "reduce_scatter": lambda: SP.reduce_scatter(_leaf(x8), 0, tp, group),
        "gather_from_sequence": lambda: SP.gather_from_sequence(_leaf(x8), 0, tp, group),
        "vocab_parallel_embedding": lambda: vocab_parallel_embedding(_leaf(x8), d["ids"], 4 * r),
        "vocab_parallel_cross_entropy": lambda: ops.vocab_parallel_cross_entropy(
            _leaf(shard(d["L"], -1, tp, r)), d["T"], r * V // tp, IGNORE, 0, 0.0, group),
        "vocab_parallel_cross_entropy_with_softmax": lambda: ops.vocab_parallel_cross_entropy_with_softmax(
            _leaf(shard(d["L"], -1, tp, r)), d["T"], r * V // tp, IGNORE, 0, 0.0, group)[0],
        # the batch statistics' ops (ops/statistics.py): over whatever group they are given
        "batch_all_reduce": lambda: ops.batch_all_reduce(_leaf(x8), group),
        "batch_scale": lambda: ops.batch_scale(_leaf(x8)),
        "global_statistic": lambda: ops.global_statistic(_leaf(x8), "count"),
        "batch_gather": lambda: ops.batch_gather(_leaf(x8), 0, tp, group),
        "batch_offset": lambda: ops.batch_offset(_leaf(x8), group),
    }
    counter = _Count(transport, ["all_reduce", "all_gather", "gather", "reduce_scatter"])
    out["table"] = {}
    with counter.active():
        for name, make in cases.items():
            y = make()
            fwd = counter.take()
            y.backward(torch.randn_like(y))
            out["table"][name] = (fwd, counter.take())

    # a one-rank group (pp here) means no communication: identity / plain copies
    one, x = one_rank_group, _leaf(x8)
    ys = [C.copy_to_region(x, one), C.all_reduce(x, one), C.all_gather(x, 1, [2], 1, one),
          C.scatter(x, 0, [1], 1, one), SP.reduce_scatter(x, 0, 1, one), SP.gather_from_sequence(x, 0, 1, one)]
    sum(y.sum() for y in ys).backward()
    out["one"] = (all(torch.equal(y, x8) and y.data_ptr() != x.data_ptr() for y in ys), x.grad)
    return out


def _job(rank: int, mesh) -> dict:
    """One 4-rank job: the cases over the mesh's tp=4 group (its shared-memory channel, then
    gloo), then over tp=2 groups {0,1} and {2,3} (made here, so gloo only)."""
    gs = groups_for(mesh)
    assert gs.index("tp") == dist.get_rank(gs.group("tp")) == rank
    assert shm.channel(gs.group("tp").group_name) is not None
    one = gs.group("pp")
    assert one.size() == 1
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]   # every rank creates every group
    out = {"tp4": _cases(gs.group("tp"), one.group_name)}
    with shm.disabled():
        out["tp4-gloo"] = _cases(gs.group("tp"), one.group_name)
    out["tp2"] = _cases(pairs[rank // 2], one.group_name)
    return out


@pytest.fixture(scope="module")
def launched():
    mesh = fxtron.Mesh(4, tp=4)
    return run_on_ranks(_job, mesh, mesh, timeout_s=180)


@pytest.fixture(params=[("tp4", 4, (0, 1, 2, 3)), ("tp4-gloo", 4, (0, 1, 2, 3)), ("tp2", 2, (0, 1)), ("tp2", 2, (2, 3))],
                ids=["tp4-shm", "tp4-gloo", "tp2-ranks01", "tp2-ranks23"])
def job(request, launched):
    """(tp, the outputs of one tp group's ranks in group order)."""
    key, tp, ranks = request.param
    return tp, [launched[r][key] for r in ranks]


def _close(a, b, tol=1e-10):
    assert a.shape == b.shape, (a.shape, b.shape)
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


@pytest.mark.slow
def test_row_parallel_linear(job):
    tp, res = job
    d = _data(tp)
    X, W = _leaf(d["X"]), _leaf(d["Wrow"])
    y = X @ W.T
    (y * d["Grow"]).sum().backward()
    for y_r, gx, _ in (o["row"] for o in res):
        _close(y_r, y.detach())
        _close(gx, X.grad)           # scatter's backward all-gathers the input gradient
    _close(unshard([o["row"][2] for o in res], 1, 2), W.grad)


@pytest.mark.slow
def test_column_parallel_fused_linear_with_f(job):
    tp, res = job
    d = _data(tp)
    X, A = _leaf(d["X"]), _leaf(d["A"])
    y = X @ A.T
    (y * d["Gcol"]).sum().backward()
    for y_r, gx, _ in (o["col"] for o in res):
        _close(y_r, y.detach())      # interleaved all-gather restores the fused layout
        _close(gx, X.grad)           # f's backward all-reduce gives the full input gradient
    _close(unshard([o["col"][2] for o in res], 0, 3), A.grad)


@pytest.mark.slow
def test_sequence_parallel_mlp(job):
    tp, res = job
    d = _data(tp)
    S, A2, B2 = _leaf(d["S"]), _leaf(d["A2"]), _leaf(d["B2"])
    y = S @ A2.T @ B2.T
    (y * d["Gsp"]).sum().backward()
    _close(unshard([o["sp"][0] for o in res], 0), y.detach())
    _close(unshard([o["sp"][1] for o in res], 0), S.grad)
    _close(unshard([o["sp"][2] for o in res], 0), A2.grad)
    _close(unshard([o["sp"][3] for o in res], 1), B2.grad)


@pytest.mark.slow
def test_reduce_scatter_last_dim(job):
    tp, res = job
    d = _data(tp)
    total = d["R"].sum(0)
    for r, o in enumerate(res):
        _close(o["rs1"][0], shard(total, 1, tp, r))
        _close(o["rs1"][1], unshard(list(d["Gr"]), 1))


@pytest.mark.slow
def test_vocab_parallel_embedding(job):
    tp, res = job
    d = _data(tp)
    E = _leaf(d["E"])
    y = F.embedding(d["ids"], E)
    (y * d["Ge"]).sum().backward()
    for o in res:
        _close(o["emb"][0], y.detach())
    _close(unshard([o["emb"][1] for o in res], 0), E.grad)


@pytest.mark.slow
def test_vocab_parallel_cross_entropy(job):
    tp, res = job
    d = _data(tp)
    for i, (red, ls, ii, dtype) in enumerate(CE_CASES):
        L = _leaf(d["L"].to(dtype).double())
        ref = F.cross_entropy(L, _targets(d, ii), ignore_index=ii, reduction=["none", "mean", "sum"][red], label_smoothing=ls)
        (ref * (d["Gce"] if red == 0 else torch.tensor(0.7, dtype=torch.float64))).sum().backward()
        tol = 1e-2 if dtype == torch.bfloat16 else 2e-5
        for o in res:
            loss = o["ce"][i][0]
            assert loss.dtype == torch.float32, CE_CASES[i]
            _close(loss, ref.detach(), tol)
        grads = [o["ce"][i][1] for o in res]
        assert all(g.dtype == dtype for g in grads)
        _close(unshard(grads, -1), L.grad, tol)
        ignored = _targets(d, ii) == ii
        assert ignored.any() and (unshard(grads, -1)[ignored] == 0).all()
        if red == 0:
            assert (res[0]["ce"][i][0][ignored] == 0).all()


@pytest.mark.slow
def test_cross_entropy_issues_exactly_three_all_reduces(job):
    _, res = job
    for o in res:
        for fwd, bwd, shm_fwd, shm_bwd in o["ce_calls"]:
            if o["transport"] == "shm":
                assert (fwd, bwd, shm_fwd, shm_bwd) == ([], [], 3, 0)
            else:
                assert fwd == [("all_reduce", "MAX"), ("all_reduce", "SUM"), ("all_reduce", "SUM")], fwd
                assert bwd == [] and shm_fwd == shm_bwd == 0, bwd


@pytest.mark.slow
def test_collective_table_matches_what_ops_issue(job):
    _, res = job
    kinds = {"all_reduce": "all_reduce", "all_gather": "all_gather", "gather": "all_gather",
             "reduce_scatter": "reduce_scatter"}
    specs = registry.specs()
    for o in res:
        # the linears communicate nothing (test_wgrad, test_fusion); the cp ops (the ring, Ulysses' all-to-all,
        # a2a+p2p, the scans of a split sequence): tests/test_context_parallel.py;
        # the ep ops: tests/test_moe.py; zero=3's and overlap_param_gather's: tests/test_fsdp.py
        assert set(o["table"]) == {n for n in specs if not n.startswith("ep_")} - {
            "linear", "master_linear", "zigzag", "ring_attention", "cp_all_to_all", "hierarchical_attention", "masked_attention", "shard_prev",
            "shard_cumsum", "fsdp_gather", "fsdp_free", "param_wait"}
        for name, (fwd, bwd) in o["table"].items():
            spec = specs[name]
            for phase, calls in (("forward", fwd), ("backward", bwd)):
                comm = getattr(spec, phase)
                assert len(calls) == (comm.count if comm else 0), (name, phase, calls)
                assert {kinds[c] for c, _ in calls} == ({comm.kind} if comm else set()), (name, phase)


@pytest.mark.slow
def test_one_rank_group_is_identity(job):
    _, res = job
    for same, grad in (o["one"] for o in res):
        assert same
        _close(grad, torch.full((8, 4), 6.0, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------
# no process group: identity with group "", fake shapes, opcheck, graph names


def test_fake_shapes_need_no_process_group():
    with FakeTensorMode():
        x = torch.empty(8, 6)
        assert C.copy_to_region(x, "").shape == (8, 6) and C.all_reduce(x, "").shape == (8, 6)
        assert C.all_gather(x, -1, [3], 4, "").shape == (8, 24)
        assert C.scatter(x, 1, [3], 2, "").shape == (8, 3)
        assert SP.reduce_scatter(x, 0, 4, "").shape == (2, 6)
        assert SP.gather_from_sequence(x, 0, 4, "").shape == (32, 6)
        with pytest.raises(ParallelizeError):
            C.scatter(x, 1, [3], 4, "")
        emb = vocab_parallel_embedding(torch.empty(4, 5, dtype=torch.bfloat16), torch.empty(2, 3, 7, dtype=torch.long), 8)
        assert emb.shape == (2, 3, 7, 5) and emb.dtype == torch.bfloat16
        lg, t = torch.empty(2, 3, 4, dtype=torch.bfloat16), torch.empty(2, 3, dtype=torch.long)
        none = ops.vocab_parallel_cross_entropy(lg, t, 0, IGNORE, 0, 0.0, "")
        mean = ops.vocab_parallel_cross_entropy(lg, t, 0, IGNORE, 1, 0.0, "")
        assert none.shape == (2, 3) and mean.shape == () and none.dtype == mean.dtype == torch.float32


def test_identity_without_group_and_world_checked():
    x = torch.randn(4, 6, requires_grad=True)
    for y in (C.copy_to_region(x, ""), C.all_reduce(x, ""), C.all_gather(x, 1, [3], 1, ""),
              C.scatter(x, 0, [1], 1, ""), SP.reduce_scatter(x, 0, 1, ""), SP.gather_from_sequence(x, 1, 1, "")):
        assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
    with pytest.raises(ValueError, match="world=2"):
        C.all_gather(x, 0, [1], 2, "")


def _samples():
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 3, requires_grad=True)
    lg = torch.randn(6, 5, requires_grad=True)
    t = torch.tensor([1, IGNORE, 4, 0, 2, 3])
    return [(ops.copy_to_region, (x, "")), (ops.all_reduce, (x, "")), (ops.all_gather, (x, 1, [3], 1, "")),
            (ops.scatter, (x, 0, [2], 1, "")), (ops.reduce_scatter, (x, 1, 1, "")),
            (ops.gather_from_sequence, (x, 0, 1, "")),
            (ops.vocab_parallel_embedding, (w, torch.tensor([[2, 7, 6], [5, 9, 0]]), 5)),
            (ops.vocab_parallel_cross_entropy_with_softmax, (lg, t, 0, IGNORE, 1, 0.1, "")),
            (ops.vocab_parallel_cross_entropy, (lg, t, 0, IGNORE, 0, 0.0, "")),
            (ops.batch_gather, (x, 0, 1, "")), (ops.batch_offset, (x, ""))]


@pytest.mark.parametrize("i", range(11))
def test_opcheck(i):
    op, args = _samples()[i]
    result = torch.library.opcheck(op, args)   # schema, autograd registration, fake, AOT (dynamic)
    assert set(result.values()) == {"SUCCESS"}, result


def test_ops_are_named_nodes_in_traced_graphs():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w, ids, t):
        h = C.all_reduce(vocab_parallel_embedding(w, ids, 0), "")
        h = C.all_gather(C.copy_to_region(h, "") @ x, -1, [1], 1, "")
        return ops.vocab_parallel_cross_entropy(h.flatten(0, 1), t, 0, IGNORE, 1, 0.0, "")

    gm = make_fx(f)(torch.randn(3, 5), torch.randn(5, 3), torch.tensor([[1, 2], [3, 4]]), torch.tensor([1, 2, 3, 4]))
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    for name in ("vocab_parallel_embedding", "all_reduce", "copy_to_region", "all_gather",
                 "vocab_parallel_cross_entropy_with_softmax"):
        assert getattr(ops, name).default in targets, name


def test_vocab_parallel_embedding_padding_row_gets_no_gradient():
    """Two shards of one table, summed, equal F.embedding with padding_idx: values and grads."""
    torch.manual_seed(0)
    full = torch.randn(8, 3, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[0, 5, 2, 0], [7, 1, 5, 6]])
    ref = torch.nn.functional.embedding(ids, full, padding_idx=5)
    (ref * torch.arange(3.0, dtype=torch.float64)).sum().backward()
    shards = [full.detach()[:4].clone().requires_grad_(), full.detach()[4:].clone().requires_grad_()]
    out = sum(torch.ops.fxtron.vocab_parallel_embedding(w, ids, 4 * r, 5) for r, w in enumerate(shards))
    (out * torch.arange(3.0, dtype=torch.float64)).sum().backward()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([w.grad for w in shards]), full.grad, rtol=0, atol=0)
    assert shards[1].grad[1].abs().sum() == 0     # row 5 is rank 1's local row 1
