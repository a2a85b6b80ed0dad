"""Scheduler: FIFO admission with backpressure over the `DiffusionKVCacheManager`.

States: waiting -> running -> finished (ok | cancelled | error). A request with AR text goes
waiting -> ar (its AR phase, `ar_schedule.py`) -> running. A request whose prefix KV is
imported (AR -> DiT transfer) goes waiting -> waiting_for_kv (pages reserved, transfer in flight)
-> running once `kv_ready` says every rank received it; its admission to waiting_for_kv is
bounded by `max_waiting_for_kv`, not by `max_running`, so transfers overlap computation. A
request that fails while its pages may still be written ends with `quarantine=True`: the pages
stay allocated until `release_quarantine`. A request that can never fit is
rejected when it is added, so it never blocks the queue; a request that does not fit *now*
stays at the head (strict FIFO: no starvation of large requests, and smaller ones behind it wait
only until it is admitted). Blocks are returned on every terminal path, at the moment the
request becomes terminal.

KV import (a stage graph's DiT stage): the scheduler holds a KV-import connector (`kv_import`, the
interface is `engine/kv_import.py` `KVImportHook`), the way vLLM's scheduler holds its KV connector:
reserve (here) -> `start` (register every rank's receive, dispatch the producer) -> `poll` (completion
notices, deadlines: ready / failed / settled requests) -> `kv_ready` -> `running` (the request's
import parameters for the workers). On every terminal path of an importing request the connector
says whether a write may still land in its pages; the scheduler then quarantines them, and frees
them when the connector reports the request settled. Connector errors: a `start` that raises ends
that request only (error result, pages quarantined: part of the write may have been dispatched); a
`poll` that raises becomes `KVImportPollError` and the engine fails closed (`_poll_import` says why);
the engine's own fail-closed errors (`fatal_errors`) pass through untouched. Each `schedule()`
reports the requests that ended since the last tick (workers clear their rows) before the newly
admitted ones (workers install them), so a worker never sees a block id owned by two live requests.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import AdmissionError
from .ar_schedule import ARPhaseMixin
from .ar_text import ARText
from .kv_manager import DiffusionKVCacheManager
from .layout import RowLayout, validate_rows
from .metadata import DiffusionKVMetadata
from .token_budget import TokenBudgetMixin

log = logging.getLogger("ditkv.scheduler")


class KVImportPollError(RuntimeError):
    """The KV-import hook's `poll` raised: the engine must fail closed (see `Scheduler._poll_import`)."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"
    AR = "ar"  # in its AR phase (ar_schedule.py)
    RUNNING = "running"
    FINISHED_OK = "finished_ok"
    FINISHED_CANCELLED = "finished_cancelled"
    FINISHED_ERROR = "finished_error"

    @property
    def finished(self) -> bool:
        return self.value.startswith("finished")


@dataclass
class SchedRequest:
    request_id: str
    rows: tuple[RowLayout, ...]
    status: RequestStatus = RequestStatus.WAITING
    metadata: DiffusionKVMetadata | None = None
    error: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    admit_time: float | None = None
    finish_time: float | None = None
    payload: object = None  # engine-owned request data (prompt, tensors); opaque here
    num_computed_tokens: tuple[int, ...] | None = None  # imported prefix per row; None = no import
    kv_received: bool = False
    import_params: object = None  # what the connector gives the workers once it runs (legacy receive slot)
    ar: ARText | None = None  # its AR phase (text before the image), None: none
    intake_rows: tuple[RowLayout, ...] = ()  # the rows checked at intake (an AR request's least DiT rows)
    handover: tuple[int, ...] | None = None  # AR done: tokens per DiT row already in the pages
    adopt: int = 0  # AR done: row 0 begins with this many of the AR row's pages
    export: str | None = None  # AR-stage work: its finished AR row goes to this export key (no DiT phase)
    prefix_keys: tuple | None = None  # prefix-cache keys per row (docs/prefix-cache.md); None: not cached
    cache_hit_tokens: tuple[int, ...] | None = None  # admitted: prefix tokens per row taken from the cache
    row0_tokens: tuple[int, ...] | None = None  # admitted: prefix tokens per row taken from its row 0

    @property
    def imports_kv(self) -> bool:
        return self.num_computed_tokens is not None

    @property
    def prefill_tokens(self) -> int:
        """Query tokens of its first step: every row from its first uncomputed token."""
        zero = (0,) * len(self.rows)  # an import's or handover's tokens, or a row's shared pages: the larger
        shared = [c + s for c, s in zip(self.cache_hit_tokens or zero, self.row0_tokens or zero)]
        done = self.num_computed_tokens or self.handover or zero
        return sum(r.seq_len - max(c, h) for r, c, h in zip(self.rows, done, shared))

    @property
    def denoise_tokens(self) -> int:
        """Query tokens of each later step: the targets."""
        return sum(r.target_len for r in self.rows)


