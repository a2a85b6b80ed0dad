"""Orchestrator: runs the AR(0) -> DiT(1) stage graph of a stage YAML and routes every request.

Per request: one `TransferTicket`; the AR replica that produced the prefix KV is bound to the
ticket (its producer sends, its pool holds the lease); the DiT replica reserves, receives, runs
and returns the image. Replicas run in-process, each on its own thread (`start()`), or all on the
caller's thread through `step()` (deterministic tests). Stages talk only through the ticket and
their thread-safe inboxes.

    orch = Orchestrator(load_stage_graph("examples/stages-native.yaml"))
    orch.start()
    out = orch.generate(GenerationRequest(prompt="a red circle", steps=2))
    orch.shutdown()

`Orchestrator(graph, on_output=cb)` hands every finished output to `cb` (on a replica thread)
instead of keeping it for `take()`; the async server backend uses that. `transfers` counts the
transfers' verdicts and bytes (`TransferStats`), `stats()` gives per-stage gauges.

size=auto (height and width None) runs as in the single engine: the intake plans the AR job up to
`<boi> <img_size>` with the ratio ids the DiT stage's envelope allows (`ARJob.choice`), admission sizes
it at the allowed bucket with the most image tokens, the AR stage draws the ratio (`ARResult.chosen`)
and the DiT rows are built at that bucket, importing the prefix that agrees with the exported row.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import msgspec
import torch

from ..core.kv_manager import blocks_for
from ..core.layout import RowLayout
from ..errors import AdmissionError, ConfigError, DitkvError, LayoutError, UnavailableError
from ..models.loader import resolve_device, resolve_dtype
from .ar_side import ARJob, ARReplica
from .dit_side import DiTJob, DiTStage
from ..transfer.stats import TransferStats
from ..transfer.ticket import TransferTicket
from ..worker.threads import apply_process_settings
from ..engine.processor import Processor, StageText
from ..engine.request_check import check_fits, check_max_steps
from ..engine.executor import load_frontend
from ..engine.messages import SamplingParams
from ..engine.step_cache_intake import step_cache_params
from ..models.text_settings import checkpoint_sampling
from .replicas import on_replica_device, replica_device, norm_device, plan_replicas, replica_transfer
from ..engine.profiling import default_envelope
from .graph import StageGraph
from ..engine.types import GenerationOutput, GenerationRequest

log = logging.getLogger("ditkv.orchestrator")


class Orchestrator:
    def __init__(self, graph: StageGraph, model_bundle=None, on_output=None, executor_options=None, on_step=None):
        """`executor_options` (`ExecutorOptions`): rank processes of multi-rank DiT replicas;
        `on_step(request_id, step, total)`: called after every denoising step (progress)."""
        self.graph = graph
        self.transfers = TransferStats()
        self._on_output = on_output
        ar, dit = graph.ar, graph.dit
        if ar.engine.torch_threads != dit.engine.torch_threads:  # one process hosts both (and ranks must agree)
            raise ConfigError("stages[0].engine.torch_threads", ar.engine.torch_threads,
                              f"the DiT stage has torch_threads={dit.engine.torch_threads}: give every stage the "
                              "same torch_threads (results are bit-identical across processes only then)")
        apply_process_settings(dit.engine)
        dit_dev = norm_device(resolve_device(dit.engine.device))
        dtype = resolve_dtype(dit.engine.dtype, dit_dev)
        # a remote AR stage (`remote:`) resolves its device and dtype on its own host (checked at connect)
        if ar.remote is None and resolve_dtype(ar.engine.dtype, norm_device(resolve_device(ar.engine.device))) != dtype:
            raise DitkvError("the AR and DiT pools hold the same pages: give both stages the same engine.dtype "
                             f"(the DiT's resolves to {str(dtype).removeprefix('torch.')})")
        plan, bundles = plan_replicas(graph, model_bundle, executor_options, dtype)
        front = model_bundle or next(iter(bundles), None)
        self.model_config, self.tokenizer = load_frontend(dit.engine, front)
        check_max_steps(dit.engine, self.model_config)
        # a request's AR text settings default to the stage's, then the checkpoint's; the stage's
        # max_new_tokens always wins over the checkpoint's (it sizes the AR pages)
        self._text = checkpoint_sampling(self.model_config).override(
            temperature=ar.temperature, top_k=ar.top_k, top_p=ar.top_p, do_sample=ar.do_sample,
            max_new_tokens=ar.max_new_tokens)
        self.envelope = default_envelope(dit.engine, self.model_config)  # it bounds size=auto's buckets too
        self.processor = self._intake(graph)  # before any replica allocates pools or spawns ranks
        from ..worker.parallel import validate_parallel

        if dit.engine.world_size > 1:  # before any replica allocates pools or spawns ranks
            validate_parallel(dit.engine, self.model_config)
        if ar.engine.tensor_parallel_size > 1 and ar.remote is None:
            validate_parallel(ar.engine, self.model_config)
        self.ar = []
        self.remote = None  # the `RemoteARStage` of a separately deployed AR stage (it reconnects)
        if ar.remote is not None:  # a separately deployed AR stage: one proxy per server replica
            from .remote_ar import RemoteARStage

            self.remote = RemoteARStage(ar, self.transfers, str(dtype).removeprefix("torch."), self.model_config)
            self.ar = self.remote.replicas
        try:
            for i, p in enumerate(plan["ar"]):
                self.ar.append(ARReplica(i, p["engine"], replica_transfer(ar.transfer, i, ar.replicas), p["bundle"],
                                         stats=self.transfers, executor_options=p["options"]))
        except BaseException:  # no rank process outlives a failed start
            for a in self.ar:
                a.close()
            raise
        self.dit = []
        try:
            for i, p in enumerate(plan["dit"]):
                self.dit.append(DiTStage(i, p["engine"], replica_transfer(dit.transfer, i, dit.replicas),
                                         p["bundle"], max_waiting_for_kv=graph.max_inflight,
                                         stats=self.transfers, executor_options=p["options"], on_step=on_step))
        except BaseException:  # no rank process outlives a failed start
            for r in self.dit + self.ar:
                r.close()
            raise
        self._ids = itertools.count()
        self._rr_ar, self._rr_dit = itertools.count(), itertools.count()
        self._cond = threading.Condition()
        self._outputs: dict[str, GenerationOutput] = {}
        self._live: dict[str, tuple] = {}  # rid -> (request, steps, guidance, ar replica, dit replica | None)
        self._cancelled: set[str] = set()
        self._revised: dict[str, str] = {}  # rid -> prompt + the AR stage's generated text
        self._auto_sizes: dict[str, str] = {}  # rid -> WIDTHxHEIGHT the AR stage chose (size=auto)
        self._ar_stats: dict[str, dict] = {}  # rid -> the AR stage's ar_* stats of its job
        self._layouts: dict[str, tuple] = {}  # rid -> (its `ARIntake`, its `ARPlanner`): the DiT rows after the AR
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self.closed = False

    def _intake(self, graph: StageGraph) -> Processor:
        """The single engine's intake with the AR stage's text settings. What the requests' default task
        (the AR stage's `bot_task`, else the checkpoint's) asks of the AR stage is checked at startup: a
        think/recaption one needs text. Any other may have a stage max_new_tokens: the cap of the
        requests' own rewrites (`text_sampling` checks each)."""
        ar = graph.ar
        try:
            processor = Processor(graph.dit.engine, self.model_config, self.tokenizer, self.envelope,
                                  stage=StageText(ar.max_new_tokens, self._text, ar.bot_task))
        except LayoutError as e:
            raise ConfigError("stages[0].bot_task", ar.bot_task, str(e).removeprefix("bot_task: ")) from None
        default = processor.planner_for(None)
        if default.rewrites:
            default.check_text(ar.max_new_tokens, "stages[0].max_new_tokens", "stages[0].bot_task")
        return processor

    # ---- intake -------------------------------------------------------------------------
    def submit(self, req: GenerationRequest) -> str:
        """Validate and route to an AR replica. Raises a client-safe `DitkvError` on bad input."""
        if self.closed:
            raise DitkvError("the orchestrator is shut down")
        rid = req.request_id or f"req-{next(self._ids)}"
        req, layout, params, intake, text = self.processor.process(req)  # the single engine's intake
        # a request's own step cache against the DiT stage, now rather than after its AR phase
        step_cache_params(self.processor.config, self.model_config, req, params)
        steps, guidance = params.steps, params.guidance
        planner = self.processor.planner_for(req.bot_task)  # the request's, else the stage's default task
        head, tail, wire = intake.head, intake.tail, intake.images
        self._check_admissible(*intake.size, layout, len(head) + len(tail))  # size=auto: its largest bucket
        alive = [a for a in self.ar if not a.dead]  # a failed-closed AR replica takes no new work
        if not alive:
            raise UnavailableError("no live AR replica: every AR replica failed closed (see the log); "
                                   + ("the remote AR stage is reconnecting: retry when it is back"
                                      if self.remote is not None else "restart the AR stage"))
        ar = alive[next(self._rr_ar) % len(alive)]
        with self._cond:
            if rid in self._live:
                raise DitkvError(f"request id {rid!r} is already live; use a unique id")
            self._live[rid] = (req, steps, guidance, ar, None)
            self._layouts[rid] = (intake, planner)
        ar.submit(ARJob(rid, TransferTicket(rid, self.graph.mode), head, tail, text, self._ar_done,
                        stop_ids=intake.stop_ids, images=wire, choice=tuple(i for _, _, i in intake.sizes)))
        return rid

    def _check_admissible(self, height: int, width: int, layout, ar_tokens: int) -> None:
        """Refuse at once what no stage could ever hold, so callers get a client error instead of
        a failed output later (the same envelope and pool checks as the single-stage engine)."""
        self.envelope.check(height, width, layout.prompt_tokens)
        ar, dit = self.graph.ar, self.graph.dit
        need = blocks_for(ar_tokens + ar.max_new_tokens, ar.engine.block_size)
        if need > ar.engine.num_kv_blocks:
            raise AdmissionError(f"prompt needs {need} AR pages but the AR pool has {ar.engine.num_kv_blocks}; "
                                 "shorten the prompt or raise the AR stage's num_kv_blocks (or kv_cache_memory_bytes)",
                                 field="prompt")
        manager = self.dit[0].manager
        rows = RowLayout.of(layout)
        check_fits(rows, dit.engine, manager)  # max_model_len in both modes, then the pool's size
        if manager is not None:  # native: the DiT's paged pool
            manager.check_admissible(rows)
        elif layout.rows[0].prefix_len > dit.transfer.legacy_max_tokens:  # legacy: the receive slot
            raise AdmissionError(f"prompt is {layout.rows[0].prefix_len} tokens, above the legacy transfer's "
                                 f"legacy_max_tokens={dit.transfer.legacy_max_tokens}; shorten the prompt",
                                 field="prompt")

    def _ar_done(self, job: ARJob, res, error: str | None) -> None:  # on an AR thread
        rid, t = job.request_id, job.ticket
        with self._cond:
            req, steps, guidance, ar, _ = self._live[rid]
            cancelled = rid in self._cancelled
        if error is not None or cancelled:
            if res is not None:
                ar.release(t)
            status = "cancelled" if (cancelled or error == "cancelled") else "error"
            return self._deliver(GenerationOutput(request_id=rid, status=status, error=error or "cancelled"))
        try:
            with self._cond:
                intake, planner = self._layouts.pop(rid)
            if intake.sizes:  # size=auto: the DiT draws the bucket the AR stage chose
                if res.chosen is None:
                    raise LayoutError("size: the AR stage drew no size for this size=auto request")
                h, w = planner.chosen_size(intake, res.chosen)
                req = msgspec.structs.replace(req, height=h, width=w)
            layout, revised = planner.dit_layout(intake, req, guidance, res.token_ids, res.generated_ids)
            # every row imports the AR's K/V as far as its tokens agree with the AR's; the DiT computes the rest
            imports = planner.imports(layout, res.token_ids, self.graph.dit.engine.block_size,
                                      exact=not planner.rewrites)
        except Exception as e:
            ar.release(t)
            return self._deliver(GenerationOutput(request_id=rid, status="error", error=f"{type(e).__name__}: {e}"))
        alive = [d for d in self.dit if not d.dead]
        if not alive:
            ar.release(t)
            return self._deliver(GenerationOutput(request_id=rid, status="error", error="no live DiT replica"))
        dit = alive[next(self._rr_dit) % len(alive)]
        with self._cond:
            self._live[rid] = (req, steps, guidance, ar, dit)
            if revised is not None:
                self._revised[rid] = revised
            if intake.sizes:
                self._auto_sizes[rid] = f"{req.width}x{req.height}"
            self._ar_stats[rid] = res.stats
        params = SamplingParams(steps=steps, guidance=guidance, seed=req.seed)
        dit.submit(DiTJob(rid, t, layout, params, imports, self._dit_done, self._abort_source, self._send,
                          arrival=time.monotonic(), request=req))
        if cancelled or rid in self._cancelled:
            dit.cancel(rid)

    def _abort_source(self, ticket: TransferTicket) -> None:
        if ticket.source is not None:
            self.ar[ticket.source.replica].release(ticket)

    def _send(self, ticket: TransferTicket) -> None:
        ar = self.ar[ticket.source.replica]  # the replica bound to the ticket produced the KV
        ar.producer.dispatch(ticket, on_done=ar.release)

    def _dit_done(self, job: DiTJob, out: GenerationOutput) -> None:
        self._deliver(out)

    def _deliver(self, out: GenerationOutput) -> None:
        with self._cond:
            self._live.pop(out.request_id, None)
            self._layouts.pop(out.request_id, None)
            self._cancelled.discard(out.request_id)
            revised = self._revised.pop(out.request_id, None)
            if revised is not None and out.ok:
                out.revised_prompt = revised
            auto = self._auto_sizes.pop(out.request_id, None)
            if auto is not None and out.ok and out.stats is not None:
                out.stats.auto_size = auto
            for k, v in self._ar_stats.pop(out.request_id, {}).items():  # the AR stage's, as a single engine's
                if out.stats is not None and hasattr(out.stats, k):
                    setattr(out.stats, k, type(getattr(out.stats, k))(v))
            if self._on_output is None:
                self._outputs[out.request_id] = out
                self._cond.notify_all()
        if self._on_output is not None:
            self._on_output(out)

    # ---- control ------------------------------------------------------------------------
    def cancel(self, request_id: str) -> bool:
        with self._cond:
            live = self._live.get(request_id)
            if live is None:
                return False
            self._cancelled.add(request_id)
        _, _, _, ar, dit = live
        ar.cancel(request_id)
        if dit is not None:
            dit.cancel(request_id)
        return True

    def step(self) -> None:
        """Drive every replica once on this thread (when not `start()`ed)."""
        for r in self.ar + self.dit:
            with on_replica_device(r):
                r.step()

    def start(self) -> "Orchestrator":
        for r in self.ar + self.dit:
            th = threading.Thread(target=self._loop, args=(r,), daemon=True,
                                  name=f"{type(r).__name__}-{r.index}")
            th.start()
            self._threads.append(th)
        return self

    def _loop(self, replica) -> None:
        dev = replica_device(replica)
        if dev.type == "cuda":  # kernels that launch on the current device (Triton) must see ours
            torch.cuda.set_device(dev)
        while not self._stop.is_set():
            try:
                replica.step(block_s=replica.wait_hint())
            except Exception:  # keep serving; the failing request already got its error
                log.exception("replica loop error")

    def take(self, request_id: str, timeout: float | None = None) -> GenerationOutput:
        """Wait for a request's output (driving `step()` when no threads run)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                if request_id in self._outputs:
                    return self._outputs.pop(request_id)
                if self._threads:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"request {request_id!r} did not finish in {timeout}s")
                    self._cond.wait(0.05 if left is None else min(left, 0.05))
                    continue
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"request {request_id!r} did not finish in {timeout}s")
            self.step()

    def generate(self, req: GenerationRequest, timeout: float | None = None) -> GenerationOutput:
        return self.take(self.submit(req), timeout)

    def run(self, requests: list[GenerationRequest], concurrency: int = 8) -> list[GenerationOutput]:
        """Keep `concurrency` requests in flight until all are done; outputs in input order."""
        pending, order, outs = list(requests), [], {}
        inflight: list[str] = []
        while pending or inflight:
            while pending and len(inflight) < concurrency:
                rid = self.submit(pending.pop(0))
                order.append(rid)
                inflight.append(rid)
            done = self._wait_any(inflight)
            outs[done.request_id] = done
            inflight.remove(done.request_id)
        return [outs[r] for r in order]

    def _wait_any(self, rids: list[str]) -> GenerationOutput:
        while True:
            with self._cond:
                for r in rids:
                    if r in self._outputs:
                        return self._outputs.pop(r)
                if self._threads:
                    self._cond.wait(0.05)
                    continue
            self.step()

    # ---- observability ------------------------------------------------------------------
    def stats(self) -> dict:
        """Per-stage gauges (summed over replicas) and the transfer counters; never blocks on a
        replica thread (the numbers are plain reads of ints)."""
        ar, dit = _sum_stats(a.stats() for a in self.ar), _sum_stats(d.stats() for d in self.dit)
        out = {"waiting": ar["waiting"] + dit["waiting"] + dit["waiting_for_kv"],
               "running": ar["running"] + dit["running"], "stages": {"ar": ar, "dit": dit},
               "transfers": self.transfers.snapshot()}
        sizes: dict[int, int] = {}  # the DiT stage's steps per batch size: /metrics histogram
        for d in self.dit:
            for n, count in d.batch_sizes.items():
                sizes[n] = sizes.get(n, 0) + count
        out["batch_sizes"] = sizes
        return out

    # ---- teardown -----------------------------------------------------------------------
    def pools_full(self) -> bool:
        return all(d.pool_full() for d in self.dit) and all(
            a.blocks.num_free == a.blocks.num_blocks for a in self.ar)

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        for th in self._threads:
            th.join(timeout=10)
        for d in self.dit:
            d.close()
        for a in self.ar:
            a.close()
        with self._cond:
            left = list(self._live)
        for rid in left:
            self._deliver(GenerationOutput(request_id=rid, status="cancelled", error="shutdown"))


def _sum_stats(snapshots) -> dict:
    """Add up replica snapshots key by key (bools count replicas, e.g. `dead`)."""
    total: dict = {"replicas": 0}
    for s in snapshots:
        total["replicas"] += 1
        for k, v in s.items():
            total[k] = total.get(k, 0) + int(v)
    return total
