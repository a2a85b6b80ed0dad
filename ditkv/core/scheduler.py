"""Scheduler: FIFO admission with backpressure over the `DiffusionKVCacheManager`.

States: waiting -> running -> finished (ok | cancelled | error). A request that can never fit is
rejected when it is added, so it never blocks the queue; a request that does not fit *now*
stays at the head (strict FIFO: no starvation of large requests, and smaller ones behind it wait
only until it is admitted). Blocks are returned on every terminal path, at the moment the
request becomes terminal. Each `schedule()` reports the requests that ended since the last tick
(workers clear their rows) before the newly admitted ones (workers install them), so a worker
never sees a block id owned by two live requests.
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import AdmissionError
from .kv_manager import DiffusionKVCacheManager
from .layout import RowLayout, validate_rows
from .metadata import DiffusionKVMetadata


class RequestStatus(enum.Enum):
    WAITING = "waiting"
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


@dataclass(frozen=True)
class FinishedRequest:
    request_id: str
    status: RequestStatus
    generation: int | None  # None when the request never reached a worker
    error: str | None = None


@dataclass
class SchedulerOutput:
    finished: list[FinishedRequest]  # clear worker rows for these first
    admitted: list[SchedRequest]  # then install these (each has .metadata)


class Scheduler:
    def __init__(self, manager: DiffusionKVCacheManager | None, max_running: int = 1):
        """`manager=None` is dense_legacy mode: FIFO lifecycle only, no page reservation."""
        if max_running < 1:
            raise ValueError(f"max_running={max_running} must be >= 1")
        self.manager = manager
        self.max_running = max_running
        self.waiting: OrderedDict[str, SchedRequest] = OrderedDict()
        self.running: dict[str, SchedRequest] = {}
        self._just_finished: list[FinishedRequest] = []
        self._known: set[str] = set()  # ids of live (waiting/running) requests

    # ---- intake -------------------------------------------------------------------------
    def add_request(self, request_id: str, rows: Sequence[RowLayout], payload=None) -> SchedRequest:
        """Queue a request. Raises `AdmissionError` at once if it can never fit."""
        if request_id in self._known:
            raise ValueError(f"request id {request_id!r} is already live; use a unique id")
        rows = tuple(rows)
        validate_rows(rows)
        if self.manager is not None:
            self.manager.check_admissible(rows)  # AdmissionError: rejected, never queued
        req = SchedRequest(request_id, rows, payload=payload)
        self.waiting[request_id] = req
        self._known.add(request_id)
        return req

    # ---- tick ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        admitted: list[SchedRequest] = []
        while self.waiting and len(self.running) < self.max_running:
            rid, req = next(iter(self.waiting.items()))
            if self.manager is None:  # dense: the model owns its cache, nothing to reserve
                self.waiting.pop(rid)
                req.status, req.admit_time = RequestStatus.RUNNING, time.monotonic()
                self.running[rid] = req
                admitted.append(req)
                continue
            try:
                meta = self.manager.reserve_request(rid, req.rows)
            except AdmissionError as e:  # pool changed (e.g. resized) since add: fail, don't block
                self.waiting.pop(rid)
                self._terminate(req, RequestStatus.FINISHED_ERROR, str(e))
                continue
            if meta is None:
                break  # backpressure: the head keeps its place
            self.waiting.pop(rid)
            req.metadata, req.status, req.admit_time = meta, RequestStatus.RUNNING, time.monotonic()
            self.running[rid] = req
            admitted.append(req)
        finished, self._just_finished = self._just_finished, []
        return SchedulerOutput(finished=finished, admitted=admitted)

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

    def cancel(self, request_id: str, reason: str = "cancelled") -> bool:
        """Cancel in any live state. False if the request is unknown or already finished."""
        req = self.waiting.get(request_id) or self.running.get(request_id)
        if req is None:
            return False
        self._terminate(req, RequestStatus.FINISHED_CANCELLED, reason)
        return True

    def fail_all(self, error: str) -> list[str]:
        """Fail every live request (engine failure / shutdown)."""
        ids = list(self.running) + list(self.waiting)
        for rid in ids:
            req = self.running.get(rid) or self.waiting.get(rid)
            self._terminate(req, RequestStatus.FINISHED_ERROR, error)
        return ids

    def shutdown(self) -> SchedulerOutput:
        for rid in list(self.running) + list(self.waiting):
            self.cancel(rid, "engine shutdown")
        if self.manager is not None:
            self.manager.close()
        finished, self._just_finished = self._just_finished, []
        return SchedulerOutput(finished=finished, admitted=[])

    def _terminate(self, req: SchedRequest, status: RequestStatus, error: str | None) -> None:
        was_running = self.running.pop(req.request_id, None) is not None
        self.waiting.pop(req.request_id, None)
        self._known.discard(req.request_id)
        gen = req.metadata.generation if (was_running and req.metadata) else None
        if self.manager is not None:
            self.manager.free_request(req.request_id)
        req.status, req.error, req.finish_time = status, error, time.monotonic()
        self._just_finished.append(FinishedRequest(req.request_id, status, gen, error))

    # ---- queries ------------------------------------------------------------------------
    def get(self, request_id: str) -> SchedRequest | None:
        return self.waiting.get(request_id) or self.running.get(request_id)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
