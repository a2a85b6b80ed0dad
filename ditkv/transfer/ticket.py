"""Transfer ticket: one AR -> DiT KV handoff of one request.

    CREATED --bind_source--> SOURCE_BOUND --bind_dest + validate + register--> DISPATCHED
    DISPATCHED --every rank reported every row--> RECEIVED
    any state --fail/abort--> FAILED (the reason is kept)

Two independent reports per destination rank decide when memory may be reused:
- `received[rank]`: the consumer rank saw the completion notice (data landed) for these rows;
- `sent[rank]`: the producer's write for that rank returned (ok or failed): it no longer reads the
  source pages, and no more bytes of it are on the way.
The source lease is released once every rank has a `sent` report (or nothing was dispatched); a
failed request's destination pages leave quarantine once every rank is `settled` (received, or
its write returned). Reports may arrive from transfer threads: all mutation holds the lock.
"""

from __future__ import annotations

import enum
import itertools
import threading
import time

import msgspec

from .config import CONSUMER_ROLES, PRODUCER_ROLES
from .descriptors import PoolGeometry, check_compatible
from .transport import RegionInfo

_ids = itertools.count()


class SourceEndpoint(msgspec.Struct, frozen=True):
    engine_id: str
    role: str
    replica: int
    region: RegionInfo
    geometry: PoolGeometry
    block_ids: tuple[int, ...]
    num_tokens: int  # confirmed tokens: only these count as transferable


class RankDest(msgspec.Struct, frozen=True):
    rank: int
    engine_id: str
    role: str
    region: RegionInfo
    geometry: PoolGeometry | None  # native: the rank's page pool; None for a legacy staging slot
    head_lo: int
    head_hi: int
    offset: int = 0  # legacy: byte offset of the receive slot inside `region`


class RowDest(msgspec.Struct, frozen=True):
    row_id: int
    num_tokens: int  # imported prefix tokens of this row
    block_ids: tuple[int, ...] = ()  # native: destination pages of those tokens


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
        self.received: dict[int, frozenset[int]] = {}
        self.sent: dict[int, str | None] = {}  # rank -> None (ok) or the failure reason
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
    def report_received(self, rank: int, rows) -> None:
        with self._lock:
            self.received[rank] = self.received.get(rank, frozenset()) | frozenset(rows)
            if self.state is TicketState.DISPATCHED and self._all_received():
                self.state = TicketState.RECEIVED

    def report_sent(self, rank: int, error: str | None = None) -> None:
        with self._lock:
            self.sent[rank] = error

    def fail(self, reason: str) -> None:
        with self._lock:
            if self.state is not TicketState.FAILED:
                self.state, self.error = TicketState.FAILED, reason

    # ---- queries ------------------------------------------------------------------------
    def _ranks(self) -> list[int]:
        return [r.rank for r in self.dest.ranks] if self.dest else []

    def _all_received(self) -> bool:
        want = frozenset(r.row_id for r in self.dest.rows) if self.dest else frozenset()
        return bool(self.dest) and all(self.received.get(k, frozenset()) >= want for k in self._ranks())

    def all_received(self) -> bool:
        """Every rank reported every row: the request may run."""
        with self._lock:
            return self._all_received()

    def send_errors(self) -> dict[int, str]:
        with self._lock:
            return {k: e for k, e in self.sent.items() if e is not None}

    def all_sent(self) -> bool:
        """The producer finished (or failed) its write on every destination rank."""
        with self._lock:
            return self.dispatched_at is None or all(k in self.sent for k in self._ranks())

    def settled(self) -> bool:
        """No byte of this ticket can still land: every rank received or its write returned."""
        want = frozenset(r.row_id for r in self.dest.rows) if self.dest else frozenset()
        with self._lock:
            if self.dispatched_at is None:
                return True
            return all(k in self.sent or self.received.get(k, frozenset()) >= want for k in self._ranks())

    @property
    def failed(self) -> bool:
        return self.state is TicketState.FAILED

    def notice(self, rank: int) -> str:
        """The completion notice a destination rank receives: `ticket|rank|row,row`."""
        rows = ",".join(str(r.row_id) for r in self.dest.rows)
        return f"{self.ticket_id}|{rank}|{rows}"


def parse_notice(msg: str) -> tuple[str, int, list[int]]:
    tid, rank, rows = msg.split("|")
    return tid, int(rank), [int(r) for r in rows.split(",") if r]


def validate_endpoints(ticket: TransferTicket, num_ranks: int) -> str | None:
    """Everything about both endpoints that must hold before either request is touched.
    None when valid, else the reason (the caller rolls back both sides)."""
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
    for r in d.ranks:
        if not r.region.endpoint or r.region.transport != s.region.transport:
            return (f"rank {r.rank} of {d.engine_id!r} is at {r.region.transport}:{r.region.endpoint!r}, the "
                    f"producer at {s.region.transport}:{s.region.endpoint!r}: both ends need one transport")
        if r.geometry is not None:
            why = check_compatible(s.geometry, r.geometry, r.head_lo, r.head_hi)
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
    return None
