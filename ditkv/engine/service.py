"""The service interface, and the asyncio plumbing both services share.

`ditkv serve` talks to one of two services: `AsyncEngine` (one DiT engine) or
`AsyncOrchestrator` (the AR -> DiT stage graph). Both run their work on their own threads and
resolve per-request asyncio futures from there, so the waiter table, the accept/close flags and
the `add()` flow live here once (`AsyncService`); a service supplies how a request is handed
over (`_submit`) and how it is aborted (`abort`).

    out = await service.add(GenerationRequest(...))  # GenerationOutput; DitkvError for a bad request
    task.cancel()                                     # cancelling the awaiting task aborts the request
    service.stats()                                   # non-blocking snapshot for /health and /metrics
    service.shutdown(drain_timeout)                   # cancel what is left, free every page, join
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Protocol

import msgspec

from ..errors import DitkvError
from .types import GenerationOutput, GenerationRequest


class EngineClosedError(DitkvError):
    """The service is shutting down or has failed; the request was not queued (HTTP 503)."""


class Service(Protocol):
    """What the HTTP layer needs from a service (duck-typed; see `AsyncService`)."""

    info: dict  # static facts for /health (at least "mode")
    transfers: object | None  # counters with snapshot() (stage graphs), else None

    async def add(self, req: GenerationRequest) -> GenerationOutput: ...
    def abort(self, request_id: str) -> None: ...
    def abort_all(self) -> None: ...
    def stop_accepting(self) -> None: ...
    @property
    def accepting(self) -> bool: ...
    @property
    def alive(self) -> bool: ...
    @property
    def num_in_flight(self) -> int: ...
    def stats(self) -> dict: ...
    def shutdown(self, drain_timeout: float = 0.0) -> dict: ...


class FutureTable:
    """request id -> (event loop, future), resolved from any thread with `call_soon_threadsafe`."""

    def __init__(self):
        self._lock = threading.Lock()
        self._waiters: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self.closed = False  # set once no new waiter may register (nobody would resolve it)

    def register(self, rid: str) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            if self.closed:  # lost a race with shutdown
                raise EngineClosedError("engine is shut down")
            if rid in self._waiters:
                raise DitkvError(f"request_id {rid!r} is already in flight")
            self._waiters[rid] = (loop, fut)
        return fut

    def discard(self, rid: str) -> None:
        with self._lock:
            self._waiters.pop(rid, None)

    def rids(self) -> list[str]:
        with self._lock:
            return list(self._waiters)

    def close(self) -> list[str]:
        """Refuse new waiters; returns the ids still waiting."""
        with self._lock:
            self.closed = True
            return list(self._waiters)

    def __len__(self) -> int:
        with self._lock:
            return len(self._waiters)

    def resolve(self, rid: str, out=None, exc: BaseException | None = None) -> None:
        with self._lock:
            entry = self._waiters.pop(rid, None)
        if entry is None:
            return
        loop, fut = entry

        def set_():
            if not fut.done():
                fut.set_exception(exc) if exc is not None else fut.set_result(out)

        try:
            loop.call_soon_threadsafe(set_)
        except RuntimeError:  # the waiter's loop is closed: nobody is listening any more
            pass

    def fail_all(self, exc: BaseException) -> None:
        for rid in self.rids():
            self.resolve(rid, exc=exc)

    def cancel_all(self, why: str) -> None:
        """Close the table and end every waiter with a 'cancelled' output (shutdown)."""
        for rid in self.close():
            self.resolve(rid, out=GenerationOutput(request_id=rid, status="cancelled", error=why))


class AsyncService:
    """Shared front half of a service: accept flag, waiter table, `add()` and drain-waiting.
    Subclasses set `self._alive`, implement `_submit(req)` (hand over; raise `DitkvError` for a
    bad request), `abort(rid)`, `abort_all()`, `stats()` and `shutdown()`."""

    transfers = None
    info: dict = {}

    def __init__(self):
        self._futures = FutureTable()
        self._accepting = True
        self._alive = False

    async def add(self, req: GenerationRequest) -> GenerationOutput:
        """Queue `req` and wait for its output. Raises the service's `DitkvError` for a bad or
        impossible request, `EngineClosedError` when shutting down. Cancelling the awaiting
        task aborts the request (its pages return to their pools)."""
        if not self._accepting or not self._alive:
            raise EngineClosedError("engine is not accepting requests (shutting down or failed)")
        rid = req.request_id or f"req-{uuid.uuid4().hex[:16]}"
        req = msgspec.structs.replace(req, request_id=rid)
        fut = self._futures.register(rid)
        try:
            self._submit(req)
        except BaseException:
            self._futures.discard(rid)
            raise
        try:
            return await fut
        except asyncio.CancelledError:
            self.abort(rid)
            raise

    def _submit(self, req: GenerationRequest) -> None:
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    def stop_accepting(self) -> None:
        self._accepting = False

    @property
    def accepting(self) -> bool:
        return self._accepting and self._alive

    @property
    def alive(self) -> bool:
        return self._alive

    @property
    def num_in_flight(self) -> int:
        return len(self._futures)

    def _wait_in_flight(self, timeout: float) -> None:
        """Blocking: give in-flight requests up to `timeout` s to finish (shutdown step 1)."""
        deadline = time.monotonic() + timeout
        while self._alive and self.num_in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
