"""Ops: the ledger -- every collective and point-to-point transfer this rank issues, in order.

NCCL matches the collectives of a communicator by their order alone, and its point-to-point
transfers by order too (tags are ignored): a rank whose program diverges (one collective more,
another op, another shape) hangs the job, or, when the sizes agree, mixes data without a word.
gloo checks sizes and fxtron's shared-memory channel checks op and size, but neither tells the
user where the programs parted. The ledger does, in two ways:

- The flight recorder (always on): the last FLIGHT operations of the rank with their state
  (issued, done, failed) and when they were issued. A collective that fails or times out
  raises a ParallelizeError naming it, with the rank's recent operations (a PeerError where
  the backend says the peer's connection closed: the peer died); where the launcher
  gives a directory (FXTRON_FLIGHT_DIR; fxtron.launch does) every operation is also written to
  a small memory-mapped file per rank, so that a failing job reports what *every* rank was
  waiting in, the ranks that were killed included.
- The order check (FXTRON_CHECK_COLLECTIVES=1, or `init_distributed(check_collectives=True)`):
  before each collective the ranks of its group exchange its description (number on the group,
  op, shape, dtype) over a gloo twin of the group; at the end of each step they exchange "the
  step ends here" on every group (a rank with one collective more is caught), and a fingerprint
  of the point-to-point transfers per pair of ranks (sender's sends in order against the
  receiver's receives in order, with what each message is: the order NCCL pairs them in). A
  difference is a ParallelizeError on every rank of the group that names the first differing
  operation on each rank -- before the collective runs, where NCCL would hang or mix data.

The books are kept per process group, by the group's name, like the shared-memory channels
(ops/shm.py): the communicating ops receive a group name, not the ProcessGroups object.
init_distributed installs them (`install`); everything here is a no-op for a group it does
not know beyond counting.
"""
from __future__ import annotations

import mmap
import os
import time
import zlib
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fxtron.config import DebugConfig
from fxtron.errors import ParallelizeError, PeerError

#: what gloo and NCCL say when the process at the other end is gone
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
             "remote process exited", "NCCL communicator was aborted")


class CollectiveFailure(ParallelizeError):
    """A collective or transfer of this rank's that failed (timed out, diverged, its peer gone
    without saying so): what the launcher reports with every rank's operations, never as the
    user's mistake (runtime/launch.py)."""


FLIGHT = 16                 # operations the recorder keeps per rank (and slots in the file)
_LINE = 240                 # bytes per operation in the flight file
_MAX_DIMS = 6               # dims described exactly; more are folded into the last
_MOD = (1 << 61) - 1        # fingerprints: polynomial hashes modulo a Mersenne prime

OPS = ("all_reduce", "all_reduce(max)", "all_gather", "reduce_scatter", "broadcast", "barrier",
       "all_gather_object", "send", "recv", "step end", "all_to_all")
_OP_CODE = {n: i + 1 for i, n in enumerate(OPS)}
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool)
_DTYPE_CODE = {d: i + 1 for i, d in enumerate(_DTYPES)}


def _dtype_name(code: int) -> str:
    return str(_DTYPES[code - 1]).removeprefix("torch.") if 0 < code <= len(_DTYPES) else "object"


def _shape_str(shape: tuple) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


