"""A DiT stage replica: the ordinary `Engine` with the KV-import hook on its scheduler.

The engine (scheduler, executor, request-level or step-level batching, fail-closed) runs the
requests; `kv_import.DiTImporter` keeps the ticket lifecycle (register -> dispatch -> ready, deadlines,
quarantine until settled). One rank runs in this process (in-process executor, its consumer local),
several in rank processes (multi-process executor, a KV consumer in every rank). This class only
adapts the orchestrator's interface: a thread-safe inbox for jobs and cancels, the endpoint check
at intake, outputs back to each job's `on_done`, and gauges.
"""

from __future__ import annotations

import queue
from dataclasses import replace

from ..engine.engine import Engine
from ..engine.options import ExecutorOptions
from ..engine.types import GenerationOutput
from ..errors import AdmissionError, DitkvError
from ..models.loader import resolve_device
from ..transfer.config import TransferConfig
from ..transfer.inbox import drain
from .kv_import import DiTImporter, DiTJob

__all__ = ["DiTJob", "DiTStage"]


class DiTStage:
    def __init__(self, index: int, config, transfer: TransferConfig, bundle=None, max_waiting_for_kv: int = 8,
                 stats=None, executor_options=None, on_step=None):
        self.index, self.config, self.transfer = index, config, transfer
        self.transfer_stats = stats
        # a paged pool without num_kv_blocks (no byte budget either) is sized by the engine itself at
        # startup: gpu_memory_utilization minus the profiled peak, capped by what the GPU has free
        opts = replace(executor_options or ExecutorOptions(), transfer=transfer)
        self.importer: DiTImporter | None = None

        def hook(executor):
            self.importer = DiTImporter(index, transfer, executor, config.block_size, max_waiting_for_kv, stats)
            return self.importer

        self.engine = Engine(config, bundle, on_step=on_step, executor_options=opts, kv_import=hook)
        w = getattr(self.engine.executor, "worker", None)
        self.device = w.device if w is not None else resolve_device(config.device)
        self._inbox: queue.Queue = queue.Queue()
        self._jobs: dict[str, DiTJob] = {}  # queued in the engine: their outputs go to `on_done`
        self._posted: set[str] = set()  # jobs still in the inbox (set add/discard: GIL-atomic)
        self._closed = False

    # ---- what tests and the orchestrator read -------------------------------------------------
    @property
    def scheduler(self):
        return self.engine.scheduler

    @property
    def manager(self):
        return self.engine.manager

    @property
    def worker(self):
        return getattr(self.engine.executor, "worker", None)

    @property
    def consumers(self):
        return self.importer.consumers

    @property
    def ranks(self):
        return self.importer.ranks

    @property
    def num_ranks(self) -> int:
        return self.importer.num_ranks

    @property
    def dead(self) -> str | None:
        return self.engine.failed

    @property
    def num_quarantined(self) -> int:
        return self.importer.num_quarantined

    @property
    def _quarantine(self):  # tests read the quarantined tickets
        return self.importer._quarantine

    # ---- thread-safe entry points ---------------------------------------------------------
    def submit(self, job: DiTJob) -> None:
        self._posted.add(job.request_id)  # counted as waiting while a running request blocks intake
        self._inbox.put(("job", job))

    def cancel(self, request_id: str) -> None:
        """Running (or once it runs): stops at its next step boundary; otherwise it ends on the
        replica thread, its pages quarantined while a write may land (the scheduler decides)."""
        self.engine.request_stop(request_id)
        self._inbox.put(("cancel", request_id))

    def wait_hint(self) -> float:
        """How long the replica thread may block on its inbox: not at all with work ready, a short
        poll interval while transfers are in flight or pages quarantined (late completions), else
        until a message arrives (bounded for the stop check)."""
        s = self.engine.scheduler
        if self.dead:
            return 0.05
        if s._kv_ready or s.running:  # received requests are ready to run now
            return 0.0
        if s.waiting or s.waiting_for_kv or self.importer.polling:
            return 0.001
        return 0.05

    # ---- replica thread -------------------------------------------------------------------
    def step(self, block_s: float = 0.0) -> bool:
        worked = drain(self._inbox, block_s, self._handle)
        if self._closed:
            return worked
        outs = self.engine.step()
        for o in outs:
            self._deliver(o)
        return worked or bool(outs)

    def _handle(self, kind: str, arg) -> None:
        if kind == "job":
            self._posted.discard(arg.request_id)
            self._intake(arg)
        else:
            self.engine.abort(arg)

    def _intake(self, job: DiTJob) -> None:
        t = job.ticket
        if self.dead or self._closed:
            self._count(t, "failed")
            return self._reject(job, f"DiT replica {self.index} failed closed: {self.dead or 'shut down'}")
        why = self.importer.check_endpoints(t)
        if why:
            self._count(t, "failed")
            return self._reject(job, f"invalid transfer endpoints: {why}")
        try:
            self.engine.add_import(job.request_id, job.layout, job.params, job.request, job.import_tokens, ext=job)
        except (AdmissionError, ValueError, DitkvError) as e:
            return self._reject(job, str(e))
        self._jobs[job.request_id] = job

    def _reject(self, job: DiTJob, error: str) -> None:
        job.ticket.fail(error)
        job.abort_source(job.ticket)
        job.on_done(job, GenerationOutput(request_id=job.request_id, status="error", error=error))

    def _deliver(self, out: GenerationOutput) -> None:
        job = self._jobs.pop(out.request_id, None)
        if job is not None:
            job.on_done(job, out)

    def _count(self, ticket, outcome: str) -> None:
        if self.transfer_stats is not None:
            self.transfer_stats.finished(ticket, outcome)

    # ---- teardown -------------------------------------------------------------------------
    def close(self) -> None:
        """Shutdown: the receivers close, then everything, quarantined pages included, returns."""
        if self._closed:
            return
        self._closed = True
        for o in self.engine.shutdown():
            self._deliver(o)
        self._posted.clear()  # jobs never taken from the inbox: the orchestrator cancels them

    # ---- observability --------------------------------------------------------------------
    def stats(self) -> dict:
        """Gauges for /health and /metrics; plain int reads, safe from any thread."""
        s = self.engine.scheduler
        out = {"waiting": s.num_waiting + len(self._posted), "waiting_for_kv": s.num_waiting_for_kv,
               "running": s.num_running, "quarantined": self.num_quarantined, "dead": bool(self.dead)}
        if self.manager is not None:
            p = self.manager.pool
            out.update(kv_num_blocks=p.num_blocks, kv_used_blocks=p.num_blocks - p.num_free,
                       kv_free_blocks=p.num_free)
        else:  # legacy: the receive slots are this stage's transfer memory
            slots = self.consumers[0].slots
            out.update(legacy_slots=self.transfer.legacy_slots, legacy_free_slots=len(slots.free))
        return out

    @property
    def batch_sizes(self) -> dict[int, int]:
        """Step-level batching: steps run at each batch size."""
        return dict(self.engine.batch_sizes)

    def pool_full(self) -> bool:
        if self.manager is not None:
            return self.manager.pool.num_free == self.manager.pool.num_blocks
        return len(self.consumers[0].slots.free) == self.transfer.legacy_slots
