"""Engine: scheduler + executor, one step of every running request per `step()`.

Python API:
    engine = Engine(EngineConfig(...))           # executor="auto" | "inproc" | "mp"
    rid = engine.add_request(GenerationRequest(prompt="a large blue square"))
    outputs = engine.run_until_complete()        # or engine.step() in your own loop
    engine.abort(rid); engine.shutdown()

Each `step()` is vLLM's loop: `schedule()` (admissions, the ends decided outside a step), then
`executor.step_batch()` (the admitted requests join with their metadata, the aborted ones leave,
one step of the whole batch on every rank), then the requests that ended in it are finished in the
scheduler. A request alone is a batch of one. `add_request` and `abort` may be called from other
threads while `step` runs; `abort` of a running request takes effect at its next step boundary on
every rank (it leaves the batch there). If the executor fails
closed (a rank died or stopped answering), every pending request ends with that error, every
page returns to the pool, and the engine refuses new requests.

A stage graph's DiT stage is this engine with a KV-import hook on its scheduler
(`kv_import=factory`, see `kv_import.py`): `add_import` queues a request whose prefix KV arrives
by transfer; it joins the batch like any other request once every rank received it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from ..config import EngineConfig
from ..core.kv_manager import DiffusionKVCacheManager, ImportKeys
from ..core.layout import RowLayout
from ..core.scheduler import KVImportPollError, RequestStatus, Scheduler
from ..errors import AdmissionError, ConfigError, DitkvError
from ..worker.threads import apply_process_settings
from .profiling import default_envelope, max_request_tokens
from ..core.ar_text import ARText
from .ar_phase import ARExportJob, ARPhases
from .prefix_ranks import rank_keys
from .processor import Processor
from .request_check import check_fits, check_max_steps
from .executor import ExecutorError, ExecutorOptions, make_executor
from .messages import NewRequest, SamplingParams
from .step_cache_intake import step_cache_params
from .types import GenerationOutput, GenerationRequest, RequestStats

log = logging.getLogger("ditkv.engine")


class _Job(NamedTuple):
    """What the engine keeps per queued request (the scheduler's opaque payload)."""
    layout: object  # RequestLayout, built once at intake: the ranks receive it, never the prompt
    params: SamplingParams
    request: GenerationRequest
    ext: object = None  # the KV-import hook's own per-request data (a stage's job)
    ar: object = None  # `ARIntake`: its AR phase's head and tail (None: no AR text)
    text: object = None  # `TextSampling`: how its AR text is drawn


class Engine:
    def __init__(self, config: EngineConfig, model_bundle=None,
                 on_step: Callable[[str, int, int], None] | None = None,
                 executor: str = "auto", executor_options: ExecutorOptions | None = None,
                 kv_import: Callable[[object], object] | None = None):
        """`model_bundle`: (model, tokenizer, codec), a zero-argument factory of one (called in
        every rank process), or None to load `config.model`. `kv_import(executor)` builds the
        scheduler's KV-import hook (`kv_import.KVImportHook`) once the executor runs, or None."""
        self.config = config
        self.on_step = on_step
        apply_process_settings(config)  # this process runs the in-process rank (and ranks match)
        self.executor = make_executor(executor, config, model_bundle, executor_options)
        try:
            check_max_steps(config, self.executor.model_config)
        except ConfigError:
            self.executor.shutdown()
            raise
        self.manager = None
        nb = self.executor.num_blocks
        if config.paged:
            max_len = config.max_model_len if config.max_model_len > 0 else nb * config.block_size
            self.manager = DiffusionKVCacheManager(nb, config.block_size,
                                                   config.diffusion_kv_max_rows_per_request, max_len,
                                                   prefix_caching=config.prefix_caching,
                                                   # CFG parallel: row 0's pages are on another rank
                                                   share_rows=config.cfg_parallel_size == 1)
        self.envelope = default_envelope(config, self.executor.model_config)  # the profiled maximum
        self.processor = Processor(config, self.executor.model_config, self.executor.tokenizer, self.envelope)
        try:
            self._check_batched_tokens()
            self.kv_import = kv_import(self.executor) if kv_import is not None else None
        except BaseException:
            self.executor.shutdown()
            raise
        kw = {} if self.kv_import is None else {"kv_import": self.kv_import,
                                                "max_waiting_for_kv": self.kv_import.max_waiting_for_kv,
                                                "fatal_errors": (ExecutorError,)}
        self.scheduler = Scheduler(self.manager, max_running=config.max_num_seqs,
                                   max_batched_tokens=config.max_num_batched_tokens, **kw)
        self._ids = itertools.count()
        self._lock = threading.RLock()  # scheduler state; never held while a request runs
        self._stop: set[str] = set()
        self._results: dict[str, tuple] = {}
        self._outputs: list[GenerationOutput] = []
        self.failed: str | None = None
        self._started: dict[str, tuple[float, int]] = {}  # step-level: start time, steps done
        self.ar = ARPhases(self)  # requests in their AR phase: work out, tokens back, handover
        self.batch_sizes: dict[int, int] = {}  # step-level: steps run at each batch size
        self.encoder_cache_hits = 0  # input images whose embeddings came from the encoder cache (all requests)

    def _check_batched_tokens(self) -> None:
        """max_num_batched_tokens must admit the largest request of the profiled envelope."""
        b = self.config.max_num_batched_tokens
        if b is None:
            return
        need = max_request_tokens(self.executor.model_config, self.executor.tokenizer, self.envelope)
        if b < need:
            raise ConfigError("max_num_batched_tokens", b,
                              f"is below the {need} query tokens of the largest admitted request "
                              f"({self.envelope.max_width}x{self.envelope.max_height}, "
                              f"{self.envelope.max_prompt_tokens} prompt tokens, CFG on); raise it to at least "
                              f"{need}, or lower max_image_height/max_image_width/max_prompt_tokens")

    @property
    def worker(self):
        """The in-process worker (tests, benchmarks); the multi-process executor has none."""
        w = getattr(self.executor, "worker", None)
        if w is None:
            raise AttributeError("this engine runs its ranks in other processes; there is no in-process worker")
        return w

    @property
    def num_blocks(self) -> int | None:
        return self.manager.pool.num_blocks if self.manager else None

    # ---- intake -------------------------------------------------------------------------
    def add_request(self, req: GenerationRequest) -> str:
        """Validate and queue. Raises a client-safe `DitkvError` (bad input, can never fit)."""
        if self.failed is not None:
            raise DitkvError(f"engine failed and accepts no requests: {self.failed}")
        rid = req.request_id or f"req-{next(self._ids)}"
        req, layout, params, intake, text = self.processor.process(req)  # checks, defaults, the layout: once
        params = self.cache_params(req, params)
        height, width = (req.height, req.width) if intake is None else intake.size  # size=auto: its largest
        rows = self.check_layout(layout, height, width)
        ar = None
        if intake is not None:
            self._check_text_room(layout, text.max_new_tokens)
            eos = None if req.ignore_eos else self.executor.model_config.eos_token_id
            ar = ARText(intake.head, intake.tail, text.max_new_tokens, eos,
                        frozenset(intake.stop_ids), whole_head=intake.image_spans,
                        choice=tuple(i for _, _, i in intake.sizes))
        keys = None  # the prefix cache's block identities: hashed once, here (an AR row's: its text head's)
        if ar is None:
            keys = self.prefix_keys(layout, params.seed)
        else:
            self._ar_keys(ar, intake.images, text.seed, layout)
        with self._lock:
            self.scheduler.add_request(rid, rows, payload=_Job(layout, params, req, ar=intake, text=text), ar=ar,
                                       prefix_keys=keys)
        return rid

    def prefix_keys(self, layout, seed: int):
        """The rows' prefix-cache keys (`ModelFamily.prefix_block_keys`), or None with the cache off.
        Under CFG parallel each row's keys name the rank whose pool alone holds its pages (`prefix_ranks`)."""
        if self.manager is None or not self.manager.prefix_caching:
            return None
        keys = self.processor.family.prefix_block_keys(self.executor.model_config, layout, seed,
                                                       self.config.block_size)
        return rank_keys(keys, self.config.cfg_parallel_size)

    def _ar_keys(self, ar: ARText, images, seed: int, layout=None) -> None:
        """An AR row's head's keys (prefix caching on). A head with input images (`images`, the wire form
        the ranks get) names each image with `seed`, the text's seed that draws their VAE samples on the
        ranks (docs/prefix-cache-ar.md). Where the head is the DiT `layout`'s cond text (no rewrite), its
        keys are that row's first pages' (equal by construction: same ids, positions and images), so the
        images are not prepared again; else the head is rebuilt here as the ranks do (`ar_head_of`)."""
        if self.manager is None or not self.manager.prefix_caching:
            return
        from .messages import ar_head_of

        cfg, fam, bs = self.executor.model_config, self.processor.family, self.config.block_size
        if images is not None and layout is not None and list(ar.head) == layout.cond_text_ids():
            ar.keys = tuple(fam.prefix_block_keys(cfg, layout, seed, bs)[0][:len(ar.head) // bs])
            return
        head = None if images is None else ar_head_of(cfg, self.executor.tokenizer, images, ar.head)
        ar.keys = fam.ar_head_block_keys(cfg, ar.head, bs, head=head, seed=seed)

    def cache_params(self, req: GenerationRequest, params: SamplingParams) -> SamplingParams:
        """`params` with the request's own step cache, checked against this engine (`step_cache_params`)."""
        return step_cache_params(self.config, self.executor.model_config, req, params)

    def _check_text_room(self, layout, max_new_tokens: int) -> None:
        """The image row holds the AR text too: the prompt plus up to max_new_tokens must stay within
        the profiled prompt envelope, or the request would fail after its text."""
        room = self.envelope.max_prompt_tokens - layout.prompt_tokens
        if max_new_tokens > room:
            raise AdmissionError(f"max_new_tokens={max_new_tokens}: the image row holds the prompt ({layout.prompt_tokens} "
                                 f"tokens) and the AR text, and max_prompt_tokens={self.envelope.max_prompt_tokens} "
                                 f"leaves room for {max(room, 0)}; ask for at most {max(room, 0)} or raise "
                                 "max_prompt_tokens", field="max_new_tokens")

    def check_layout(self, layout, height: int, width: int) -> list[RowLayout]:
        """The rows of `layout` if this engine can ever run them (envelope, max_model_len, pool)."""
        self.envelope.check(height, width, layout.prompt_tokens)
        rows = RowLayout.of(layout)
        check_fits(rows, self.config, self.manager)
        return rows

    def add_import(self, request_id: str, layout, params: SamplingParams, request: GenerationRequest,
                   import_tokens, ext=None) -> None:
        """Queue a request whose prefix KV (`import_tokens` per row) arrives through the KV-import
        hook; `layout` is already built (the stage's front end). Raises `AdmissionError` when it
        can never fit, `ValueError` for a live or quarantined id; nothing is queued then."""
        if self.failed is not None:
            raise DitkvError(f"engine failed and accepts no requests: {self.failed}")
        rows = RowLayout.of(layout)
        params = self.cache_params(request, params)
        job = _Job(layout, params, request, ext)
        # the imported pages (the AR stage's bytes, same dtype) and the rest commit after the first step; the
        # rows look up only where the hook's transfer skips the pages they find cached (native, not legacy)
        keys = self.prefix_keys(layout, params.seed)
        keys = ImportKeys(keys) if keys is not None and getattr(self.kv_import, "skips_cached_pages", False) else keys
        with self._lock:
            self.scheduler.add_request(request_id, rows, payload=job, num_computed_tokens=import_tokens,
                                       prefix_keys=keys)

    def add_ar_export(self, request_id: str, text: ARText, sampling, images, key: str) -> None:
        """Queue an AR stage's pre-planned work (a stage graph's orchestrator built its head and tail): its
        AR phase runs batched with the others and, instead of a DiT phase, its row's pages that hold
        its tokens pass to the export `key` when it ends (`take_export`, then `release_export`).
        Raises `AdmissionError` when it can never fit, `ValueError` for a live id; nothing is queued then."""
        if self.failed is not None:
            raise DitkvError(f"engine failed and accepts no requests: {self.failed}")
        self._ar_keys(text, images, sampling.seed)
        job = _Job(None, None, None, ar=ARExportJob(images), text=sampling)
        with self._lock:
            self.scheduler.add_request(request_id, (), payload=job, ar=text, export=key)

    def take_export(self, request_id: str):
        """The `ExportedKV` of an AR stage's work that ended ok (once), or None."""
        with self._lock:
            return self.ar.exports.pop(request_id, None)

    def release_export(self, key: str, generation: int | None = None) -> bool:
        """The export `key` is done with its pages (sent, or never dispatched): they return to the pool.
        A release naming another generation is stale and frees nothing."""
        with self._lock:
            return self.manager.release_export(key, generation)

    def abort(self, request_id: str) -> bool:
        """Cancel a waiting request now, a running one at its next step boundary."""
        with self._lock:
            req = self.scheduler.get(request_id)
            if req is None:
                self._stop.discard(request_id)  # nothing left to stop (see `request_stop`)
                return False
            if req.status is RequestStatus.AR:
                # its pages return now (nothing else takes them before the next schedule), and the ranks
                # forget its AR row first thing in the next step (`_retire`, on the stepping thread)
                return self.scheduler.cancel(request_id, "aborted by client")
            if req.status is RequestStatus.RUNNING:
                self._stop.add(request_id)
                return True
            self._stop.discard(request_id)
            return self.scheduler.cancel(request_id, "aborted by client")

    def request_stop(self, request_id: str) -> None:
        """Thread-safe and touches nothing else: `request_id` stops at its next step boundary once it
        runs (at its first, if it has not started yet). A KV-import stage calls this from any thread
        and `abort` from the thread that steps the engine (the hook's state lives there)."""
        with self._lock:
            self._stop.add(request_id)

    # ---- loop ---------------------------------------------------------------------------
    def step(self) -> list[GenerationOutput]:
        """schedule -> execute one step of the batch -> update from its output."""
        with self._lock:
            if self.failed is None:
                self._guard(self.executor.check_health)  # a rank may die while the engine idles
            if self.failed is not None:
                return self._take_outputs()
            out = self._guard(self.scheduler.schedule)  # the KV-import hook may fail it closed
            if out is None:
                return self._take_outputs()
            self._retire(out.finished)
            for rid in out.ar_ended:  # handed over or preempted: before any start reuses the pages
                self.executor.end_ar(rid)
            self._join(out.admitted)
            works = self.ar.works(out)
            if not self._started and not works:
                return self._take_outputs()
            if works:
                self.executor.queue_ar(works)
            n = len(self._started)
            if n:
                self.batch_sizes[n] = self.batch_sizes.get(n, 0) + 1
        outcomes = self._guard(self.executor.step_batch)  # the lock is free: add_request/abort go on
        if outcomes is not None:
            self._update_from_output(outcomes)
            if works:
                with self._lock:
                    self.ar.update(out, self.executor.take_ar())
        return self._take_outputs()

    def _join(self, admitted) -> None:
        """Admitted requests join the batch, aborted running ones leave it (both at the next step)."""
        for req in admitted:
            job: _Job = req.payload
            self.executor.start(NewRequest(request_id=req.request_id, metadata=req.metadata,
                                           layout=self.processor.family.layout_to_wire(job.layout),
                                           params=job.params, legacy=req.import_params))
            self._started[req.request_id] = (time.monotonic(), 0)
        for rid in [rid for rid in self._stop if rid in self._started]:
            self._stop.discard(rid)
            self.executor.drop(rid)
            self._started.pop(rid)
            self.scheduler.cancel(rid, "aborted by client")

    def _update_from_output(self, outcomes) -> None:
        """Count the step of every running request, then finish those that ended in it (a request's
        own error ends only that request)."""
        ended = {o.request_id: o for o in outcomes}
        for rid, (t0, i) in list(self._started.items()):
            self._started[rid] = (t0, i + 1)
            if i == 0 and self.manager is not None and (rid not in ended or ended[rid].status == "ok"):
                with self._lock:  # its prefix pages are written on every rank: they may be shared now
                    self.manager.commit_prefix(rid)
            if self.on_step is not None and (rid not in ended or ended[rid].status == "ok"):
                self.on_step(rid, i, self.scheduler.get(rid).payload.params.steps)
        with self._lock:
            for rid, o in ended.items():
                t0, _ = self._started.pop(rid)
                req = self.scheduler.get(rid)
                if o.status != "ok":
                    self.scheduler.finish(rid, error=o.error)
                    continue
                self._results[rid] = (o.image, self._request_stats(req, o.stats, t0, self.ar.stats_of(rid)))
                self.encoder_cache_hits += o.stats.encoder_cache_hits
                self.scheduler.finish(rid)

    @staticmethod
    def _request_stats(req, s, t0: float, ar: dict) -> RequestStats:
        revised = ar.pop("revised_prompt", None)
        stats = RequestStats(queue_time_s=req.admit_time - req.arrival_time, run_time_s=time.monotonic() - t0,
                             blocks=req.metadata.num_blocks if req.metadata else 0,
                             prefix_tokens_reused=s.prefix_tokens_reused, tokens_computed=s.tokens_computed,
                             imported_tokens=s.imported_tokens, steps=s.steps,
                             computed_steps=s.steps - s.cached_steps, cached_steps=s.cached_steps,
                             prefix_cache_hit_tokens=sum(req.cache_hit_tokens or ()),
                             prefix_shared_rows_tokens=sum(req.row0_tokens or ()),
                             encoder_cache_hits=s.encoder_cache_hits, **ar)
        return stats, revised

    def _guard(self, fn, *args):
        """Call into the executor; on `ExecutorError` fail the engine closed and return None. The
        scheduler's `KVImportPollError` too: the KV-import hook lost track of which writes settled."""
        try:
            return fn(*args)
        except (ExecutorError, KVImportPollError) as e:
            self._fail_closed(str(e))
            return None

    def fail_closed(self, reason: str) -> None:
        """A stage's own call into the ranks found one dead or silent: stop every rank, fail every
        request, return their pages (exported rows stay: `release_exports` once nothing reads them)."""
        if self.failed is None:
            self._fail_closed(reason)

    def release_exports(self) -> int:
        """Every exported row returns (their readers are gone); how many there were."""
        with self._lock:
            return self.manager.release_exports()

    def _fail_closed(self, reason: str) -> None:
        # the executor has already stopped every rank, so freeing the pages now is safe
        with self._lock:
            self.failed = reason
            log.error("engine failed closed: %s", reason)
            self.executor.shutdown()  # no rank (and no KV receiver) touches a page from here on
            if self.kv_import is not None:
                self.kv_import.fail_closed(reason)
            self.scheduler.fail_all(f"engine failed closed: {reason}")
            self.scheduler.release_all_quarantine()  # the receivers are closed: nothing lands any more
            self._stop.clear()
            self._started.clear()

    def _take_outputs(self) -> list[GenerationOutput]:
        with self._lock:
            self._retire(self.scheduler.take_finished())
            done, self._outputs = self._outputs, []
        return done

    def _retire(self, finished) -> None:
        for f in finished:
            self._stop.discard(f.request_id)
            if self._started.pop(f.request_id, None) is not None and self.failed is None:
                self.executor.drop(f.request_id)  # ended outside a step (shutdown): leave the batch
            if f.generation is not None and self.failed is None:
                self.executor.remove(f.request_id, f.generation)  # idempotent: ranks cleared rows already
            img, (stats, revised) = self._results.pop(f.request_id, (None, (RequestStats(), None)))
            if f.request_id in self.ar.live:  # ended in its AR phase: the ranks forget its state
                self.ar.live.pop(f.request_id)
                if self.failed is None:
                    self.executor.end_ar(f.request_id)
            status = {RequestStatus.FINISHED_OK: "ok", RequestStatus.FINISHED_CANCELLED: "cancelled"}.get(
                f.status, "error")
            self._outputs.append(GenerationOutput(request_id=f.request_id, status=status, error=f.error,
                                                  image=img, stats=stats, revised_prompt=revised))

    def run_until_complete(self) -> list[GenerationOutput]:
        outs: list[GenerationOutput] = []
        while self.scheduler.has_work():
            outs.extend(self.step())
        outs.extend(self.step())
        return outs

    def generate(self, req: GenerationRequest) -> GenerationOutput:
        rid = self.add_request(req)
        for o in self.run_until_complete():
            if o.request_id == rid:
                return o
        raise DitkvError(f"request {rid} produced no output")

    def shutdown(self) -> list[GenerationOutput]:
        with self._lock:
            if self.kv_import is not None:  # the receivers close before any page is freed
                self.executor.shutdown()
                self.kv_import.close()
            out = self.scheduler.shutdown()  # frees quarantined pages too
            self._retire(out.finished)
            self.executor.shutdown()
            done, self._outputs = self._outputs, []
        return done

    def stats(self) -> dict:
        s = {"waiting": self.scheduler.num_waiting, "running": self.scheduler.num_running + self.scheduler.num_ar,
             "ar_running": self.scheduler.num_ar, "ar_preempted": self.scheduler.num_preempted,
             "executor": self.executor.kind, "world_size": self.executor.world_size, "failed": self.failed}
        if self.manager:
            s.update(self.manager.stats())
        if self.config.encoder_cache_bound:
            s["encoder_cache_hits"] = self.encoder_cache_hits
        s["batch_sizes"] = dict(self.batch_sizes)
        return s


__all__ = ["Engine", "ExecutorOptions", "GenerationRequest", "GenerationOutput", "AdmissionError"]
