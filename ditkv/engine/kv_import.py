"""The KV-import hook of an engine's scheduler (a stage graph's DiT stage).

One `Engine` serves every DiT stage; a stage of a graph differs from a single-stage server only in
this hook, held by the scheduler the way vLLM's scheduler holds its KV connector. The engine builds
it from a factory once its executor exists (`Engine(kv_import=factory)`, `factory(executor)`), and
admits imported requests with `Engine.add_import`. Every method is called with the engine's lock
held, on the thread that calls into the scheduler; none runs a request.

Lifecycle of one imported request (the scheduler drives it):

    add_import      waiting (the prefix per row is marked computed: `num_computed_tokens`)
    reserve         the scheduler reserves every row atomically -> waiting_for_kv
    start(req)      register the receive on every rank, then dispatch the producer's write;
                    an error string rolls the reservation back (nothing was dispatched)
    poll()          completion notices, deadlines -> `KVImportEvents` (ready / failed / settled)
    kv_ready        every rank received every row: the request runs at this or the next tick
    running(req)    what the workers need to use the import (legacy: the receive slot), set on
                    `req.import_params` and carried to every rank in the `Execute` message
    finished(req, error, cancelled) -> bool
                    on every terminal path: True when a write may still land in the request's
                    pages; the scheduler then quarantines them until `poll` reports it settled

A protocol violation (a notice from a rank that does not exist, invalid own block ids) raises
`ExecutorError`: the engine fails closed (executor shut down, `fail_closed`, every request failed,
every page freed, quarantined ones included, since nothing can write any more).

Any other exception (a broken transport, a bug) never leaves `Engine.step`:
- from `start`: that request ends with an error naming the cause; its pages are quarantined,
  because the raise may have come after part of the write was dispatched, until `poll` reports
  it settled or the hook closes; the other requests go on. `finished` is still called, and the
  pages stay quarantined even when it returns False, so a hook reports such a request `settled`
  once nothing can land (`DiTImporter` does at the next poll when nothing was in flight).
- from `poll`: the engine fails closed, as for `ExecutorError`. A poll that raised may have taken
  notices and dropped them, so which writes settled is no longer known; failing only the importing
  requests would keep their pages until shutdown while the replica, still reported alive, took new
  requests into the same broken poll. Failing closed marks it dead, ends every request with the
  cause, and returns every page at once (the ranks and receivers are stopped first).
- from `finished`: the scheduler cannot tell whether a write may land, so it quarantines.
"""

from __future__ import annotations

from typing import Protocol

from ..core.scheduler import KVImportEvents, SchedRequest


class KVImportHook(Protocol):
    max_waiting_for_kv: int  # bound on requests reserved while their transfer is in flight
    # True: its transfer skips the leading pages a row finds in the prefix cache, so `add_import` lets the
    # rows look up (`ImportKeys`); absent or False: an import looks nothing up (a legacy slot is copied whole)
    skips_cached_pages: bool

    def start(self, req: SchedRequest) -> str | None: ...

    def poll(self) -> KVImportEvents: ...

    def running(self, req: SchedRequest) -> object: ...

    def finished(self, req: SchedRequest, error: str | None, cancelled: bool) -> bool: ...

    def fail_closed(self, reason: str) -> None: ...

    def close(self) -> None: ...


__all__ = ["KVImportEvents", "KVImportHook"]