@dataclass
class Entry:
    """One operation: its number among this rank's operations (n), its number on its group
    (seq; for point-to-point, among the transfers to or from that peer), what it is, and when."""

    n: int
    group: str
    seq: int
    op: str
    shape: tuple
    dtype: int
    peer: int | None = None
    note: str = ""
    issued: float = 0.0
    done: float | None = None
    failed: bool = False
    blocked: bool = False       # the rank is waiting for it to complete

    @property
    def state(self) -> str:
        """'issued', 'waiting' (the rank blocks on it), 'done' or 'failed'."""
        return "failed" if self.failed else "done" if self.done is not None else "waiting" if self.blocked else "issued"

    def what(self) -> str:
        """'all_reduce (2, 8, 64) float32', 'send (2, 8, 64) float32 to rank 1 [act mb 0]'."""
        if self.op == "step end":
            return f"the end of step {self.shape[0]} (no further collective on the group)"
        out = f"{self.op} {_shape_str(self.shape)} {_dtype_name(self.dtype)}"
        if self.peer is not None:
            out += f" {'to' if self.op == 'send' else 'from'} rank {self.peer}"
        return out + (f" [{self.note}]" if self.note else "")

    def describe(self) -> str:
        kind = "transfer" if self.peer is not None else "collective"
        return f"{kind} #{self.seq} on group {self.group}: {self.what()}"

    def code(self) -> list[int]:
        """The operation as integers, as the ranks of a group compare it."""
        dims = list(self.shape)
        if len(dims) > _MAX_DIMS:
            tail = 1
            for d in dims[_MAX_DIMS - 1:]:
                tail *= d
            dims = dims[:_MAX_DIMS - 1] + [tail]
        return [self.seq, _OP_CODE[self.op], self.dtype, len(self.shape), *dims, *[0] * (_MAX_DIMS - len(dims))]

    @staticmethod
    def decode(group: str, code: list[int]) -> "Entry":
        seq, op, dtype, ndim, *dims = code
        return Entry(0, group, seq, OPS[op - 1], tuple(dims[:min(ndim, _MAX_DIMS)]), dtype)


@dataclass
class _Book:
    """What the ledger knows of one process group."""

    label: str                       # "tp (ranks 0, 1)"
    ranks: tuple[int, ...]
    twin: object = None              # a gloo group of the same ranks, for the order check
    seq: int = 0                     # collectives issued on the group so far
    # point-to-point, per (peer, "send" | "recv"): [count, fingerprint], and (checking) the log
    p2p: dict = field(default_factory=dict)
    p2p_log: dict = field(default_factory=dict)


class _State:
    def __init__(self):
        self.rank = 0
        self.check = False
        self.books: dict[str, _Book] = {}
        self.flight: deque[Entry] = deque(maxlen=FLIGHT)
        self.n = 0
        self.step = 0
        self.checked = 0            # operations compared across their group (the order check)
        self.file: mmap.mmap | None = None
        self.tally: dict[tuple[tuple[int, ...], str], list] = {}   # (group ranks, op) -> [count, bytes, wire]


_S = _State()


def check_default() -> bool:
    """The order check's default: config.DebugConfig.check_collectives (FXTRON_CHECK_COLLECTIVES)."""
    return DebugConfig().check_collectives


def install(rank: int, books: list[tuple[str, str, tuple[int, ...], object]], *, check: bool,
            flight_dir: str | None = None) -> None:
    """Start this process's ledger: `books` lists (group name, label, ranks, gloo twin or None)
    for every group of the mesh holding this rank."""
    close()
    _S.rank, _S.check = rank, check
    for name, label, ranks, twin in books:
        _S.books[name] = _Book(f"{label} (ranks {', '.join(map(str, ranks))})", tuple(ranks), twin)
    if flight_dir:
        path = os.path.join(flight_dir, f"rank{rank}")
        with open(path, "wb") as f:
            f.write(b" " * (FLIGHT * _LINE))
        fd = os.open(path, os.O_RDWR)
        try:
            _S.file = mmap.mmap(fd, FLIGHT * _LINE)
        finally:
            os.close(fd)


def close() -> None:
    if _S.file is not None:
        _S.file.close()
    _S.__init__()


def checking() -> bool:
    return _S.check


def stats() -> dict[str, int]:
    """Operations recorded, compared across their groups, and steps ended, in this process."""
    return {"operations": _S.n, "checked": _S.checked, "steps": _S.step}


def tally(reset: bool = False) -> dict[tuple[tuple[int, ...], str], tuple[int, int, float]]:
    """What this rank issued since the last reset, by group (its global ranks; a gloo control
    twin counts with its group) and operation: (operations, bytes of the tensors passed, bytes
    this rank sends by the ring algorithms: an all-reduce 2(n-1)/n of its tensor, a
    reduce-scatter (n-1)/n, an all-gather (n-1) times its piece, a send its tensor, a receive
    nothing; an all-to-all the rows it sends the other ranks). pm.collectives(rank) lists the same, as formulas."""
    out = {k: (v[0], v[1], v[2]) for k, v in _S.tally.items()}
    if reset:
        _S.tally = {}
    return out


_RING = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
         "all_to_all": lambda n: (n - 1) / n, "all_gather": lambda n: n - 1, "send": lambda n: 1}


