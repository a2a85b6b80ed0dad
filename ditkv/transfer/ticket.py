"""Transfer ticket: one AR -> DiT KV handoff of one request.

    CREATED --bind_source--> SOURCE_BOUND --bind_dest + validate + register--> DISPATCHED
    DISPATCHED --every rank reported every row--> RECEIVED
    any state --fail/abort--> FAILED (the reason is kept)

Two independent reports per (source rank, destination rank) pair decide when memory may be
reused. A pair exists where the source rank's KV-head range overlaps the destination rank's (a
single-rank producer holds every head: one source rank 0, one pair per destination rank):
- `received`: the consumer rank saw that source rank's completion notice (data landed);
- `sent`: that source rank's write returned (ok or failed): it no longer reads the source pages,
  and no more bytes of it are on the way.
A destination rank is received once every pair into it is; the source lease is released once
every pair has a `sent` report (or nothing was dispatched); a failed request's destination pages
leave quarantine once every pair is `settled` (received, or its write returned). `received` and
`sent` keep source rank 0's reports keyed by destination rank (the single-producer view).
Reports may arrive from transfer threads: all mutation holds the lock.
"""

from __future__ import annotations

import enum
import itertools
import threading
import time

import msgspec

from .config import CONSUMER_ROLES, PRODUCER_ROLES
from .descriptors import PoolGeometry, check_compatible, check_pages
from .transport import RegionInfo

_ids = itertools.count()


class RankDest(msgspec.Struct, frozen=True):
    rank: int
    engine_id: str
    role: str
    region: RegionInfo
    geometry: PoolGeometry | None  # native: the rank's page pool; None for a legacy staging slot
    head_lo: int
    head_hi: int
    offset: int = 0  # legacy: byte offset of the receive slot inside `region`


class SourceEndpoint(msgspec.Struct, frozen=True):
    engine_id: str
    role: str
    replica: int
    region: RegionInfo
    geometry: PoolGeometry
    block_ids: tuple[int, ...]
    num_tokens: int  # confirmed tokens: only these count as transferable
    # a multi-rank producer (AR tensor parallel): one entry per source rank with its KV-head range
    # (`RankDest` reused: rank, region, geometry, heads); empty = one rank holding every head
    ranks: tuple[RankDest, ...] = ()

    def source_ranks(self) -> list[tuple[int, int, int, PoolGeometry]]:
        """(source rank, head_lo, head_hi, geometry) of every rank that writes."""
        if not self.ranks:
            return [(0, 0, self.geometry.num_kv_heads, self.geometry)]
        return [(r.rank, r.head_lo, r.head_hi, r.geometry) for r in self.ranks]


class RowDest(msgspec.Struct, frozen=True):
    row_id: int
    num_tokens: int  # imported prefix tokens of this row
    block_ids: tuple[int, ...] = ()  # native: destination pages of those tokens
    # native: the leading pages of `block_ids` the destination holds already (prefix-cache hits, shared
    # and read-only): the producer writes only `block_ids[skip_pages:]` (remote protocol 6)
    skip_pages: int = 0

    def written(self) -> tuple[int, ...]:
        """The destination pages the producer writes."""
        return self.block_ids[self.skip_pages:]


class DestEndpoint(msgspec.Struct, frozen=True):
    engine_id: str
    role: str
    replica: int
    ranks: tuple[RankDest, ...]
    rows: tuple[RowDest, ...]


class TicketState(enum.Enum):
    CREATED = "created"
    SOURCE_BOUND = "source_bound"
    DISPATCHED = "dispatched"
    RECEIVED = "received"
    FAILED = "failed"


