"""A tensor-parallel AR stage replica (`tensor_parallel_size` > 1): the serial path, one job at a time.

The single-rank replica runs its jobs through the engine (`ar_side.py`); a replica of several ranks
still runs here until the engine's AR phase runs on tensor-parallel ranks with a KV-export hook.
`ARReplica(...)` builds this class for such a stage, so the orchestrator and the AR stage server
build either kind alike.

Page lifetime: a job leases its pages when it starts (`LeaseManager.acquire`); when the prefill is
done the lease is handed over to the ticket for the pages the prefix fills and the unused tail
returns at once (`hand_over`), so the prompt pages live exactly until `release(ticket)`: after the
producer's write returned on every destination rank, or when the ticket was aborted before
dispatch. All pool mutation happens on the replica's own thread (`step`); other threads talk to
it through the inbox.

The model, the pages' contents and the writes live in rank processes (`ar_ranks.py`); the replica
keeps the block pool, the jobs and the leases, and a rank that dies or wedges fails the replica
closed: every write of its tickets is reported failed (the ranks are killed first, so none can
still land), queued jobs fail, and the leases return.
"""

from __future__ import annotations

import logging
import queue
from collections import deque

from ..core.kv_manager import blocks_for
from ..core.leases import LeaseManager
from ..engine.executor import ExecutorError, load_frontend
from ..models.family import family_of
from ..models.loader import resolve_device
from ..transfer.config import TransferConfig
from ..transfer.inbox import drain
from ..transfer.ticket import TransferTicket
from .ar_side import ARJob

log = logging.getLogger("ditkv.ar")


class _RankProducer:
    """`KVProducer`'s interface for a tensor-parallel replica: `dispatch` may be called from any
    thread, so it only posts to the replica's inbox; the replica thread sends `SendKV`."""

    def __init__(self, replica: "SerialARReplica"):
        self.replica, self.geometry = replica, replica.ranks.geometry

    def source(self, block_ids, num_tokens: int):
        return self.replica.ranks.source(block_ids, num_tokens)

    def dispatch(self, ticket: TransferTicket, on_done) -> None:
        self.replica._inbox.put(("send", (ticket, on_done)))  # noqa: SLF001

    def close(self, wait: bool = True) -> None:
        pass


