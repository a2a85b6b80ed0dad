"""The DiT stage's KV-import hook (`engine/kv_import.py` `KVImportHook`): the ticket lifecycle of
AR -> DiT transfers, held by the DiT engine's scheduler.

Per request (native):
  intake     `check_endpoints`: both endpoints (roles, engine ids, addresses, geometry) are valid
             before the engine queues it; invalid: the stage rejects it and the producer frees its
             pages; neither request was touched
  reserve    the scheduler reserves every row atomically, imported prefix marked computed
             (`num_computed_tokens`); each row begins with its prefix-cache hit, shared pages the
             transfer skips (`RowDest.skip_pages`; nothing to send at all: ready at the next poll,
             the producer's pages returned at once) -> waiting_for_kv
  start      every consumer rank registers the receive; a failure unregisters all and the
             scheduler rolls the reservation back (the producer frees its pages): nothing was
             dispatched (an unexpected exception from a rank's registration included). Then the
             producer writes the prefix pages (its thread); deadline = now + transfer_timeout. A
             raise from the dispatch ends the request with its pages quarantined until the ticket
             settles or the stage closes (part of the write may have left)
  poll       completion notices per rank; every rank reported every row -> ready (the request runs;
             step 0 starts at the import); timeout / producer error -> failed
  finished   on every terminal path: a dispatched write that has not settled on every rank keeps
             the pages quarantined (the scheduler decides, `poll` reports them settled later); a
             peer that never settles keeps them until shutdown
  fail-closed  a notice from an unknown rank, a consumer set that is not 0..n-1 or invalid own
             block ids raise `ExecutorError`: the engine stops its ranks, fails every request, and
             only then frees the pages
Legacy differs only in the destination: a receive slot per request (the same slot index on every
rank) instead of pages; `running` hands the workers a `LegacyImport` (the slot), which every rank
copies into its dense cache when the request starts (`DenseImport`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..engine.ar_plan import importable_prefix, shared_prefix  # noqa: F401 (re-exported)
from ..core.kv_manager import blocks_for
from ..core.scheduler import KVImportEvents, RequestStatus, SchedRequest
from ..engine.executor import ExecutorError
from ..engine.messages import LegacyImport
from ..transfer.config import NATIVE, TransferConfig
from ..transfer.connector import BadBlockIdsError, RegistrationError
from ..transfer.ticket import DestEndpoint, RowDest, TransferTicket, validate_endpoints

log = logging.getLogger("ditkv.dit")


def import_rows(meta, import_tokens, block_size: int) -> tuple[list[RowDest], frozenset[int]]:
    """The native destination of each importing row, and the pages the request holds shared. A row's
    shared leading pages (`num_cached_tokens`: prefix-cache hits) are skipped: the transfer writes only
    the rest, and a row whose imported tokens lie wholly in them keeps its place with nothing to write,
    so the notice still names it."""
    rows, shared = [], set()
    for i, (m, n) in enumerate(zip(meta.rows, import_tokens)):
        hit = m.num_cached_tokens // block_size
        shared.update(m.block_ids[:hit])
        if n > 0:
            ids = tuple(m.block_ids[:blocks_for(n, block_size)])
            rows.append(RowDest(i, n, ids, min(hit, len(ids))))
    return rows, frozenset(shared)


@dataclass
class DiTJob:
    request_id: str
    ticket: TransferTicket
    layout: object  # RequestLayout: built by the orchestrator, sent to the DiT ranks as it is
    params: object  # SamplingParams
    import_tokens: list[int]  # per row
    on_done: Callable[[DiTJob, object], None]  # (job, GenerationOutput)
    abort_source: Callable[[TransferTicket], None]  # producer frees its pages (nothing in flight)
    send: Callable[[TransferTicket], None]  # start the producer's write
    arrival: float = 0.0
    request: object = None  # the GenerationRequest


class DiTImporter:
    """One per DiT engine; built by the engine from its executor (`Engine(kv_import=...)`)."""

    def __init__(self, index: int, transfer: TransferConfig, executor, block_size: int, max_inflight: int = 8,
                 stats=None):
        self.index, self.transfer, self.block_size = index, transfer, block_size
        self.native = transfer.mode == NATIVE
        self.transfer_stats = stats  # `TransferStats`: one verdict per ticket, or None
        self.num_ranks = executor.world_size
        slots = transfer.legacy_slots if not self.native else max_inflight
        self.max_waiting_for_kv = min(slots, max_inflight)
        self.ranks = None  # RankGroup: the rank processes of a multi-rank engine
        if getattr(executor, "receiver", None) is not None:  # in-process: the rank's own consumer
            self.consumers = [executor.receiver.consumer]
        else:
            from .remote_ranks import RankGroup

            self.ranks = RankGroup(executor, transfer)  # every rank registers its own pool (its KV heads)
            self.consumers = self.ranks.consumers
        self._tickets: dict[str, TransferTicket] = {}  # ticket id -> ticket (registered receives)
        self._waiting: dict[str, TransferTicket] = {}  # dispatched, not yet received on every rank
        self._unbound: dict[str, SchedRequest] = {}  # legacy: reserved while every slot was quarantined
        self._quarantine: dict[str, TransferTicket] = {}
        self._slots: dict[str, int] = {}  # legacy receive slot per request
        # requests whose `start` raised: the scheduler quarantines their pages whatever `finished`
        # answers, so once nothing can land (at once when nothing was dispatched) `poll` says settled
        self._raised: set[str] = set()
        self._settle_next: list[str] = []
        self._ready_next: dict[str, TransferTicket] = {}  # native imports with nothing to send: ready at the next poll
        self.skips_cached_pages = self.native  # `Engine.add_import`: an import may look its rows up (they skip hits)
        self.closed: str | None = None  # "failed" (failed closed) or "shutdown"

    # ---- intake (the stage, before the engine queues the request) -------------------------
    def check_endpoints(self, ticket: TransferTicket) -> str | None:
        """Endpoint-level check before touching anything; the reason when invalid."""
        ticket.bind_dest(self._dest(rows=(), slot=None))
        return validate_endpoints(ticket, self.num_ranks)

    def _dest(self, rows, slot) -> DestEndpoint:
        t = self.transfer
        return DestEndpoint(t.engine_id, t.kv_role, self.index, tuple(c.rank_dest(slot) for c in self.consumers),
                            tuple(rows))

    # ---- the scheduler's hook ---------------------------------------------------------------
    def start(self, req: SchedRequest) -> str | None:
        """Register the receive on every rank, then dispatch; an error when nothing was dispatched."""
        try:
            return self._start(req)
        except ExecutorError:
            raise
        except Exception:
            self._raised.add(req.request_id)
            raise

    def _start(self, req: SchedRequest) -> str | None:
        rid, job = req.request_id, req.payload.ext
        slot = None
        shared: frozenset[int] = frozenset()
        if self.native:
            rows, shared = import_rows(req.metadata, job.import_tokens, self.block_size)
        else:
            slot = self.consumers[0].slots.take()
            if slot is None:
                self._unbound[rid] = req  # every slot quarantined: retry on a later tick
                return None
            self._slots[rid] = slot
            rows = [RowDest(i, n) for i, n in enumerate(job.import_tokens) if n > 0]
        self._unbound.pop(rid, None)
        if sorted(c.rank for c in self.consumers) != list(range(self.num_ranks)):
            raise ExecutorError(f"consumer ranks {[c.rank for c in self.consumers]} != 0..{self.num_ranks - 1}")
        t = job.ticket
        t.bind_dest(self._dest(rows, slot))
        why = validate_endpoints(t, self.num_ranks, shared)
        if why:
            self._count(t, "failed")
            return f"invalid transfer: {why}"
        if self.native and not any(r.written() for r in rows):  # every imported page is cached here
            job.abort_source(t)  # nothing to send: the producer's pages return now, no notice to wait for
            self._count_skipped(t)
            self._ready_next[rid] = t
            return None
        done = []
        try:
            for c in self.consumers:
                c.register(t)
                done.append(c)
        except ExecutorError:
            raise  # a rank died or went silent: the engine fails closed
        except Exception as e:  # nothing was dispatched yet: every rank forgets it, then roll back
            for c in done:
                c.unregister(t.ticket_id)
            if isinstance(e, BadBlockIdsError):  # our own block ids are invalid: the engine is corrupt
                raise ExecutorError(str(e)) from e
            self._count(t, "failed")
            why = str(e) if isinstance(e, RegistrationError) else f"{type(e).__name__}: {e}"
            return f"KV receive registration failed: {why}"
        self._tickets[t.ticket_id] = t
        self._waiting[rid] = t
        t.mark_dispatched(self.transfer.transfer_timeout)
        self._count_skipped(t)
        # a raise from here on may come after part of the write left: the scheduler ends this request
        # with its pages quarantined, and `finished` keeps the ticket until it settles (or we close)
        job.send(t)
        return None

    def poll(self) -> KVImportEvents:
        ev = KVImportEvents(settled=self._settle_next)
        self._settle_next = []
        if self.closed is not None:
            return ev
        for rid, t in self._ready_next.items():
            self._count(t, "ok")
            ev.ready.append(rid)
        self._ready_next.clear()
        for rid, req in list(self._unbound.items()):
            try:
                error = self.start(req)
            except ExecutorError:
                raise
            except Exception as e:  # as the scheduler treats a raising `start`: this request ends, and
                # `finished` quarantines its pages if the ticket was dispatched (a write may have left)
                log.warning("starting the KV transfer of %s failed", rid, exc_info=True)
                self._raised.discard(rid)  # reported below: `finished` alone decides the quarantine
                error = f"starting the KV transfer failed: {type(e).__name__}: {e}"
            if error is not None:
                ev.failed.append((rid, error, False))
        for c in self.consumers:
            for tid, rank, rows, src in c.poll():
                if rank != c.rank:
                    raise ExecutorError(f"rank {c.rank} received a completion notice for rank {rank}")
                t = self._tickets.get(tid)
                if t is not None:  # else a notice for a ticket already released
                    t.report_received(rank, rows, src)
        now = time.monotonic()
        for rid, t in list(self._waiting.items()):
            if t.all_received():
                del self._waiting[rid]
                self._count(t, "ok")
                ev.ready.append(rid)
            elif t.send_errors() and t.all_sent():
                errs = "; ".join(f"rank {k}: {e}" for k, e in sorted(t.send_errors().items()))
                ev.failed.append((rid, f"KV transfer failed: {errs}", False))
            elif t.failed:  # the producer's side was lost mid-write (a remote AR stage): what may land stays quarantined
                ev.failed.append((rid, f"KV transfer failed: {t.error}", False))
            elif now >= t.deadline:
                ev.failed.append((rid, f"timed out receiving KV after {self.transfer.transfer_timeout:g}s", False))
        for rid, t in list(self._quarantine.items()):
            if t.settled():
                del self._quarantine[rid]
                self._forget(t)
                self._give_slot(rid)
                ev.settled.append(rid)
        return ev

    def running(self, req: SchedRequest):
        """Received on every rank: the registration is done; legacy: the slot every rank reads."""
        job = req.payload.ext
        self._forget(job.ticket)
        if self.native:
            return None
        src = job.ticket.source
        return LegacyImport(slot=self._slots[req.request_id], tokens_per_row=list(job.import_tokens),
                            num_layers=src.geometry.num_layers, head_dim=src.geometry.head_dim,
                            src_heads=[(lo, hi) for _, lo, hi, _ in src.source_ranks()])

    def finished(self, req: SchedRequest, error: str | None, cancelled: bool) -> bool:
        """The request ends (any path); True when a write may still land in its pages."""
        raised = req.request_id in self._raised
        self._raised.discard(req.request_id)
        in_flight = self._finished(req, error, cancelled)
        if raised and not in_flight:  # quarantined by the scheduler all the same: release it next poll
            self._settle_next.append(req.request_id)
        return in_flight

    def _finished(self, req: SchedRequest, error: str | None, cancelled: bool) -> bool:
        rid, job = req.request_id, req.payload.ext
        t = job.ticket
        self._unbound.pop(rid, None)
        self._waiting.pop(rid, None)
        self._ready_next.pop(rid, None)
        if self.closed == "failed":
            self._count(t, "failed")  # a ticket already received keeps its "ok"
        elif self.closed == "shutdown" and t.dispatched_at is not None:
            self._count(t, "cancelled")
        if req.status is RequestStatus.RUNNING:  # it ran: the ranks answered, nothing reads the slot now
            self._forget(t)
            self._give_slot(rid)
            return False
        t.fail(error or "cancelled")
        if t.dispatched_at is None:  # nothing in flight: the producer frees its pages
            job.abort_source(t)
            self._give_slot(rid)
            return False
        self._count(t, "cancelled" if cancelled else "failed")
        if self.closed is None and not t.settled():
            self._quarantine[rid] = t
            return True
        self._forget(t)
        self._give_slot(rid)
        return False

    def fail_closed(self, reason: str) -> None:
        """The engine failed closed and its executor is shut down: nothing can write any more."""
        log.error("DiT stage %d fails closed: %s", self.index, reason)
        self.closed = "failed"
        self._stop_ranks()

    def close(self) -> None:
        """Shutdown (the executor is already shut down): everything, quarantined pages included, returns."""
        if self.closed is None:
            self.closed = "shutdown"
        self._stop_ranks()

    def _stop_ranks(self) -> None:
        if self.ranks is not None:
            self.ranks.stop()
        self._quarantine.clear()
        self._tickets.clear()
        for rid in list(self._slots):
            self._give_slot(rid)

    # ---- helpers ----------------------------------------------------------------------------
    def _forget(self, t: TransferTicket) -> None:
        if self._tickets.pop(t.ticket_id, None) is not None and self.closed is None:
            for c in self.consumers:
                c.unregister(t.ticket_id)

    def _count(self, ticket: TransferTicket, outcome: str) -> None:
        if self.transfer_stats is not None:
            self.transfer_stats.finished(ticket, outcome)

    def _count_skipped(self, t: TransferTicket) -> None:
        """The bytes the skipped pages would have cost: each destination rank's share of every page."""
        if self.transfer_stats is not None and self.native:
            pages = sum(r.skip_pages for r in t.dest.rows)
            self.transfer_stats.add_skipped(pages * sum(r.geometry.page_bytes for r in t.dest.ranks))

    def _give_slot(self, rid: str) -> None:
        slot = self._slots.pop(rid, None)
        if slot is not None:
            self.consumers[0].slots.give(slot)

    # ---- observability ----------------------------------------------------------------------
    @property
    def num_quarantined(self) -> int:
        return len(self._quarantine)

    @property
    def polling(self) -> bool:
        """Transfers in flight, quarantined pages or unbound requests: poll often."""
        return bool(self._waiting or self._quarantine or self._unbound or self._ready_next)
