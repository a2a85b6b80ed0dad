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
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import replace

from ..errors import DitkvError
from ..models.hunyuan.layout import build_request_layout
from ..models.loader import load_model, resolve_device, resolve_dtype
from ..transfer.ar_side import ARJob, ARReplica
from ..transfer.dit_side import DiTJob, DiTReplica
from ..transfer.ticket import TransferTicket
from ..worker.ar_runner import image_tail_ids
from ..worker.worker import resolve_steps_guidance
from .stages import StageGraph
from .types import GenerationOutput, GenerationRequest

log = logging.getLogger("ditkv.orchestrator")


class _FixedPrompt:
    """A tokenizer stand-in that encodes the layout's prompt as given ids (AR-generated text)."""

    def __init__(self, tokenizer, ids: list[int]):
        self.tokenizer, self.ids = tokenizer, ids

    def encode(self, text: str) -> list[int]:
        return list(self.ids) if text == "" else self.tokenizer.encode(text)


def shared_prefix(a, b) -> int:
    """Length of the common leading tokens of two rows (the uncond row imports only these)."""
    n = min(len(a), len(b))
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0]) if diff.numel() else n


def _replica_transfer(cfg, i: int, n: int):
    return cfg if n == 1 else replace(cfg, engine_id=f"{cfg.engine_id}-{i}")


class Orchestrator:
    def __init__(self, graph: StageGraph, model_bundle=None):
        self.graph = graph
        ar, dit = graph.ar, graph.dit
        device = resolve_device(dit.engine.device)
        dtype = resolve_dtype(dit.engine.dtype, device)
        if resolve_device(ar.engine.device) != device or resolve_dtype(ar.engine.dtype, device) != dtype:
            raise DitkvError("the in-process AR and DiT stages share one model copy: give both stages the "
                             "same engine.device and engine.dtype")
        bundle = model_bundle or load_model(dit.engine.model, device, dtype)
        self.model_config, self.tokenizer = bundle[0].config, bundle[1]
        self.ar = [ARReplica(i, ar.engine, _replica_transfer(ar.transfer, i, ar.replicas), bundle)
                   for i in range(ar.replicas)]
        geom = self.ar[0].producer.geometry
        self.dit = [DiTReplica(i, dit.engine, _replica_transfer(dit.transfer, i, dit.replicas), bundle,
                               max_waiting_for_kv=graph.max_inflight, source_geometry=geom)
                    for i in range(dit.replicas)]
        self._ids = itertools.count()
        self._rr_ar, self._rr_dit = itertools.count(), itertools.count()
        self._cond = threading.Condition()
        self._outputs: dict[str, GenerationOutput] = {}
        self._live: dict[str, tuple] = {}  # rid -> (request, steps, guidance, ar replica, dit replica | None)
        self._cancelled: set[str] = set()
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self.closed = False

    # ---- intake -------------------------------------------------------------------------
    def submit(self, req: GenerationRequest) -> str:
        """Validate and route to an AR replica. Raises a client-safe `DitkvError` on bad input."""
        if self.closed:
            raise DitkvError("the orchestrator is shut down")
        rid = req.request_id or f"req-{next(self._ids)}"
        cfg = self.model_config
        steps, guidance = resolve_steps_guidance(cfg, req.steps, req.guidance_scale)
        build_request_layout(cfg, self.tokenizer, req.prompt, req.height, req.width, guidance, req.negative_prompt)
        ar = self.ar[next(self._rr_ar) % len(self.ar)]
        with self._cond:
            if rid in self._live:
                raise DitkvError(f"request id {rid!r} is already live; use a unique id")
            self._live[rid] = (req, steps, guidance, ar, None)
        head = [cfg.bos_token_id] + [int(i) for i in self.tokenizer.encode(req.prompt)]
        spec = self.graph.ar
        ar.submit(ARJob(rid, TransferTicket(rid, self.graph.mode), head, image_tail_ids(cfg, req.height, req.width),
                        spec.max_new_tokens, spec.temperature, req.seed, self._ar_done))
        return rid

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
            prompt = "" if res.generated_ids else req.prompt
            tok = _FixedPrompt(self.tokenizer, res.token_ids[1:len(res.token_ids) - 3]) if res.generated_ids \
                else self.tokenizer
            layout = build_request_layout(self.model_config, tok, prompt, req.height, req.width, guidance,
                                          req.negative_prompt)
            cond = layout.rows[0]
            prefix = cond.token_ids[:cond.prefix_len]
            if res.token_ids != prefix.tolist():
                raise DitkvError("the AR prefix does not match the DiT layout's cond-row prefix")
            imports = [cond.prefix_len] + [shared_prefix(prefix, r.token_ids[:r.prefix_len]) for r in layout.rows[1:]]
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
        dit.submit(DiTJob(rid, t, layout, steps, guidance, req.seed, imports, self._dit_done, self._abort_source,
                          self._send, arrival=time.monotonic()))
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
            self._cancelled.discard(out.request_id)
            self._outputs[out.request_id] = out
            self._cond.notify_all()

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
            r.step()

    def start(self) -> "Orchestrator":
        for r in self.ar + self.dit:
            th = threading.Thread(target=self._loop, args=(r,), daemon=True,
                                  name=f"{type(r).__name__}-{r.index}")
            th.start()
            self._threads.append(th)
        return self

    def _loop(self, replica) -> None:
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
            for rid in list(self._live):
                self._outputs[rid] = GenerationOutput(request_id=rid, status="cancelled", error="shutdown")
            self._live.clear()
            self._cond.notify_all()