@dataclass(frozen=True)
class FinishedRequest:
    request_id: str
    status: RequestStatus
    generation: int | None  # None when the request never reached a worker
    error: str | None = None


@dataclass
class KVImportEvents:
    """What a KV-import connector's `poll` reports to the scheduler."""
    ready: list[str] = field(default_factory=list)  # every rank received every row
    failed: list[tuple[str, str, bool]] = field(default_factory=list)  # (request id, error, cancelled)
    settled: list[str] = field(default_factory=list)  # quarantined requests whose writes all settled


@dataclass
class SchedulerOutput:
    finished: list[FinishedRequest]  # clear worker rows for these first
    admitted: list[SchedRequest]  # then install these (each has .metadata)
    reserved: list[SchedRequest] = field(default_factory=list)  # now waiting_for_kv: start their transfer
    ar_ended: list[str] = field(default_factory=list)  # ranks forget these AR states (handed over, preempted)
    ar_work: list = field(default_factory=list)  # `ARStepWork`: this step's AR chunks and decode tokens


class Scheduler(ARPhaseMixin, TokenBudgetMixin):
    WAITING, AR, RUNNING = RequestStatus.WAITING, RequestStatus.AR, RequestStatus.RUNNING
    FINISHED_OK = RequestStatus.FINISHED_OK

    def __init__(self, manager: DiffusionKVCacheManager | None, max_running: int = 1,
                 max_waiting_for_kv: int = 8, max_batched_tokens: int | None = None, kv_import=None,
                 fatal_errors: tuple[type[Exception], ...] = ()):
        """`manager=None` is dense_legacy mode: FIFO lifecycle only, no page reservation.
        `kv_import`: the KV-import connector of a stage graph's DiT stage, or None.
        `fatal_errors`: what the engine fails closed on (its `ExecutorError`); raised by the hook,
        they pass through `schedule()` untouched instead of ending one request.
        `max_batched_tokens` bounds one step's query tokens under step-level batching: the
        running requests' denoise tokens plus the prefill tokens of those admitted this tick."""
        if max_running < 1:
            raise ValueError(f"max_running={max_running} must be >= 1")
        if max_batched_tokens is not None and max_batched_tokens < 1:
            raise ValueError(f"max_batched_tokens={max_batched_tokens} must be >= 1")
        self.max_batched_tokens = max_batched_tokens
        if max_waiting_for_kv < 1:
            raise ValueError(f"max_waiting_for_kv={max_waiting_for_kv} must be >= 1")
        self.manager = manager
        self.kv_import = kv_import
        self.fatal_errors = tuple(fatal_errors)
        self.max_running = max_running
        self.max_waiting_for_kv = max_waiting_for_kv
        self.waiting: OrderedDict[str, SchedRequest] = OrderedDict()
        self.waiting_for_kv: OrderedDict[str, SchedRequest] = OrderedDict()
        self._kv_ready: OrderedDict[str, SchedRequest] = OrderedDict()  # received, in readiness order
        self.running: dict[str, SchedRequest] = {}
        self.ar_running: OrderedDict[str, SchedRequest] = OrderedDict()  # AR phases, oldest first
        self._ar_work, self._ar_tokens, self._tick_admitted = [], 0, []
        self.num_preempted = 0
        self.preempted_for: dict[str, int] = {}  # handover / ar_row: what needed the pages
        self._just_finished: list[FinishedRequest] = []
        self._known: set[str] = set()  # ids of live (waiting/running) requests

    # ---- intake -------------------------------------------------------------------------
    def add_request(self, request_id: str, rows: Sequence[RowLayout], payload=None,
                    num_computed_tokens: Sequence[int] | None = None, ar: ARText | None = None,
                    export: str | None = None, prefix_keys=None) -> SchedRequest:
        """Queue a request. Raises `AdmissionError` at once if it can never fit.

        `num_computed_tokens` (one per row) marks a request whose prefix arrives by transfer: it
        is reserved into waiting_for_kv and runs only after `kv_ready`. `ar`: its AR phase runs
        first (`rows` are then the least DiT rows it can have; the engine gives the real ones).
        `export` (with `ar`, no rows): an AR stage's work, whose AR row goes to that export key
        (`ar_exported`) instead of a DiT phase. `prefix_keys`: per row, its cacheable pages' keys (a
        request without AR phase; an import's are committed after its first step, looked up only as
        `ImportKeys`); a cache hit is its own field (`cache_hit_tokens`)."""
        if request_id in self._known:
            raise ValueError(f"request id {request_id!r} is already live; use a unique id")
        if self.manager is not None and request_id in self.manager.quarantined_requests():
            raise ValueError(f"request id {request_id!r} still has quarantined pages (a transfer may "
                             "write into them); use a unique id")
        rows = tuple(rows)
        if export is not None and (rows or ar is None):
            raise ValueError("an export request has an AR phase and no DiT rows")
        if export is None:
            validate_rows(rows)
        if self.manager is not None:
            self.manager.check_admissible(rows)  # AdmissionError: rejected, never queued
        computed = None
        if num_computed_tokens is not None:
            computed = tuple(int(c) for c in num_computed_tokens)
            if len(computed) != len(rows) or any(not 0 <= c <= r.prefix_len for c, r in zip(computed, rows)):
                raise AdmissionError(f"num_computed_tokens={list(computed)} must give one value per row "
                                     "within [0, prefix_len]")
        if ar is not None:
            self._check_ar(ar, rows, computed)
        req = SchedRequest(request_id, rows, payload=payload, num_computed_tokens=computed, ar=ar,
                           intake_rows=rows, export=export,
                           prefix_keys=None if ar is not None else prefix_keys)
        # the whole prefill (no hit credited): a hit is not guaranteed, the pages may be evicted first
        if self.max_batched_tokens is not None and req.prefill_tokens > self.max_batched_tokens:
            raise AdmissionError(f"request needs {req.prefill_tokens} query tokens in its first step, above "
                                 f"max_num_batched_tokens={self.max_batched_tokens}; lower the image size or "
                                 "prompt length, or raise max_num_batched_tokens", field="size")
        self.waiting[request_id] = req
        self._known.add(request_id)
        return req

    # ---- tick ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        admitted: list[SchedRequest] = []
        reserved: list[SchedRequest] = []
        ar_ended: list[str] = []
        if self.kv_import is not None:
            self._apply_import(self._poll_import())
        stalled = self._ar_tick(admitted, ar_ended) if self.ar_running else self._no_ar_tick(admitted)
        while self._kv_ready and len(self.running) < self.max_running:  # received KV runs first
            if not self._fits_batch(next(iter(self._kv_ready.values())), admitted):
                break
            rid, req = self._kv_ready.popitem(last=False)
            self.waiting_for_kv.pop(rid)
            req.status = RequestStatus.RUNNING
            self.running[rid] = req
            if self.kv_import is not None:
                req.import_params = self.kv_import.running(req)
            admitted.append(req)
        while self.waiting and not stalled:
            rid, req = next(iter(self.waiting.items()))
            if req.ar is not None:
                if len(self.running) + len(self.ar_running) >= self.max_running or not self._admit_ar(req):
                    break
                continue
            if req.imports_kv:
                if len(self.waiting_for_kv) >= self.max_waiting_for_kv:
                    break
            elif len(self.running) + len(self.ar_running) >= self.max_running or not self._fits_batch(req, admitted):
                break
            if self.manager is None:  # dense: the model owns its cache, nothing to reserve
                self.waiting.pop(rid)
                req.admit_time = time.monotonic()
                self._place(req, admitted, reserved)
                continue
            try:
                kw = {} if req.prefix_keys is None else {"prefix_keys": req.prefix_keys}  # off: today's call
                meta = self.manager.reserve_request(rid, req.rows, req.num_computed_tokens, **kw)
            except AdmissionError as e:  # pool changed (e.g. resized) since add: fail, don't block
                self.waiting.pop(rid)
                self._terminate(req, RequestStatus.FINISHED_ERROR, str(e))
                continue
            except Exception as e:
                # a bug or a broken pool: end this request only (its pages freed) and go on, so the
                # requests admitted before it in this tick are still reported
                self.waiting.pop(rid)
                self._terminate(req, RequestStatus.FINISHED_ERROR,
                                f"reserving KV blocks failed: {type(e).__name__}: {e}")
                continue
            if meta is None:
                break  # backpressure: the head keeps its place
            if req.prefix_keys:  # the shared pages: from the cache, then (rows > 0) row 0's
                req.cache_hit_tokens = tuple(r.num_cached_tokens - r.num_row0_tokens for r in meta.rows)
                req.row0_tokens = tuple(r.num_row0_tokens for r in meta.rows)
                if not self._fits_batch(req, admitted):  # a smaller hit than credited: `_fits_batch`
                    self.manager.unreserve(rid)
                    req.cache_hit_tokens = req.row0_tokens = None
                    break
            self.waiting.pop(rid)
            req.metadata, req.admit_time = meta, time.monotonic()
            self._place(req, admitted, reserved)
        if self.kv_import is not None:
            for req in reserved:
                self._start_import(req)
        finished, self._just_finished = self._just_finished, []
        return SchedulerOutput(finished=finished, admitted=admitted, reserved=reserved, ar_ended=ar_ended,
                               ar_work=list(self._ar_work))

    def _no_ar_tick(self, admitted: list) -> bool:
        self._ar_work, self._ar_tokens, self._tick_admitted = [], 0, admitted
        return False

    def _poll_import(self) -> KVImportEvents:
        """The hook's events. A raise means its completion state is lost (notices taken and dropped,
        a broken notice channel), so no page can be proven free any more: `KVImportPollError`, on
        which the engine fails closed (ranks stopped first, then every page returns)."""
        try:
            return self.kv_import.poll()
        except self.fatal_errors:
            raise  # the engine's own fail-closed error: let it handle it as it is
        except Exception as e:
            raise KVImportPollError(f"KV import poll failed: {type(e).__name__}: {e}") from e

    def _start_import(self, req: SchedRequest) -> None:
        """Register + dispatch one reserved request. A returned error means nothing was dispatched:
        roll back. A raise ends this request only, and since it may have come after part of the
        write was dispatched its pages stay quarantined until the hook reports them settled (or
        the engine closes); the other requests of this tick still start."""
        try:
            error = self.kv_import.start(req)
        except self.fatal_errors:
            raise
        except Exception as e:
            log.warning("starting the KV transfer of %s failed", req.request_id, exc_info=True)
            self.fail(req.request_id, f"starting the KV transfer failed: {type(e).__name__}: {e}", quarantine=True)
            return
        if error is not None:
            self.fail(req.request_id, error)

    def _apply_import(self, ev: KVImportEvents) -> None:
        for rid in ev.ready:
            self.kv_ready(rid)
        for rid, error, cancelled in ev.failed:
            req = self.get(rid)
            if req is not None:  # the connector says whether to quarantine (`_terminate`)
                self._terminate(req, RequestStatus.FINISHED_CANCELLED if cancelled else RequestStatus.FINISHED_ERROR,
                                error)
        for rid in ev.settled:
            self.release_quarantine(rid)

    def _place(self, req: SchedRequest, admitted: list, reserved: list) -> None:
        if req.imports_kv:
            req.status = RequestStatus.WAITING_FOR_KV
            self.waiting_for_kv[req.request_id] = req
            reserved.append(req)
        else:
            req.status = RequestStatus.RUNNING
            self.running[req.request_id] = req
            admitted.append(req)

    def kv_ready(self, request_id: str) -> bool:
        """Every rank reported every row received: the request may run at the next tick."""
        req = self.waiting_for_kv.get(request_id)
        if req is None or req.kv_received:
            return False
        req.kv_received = True
        self._kv_ready[request_id] = req
        return True

    def take_finished(self) -> list[FinishedRequest]:
        """Requests that ended since the last tick, without admitting anything."""
        finished, self._just_finished = self._just_finished, []
        return finished

    # ---- terminal paths -----------------------------------------------------------------
    def finish(self, request_id: str, error: str | None = None) -> bool:
        """A running request ended (ok, or with `error`)."""
        req = self.running.get(request_id)
        if req is None:
            return False
        status = RequestStatus.FINISHED_ERROR if error is not None else RequestStatus.FINISHED_OK
        self._terminate(req, status, error)
        return True

    def cancel(self, request_id: str, reason: str = "cancelled", quarantine: bool = False) -> bool:
        """Cancel in any live state. False if the request is unknown or already finished.
        `quarantine=True` keeps its pages allocated until `release_quarantine`."""
        req = self.get(request_id)
        if req is None:
            return False
        self._terminate(req, RequestStatus.FINISHED_CANCELLED, reason, quarantine)
        return True

    def fail(self, request_id: str, error: str, quarantine: bool = False) -> bool:
        """Fail a request in any live state (e.g. a transfer timed out)."""
        req = self.get(request_id)
        if req is None:
            return False
        self._terminate(req, RequestStatus.FINISHED_ERROR, error, quarantine)
        return True

    def release_quarantine(self, request_id: str) -> bool:
        return self.manager.release_quarantine(request_id) if self.manager is not None else False

    def release_all_quarantine(self) -> None:
        """Nothing can write any more (the receivers are closed): every quarantined page returns."""
        if self.manager is not None:
            for rid in self.manager.quarantined_requests():
                self.manager.release_quarantine(rid)

    def fail_all(self, error: str) -> list[str]:
        """Fail every live request (engine failure / shutdown)."""
        ids = list(self.running) + list(self.ar_running) + list(self.waiting_for_kv) + list(self.waiting)
        for rid in ids:
            self._terminate(self.get(rid), RequestStatus.FINISHED_ERROR, error)
        return ids

    def shutdown(self) -> SchedulerOutput:
        for rid in list(self.running) + list(self.ar_running) + list(self.waiting_for_kv) + list(self.waiting):
            self.cancel(rid, "engine shutdown")
        if self.manager is not None:
            self.manager.close()
        finished, self._just_finished = self._just_finished, []
        return SchedulerOutput(finished=finished, admitted=[])

    def _terminate(self, req: SchedRequest, status: RequestStatus, error: str | None,
                   quarantine: bool = False) -> None:
        if self.kv_import is not None and req.imports_kv:  # a write may still land: quarantine
            quarantine = self._import_in_flight(req, status, error) or quarantine
        was_running = self.running.pop(req.request_id, None) is not None
        self.ar_running.pop(req.request_id, None)
        self._ar_work = [w for w in self._ar_work if w.request is not req]
        self.waiting.pop(req.request_id, None)
        self.waiting_for_kv.pop(req.request_id, None)
        self._kv_ready.pop(req.request_id, None)
        self._known.discard(req.request_id)
        gen = req.metadata.generation if (was_running and req.metadata) else None
        if self.manager is not None:
            self.manager.free_request(req.request_id, quarantine=quarantine)
        req.status, req.error, req.finish_time = status, error, time.monotonic()
        self._just_finished.append(FinishedRequest(req.request_id, status, gen, error))

    def _import_in_flight(self, req: SchedRequest, status: RequestStatus, error: str | None) -> bool:
        """The hook's answer whether a write may still land in `req`'s pages; a hook that raises
        cannot say, so the pages are kept (quarantined until it settles them or the engine closes)."""
        try:
            return bool(self.kv_import.finished(req, error, status is RequestStatus.FINISHED_CANCELLED))
        except self.fatal_errors:
            raise
        except Exception:
            log.exception("the KV-import hook failed to end %s; its pages stay quarantined", req.request_id)
            return True

    # ---- queries ------------------------------------------------------------------------
    def get(self, request_id: str) -> SchedRequest | None:
        return (self.waiting.get(request_id) or self.waiting_for_kv.get(request_id)
                or self.running.get(request_id) or self.ar_running.get(request_id))

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting_for_kv(self) -> int:
        return len(self.waiting_for_kv)

    @property
    def num_ar(self) -> int:
        return len(self.ar_running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_kv or self.ar_running)
