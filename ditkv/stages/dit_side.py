"""DiT stage replica: scheduler + worker + one KV consumer per rank, and the ticket lifecycle.

Per request (native):
  intake     validate both endpoints (roles, engine ids, addresses, geometry) -> queue; invalid:
             reject, tell the producer to free its pages; neither request was touched
  reserve    the scheduler reserves every row atomically, imported prefix marked computed
             (`num_computed_tokens`) -> waiting_for_kv
  register   every consumer rank registers the receive; a failure unregisters all, frees the
             reservation and aborts the source: nothing was dispatched
  dispatch   the producer writes the prefix pages (its thread); deadline = now + transfer_timeout
  ready      every rank reported every row -> the request runs; step 0 starts at the import
  failures   timeout / cancel / producer error: the request fails at once; pages whose write
             may still land stay quarantined until every rank settled (late completions keep
             being polled while any remain); a peer that never settles keeps them until shutdown
  fail-closed  a missing rank, a notice from an unknown rank or invalid block ids stop the whole
             replica: fail every request, close the receivers, only then free the pages
Legacy differs only in the destination: a receive slot per request (the same slot index on every
rank) instead of pages, copied into the dense cache when the request starts.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..core.kv_manager import DiffusionKVCacheManager, blocks_for
from ..core.layout import RowLayout
from ..core.scheduler import RequestStatus, Scheduler
from ..engine.executor import ExecutorError
from ..engine.messages import LegacyImport
from ..engine.types import GenerationOutput, RequestStats
from ..errors import AdmissionError, DitkvError
from ..models.loader import resolve_device
from ..worker.dit_runner import DenseImport
from ..worker.worker import DiTWorker
from ..transfer.config import NATIVE, TransferConfig
from ..transfer.connector import BadBlockIdsError, KVConsumer, RegistrationError, transfer_pool
from ..transfer.descriptors import legacy_heads
from ..transfer.inbox import drain
from ..transfer.ticket import DestEndpoint, RowDest, TransferTicket, validate_endpoints
from ..transfer.transport import Transport, make_transport

log = logging.getLogger("ditkv.dit")


@dataclass
class DiTJob:
    request_id: str
    ticket: TransferTicket
    layout: object  # RequestLayout
    steps: int
    guidance: float
    seed: int
    import_tokens: list[int]  # per row
    on_done: Callable[["DiTJob", GenerationOutput], None]
    abort_source: Callable[[TransferTicket], None]  # producer frees its pages (nothing in flight)
    send: Callable[[TransferTicket], None]  # start the producer's write
    arrival: float = 0.0
    request: object = None  # the GenerationRequest (multi-rank replicas rebuild the layout on each rank)
    prompt_ids: list[int] | None = None  # the prompt as ids when the AR generated text


class DiTReplica:
    def __init__(self, index: int, config, transfer: TransferConfig, bundle=None, transport: Transport | None = None,
                 max_waiting_for_kv: int = 8, source_geometry=None, stats=None, executor_options=None,
                 on_step=None):
        self.index, self.config, self.transfer = index, config, transfer
        self.on_step = on_step  # (request id, step, total steps) after every denoising step, or None
        self.transfer_stats = stats  # `TransferStats`: one verdict per ticket, or None
        self.native = transfer.mode == NATIVE
        self.manager = None
        num_blocks = None
        if config.paged:
            num_blocks = config.num_kv_blocks
            if not num_blocks:
                raise DitkvError("an orchestrated paged DiT stage needs engine.num_kv_blocks")
            self.manager = DiffusionKVCacheManager(num_blocks, config.block_size,
                                                   config.diffusion_kv_max_rows_per_request,
                                                   config.max_model_len if config.max_model_len > 0
                                                   else num_blocks * config.block_size)
        self.num_ranks = config.world_size
        self.ranks = None  # RankGroup: the rank processes of a multi-rank replica
        slots = transfer.legacy_slots if not self.native else max_waiting_for_kv
        self.scheduler = Scheduler(self.manager, max_running=1, max_waiting_for_kv=min(slots, max_waiting_for_kv))
        if self.num_ranks > 1:
            from .remote_ranks import RankGroup

            # every rank registers its own pool (its KV-head range) and reports its own receives
            self.ranks = RankGroup(config, bundle, transfer, executor_options)
            if self.ranks.executor.num_blocks != num_blocks:
                self.ranks.stop()
                raise DitkvError(f"the DiT ranks hold {self.ranks.executor.num_blocks} blocks, the scheduler "
                                 f"{num_blocks}")
            self.worker, self.transport, self.device = None, None, resolve_device(config.device)
            self.consumers = self.ranks.consumers
        else:
            self.worker = DiTWorker(config, num_blocks=num_blocks, model_bundle=bundle)
            self.device = self.worker.device
            if self.worker.pool is not None:
                transfer_pool(self.worker.pool, transfer.kv_connector)
            self.transport = transport or make_transport(transfer.kv_connector, transfer.kv_ip, transfer.protocol,
                                                         transfer.max_descriptors_per_batch)
            mc = self.worker.model.config
            token_bytes = (source_geometry.token_bytes if source_geometry is not None else
                           mc.num_hidden_layers * 2 * mc.num_key_value_heads * mc.attention_head_dim
                           * self.worker.model.lm_head.weight.element_size())
            self.consumers = [KVConsumer(transfer, self.transport, 0, self.worker.pool, 0, mc.num_key_value_heads,
                                         token_bytes=token_bytes, device=self.worker.device)]
        self._inbox: queue.Queue = queue.Queue()
        self._jobs: dict[str, DiTJob] = {}
        self._tickets: dict[str, str] = {}  # ticket id -> request id (registered receives)
        self._quarantine: dict[str, TransferTicket] = {}
        self._slots: dict[str, int] = {}  # legacy receive slot per request
        self._unbound: list[str] = []  # legacy requests reserved while every slot was quarantined
        self._stop: set[str] = set()
        self._posted: set[str] = set()  # jobs still in the inbox (set add/discard: GIL-atomic)
        self.dead: str | None = None

    # ---- thread-safe entry points ---------------------------------------------------------
    def submit(self, job: DiTJob) -> None:
        self._posted.add(job.request_id)  # counted as waiting while a running request blocks intake
        self._inbox.put(("job", job))

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))
        self._stop.add(request_id)  # a running request stops at its next step boundary

    @property
    def num_quarantined(self) -> int:
        return len(self._quarantine)

    def wait_hint(self) -> float:
        """How long the replica thread may block on its inbox: not at all with work queued, a
        short poll interval while transfers are in flight or pages quarantined (late
        completions), else until a message arrives (bounded for the stop check)."""
        s = self.scheduler
        if self.dead:
            return 0.05
        if s._kv_ready:  # noqa: SLF001 - received requests are ready to run now
            return 0.0
        if s.waiting or s.waiting_for_kv or self._quarantine or self._unbound:
            return 0.001  # admission retry / transfer polling / late completions
        return 0.05

    # ---- replica thread -------------------------------------------------------------------
    def step(self, block_s: float = 0.0) -> bool:
        try:
            return self._step(block_s)
        except ExecutorError as e:  # a rank died, went silent or wedged: nothing on it can be trusted
            self._fail_closed(str(e))
            return True

    def _step(self, block_s: float) -> bool:
        worked = self._drain(block_s)
        if self.dead:
            return worked
        out = self.scheduler.schedule()
        self._retire(out.finished)
        for req in out.reserved:
            self._unbound.append(req.request_id)
        for rid in list(self._unbound):
            self._bind_and_dispatch(rid)
        if self.dead:
            return True
        self._poll()
        self._check_waiting()
        self._check_quarantine()
        for req in out.admitted:
            self._run(req)
        self._retire(self.scheduler.take_finished())
        return worked or bool(out.reserved or out.admitted or out.finished)

    def _drain(self, block_s: float) -> bool:
        return drain(self._inbox, block_s, self._handle)

    def _handle(self, kind: str, arg) -> None:
        if kind == "job":
            self._posted.discard(arg.request_id)
            self._intake(arg)
        else:
            self._cancel(arg)

    def _intake(self, job: DiTJob) -> None:
        rid, t = job.request_id, job.ticket
        if self.dead:
            self._count(t, "failed")
            return self._reject(job, f"DiT replica {self.index} failed closed: {self.dead}")
        t.bind_dest(self._dest(rows=(), slot=None))  # endpoint-level check before touching anything
        why = validate_endpoints(t, self.num_ranks)
        if why:
            self._count(t, "failed")
            return self._reject(job, f"invalid transfer endpoints: {why}")
        rows = [RowLayout(i, r.prefix_len, r.target_len, r.seq_len, tuple(r.full_attn_spans))
                for i, r in enumerate(job.layout.rows)]
        try:
            self.scheduler.add_request(rid, rows, payload=job, num_computed_tokens=job.import_tokens)
        except (AdmissionError, ValueError) as e:
            return self._reject(job, str(e))
        self._jobs[rid] = job

    def _reject(self, job: DiTJob, error: str) -> None:
        job.ticket.fail(error)
        job.abort_source(job.ticket)
        job.on_done(job, GenerationOutput(request_id=job.request_id, status="error", error=error))

    def _dest(self, rows, slot) -> DestEndpoint:
        t = self.transfer
        return DestEndpoint(t.engine_id, t.kv_role, self.index, tuple(c.rank_dest(slot) for c in self.consumers),
                            tuple(rows))

    def _bind_and_dispatch(self, rid: str) -> None:
        req, job = self.scheduler.get(rid), self._jobs.get(rid)
        if req is None or job is None or req.status is not RequestStatus.WAITING_FOR_KV:
            self._unbound.remove(rid)
            return
        slot = None
        if self.native:
            bs = self.config.block_size
            rows = [RowDest(i, n, tuple(req.metadata.rows[i].block_ids[:blocks_for(n, bs)]))
                    for i, n in enumerate(job.import_tokens) if n > 0]
        else:
            slot = self.consumers[0].slots.take()
            if slot is None:
                return  # every slot quarantined: retry on a later tick
            self._slots[rid] = slot
            rows = [RowDest(i, n) for i, n in enumerate(job.import_tokens) if n > 0]
        self._unbound.remove(rid)
        if sorted(c.rank for c in self.consumers) != list(range(self.num_ranks)):
            return self._fail_closed(f"consumer ranks {[c.rank for c in self.consumers]} != 0..{self.num_ranks - 1}")
        t = job.ticket
        t.bind_dest(self._dest(rows, slot))
        why = validate_endpoints(t, self.num_ranks)
        if why:
            return self._rollback(rid, f"invalid transfer: {why}")
        done = []
        try:
            for c in self.consumers:
                c.register(t)
                done.append(c)
        except RegistrationError as e:
            for c in done:
                c.unregister(t.ticket_id)
            if isinstance(e, BadBlockIdsError):  # our own block ids are invalid: the replica is corrupt
                return self._fail_closed(str(e))
            return self._rollback(rid, f"KV receive registration failed: {e}")
        self._tickets[t.ticket_id] = rid
        t.mark_dispatched(self.transfer.transfer_timeout)
        job.send(t)

    def _rollback(self, rid: str, error: str) -> None:
        """Nothing was dispatched: free the reservation and let the producer free its pages."""
        job = self._jobs.pop(rid)
        self.scheduler.fail(rid, error)
        self._give_slot(rid)
        self._count(job.ticket, "failed")
        self._reject(job, error)

    def _poll(self) -> None:
        for c in self.consumers:
            for tid, rank, rows, src in c.poll():
                if rank != c.rank:
                    return self._fail_closed(f"rank {c.rank} received a completion notice for rank {rank}")
                rid = self._tickets.get(tid)
                if rid is None:
                    continue  # a notice for a ticket already released
                job = self._jobs.get(rid)
                t = job.ticket if job is not None else self._quarantine.get(rid)
                if t is not None:
                    t.report_received(rank, rows, src)

    def _check_waiting(self) -> None:
        now = time.monotonic()
        for rid in list(self.scheduler.waiting_for_kv):
            job = self._jobs[rid]
            t = job.ticket
            if t.dispatched_at is None or self.scheduler.get(rid).kv_received:
                continue
            if t.all_received():
                self.scheduler.kv_ready(rid)
                self._count(t, "ok")
            elif t.send_errors() and t.all_sent():
                errs = "; ".join(f"rank {k}: {e}" for k, e in sorted(t.send_errors().items()))
                self._end(rid, f"KV transfer failed: {errs}")
            elif t.failed:  # the producer's side was lost mid-write (a remote AR stage): what may land stays quarantined
                self._end(rid, f"KV transfer failed: {t.error}")
            elif now >= t.deadline:
                self._end(rid, f"timed out receiving KV after {self.transfer.transfer_timeout:g}s")

    def _end(self, rid: str, error: str, cancelled: bool = False) -> None:
        """Terminate a request whose transfer was dispatched; quarantine what may still land."""
        job = self._jobs.pop(rid)
        t = job.ticket
        quarantine = not t.settled()
        if cancelled:
            self.scheduler.cancel(rid, error, quarantine=quarantine)
        else:
            self.scheduler.fail(rid, error, quarantine=quarantine)
        t.fail(error)
        self._count(t, "cancelled" if cancelled else "failed")
        if quarantine:
            self._quarantine[rid] = t
        else:
            self._forget(rid, t)
            self._give_slot(rid)
        job.on_done(job, GenerationOutput(request_id=rid, status="cancelled" if cancelled else "error", error=error))

    def _check_quarantine(self) -> None:
        for rid, t in list(self._quarantine.items()):
            if t.settled():
                del self._quarantine[rid]
                self.scheduler.release_quarantine(rid)
                self._forget(rid, t)
                self._give_slot(rid)

    def _forget(self, rid: str, t: TransferTicket) -> None:
        self._tickets.pop(t.ticket_id, None)
        for c in self.consumers:
            c.unregister(t.ticket_id)

    def _count(self, ticket: TransferTicket, outcome: str) -> None:
        if self.transfer_stats is not None:
            self.transfer_stats.finished(ticket, outcome)

    def _give_slot(self, rid: str) -> None:
        slot = self._slots.pop(rid, None)
        if slot is not None:
            self.consumers[0].slots.give(slot)

    def _cancel(self, rid: str) -> None:
        req = self.scheduler.get(rid)
        job = self._jobs.get(rid)
        if req is not None and req.status is RequestStatus.RUNNING:
            return  # the stop flag ends it at the next step (and `_run` drops the flag)
        self._stop.discard(rid)  # never ran (or already ended): the flag has no one to stop
        if req is None or job is None:
            return
        if req.status is RequestStatus.WAITING_FOR_KV and job.ticket.dispatched_at is not None:
            return self._end(rid, "cancelled", cancelled=True)
        self._jobs.pop(rid)
        if rid in self._unbound:
            self._unbound.remove(rid)
        self.scheduler.cancel(rid, "cancelled")
        self._give_slot(rid)
        job.ticket.fail("cancelled")
        job.abort_source(job.ticket)
        job.on_done(job, GenerationOutput(request_id=rid, status="cancelled", error="cancelled"))

    def _run(self, req) -> None:
        rid = req.request_id
        job = self._jobs[rid]
        self._forget(rid, job.ticket)  # received: the receive registration is done
        if self.ranks is not None:
            return self._run_ranks(req, job)
        t0 = time.monotonic()
        try:
            dense = None
            if self.native:
                self.worker.install(req.metadata)
            else:
                dense = self._dense_import(rid, job)
            latents, st = self.worker.runner.generate(rid, job.layout, job.steps, job.guidance, job.seed,
                                                      on_step=self._progress(rid, job.steps),
                                                      should_stop=lambda: rid in self._stop, dense_import=dense)
            img = self.worker.codec.decode(latents.to(self.worker.dtype)).float().clamp(-1, 1)
            u8 = ((img[0] + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
        except InterruptedError:
            self.scheduler.cancel(rid, "cancelled")
            self._finish(job, GenerationOutput(request_id=rid, status="cancelled", error="cancelled"))
            return
        except Exception as e:  # one request's failure never takes the replica down
            log.exception("DiT request %s failed", rid)
            self.scheduler.finish(rid, error=f"{type(e).__name__}: {e}")
            self._finish(job, GenerationOutput(request_id=rid, status="error", error=f"{type(e).__name__}: {e}"))
            return
        finally:
            self._stop.discard(rid)
            self._give_slot(rid)
        stats = RequestStats(queue_time_s=t0 - job.arrival, run_time_s=time.monotonic() - t0,
                             blocks=req.metadata.num_blocks if req.metadata else 0,
                             prefix_tokens_reused=st.prefix_tokens_reused, tokens_computed=st.tokens_computed,
                             imported_tokens=st.imported_tokens, steps=st.steps)
        self.scheduler.finish(rid)
        self._finish(job, GenerationOutput(request_id=rid, status="ok", image=u8, stats=stats))

    def _progress(self, rid: str, total: int):
        cb = self.on_step
        return None if cb is None else (lambda i: cb(rid, i, total))

    def _run_ranks(self, req, job: DiTJob) -> None:
        rid, t0 = req.request_id, time.monotonic()
        legacy = None
        if not self.native:  # each rank fills its dense cache from its own copy of the slot
            src = job.ticket.source
            legacy = LegacyImport(slot=self._slots[rid], tokens_per_row=list(job.import_tokens),
                                  num_layers=src.geometry.num_layers, head_dim=src.geometry.head_dim,
                                  src_heads=[(lo, hi) for _, lo, hi, _ in src.source_ranks()])
        try:
            res = self.ranks.run(req, job, should_stop=lambda: rid in self._stop, legacy=legacy,
                                 on_step=self._progress(rid, job.steps))
        finally:
            self._stop.discard(rid)
            self._give_slot(rid)  # the ranks answered (or were killed): nothing reads the slot now
        if res.status == "stopped" and res.error is None:
            self.scheduler.cancel(rid, "cancelled")
            return self._finish(job, GenerationOutput(request_id=rid, status="cancelled", error="cancelled"))
        if res.status != "ok":
            self.scheduler.finish(rid, error=res.error)
            return self._finish(job, GenerationOutput(request_id=rid, status="error", error=res.error))
        st = res.stats
        stats = RequestStats(queue_time_s=t0 - job.arrival, run_time_s=time.monotonic() - t0,
                             blocks=req.metadata.num_blocks if req.metadata else 0, prefix_tokens_reused=st.prefix_tokens_reused,
                             tokens_computed=st.tokens_computed, imported_tokens=st.imported_tokens, steps=st.steps)
        self.scheduler.finish(rid)
        self._finish(job, GenerationOutput(request_id=rid, status="ok", image=res.image, stats=stats))

    def _finish(self, job: DiTJob, out: GenerationOutput) -> None:
        self._jobs.pop(job.request_id, None)
        job.on_done(job, out)

    def _dense_import(self, rid: str, job: DiTJob) -> DenseImport:
        src = job.ticket.source
        c = self.consumers[0]
        kv = legacy_heads(c.slots.buffer[self._slots[rid]], [(lo, hi) for _, lo, hi, _ in src.source_ranks()],
                          src.geometry.num_layers, max(job.import_tokens), src.geometry.head_dim,
                          self.worker.dtype, c.head_lo, c.head_hi)
        return DenseImport(kv, list(job.import_tokens))

    def _retire(self, finished) -> None:
        for f in finished:
            if f.generation is not None and self.worker is not None:  # ranks clear their rows themselves
                self.worker.remove(f.request_id, f.generation)

    # ---- failure / teardown ---------------------------------------------------------------
    def _fail_closed(self, reason: str) -> None:
        """Stop the replica: fail every request, close the receivers, then free every page."""
        log.error("DiT replica %d fails closed: %s", self.index, reason)
        self.dead = reason
        for rid, job in list(self._jobs.items()):
            self._count(job.ticket, "failed")  # a ticket already received keeps its "ok"
            job.ticket.fail(reason)
            if job.ticket.dispatched_at is None:
                job.abort_source(job.ticket)
            job.on_done(job, GenerationOutput(request_id=rid, status="error",
                                              error=f"DiT replica failed closed: {reason}"))
        self._jobs.clear()
        self._unbound.clear()
        if self.ranks is not None:  # no rank may still write into a page the scheduler frees next
            self.ranks.stop()
        self.scheduler.fail_all(f"DiT replica failed closed: {reason}")
        self.close()

    def close(self) -> None:
        """Shutdown: everything, quarantined pages included, returns to the pool."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        for job in list(self._jobs.values()):
            if job.ticket.dispatched_at is not None:
                self._count(job.ticket, "cancelled")
            job.ticket.fail("DiT stage shut down")
            job.on_done(job, GenerationOutput(request_id=job.request_id, status="cancelled",
                                              error="DiT stage shut down"))
        self._jobs.clear()
        self._posted.clear()  # jobs never taken from the inbox: the orchestrator cancels them
        if self.ranks is not None:
            self.ranks.stop()
        else:
            self.transport.close()
        self.scheduler.shutdown()  # frees reserved and quarantined pages
        self._quarantine.clear()
        for rid in list(self._slots):
            self._give_slot(rid)

    def stats(self) -> dict:
        """Gauges for /health and /metrics; plain int reads, safe from any thread."""
        s = self.scheduler
        out = {"waiting": s.num_waiting + len(self._posted), "waiting_for_kv": s.num_waiting_for_kv,
               "running": s.num_running, "quarantined": len(self._quarantine), "dead": bool(self.dead)}
        if self.manager is not None:
            p = self.manager.pool
            out.update(kv_num_blocks=p.num_blocks, kv_used_blocks=p.num_blocks - p.num_free,
                       kv_free_blocks=p.num_free)
        else:  # legacy: the receive slots are this stage's transfer memory
            slots = self.consumers[0].slots
            out.update(legacy_slots=self.transfer.legacy_slots, legacy_free_slots=len(slots.free))
        return out

    def pool_full(self) -> bool:
        if self.manager is not None:
            return self.manager.pool.num_free == self.manager.pool.num_blocks
        return len(self.consumers[0].slots.free) == self.transfer.legacy_slots