class TransferTicket:
    def __init__(self, request_id: str, mode: str):
        self.ticket_id = f"t{next(_ids)}-{request_id}"
        self.request_id, self.mode = request_id, mode
        self.state = TicketState.CREATED
        self.source: SourceEndpoint | None = None
        self.dest: DestEndpoint | None = None
        self.error: str | None = None
        self.dispatched_at: float | None = None
        self.deadline: float | None = None
        self._received: dict[tuple[int, int], frozenset[int]] = {}  # (src, dst) -> rows
        self._sent: dict[tuple[int, int], str | None] = {}  # (src, dst) -> None (ok) or the reason
        self.counted: str | None = None  # the verdict `TransferStats` counted (once per ticket)
        self._lock = threading.Lock()

    # ---- binding ------------------------------------------------------------------------
    def bind_source(self, source: SourceEndpoint) -> None:
        with self._lock:
            if self.state is not TicketState.CREATED:
                raise RuntimeError(f"ticket {self.ticket_id}: source bound twice (state {self.state.value})")
            self.source, self.state = source, TicketState.SOURCE_BOUND

    def bind_dest(self, dest: DestEndpoint) -> None:
        with self._lock:
            self.dest = dest

    def mark_dispatched(self, timeout_s: float) -> None:
        with self._lock:
            self.dispatched_at = time.monotonic()
            self.deadline = self.dispatched_at + timeout_s
            if self.state is TicketState.SOURCE_BOUND:
                self.state = TicketState.DISPATCHED

    # ---- reports ------------------------------------------------------------------------
    def report_received(self, rank: int, rows, src: int = 0) -> None:
        with self._lock:
            self._received[src, rank] = self._received.get((src, rank), frozenset()) | frozenset(rows)
            if self.state is TicketState.DISPATCHED and self._all_received():
                self.state = TicketState.RECEIVED

    def report_sent(self, rank: int, error: str | None = None, src: int = 0) -> None:
        with self._lock:
            self._sent[src, rank] = error

    def was_sent(self, rank: int, src: int = 0) -> bool:
        with self._lock:
            return (src, rank) in self._sent

    @property
    def sent(self) -> dict[int, str | None]:
        """Source rank 0's write reports by destination rank."""
        with self._lock:
            return {d: e for (s, d), e in self._sent.items() if s == 0}

    @property
    def received(self) -> dict[int, frozenset[int]]:
        """Source rank 0's completion notices by destination rank."""
        with self._lock:
            return {d: r for (s, d), r in self._received.items() if s == 0}

    def fail(self, reason: str) -> None:
        with self._lock:
            if self.state is not TicketState.FAILED:
                self.state, self.error = TicketState.FAILED, reason

    # ---- queries ------------------------------------------------------------------------
    def pairs(self) -> list[tuple[int, int]]:
        """(source rank, destination rank) pairs whose KV-head ranges overlap: one write each."""
        if not self.dest or self.source is None:
            return []
        return [(s, d.rank) for s, lo, hi, _ in self.source.source_ranks() for d in self.dest.ranks
                if max(lo, d.head_lo) < min(hi, d.head_hi)]

    def _all_received(self) -> bool:
        want = frozenset(r.row_id for r in self.dest.rows) if self.dest else frozenset()
        pairs = self.pairs()
        return bool(pairs) and all(self._received.get(p, frozenset()) >= want for p in pairs)

    def all_received(self) -> bool:
        """Every rank reported every row: the request may run."""
        with self._lock:
            return self._all_received()

    def send_errors(self) -> dict[int, str]:
        """Failed writes by destination rank (the first reason when several source ranks failed)."""
        with self._lock:
            out: dict[int, str] = {}
            for (s, d), e in sorted(self._sent.items()):
                if e is not None and d not in out:
                    out[d] = e if s == 0 else f"from source rank {s}: {e}"
            return out

    def all_sent(self) -> bool:
        """Every source rank finished (or failed) its write to every destination rank it feeds."""
        with self._lock:
            return self.dispatched_at is None or all(p in self._sent for p in self.pairs())

    def settled(self) -> bool:
        """No byte of this ticket can still land: every pair received or its write returned."""
        want = frozenset(r.row_id for r in self.dest.rows) if self.dest else frozenset()
        with self._lock:
            if self.dispatched_at is None:
                return True
            return all(p in self._sent or self._received.get(p, frozenset()) >= want for p in self.pairs())

    @property
    def failed(self) -> bool:
        return self.state is TicketState.FAILED

    def notice(self, rank: int, src: int = 0) -> str:
        """The completion notice destination `rank` receives from source rank `src`:
        `ticket|rank|row,row|src`."""
        rows = ",".join(str(r.row_id) for r in self.dest.rows)
        return f"{self.ticket_id}|{rank}|{rows}|{src}"


def parse_notice(msg: str) -> tuple[str, int, list[int], int]:
    """(ticket id, destination rank, rows, source rank); a notice without a source is rank 0's."""
    parts = msg.split("|")
    if len(parts) not in (3, 4):
        raise ValueError(f"malformed completion notice {msg!r}")
    src = int(parts[3]) if len(parts) == 4 else 0
    return parts[0], int(parts[1]), [int(r) for r in parts[2].split(",") if r], src