def _book(pg) -> _Book:
    name = pg.group_name
    book = _S.books.get(name)
    if book is None:       # a group made outside the mesh (a user's): recorded, not checked
        try:
            ranks = tuple(dist.get_process_group_ranks(pg))
        except Exception:   # noqa: BLE001 - a name is enough for the record
            ranks = ()
        book = _S.books[name] = _Book(f"'{name}' (ranks {', '.join(map(str, ranks))})", ranks)
    return book


# ---------------------------------------------------------------------------------- recording
def issue(pg, op: str, t: torch.Tensor | None = None, *, peer: int | None = None, note: str = "",
          sent: tuple[int, float] | None = None) -> Entry | None:
    """Record that this rank issues `op` on `pg` (with tensor t; to or from global rank `peer`
    for a transfer), after checking it against the group's other ranks when the order check is
    on. `sent`: (bytes passed, bytes sent to the other ranks) for the tally where `t` does not
    say them (an all-to-all, whose checked tensor leaves its rows open). Returns the entry to
    mark done (`waiting`, `Tracked`); None without a group."""
    if pg is None:
        return None
    book = _book(pg)
    shape = tuple(t.shape) if t is not None else ()
    dtype = _DTYPE_CODE.get(t.dtype, 0) if t is not None else 0
    _S.n += 1
    count = _S.tally.setdefault((book.ranks, op.split("(")[0]), [0, 0, 0.0])     # all_reduce(max): an all_reduce
    nbytes = t.numel() * t.element_size() if t is not None else 0
    count[0] += 1
    if sent is not None:
        count[1] += sent[0]
        count[2] += sent[1]
    else:
        count[1] += nbytes
        count[2] += nbytes * _RING.get(op.split("(")[0], lambda n: 0)(max(1, len(book.ranks)))
    if peer is None:
        book.seq += 1
        e = Entry(_S.n, book.label, book.seq, op, shape, dtype, issued=time.time())
    else:
        key = (peer, op)
        count, h = book.p2p.get(key, (0, 0))
        e = Entry(_S.n, book.label, count + 1, op, shape, dtype, peer, note, time.time())
        for x in (zlib.crc32(note.encode()), *e.code()[2:]):
            h = (h * 1000003 + x) % _MOD
        book.p2p[key] = (count + 1, h)
        if _S.check:
            book.p2p_log.setdefault(key, []).append(e)
    _S.flight.append(e)
    _write(e)
    if peer is None and _S.check and book.twin is not None:
        _agree(book, e)
    return e


def done(e: Entry | None) -> None:
    if e is not None and e.done is None:
        e.done = time.time()
        _mark(e, "done")


def failure(e: Entry, exc: BaseException) -> ParallelizeError:
    """The error for operation e that failed with exc: what it was, after how long, and this
    rank's last operations; a PeerError where the backend says the other side is gone."""
    e.failed = True
    _mark(e, "failed")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if any(sign in str(exc) for sign in PEER_GONE):
        # the other side's process is gone: say so, rather than a failed collective of ours
        who = f"rank {e.peer}" if e.peer is not None else f"a peer in group {e.group}"
        return PeerError(
            f"rank {_S.rank}: {who} died (its connection closed) during {e.describe()}, "
            f"{time.time() - e.issued:.1f} s after it was issued: {first}\n{recent()}\n"
            "(the dead rank's own output, or the launcher's report, says why it exited)")
    return CollectiveFailure(
        f"rank {_S.rank}: {e.describe()} failed after {time.time() - e.issued:.1f} s: {first}\n"
        f"{recent()}\n(a peer that died, timed out or runs a different program; with "
        "FXTRON_CHECK_COLLECTIVES=1 every collective is compared across its group before it runs)")


class waiting:
    """Around the call that completes e: marks it waited for, then done, or turns its failure
    into `failure` (a context manager; a class, for it runs around every collective)."""

    __slots__ = ("e",)

    def __init__(self, e: Entry | None):
        self.e = e

    def __enter__(self):
        e = self.e
        if e is not None:
            e.blocked = True
            _mark(e, "waiting")
        return e

    def __exit__(self, kind, exc, tb) -> bool:
        e = self.e
        if e is None:
            return False
        if exc is None:
            done(e)
        elif isinstance(exc, Exception) and not isinstance(exc, ParallelizeError):
            raise failure(e, exc) from exc      # a backend's error, whatever its type, gets the context
        return False


