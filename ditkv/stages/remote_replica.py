"""The orchestrator-side proxy of one remote AR replica (`remote_ar.RemoteARStage` builds one per
server replica): what the orchestrator uses of `ARReplica` (submit, release, cancel, step /
wait_hint, stats, dead, num_leases, producer.geometry / dispatch, blocks, close), over the stage's
DEALER socket; its jobs and results run on the replica thread through its inbox."""

from __future__ import annotations

import logging
import queue

from ..transfer.descriptors import PoolGeometry
from ..transfer.inbox import drain
from ..transfer.ticket import SourceEndpoint, TransferTicket
from ..worker.ar_runner import ARResult
from ..models.text_settings import to_wire
from .remote_messages import Cancel, Release, Submit

log = logging.getLogger("ditkv.remote_ar")


class _RemoteBlocks:
    """`blocks.num_free` / `num_blocks` of the remote pool, as last reported."""

    def __init__(self, num_blocks: int):
        self.num_blocks = self.num_free = num_blocks


class _RemoteProducer:
    def __init__(self, replica: "RemoteARReplica", geometry: PoolGeometry):
        self.replica, self.geometry = replica, geometry

    def dispatch(self, ticket: TransferTicket, on_done) -> None:
        self.replica.stage.dispatch(ticket, on_done)

    def close(self, wait: bool = True) -> None:
        pass


class RemoteARReplica:
    def __init__(self, stage, index: int, geometry: PoolGeometry):  # stage: its remote_ar.RemoteARStage
        import torch

        self.stage, self.index, self.device = stage, index, torch.device("cpu")
        self.producer = _RemoteProducer(self, geometry)
        self.blocks = _RemoteBlocks(geometry.num_blocks)
        self.dead: str | None = None
        self.closed = False
        self.remote_stats: dict[str, int] = {}
        self._inbox: queue.Queue = queue.Queue()  # callbacks, run on the replica thread (`step`)
        self._jobs: dict[str, object] = {}  # ticket id -> ARJob awaiting its result
        self._leases: set[str] = set()  # ticket ids whose source pages the server holds for us

    def submit(self, job) -> None:
        with self.stage.lock:
            if self.dead is None and not self.stage.closed:
                self._jobs[job.ticket.ticket_id] = job
                self.stage.send(Submit(replica=self.index, ticket_id=job.ticket.ticket_id, request_id=job.request_id,
                                       mode=job.ticket.mode, head_ids=list(job.head_ids),
                                       tail_ids=list(job.tail_ids), **to_wire(job.sampling),
                                       stop_ids=list(job.stop_ids), images=job.images,
                                       choice=list(job.choice)))
                return
            why = self.dead or "AR stage shut down"
        self.post(job.on_done, job, None, f"AR replica {self.index} failed closed: {why}")

    def release(self, ticket: TransferTicket) -> None:
        with self.stage.lock:
            held = ticket.ticket_id in self._leases
            self._leases.discard(ticket.ticket_id)
            if held and self.dead is None:
                self.stage.send(Release(ticket_id=ticket.ticket_id))

    def cancel(self, request_id: str) -> None:
        if self.dead is None:
            self.stage.send(Cancel(replica=self.index, request_id=request_id))

    def post(self, fn, *args) -> None:
        self._inbox.put(("call", (fn, args)))

    def wait_hint(self) -> float:
        return 0.05

    def step(self, block_s: float = 0.0) -> bool:
        return drain(self._inbox, block_s, lambda _kind, a: a[0](*a[1]))

    def _bind(self, job, res: ARResult, source: SourceEndpoint) -> None:  # on the replica thread
        try:
            job.ticket.bind_source(source)
        except Exception as e:  # a duplicate result: keep serving, give the pages back
            log.warning("remote AR result for %s not bound: %s", job.ticket.ticket_id, e)
            return self.release(job.ticket)
        job.on_done(job, res, None)

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    def stats(self) -> dict:
        s, n = self.remote_stats, len(self._jobs)
        running = min(int(s.get("running", 0)), n)
        return {"waiting": n - running, "running": running, "kv_num_blocks": self.blocks.num_blocks,
                "kv_used_blocks": self.blocks.num_blocks - self.blocks.num_free, "kv_free_blocks": self.blocks.num_free,
                "leases": int(s.get("leases", 0)) if self.dead is None else 0, "dead": bool(self.dead)}

    def close(self) -> None:
        self.closed = True
        self.stage.close()