class SerialARReplica:
    def __init__(self, index: int, engine, transfer: TransferConfig, bundle=None, stats=None, executor_options=None):
        from .ar_ranks import ARRankGroup

        self.index, self.transfer = index, transfer
        self.device = resolve_device(engine.device)
        self.model = None  # the ranks load their own shards: config + tokenizer suffice here
        self.model_config, self.tokenizer = load_frontend(engine, None)
        self.leases = LeaseManager(engine.num_kv_blocks, engine.block_size)  # every page of this replica
        self.blocks = self.leases.pool  # its gauges (num_free, num_blocks), read by the orchestrator and server
        self.banned = family_of(self.model_config).banned_generation_ids(self.model_config)
        self.dead: str | None = None
        self._failing = False
        self.ranks = ARRankGroup(engine, bundle, transfer, executor_options, replica=index, stats=stats)
        self.pool = self.transport = None
        self.runner, self.producer = self.ranks, _RankProducer(self)
        self._inbox: queue.Queue = queue.Queue()
        self._jobs: deque[ARJob] = deque()
        self._starved = False  # the head job waits for pages: block until a release arrives
        self._running = 0  # 1 while a prefill runs (read by stats() from other threads)
        self._posted: set[str] = set()  # jobs still in the inbox (set add/discard: GIL-atomic)
        self.closed = False

    # ---- thread-safe entry points ---------------------------------------------------------
    def submit(self, job: ARJob) -> None:
        self._posted.add(job.request_id)  # counted as waiting before the replica thread takes it
        self._inbox.put(("job", job))

    def release(self, ticket: TransferTicket) -> None:
        """The ticket no longer needs its source pages (sent on every rank, or never dispatched)."""
        self._inbox.put(("release", ticket))

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    # ---- replica thread -------------------------------------------------------------------
    def wait_hint(self) -> float:
        if self.ranks.sending and not self.dead:
            return 0.002  # poll the ranks' write reports
        return 0.05 if (not self._jobs or self._starved) else 0.0

    def step(self, block_s: float = 0.0) -> bool:
        try:
            return self._step(block_s)
        except ExecutorError as e:  # a rank died, went silent or wedged
            self._fail_closed(str(e))
            return True

    def _step(self, block_s: float) -> bool:
        worked = self._drain(block_s)
        if not self.dead:
            self.ranks.poll_sent()
        if worked:
            self._starved = False
        if not self._jobs:
            return worked
        job = self._jobs[0]
        need = blocks_for(len(job.head_ids) + job.sampling.max_new_tokens + len(job.tail_ids), self.blocks.block_size)
        if need > self.blocks.num_blocks:
            self._jobs.popleft()
            job.on_done(job, None, f"prompt needs {need} AR pages but the AR pool has {self.blocks.num_blocks}; "
                                   "shorten the prompt or raise the AR stage's num_kv_blocks")
            return True
        if need > self.blocks.num_free:
            self._starved = True
            return worked  # backpressure: leases still held; they come back via release()
        self._jobs.popleft()
        self._running = 1
        try:
            self._run(job, need)
        finally:
            self._running = 0
        return True

    def _drain(self, block_s: float) -> bool:
        return drain(self._inbox, block_s, self._handle)

    def _handle(self, kind: str, arg) -> None:
        if kind == "job":
            self._posted.discard(arg.request_id)
            if self.dead:
                arg.on_done(arg, None, f"AR replica {self.index} failed closed: {self.dead}")
                return
            self._jobs.append(arg)
        elif kind == "send":
            self.ranks.start_send(*arg)  # after a failure or shutdown it settles at once
        elif kind == "release":
            self.leases.release(arg.ticket_id)
        elif kind == "cancel":
            for job in [j for j in self._jobs if j.request_id == arg]:
                self._jobs.remove(job)
                job.on_done(job, None, "cancelled")

    def _run(self, job: ARJob, need: int) -> None:
        lease = self.leases.acquire(f"job:{job.request_id}", need)
        ids = list(lease.block_ids)
        try:
            res = self.runner.run(job.request_id, job.head_ids, job.tail_ids, ids, job.sampling,
                                  self.model_config.eos_token_id, self.banned,
                                  stop_ids=tuple(job.stop_ids), images=job.images)  # the ranks rebuild the head
            keep = blocks_for(len(res.token_ids), self.blocks.block_size)
            job.ticket.bind_source(self.producer.source(ids[:keep], len(res.token_ids)))
        except ExecutorError as e:  # the ranks are gone: this job fails, then the replica
            self.leases.release(lease.key, lease.generation)
            job.on_done(job, None, f"AR replica {self.index} failed closed: {e}")
            raise
        except Exception as e:
            log.exception("AR request %s failed", job.request_id)
            self.leases.release(lease.key, lease.generation)
            job.on_done(job, None, f"AR stage failed: {type(e).__name__}: {e}")
            return
        # the ticket's lease takes the prefix pages until the DiT side releases it; unused tail pages return now
        self.leases.hand_over(lease, job.ticket.ticket_id, keep)
        job.on_done(job, res, None)

    # ---- teardown -------------------------------------------------------------------------
    @property
    def num_leases(self) -> int:
        return self.leases.num_leases

    def stats(self) -> dict:
        """Gauges for /health and /metrics; plain int reads, safe from any thread."""
        b = self.blocks
        return {"waiting": len(self._jobs) + len(self._posted), "running": self._running,
                "kv_num_blocks": b.num_blocks, "kv_used_blocks": b.num_blocks - b.num_free,
                "kv_free_blocks": b.num_free, "leases": self.leases.num_leases, "dead": bool(self.dead)}

    def _fail_closed(self, reason: str) -> None:
        """Kill the ranks (already done by the executor), settle every write, fail queued jobs,
        free every lease: nothing of a dead rank can still read or write a page."""
        if self.dead or self._failing:
            return
        self._failing = True
        log.error("AR replica %d fails closed: %s", self.index, reason)
        self.ranks.stop()
        self.ranks.fail(reason)
        for job in list(self._jobs):
            job.on_done(job, None, f"AR replica {self.index} failed closed: {reason}")
        self._jobs.clear()
        self.leases.release_all()
        # `dead` is what other threads watch: set it last, so whoever sees it also sees every
        # write settled and every lease returned.
        self.dead = reason

    def close(self) -> None:
        """Shutdown: no send outlives it; every lease returns."""
        if self.closed:
            return
        self.closed = True
        self.producer.close(wait=False)
        self.ranks.stop()  # the ranks end first: no write of theirs outlives the leases
        self.ranks.fail("AR stage shut down")
        self._drain(0)
        for job in list(self._jobs):
            job.on_done(job, None, "AR stage shut down")
        self._jobs.clear()
        self.leases.release_all()