def collective(pg, op: str, t: torch.Tensor | None = None, *, sent: tuple[int, float] | None = None) -> waiting:
    """Record a blocking collective issued inside the returned context, and complete it."""
    return waiting(issue(pg, op, t, sent=sent))


class Tracked:
    """A started operation's work whose wait() marks its entries done (or reports the failure)."""

    def __init__(self, work, *entries: Entry | None):
        self.work, self.entries = work, [e for e in entries if e is not None]

    def wait(self, *args, **kwargs):
        with waiting(self.entries[0] if self.entries else None):
            out = self.work.wait(*args, **kwargs)
        for e in self.entries[1:]:
            done(e)
        return out

    def discard(self) -> None:
        """Complete it without writing its result where it was started (a shared-memory work's
        discard; a backend's work is waited for: it wrote there already or does so now)."""
        with waiting(self.entries[0] if self.entries else None):
            discard(self.work)
        for e in self.entries[1:]:
            done(e)


def discard(work) -> None:
    """Complete a started collective's `work` without using its result: a shared-memory work
    (or a wrapper of one) into scratch, any other by waiting (it wrote where it was started
    already, or does so now)."""
    getattr(work, "discard", work.wait)()


def started(e: Entry | None, work):
    """`work` (an async collective's) tracked as e, or itself when nothing was recorded."""
    return work if e is None or work is None else Tracked(work, e)


def recent(limit: int = 6) -> str:
    """This rank's last operations, oldest first, as lines."""
    now = time.time()
    lines = [f"  {_state(e, now):<22} {e.describe()}" for e in list(_S.flight)[-limit:]]
    return "last operations of rank %d:\n%s" % (_S.rank, "\n".join(lines) if lines else "  (none)")


def _state(e: Entry, now: float) -> str:
    return e.state if e.state in ("done", "failed") else f"{e.state} ({now - e.issued:.1f} s)"


# ---------------------------------------------------------------------------------- the check
def _gather(book: _Book, mine: list[int], e: Entry) -> list[list[int]]:
    t = torch.tensor(mine, dtype=torch.int64)
    every = [torch.empty_like(t) for _ in book.ranks]
    try:
        dist.all_gather(every, t, group=book.twin)
    except Exception as exc:  # noqa: BLE001 - a backend's error, whatever its type
        raise failure(e, exc) from exc
    return [x.tolist() for x in every]


def _agree(book: _Book, e: Entry) -> None:
    rows = _gather(book, e.code(), e)
    _S.checked += 1
    if all(r == rows[0] for r in rows):
        return
    e.failed = True
    _mark(e, "failed")
    seqs = {r[0] for r in rows}
    where = f"collective #{e.seq}" if len(seqs) == 1 else "collectives #" + "/".join(str(r[0]) for r in rows)
    said = ", ".join(f"rank {rk} {Entry.decode(book.label, r).what()}" for rk, r in zip(book.ranks, rows))
    raise CollectiveFailure(
        f"the ranks' programs diverged at {where} on group {book.label}: {said}. Every rank of a "
        "group must issue the same collectives in the same order (NCCL matches them by order "
        f"alone and would hang or mix data here).\n{recent()}")


def step_end(groups) -> None:
    """At a step boundary, with the order check on: on every group of this rank (in the
    mesh's order of kinds, the same on every rank), agree that the step ends here, then compare
    each pair's point-to-point transfers of the step. Every rank of the job calls it."""
    _S.step += 1
    if not _S.check or groups is None:
        return
    for _, ranks, pg in groups.distinct():
        book = _S.books.get(pg.group_name)
        if len(ranks) == 1 or book is None or book.twin is None:
            continue
        e = Entry(0, book.label, book.seq + 1, "step end", (_S.step,), 0, issued=time.time())
        _agree(book, e)
        _agree_p2p(book, e)
    for book in _S.books.values():
        book.p2p.clear()
        book.p2p_log.clear()


