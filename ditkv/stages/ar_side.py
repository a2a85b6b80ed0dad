"""AR stage replica: the engine's AR phase plus a KV-export hook (the mirror of the DiT stage's import).

The replica runs its jobs through an `Engine` (one in-process rank): each `ARJob` enters the engine's
scheduler as pre-planned AR work (`Engine.add_ar_export`: the orchestrator already built its head and
tail), so the jobs of a replica run batched and continuously scheduled, one AR forward per step,
sampled on the device (docs/ar-phase.md). Instead of a DiT phase, a job's finished AR row is
**exported**: its first `blocks_for(len(token_ids))` pages pass to an exported row keyed by the
ticket id (the engine's KV manager holds it, with its own generation), the rest of the row returns
at once, the ticket's source is bound to those pages of the engine worker's pool (registered for
transfer) and `on_done(job, ARResult, None)` runs. A size=auto job (`ARJob.choice`: the ratio ids) draws
`<img_ratio_k>` after its tail, greedily, as the single engine's AR phase does; the token is not fed (the
DiT's row 0 holds it, as where the single engine's row 0 adopts the AR row), so the export ends at
`<img_size>` and `ARResult.chosen` carries the drawn id.

Page lifetime: an exported row lives until `release(ticket)` (the producer's write returned on every
destination rank, or the ticket was aborted before dispatch); a release of another ticket object or
generation for that id is stale and frees nothing. Every other path returns the pages through the
engine's scheduler: a cancel or a failure during the AR phase frees the job's AR row at once (the
job ends with an error, its ticket never bound); shutdown frees every row, exported ones included.
All engine calls happen on the replica's own thread (`step`); other threads post to its inbox.

With `tensor_parallel_size` > 1 the engine's executor runs the ranks in processes (`ar_ranks.py`):
each rank runs the AR pass on its shard and holds its KV-head range of every page, and hosts an
`ARSide` whose `KVProducer` writes that range; the replica sends them `SendKV` and collects their
`Sent` reports (`ARRankGroup`). A rank that dies or wedges fails the replica closed: the engine stops
the ranks and fails every job, every write of its tickets is reported failed (no rank can still
write), every exported row returns, and only then does `dead` say so.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from dataclasses import dataclass

from ..core.ar_text import ARText
from ..engine.engine import Engine
from ..engine.executor import ExecutorError
from ..engine.messages import HeadImages
from ..engine.types import GenerationOutput
from ..errors import AdmissionError, DitkvError
from ..models.loader import resolve_device
from ..models.text_settings import TextSampling
from ..transfer.config import TransferConfig
from ..transfer.connector import KVProducer, transfer_pool
from ..transfer.inbox import drain
from ..transfer.ticket import TransferTicket
from ..transfer.transport import Transport, make_transport
from ..worker.ar_runner import ARResult

log = logging.getLogger("ditkv.ar")


@dataclass
class ARJob:
    request_id: str
    ticket: TransferTicket
    head_ids: list[int]  # <bos> and the templated prompt (a rewrite: the AR input, `ar_prompt_pieces`)
    tail_ids: list[int]  # <boi> <img_size> <img_ratio> (instruct rewrite: <answer> first)
    sampling: TextSampling  # max_new_tokens, how tokens are drawn, and the request's seed
    on_done: Callable[["ARJob", ARResult | None, str | None], None]
    stop_ids: tuple[int, ...] = ()  # generation also ends at these, kept (think/recaption: `ar_stop_ids`)
    images: HeadImages | None = None  # the head's input images (image-conditioned generation)
    choice: tuple[int, ...] = ()  # size=auto: after the tail, draw one of these ratio ids (`ARIntake.sizes`)


class _RankProducer:
    """`KVProducer`'s interface for a tensor-parallel replica: `dispatch` may be called from any
    thread, so it only posts to the replica's inbox; the replica thread sends `SendKV`."""

    def __init__(self, replica: "ARReplica"):
        self.replica, self.geometry = replica, replica.ranks.geometry

    def source(self, block_ids, num_tokens: int):
        return self.replica.ranks.source(block_ids, num_tokens)

    def dispatch(self, ticket: TransferTicket, on_done) -> None:
        self.replica._inbox.put(("send", (ticket, on_done)))  # noqa: SLF001

    def close(self, wait: bool = True) -> None:
        pass