def validate_endpoints(ticket: TransferTicket, num_ranks: int, shared_pages=frozenset()) -> str | None:
    """Everything about both endpoints that must hold before either request is touched.
    `shared_pages`: the destination pages its request holds shared (prefix-cache hits), which no
    transfer may write. None when valid, else the reason (the caller rolls back both sides)."""
    s, d = ticket.source, ticket.dest
    if s is None or d is None:
        return "ticket has no " + ("source" if s is None else "destination") + " endpoint bound"
    if s.role not in PRODUCER_ROLES:
        return f"source engine {s.engine_id!r} has kv_role={s.role!r}; a producer needs one of {PRODUCER_ROLES}"
    if d.role not in CONSUMER_ROLES:
        return f"destination engine {d.engine_id!r} has kv_role={d.role!r}; a consumer needs one of {CONSUMER_ROLES}"
    if not s.engine_id or not d.engine_id:
        return "an endpoint has an empty engine_id"
    if s.engine_id == d.engine_id:
        return f"source and destination share engine_id {s.engine_id!r}; engine ids must be unique"
    if not s.region.endpoint:
        return f"source engine {s.engine_id!r} has no transport address"
    if [r.rank for r in d.ranks] != list(range(num_ranks)):
        return f"destination ranks {[r.rank for r in d.ranks]} != 0..{num_ranks - 1}"
    srcs = s.source_ranks()
    total = sum(hi - lo for _, lo, hi, _ in srcs)
    if s.ranks and [lo for _, lo, _, _ in srcs] != [sum(h - l for _, l, h, _ in srcs[:i]) for i in range(len(srcs))]:
        return f"source ranks' KV-head ranges {[(lo, hi) for _, lo, hi, _ in srcs]} do not tile [0, {total})"
    for r in d.ranks:
        if not r.region.endpoint or r.region.transport != s.region.transport:
            return (f"rank {r.rank} of {d.engine_id!r} is at {r.region.transport}:{r.region.endpoint!r}, the "
                    f"producer at {s.region.transport}:{s.region.endpoint!r}: both ends need one transport")
        if r.geometry is not None:
            why = check_compatible(s.geometry, r.geometry, r.head_lo, r.head_hi) if not s.ranks else \
                _check_ranks_compatible(srcs, total, r)
            if why:
                return f"rank {r.rank}: {why}"
    bs = s.geometry.block_size
    for row in d.rows:
        if not 0 < row.num_tokens <= s.num_tokens:
            return f"row {row.row_id} imports {row.num_tokens} tokens; the source confirmed {s.num_tokens}"
        need = -(-row.num_tokens // bs)
        if len(s.block_ids) < need:
            return f"source holds {len(s.block_ids)} pages, row {row.row_id} needs {need}"
        if d.ranks and d.ranks[0].geometry is not None and len(row.block_ids) != need:
            return f"row {row.row_id}: {len(row.block_ids)} destination pages for {row.num_tokens} tokens, need {need}"
    return _check_skips(d, shared_pages)


def _check_skips(d: DestEndpoint, shared_pages) -> str | None:
    """Skipped pages only on the native path, within each row, and no written page a shared one:
    a shared page is read by other requests, so a write into it would corrupt them."""
    native = bool(d.ranks) and d.ranks[0].geometry is not None
    shared = set(shared_pages)
    for row in d.rows:
        if row.skip_pages and not native:
            return f"row {row.row_id} skips {row.skip_pages} pages, but a legacy receive slot is written whole"
        if not 0 <= row.skip_pages <= len(row.block_ids):
            return f"row {row.row_id} skips {row.skip_pages} of its {len(row.block_ids)} destination pages"
        shared.update(row.block_ids[:row.skip_pages])
    for row in d.rows:
        bad = sorted(shared.intersection(row.written()))
        if bad:
            return (f"row {row.row_id} would write shared (prefix-cached) destination pages {bad[:4]}; "
                    "skip them (RowDest.skip_pages)")
    return None


def _check_ranks_compatible(srcs, total: int, r: RankDest) -> str | None:
    """A destination rank fed by several source ranks: page geometry equal, heads inside [0, total)."""
    if not 0 <= r.head_lo < r.head_hi <= total or r.head_hi - r.head_lo != r.geometry.num_kv_heads:
        return f"head range [{r.head_lo}, {r.head_hi}) does not fit the producer's {total} KV heads / its own pool"
    for _, _, _, g in srcs:
        why = check_pages(g, r.geometry)
        if why:
            return why
    return None
