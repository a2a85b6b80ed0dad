"""What every route family of `ditkv serve` shares: one typed `ApiContext` per app (the serving
service, the server's limits, the served model's name and size rule, the metrics, the drain
state), and on it the serving path each image route runs through: refuse when dead, draining or
full, await the images (aborting them if the client goes away), map failures to OpenAI-shaped
errors, encode the PNGs off the event loop and count the outcome.

The routers (`routes_generations.py`, `routes_edits.py`, `routes_chat.py`, `routes_ops.py`) are
each built from the context; `serve.create_app` assembles them.
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..engine.service import EngineClosedError
from ..errors import DitkvError, UnavailableError
from .http_limits import ServeLimits
from .http_validation import _check_request, _describe_engine_error
from .metrics import ServerMetrics
from .sizes import SizeRule, size_rule
from .text_fields import bot_tasks_of

if TYPE_CHECKING:
    from ..engine.service import Service
    from ..engine.types import GenerationOutput, GenerationRequest

log = logging.getLogger("ditkv.serve")


@dataclass
class ApiContext:
    """One app's shared state; the routers read it, only `drain` changes it."""

    service: Service  # AsyncEngine or AsyncOrchestrator (started; the app shuts it down on exit)
    limits: ServeLimits
    model_name: str  # the id in /v1/models and the only accepted `model`
    metrics: ServerMetrics
    rule: SizeRule  # the sizes the model makes, within --max-image-size: the schemas' patterns and the checks
    max_steps: int  # the engine's max_steps: the schemas' bound on steps
    staged: bool  # a stage graph: responses also carry imported_tokens
    bot_tasks: tuple[str, ...]  # the served model's prompt-template tasks: the schemas' `bot_task` enum
    started: int  # unix time the app was built (the model card's `created`)
    draining: bool = False  # set by `drain`: new requests get 503
    body_models: dict[str, tuple[type | None, str]] = field(default_factory=dict)  # path -> (model, required)
    schemas: dict[str, dict] = field(default_factory=dict)  # hand-written components (the edit form), by name

    @classmethod
    def create(cls, service, limits: ServeLimits, model_name: str) -> ApiContext:
        return cls(service=service, limits=limits, model_name=model_name,
                   metrics=ServerMetrics(service.stats, getattr(service, "transfers", None)),
                   rule=size_rule(service, limits.max_image_size), max_steps=service.config.max_steps,
                   staged="graph" in service.info, bot_tasks=bot_tasks_of(service), started=int(time.time()))

    # ---- answers ------------------------------------------------------------------------------
    @staticmethod
    def error(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
              code: str | None = None, headers: dict | None = None) -> JSONResponse:
        """An error in OpenAI's shape."""
        return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                            status_code=status, headers=headers)

    def refused(self, status: int, param: str, message: str) -> JSONResponse:
        """A client error, counted as invalid."""
        self.metrics.requests.labels("invalid").inc()
        return self.error(status, message, param)

    def disconnected(self, when: str) -> Response:
        log.info("client disconnected %s", when)
        self.metrics.requests.labels("disconnected").inc()
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    def check(self, body):
        """The checks the schema cannot express (`http_validation._check_request`) against this
        server's limits and model: (status, param, message) or None."""
        return _check_request(body, self.limits, self.model_name)

    def image_info(self, outs: list[GenerationOutput], reqs: list[GenerationRequest]) -> list[dict]:
        """The per-image `ditkv` entries of a response."""
        return [{"request_id": o.request_id, "seed": r.seed, "steps": o.stats.steps,
                 "queue_time_s": o.stats.queue_time_s, "run_time_s": o.stats.run_time_s,
                 "kv_blocks": o.stats.blocks, "prefix_tokens_reused": o.stats.prefix_tokens_reused,
                 **({"computed_steps": o.stats.computed_steps, "cached_steps": o.stats.cached_steps}
                    if o.stats.cached_steps else {}),
                 **({"imported_tokens": o.stats.imported_tokens} if self.staged else {}),
                 # prefix tokens taken from the prefix cache (docs/prefix-cache.md), when there were any
                 **({"prefix_cache_hit_tokens": o.stats.prefix_cache_hit_tokens}
                    if o.stats.prefix_cache_hit_tokens else {}),
                 **({"encoder_cache_hits": o.stats.encoder_cache_hits} if o.stats.encoder_cache_hits else {}),
                 **(_ar_info(o.stats) if o.stats.ar_prompt_tokens else {}),
                 # size=auto: the single engine's AR phase or a stage graph's AR stage chose it
                 **({"auto_size": o.stats.auto_size} if o.stats.auto_size is not None else {})}
                for o, r in zip(outs, reqs)]

    def images_response(self, outs, pngs: list[str], reqs) -> dict:
        """The body of an OpenAI images answer (generations and edits)."""
        height, width = outs[0].image.shape[:2]  # a release model snaps sizes to its buckets
        return {"created": int(time.time()), "size": f"{width}x{height}",
                "data": [{"b64_json": b, "revised_prompt": o.revised_prompt} for b, o in zip(pngs, outs)],
                "ditkv": self.image_info(outs, reqs)}

    # ---- serving ------------------------------------------------------------------------------
    async def serve(self, reqs, request: Request, t0: float, size_note: str | None = None):
        """`serve_requests`, then the images as base64 PNGs (off the event loop) and the success
        counted: (outputs, pngs), or the error response to send."""
        outs = await self.serve_requests(reqs, request, size_note)
        if not isinstance(outs, list):
            return outs
        pngs = await asyncio.to_thread(lambda: [png_b64(o.image) for o in outs])
        self._finish(outs, t0)
        return outs, pngs

    async def serve_requests(self, reqs, request: Request, size_note: str | None = None):
        """Run validated requests: refuse when dead, draining or full, await the images (aborting
        them if the client goes away) and map failures. The outputs, or the error response to send.
        `size_note`: where the size came from, for the engine's errors about it (size=auto)."""
        refusal = self._admission(len(reqs))
        if refusal is not None:
            self.metrics.requests.labels("rejected").inc()
            return refusal
        try:
            outs = await run_until_disconnect(self.service, reqs, request)
        except DisconnectedError:
            return self.disconnected(f"before its answer; aborted {len(reqs)} request(s)")
        except (EngineClosedError, UnavailableError) as e:  # not the client's fault: retry elsewhere
            self.metrics.requests.labels("rejected").inc()
            return self.error(503, str(e), type_="server_error")
        except DitkvError as e:  # the engine's verdict on the request: a client error
            param, message = _describe_engine_error(e, size_note)
            return self.refused(400, param, message)
        failed = [o for o in outs if not o.ok]
        if failed:
            cancelled = all(o.status == "cancelled" for o in failed)
            self.metrics.requests.labels("cancelled" if cancelled else "error").inc()
            if cancelled:
                return self.error(503, f"request cancelled: {failed[0].error or 'server shutting down'}",
                                  type_="server_error")
            return self.error(500, f"generation failed: {failed[0].error}", type_="server_error")
        return outs

    def _admission(self, n: int) -> JSONResponse | None:
        """The 503 (dead, draining) or 429 (full) for `n` more images, or None to go ahead."""
        s = self.service.stats()
        if not s.get("alive", True):  # a stage failed closed: nothing could finish
            return self.error(503, "the engine failed closed (every replica of a stage is dead, see GET /health "
                              "and the server log); retry on another replica", type_="server_error")
        if self.draining or not self.service.accepting:
            return self.error(503, "server is shutting down; retry on another replica", type_="server_error")
        if s.get("in_flight", 0) + n > self.limits.max_queue:
            return self.error(429, f"server busy: {s['in_flight']} images in flight (max_queue="
                              f"{self.limits.max_queue}); retry later", type_="rate_limit_error")
        return None

    def _finish(self, outs, t0: float) -> None:
        """Count a successful request (after its images were encoded)."""
        m = self.metrics
        for o in outs:
            m.queue_time.observe(o.stats.queue_time_s)
            m.run_time.observe(o.stats.run_time_s)
            m.cached_steps.inc(o.stats.cached_steps)
            if o.stats.steps:
                m.cache_ratio.observe(o.stats.cached_steps / o.stats.steps)
        m.images.inc(len(outs))
        m.requests.labels("ok").inc()
        m.latency.observe(time.monotonic() - t0)

    async def drain(self, timeout: float) -> None:
        """Shutdown step 1 (before uvicorn waits for open requests): refuse new work, let in-flight
        requests finish for `timeout` s, then cancel them so their handlers answer 503."""
        self.draining = True
        service = self.service
        service.stop_accepting()
        deadline = time.monotonic() + timeout
        while service.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if service.num_in_flight:
            log.warning("cancelling %d in-flight request(s) after %.1fs", service.num_in_flight, timeout)
            service.abort_all()


class DisconnectedError(Exception):
    pass


async def run_until_disconnect(service, reqs, request):
    """Await all images; if the client goes away first, cancel them (=> engine aborts, blocks free)."""
    tasks = [asyncio.ensure_future(service.add(r)) for r in reqs]
    gathered = asyncio.gather(*tasks)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({gathered, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if gathered in done:
            return gathered.result()
        raise DisconnectedError()
    finally:  # runs on error, disconnect and on our own cancellation (server shutdown timeout)
        watcher.cancel()
        for t in tasks:
            t.cancel()
        if not gathered.done():
            gathered.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if gathered.done() and not gathered.cancelled():
            gathered.exception()  # mark retrieved: no "exception never retrieved" warnings


async def _wait_disconnect(request) -> None:
    # the body is already read, so the next ASGI message is the disconnect
    while (await request.receive())["type"] != "http.disconnect":
        pass


def png_b64(image) -> str:
    """An RGB uint8 image as a base64 PNG."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _ar_info(s) -> dict:
    """The AR phase of a single engine's request (a stage graph reports it per stage)."""
    return {"ar_generated_tokens": s.ar_generated_tokens, "ar_seconds": s.ar_seconds,
            "ar_time_to_first_token_s": s.ar_time_to_first_token_s}