class ARReplica:
    def __init__(self, index: int, engine, transfer: TransferConfig, bundle=None,
                 transport: Transport | None = None, stats=None, executor_options=None):
        self.index, self.transfer = index, transfer
        self.device = resolve_device(engine.device)
        self.ranks = self.transport = self.model = None
        config = engine  # the AR stage's EngineConfig (`graph.ar_engine_from_dict`)
        if engine.tensor_parallel_size > 1:
            self._start_ranks(config, bundle, stats, executor_options)
        else:
            self._start_here(config, bundle, transport, stats)
        self.model_config, self.tokenizer = self.engine.executor.model_config, self.engine.executor.tokenizer
        self.blocks = self.engine.manager.pool  # its gauges (num_free, num_blocks), read by the orchestrator and server
        self._inbox: queue.Queue = queue.Queue()
        self._jobs: dict[str, ARJob] = {}  # in the engine: their outputs go to `on_done`
        self._exports: dict[str, tuple[TransferTicket, int]] = {}  # ticket id -> (ticket, export generation)
        self._posted: set[str] = set()  # jobs still in the inbox (set add/discard: GIL-atomic)
        self._dead: str | None = None
        self.closed = False

    def _start_here(self, config, bundle, transport, stats) -> None:
        """One rank in this process (executor options are for rank processes: none here)."""
        t = self.transfer
        self.engine = Engine(config, bundle, executor="inproc")
        try:
            pool = self.engine.worker.pool
            transfer_pool(pool, t.kv_connector)  # before any step writes a page: it starts zeroed
            self.transport = transport or make_transport(t.kv_connector, t.kv_ip, t.protocol,
                                                         t.max_descriptors_per_batch)
            self.producer = KVProducer(t, self.transport, pool, replica=self.index, stats=stats)
        except BaseException:
            self.engine.shutdown()
            raise
        self.model = self.engine.worker.model

    def _start_ranks(self, config, bundle, stats, options) -> None:
        """Tensor parallel: the engine's ranks in processes, each with its `ARSide` (pool, producer)."""
        from .ar_ranks import ARRankGroup, rank_options

        self.engine = Engine(config, bundle, executor="mp", executor_options=rank_options(options, self.transfer))
        try:
            self.ranks = ARRankGroup(self.engine.executor, self.transfer, self.index, stats)
        except BaseException:
            self.engine.shutdown()
            raise
        self.producer = _RankProducer(self)

    @property
    def dead(self) -> str | None:
        """Set once the replica failed closed and every write and page of it has settled."""
        return self._dead

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
        """No wait while AR work runs; a short poll while the ranks write; otherwise (idle, or every
        job waits for pages) block on the inbox until a job or a release arrives, bounded for the stop check."""
        s = self.engine.scheduler
        if s.ar_running and s.ar_work:
            return 0.0
        return 0.002 if self.ranks is not None and self.ranks.sending and not self._dead else 0.05

    def step(self, block_s: float = 0.0) -> bool:
        worked = drain(self._inbox, block_s, self._handle)
        if self.closed:
            return worked
        if self.ranks is not None and not self.engine.failed:
            self._on_ranks(self.ranks.poll_sent)  # the ranks' write reports
        outs = self.engine.step()
        for o in outs:
            try:
                self._deliver(o)
            except Exception:  # one job's callback must not cost the others theirs
                log.exception("AR request %s: delivering its result failed", o.request_id)
        if self.engine.failed and self._dead is None:
            self._fail_closed(self.engine.failed)
        return worked or bool(outs) or bool(self.engine.scheduler.ar_running)

    def _on_ranks(self, fn, *args) -> None:
        """Call into the ranks; a dead or silent rank fails the engine closed (the replica follows)."""
        try:
            fn(*args)
        except ExecutorError as e:
            self.engine.fail_closed(str(e))

    def _fail_closed(self, reason: str) -> None:
        """The engine failed closed (its ranks are stopped, its jobs failed): settle every write of
        the ranks, return every exported row (no rank can read a page any more), then say so."""
        log.error("AR replica %d fails closed: %s", self.index, reason)
        if self.ranks is not None:
            self.ranks.stop(reason)
            self.ranks.fail(reason)
            self.engine.release_exports()
            self._exports.clear()
        # `dead` is what other threads watch: set it last, so whoever sees it also sees every
        # write settled and every page returned
        self._dead = reason

    def _handle(self, kind: str, arg) -> None:
        if kind == "job":
            self._posted.discard(arg.request_id)
            self._intake(arg)
        elif kind == "release":
            self._release(arg)
        elif kind == "send":
            self._on_ranks(self.ranks.start_send, *arg)  # after a failure or shutdown it settles at once
        elif kind == "cancel" and arg in self._jobs:
            self.engine.abort(arg)  # its AR row returns now; its output ends the job at the next step

    def _intake(self, job: ARJob) -> None:
        if self.closed:
            return job.on_done(job, None, "AR stage shut down")
        if self.engine.failed:
            return job.on_done(job, None, f"AR replica {self.index} failed closed: {self.engine.failed}")
        text = ARText(list(job.head_ids), list(job.tail_ids), job.sampling.max_new_tokens,
                      self.model_config.eos_token_id, frozenset(job.stop_ids), whole_head=job.images is not None,
                      choice=tuple(job.choice))
        try:
            self.engine.add_ar_export(job.request_id, text, job.sampling, job.images, key=job.ticket.ticket_id)
        except (AdmissionError, ValueError, DitkvError) as e:
            return job.on_done(job, None, str(e))
        self._jobs[job.request_id] = job

    def _deliver(self, out: GenerationOutput) -> None:
        """A job's work ended: bind its ticket to the exported pages, or pass on its error."""
        job = self._jobs.pop(out.request_id, None)
        if job is None:
            return
        if out.status != "ok":
            return job.on_done(job, None, "cancelled" if out.status == "cancelled" else out.error)
        ex = self.engine.take_export(out.request_id)
        t = job.ticket
        try:
            t.bind_source(self.producer.source(ex.row.block_ids, len(ex.token_ids)))
        except Exception as e:  # nothing reads the pages yet: they return
            log.exception("AR request %s: binding its ticket failed", job.request_id)
            self.engine.release_export(ex.row.key, ex.row.generation)
            return job.on_done(job, None, f"AR stage failed: {type(e).__name__}: {e}")
        self._exports[t.ticket_id] = (t, ex.row.generation)
        job.on_done(job, ARResult(job.request_id, ex.token_ids, ex.generated_ids, len(ex.token_ids),
                                     ex.chosen, dict(ex.stats)), None)

    def _release(self, ticket: TransferTicket) -> None:
        held = self._exports.get(ticket.ticket_id)
        if held is None or held[0] is not ticket:
            return  # stale (another ticket of that id, or released already): frees nothing
        del self._exports[ticket.ticket_id]
        self.engine.release_export(ticket.ticket_id, held[1])

    # ---- gauges and teardown ----------------------------------------------------------------
    @property
    def num_leases(self) -> int:
        """Page holders: the exported rows and the AR rows of running jobs."""
        m = self.engine.manager
        return m.num_exports + m.num_ar_rows

    def stats(self) -> dict:
        """Gauges for /health and /metrics; plain int reads, safe from any thread."""
        b, s = self.blocks, self.engine.scheduler
        return {"waiting": s.num_waiting + len(self._posted), "running": s.num_ar,
                "kv_num_blocks": b.num_blocks, "kv_used_blocks": b.num_blocks - b.num_free,
                "kv_free_blocks": b.num_free, "leases": self.num_leases, "dead": bool(self._dead)}

    def close(self) -> None:
        """Shutdown: no send outlives it; every job ends and every page returns."""
        if self.closed:
            return
        self.closed = True
        self.producer.close(wait=False)
        if self.ranks is not None:  # the ranks end first: no write of theirs outlives the pages
            self.ranks.stop("AR stage shut down")
            self.ranks.fail("AR stage shut down")
        drain(self._inbox, 0, self._handle)
        for o in self.engine.shutdown():  # frees every row, exported ones too
            job = self._jobs.pop(o.request_id, None)
            if job is not None:
                job.on_done(job, None, "AR stage shut down")
        self._exports.clear()
        if self.transport is not None:
            self.transport.close()