def _agree_p2p(book: _Book, e: Entry) -> None:
    n = len(book.ranks)
    mine = []
    for peer in book.ranks:
        for op in ("send", "recv"):
            mine += list(book.p2p.get((peer, op), (0, 0)))
    rows = _gather(book, mine, e)
    bad = []
    for a, ra in enumerate(book.ranks):
        for b, rb in enumerate(book.ranks):
            sent = rows[a][4 * b:4 * b + 2]
            got = rows[b][4 * a + 2:4 * a + 4]
            if sent != got:
                bad.append((ra, rb))
    if not bad:
        return
    logs: list = [None] * n
    mine_log = {k: [(x.code()[2:], x.note, x.what()) for x in v] for k, v in book.p2p_log.items()}
    dist.all_gather_object(logs, mine_log, group=book.twin)
    lines = []
    for ra, rb in bad:
        sends = logs[book.ranks.index(ra)].get((rb, "send"), [])
        recvs = logs[book.ranks.index(rb)].get((ra, "recv"), [])
        i = next((i for i, (s, r) in enumerate(zip(sends, recvs)) if s[:2] != r[:2]), min(len(sends), len(recvs)))
        s = sends[i][2] if i < len(sends) else "nothing more"
        r = recvs[i][2] if i < len(recvs) else "nothing more"
        lines.append(f"transfer #{i + 1} from rank {ra} to rank {rb}: rank {ra} sends {s}, rank {rb} receives {r}")
    raise CollectiveFailure(
        f"the point-to-point transfers of step {_S.step} on group {book.label} do not pair up in "
        f"order (NCCL pairs a sender's sends with the receiver's receives by order alone): "
        + "; ".join(lines))


# ---------------------------------------------------------------------------------- the file
_STATE = 8          # bytes of a slot's state field: "issued", "waiting", "done", "failed", padded


def _write(e: Entry) -> None:
    """Enter e in its slot of the flight file: state, then 'n issued description'."""
    f = _S.file
    if f is None:
        return
    state = e.state
    line = f"{e.n} {e.issued:.3f} {e.describe()}".encode()[:_LINE - _STATE - 1]
    at = (e.n % FLIGHT) * _LINE
    f[at:at + _LINE] = state.encode().ljust(_STATE) + line.ljust(_LINE - _STATE - 1) + b"\n"


def _mark(e: Entry, state: str) -> None:
    """Change e's state in the flight file (its slot holds e until FLIGHT later operations)."""
    f = _S.file
    if f is not None:
        at = (e.n % FLIGHT) * _LINE
        f[at:at + _STATE] = state.encode().ljust(_STATE)


def read_flight(directory: str, rank: int) -> list[tuple[int, str, float, str]]:
    """The operations a rank's flight file holds: (n, state, issued, description), in order."""
    try:
        with open(os.path.join(directory, f"rank{rank}"), "rb") as f:
            data = f.read()
    except OSError:
        return []
    out = []
    for at in range(0, len(data) - _LINE + 1, _LINE):
        line = data[at:at + _LINE].decode(errors="replace")
        state, parts = line[:_STATE].strip(), line[_STATE:].strip().split(" ", 2)
        if len(parts) == 3 and parts[0].isdigit():
            out.append((int(parts[0]), state, float(parts[1]), parts[2]))
    return sorted(out)


def flight_report(directory: str, world: int, now: float | None = None) -> str:
    """What every rank was doing when the job ended, from the flight files: the last operation
    it was waiting in or failed in, else the first it had issued and not waited for, else its
    last one."""
    now = time.time() if now is None else now
    lines = []
    for r in range(world):
        ops = read_flight(directory, r)
        if not ops:
            lines.append(f"  rank {r}: no communication recorded")
            continue
        stuck = [o for o in ops if o[1] in ("waiting", "failed")]
        pending = [o for o in ops if o[1] == "issued"]
        n, state, t, what = stuck[-1] if stuck else pending[0] if pending else ops[-1]
        if state == "done":
            lines.append(f"  rank {r}: not in a collective; its last: {what} (done)")
        else:
            verb = {"failed": "failed in", "waiting": "waiting in", "issued": "had issued, not yet waited for,"}[state]
            lines.append(f"  rank {r}: {verb} {what} (issued {now - t:.1f} s before)")
    return "what every rank was doing (flight recorder):\n" + "\n".join(lines)
