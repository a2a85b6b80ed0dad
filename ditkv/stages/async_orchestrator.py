"""asyncio front of `Orchestrator`: the AR -> DiT stage graph as a service.

    service = AsyncOrchestrator(load_stage_graph("examples/stages-native.yaml"))  # loads + starts
    out = await service.add(GenerationRequest(...))   # GenerationOutput; DitkvError for a bad request
    task.cancel()                                     # cancels the request and its transfer ticket
    service.shutdown()                                # cancel what is left, both pools full, join

Unlike `AsyncEngine`, no command queue is needed: the orchestrator is thread-safe, its replicas
run on their own threads, and it hands finished outputs to a callback (`on_output`), which
resolves the awaiting future through the shared `FutureTable`. Cancelling goes through
`Orchestrator.cancel`, so the transfer layer's rules hold: pages a write may still land in stay
quarantined until the write settles, then both pools are full again.
"""

from __future__ import annotations

import logging
import threading

from ..engine.service import AsyncService, EngineClosedError
from .orchestrator import Orchestrator
from .graph import StageGraph
from ..engine.types import GenerationOutput, GenerationRequest

log = logging.getLogger("ditkv.async_orchestrator")


class AsyncOrchestrator(AsyncService):
    def __init__(self, graph: StageGraph, model_bundle=None, orchestrator_factory=None):
        super().__init__()
        self.graph = graph
        factory = orchestrator_factory or Orchestrator
        self.orch = factory(graph, model_bundle, on_output=self._on_output)
        self.transfers = self.orch.transfers
        dit = graph.dit
        self.config = dit.engine  # the DiT's engine fields (what the single-stage server exposes)
        self.info = {"mode": dit.engine.diffusion_kv_mode, "graph": "ar->dit",
                     "transfer": f"{graph.mode}/{dit.transfer.kv_connector}"}
        self._lock = threading.Lock()  # serialises shutdown
        self._final: dict | None = None
        self.orch.start()
        self._alive = True  # False for good once a stage failed closed (a remote AR stage excepted)
        self._ar_down = False  # a remote AR stage is lost (or refused) and may come back

    # ---- service API (AsyncService provides add) ------------------------------------------
    def _submit(self, req: GenerationRequest) -> None:
        if self.orch.closed:
            raise EngineClosedError("engine is shut down")
        dead = self._dead_stage()
        if dead == "AR" and getattr(self.orch, "remote", None) is not None:
            raise EngineClosedError("the remote AR stage is down (reconnecting); retry later")
        if dead:
            raise EngineClosedError(f"every {dead} replica failed closed; the server accepts no requests")
        self.orch.submit(req)  # validates on this thread; DitkvError = the client's fault

    def abort(self, request_id: str) -> None:
        self.orch.cancel(request_id)

    def abort_all(self) -> None:
        for rid in self._futures.rids():
            self.orch.cancel(rid)

    def _on_output(self, out: GenerationOutput) -> None:  # on a replica thread
        self._futures.resolve(out.request_id, out=out)

    def stats(self) -> dict:
        s = self.orch.stats()
        dead = self._dead_stage()
        remote = getattr(self.orch, "remote", None)
        if self._alive and dead == "AR" and remote is not None:  # it reconnects: 503 only while it is down
            if not self._ar_down:
                log.error("every AR replica is down (the remote AR stage is lost); requests get 503 until it is back")
            self._ar_down = True
        elif self._alive and dead:  # nothing can finish any more: /health turns 503
            log.error("every %s replica failed closed; the server stops accepting requests", dead)
            self._alive = False
        elif self._ar_down and dead is None:
            log.warning("the remote AR stage is back; accepting requests again")
            self._ar_down = False
        if remote is not None:
            s["remote_ar"] = remote.status()
        s.update(alive=self._alive and dead is None, in_flight=self.num_in_flight, accepting=self.accepting,
                 pools_full=self._pools_full())
        return s

    def _dead_stage(self) -> str | None:
        """The stage none of whose replicas is alive ('DiT' / 'AR'), else None."""
        if all(d.dead for d in self.orch.dit):
            return "DiT"
        if all(a.dead for a in self.orch.ar):
            return "AR"
        return None

    def _pools_full(self) -> bool:
        return self.orch.pools_full() and not any(d.num_quarantined for d in self.orch.dit)

    def shutdown(self, drain_timeout: float = 0.0) -> dict:
        """Stop accepting; give in-flight requests up to `drain_timeout` s; cancel the rest; stop
        the replica threads; free every page (quarantined ones too). Blocking and idempotent."""
        self._accepting = False
        self._wait_in_flight(drain_timeout)
        with self._lock:
            if self._final is None:
                try:
                    self.orch.shutdown()  # delivers 'cancelled' for whatever was still live
                except Exception:  # still free what we can and end every waiter
                    log.exception("orchestrator shutdown failed")
                finally:
                    self._alive = False
                    self._futures.cancel_all("engine shut down before the request finished")
                self._final = self.stats()
        return self._final
