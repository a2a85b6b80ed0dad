"""`ditkv serve`: an OpenAI-compatible image generation server (FastAPI + uvicorn).

Endpoints: POST /v1/images/generations, POST /v1/images/edits and POST /v1/chat/completions (input
images; `image_routes.py`), GET /health, GET /v1/models, GET /v1/models/{model}, GET /metrics. The
backend is an `AsyncEngine` (one DiT engine) or, for a stage file (`stages:`), an
`AsyncOrchestrator` (the AR -> DiT graph); both fit `ditkv.engine.backend.ServingBackend`.
Every malformed field gets a 400 naming the field (OpenAI error shape); the engine only sees
requests that passed validation, and its own `DitkvError`s (prompt too long, can never fit)
map to 400 too, with `param` from the error's `field`. Body size and read-time limits:
`http_limits.py`; what /openapi.json documents: `openapi.py`; the sizes a model makes: `sizes.py`;
the socket, bound before the model loads: `listen.py`. See docs/serving.md.

(No `from __future__ import annotations` here: FastAPI must see the real request class, which
is built per app inside `create_app` so that the OpenAPI schema carries this server's limits.)
"""

import argparse
import asyncio
import base64
import contextlib
import io
import logging
import math
import random
import time
from dataclasses import dataclass

from ..config import is_stage_file
from .engine_args import add_engine_arguments, config_from_args
from ..engine.request_check import (MAX_INPUT_IMAGE_BYTES, MAX_INPUT_IMAGE_PIXELS, MAX_INPUT_IMAGES,  # noqa: F401
                                    MAX_PROMPT_CHARS, MAX_SEED)  # the server accepts what the engine does
from ..stages.graph import stage_graph_from_args
from .http_limits import DEFAULT_BODY_TIMEOUT, MAX_BODY_BYTES
from .http_validation import (SIZE_PATTERN, _check_request, _describe_engine_error,  # noqa: F401 (tests)
                              _describe_validation_error, _parse_size)

log = logging.getLogger("ditkv.serve")


@dataclass
class ServeLimits:
    max_n: int = 4
    max_image_size: int = 2048  # pixels per side
    max_queue: int = 256  # queued + running images before 429
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish on shutdown
    body_timeout: float = DEFAULT_BODY_TIMEOUT  # seconds from a request's headers to the end of its body
    max_input_images: int = 4  # input images per edit / chat request (the model's max_input_images bounds it too)
    max_input_image_bytes: int = MAX_INPUT_IMAGE_BYTES  # per encoded image file
    max_input_image_pixels: int = MAX_INPUT_IMAGE_PIXELS  # per decoded image


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI images API over HTTP",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 = all interfaces)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="model id in /v1/models (default: --model)")
    p.add_argument("--max-n", type=int, default=ServeLimits.max_n, help="largest accepted 'n'")
    p.add_argument("--max-image-size", type=int, default=ServeLimits.max_image_size,
                   help="largest accepted width or height in pixels")
    p.add_argument("--max-queue", type=int, default=ServeLimits.max_queue,
                   help="images queued or running before new requests get 429")
    p.add_argument("--shutdown-timeout", type=float, default=ServeLimits.shutdown_timeout,
                   help="seconds in-flight requests may run after SIGINT/SIGTERM before they are cancelled")
    p.add_argument("--body-timeout", type=float, default=ServeLimits.body_timeout,
                   help="seconds a client may take to send a request body after its headers (else 408)")
    p.add_argument("--max-input-images", type=int, default=ServeLimits.max_input_images,
                   help=f"input images per /v1/images/edits or chat request (at most {MAX_INPUT_IMAGES}; the model's "
                        "max_input_images bounds it too)")
    p.add_argument("--max-input-image-bytes", type=int, default=ServeLimits.max_input_image_bytes,
                   help="largest accepted input image file, in bytes (413 above)")
    p.add_argument("--max-input-image-pixels", type=int, default=ServeLimits.max_input_image_pixels,
                   help=f"largest accepted input image, width x height (at most {MAX_INPUT_IMAGE_PIXELS})")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_arguments(p)
    p.set_defaults(func=run)


# ---- app -------------------------------------------------------------------------------------
def create_app(engine, limits: ServeLimits | None = None, model_name: str = "tiny"):
    """The FastAPI app around a started serving backend (`AsyncEngine` or `AsyncOrchestrator`;
    the app shuts it down on exit)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from pydantic import BaseModel, ConfigDict, Field, field_validator
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from ..engine.backend import EngineClosedError
    from ..engine.types import GenerationRequest
    from ..errors import DitkvError, UnavailableError
    from . import image_routes, openapi
    from .http_limits import BodyLimit, client_gone
    from .metrics import ServerMetrics
    from .sizes import size_rule

    limits = limits or ServeLimits()
    rule = size_rule(engine)  # the sizes the model makes: the schema's pattern and the server's check

    class ImageGenerationRequest(BaseModel):
        """OpenAI `images.generate` fields that apply, plus the engine's sampling extras."""

        # strict: "3" is not a number, 2.5 is not an integer; unknown fields are errors (typos)
        model_config = ConfigDict(extra="forbid", strict=True)
        prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
        # the enums document the one accepted value; others get a 400 (404 for model) with a hint
        model: str | None = Field(None, description=f"'{model_name}' or omitted",
                                  json_schema_extra={"enum": [model_name, None]})
        n: int = Field(1, ge=1, le=limits.max_n, description="images to generate (seeds seed, seed+1, ...)")
        size: str | None = Field(None, pattern=rule.pattern(), description=rule.hint())
        response_format: str = Field("b64_json", description="only 'b64_json' ('url' is refused)",
                                     json_schema_extra={"enum": ["b64_json"]})
        output_format: str | None = Field(None, description="only 'png'", json_schema_extra={"enum": ["png", None]})
        user: str | None = Field(None, max_length=256)
        steps: int | None = Field(None, ge=1, le=engine.config.max_steps,
                                  description="default: the model's; the largest is the engine's max_steps")
        guidance_scale: float | None = Field(None, ge=0, allow_inf_nan=False,
                                             description="CFG scale; <= 1 disables CFG. Default: the model's")
        seed: int | None = Field(None, ge=0, le=MAX_SEED,
                                 description="default: random; image i uses seed + i, so seed + n - 1 <= 2^63-1")
        negative_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)

        @field_validator("n", "steps", "seed", mode="before")
        @classmethod
        def _integral(cls, v):  # JSON Schema counts 3.0 as an integer, so the server does too (not 2.5)
            return int(v) if isinstance(v, float) and v.is_integer() else v

        @field_validator("prompt", "negative_prompt", "user")
        @classmethod
        def _utf8(cls, v):
            if v is not None:
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:  # lone surrogates from "\ud800"-style JSON escapes
                    raise ValueError("must be valid Unicode text (no lone surrogates)") from None
            return v

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        final = await asyncio.to_thread(engine.shutdown)  # cancel leftovers, free every block
        if "num_blocks" in final:
            log.info("engine stopped; KV pool: %d/%d blocks free", final["free_blocks"], final["num_blocks"])
        for stage, st in (final.get("stages") or {}).items():
            if "kv_num_blocks" in st:
                log.info("%s stage stopped; KV pool: %d/%d blocks free", stage, st["kv_free_blocks"],
                         st["kv_num_blocks"])

    app = FastAPI(title="ditkv", version="0.1.0", summary="Image generation with a paged diffusion KV cache",
                  lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES, timeout=limits.body_timeout,
                       routes=image_routes.body_limits(limits))
    metrics = ServerMetrics(engine.stats, getattr(engine, "transfers", None))
    staged = "graph" in engine.info  # a stage graph: responses also carry imported_tokens
    state = {"draining": False, "started": int(time.time())}
    app.state.engine, app.state.metrics, app.state.limits = engine, metrics, limits

    def error(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
              code: str | None = None, headers: dict | None = None):
        return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                            status_code=status, headers=headers)

    def disconnected(when: str):
        log.info("client disconnected %s", when)
        metrics.requests.labels("disconnected").inc()
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    body_models = {"/v1/images/generations": (ImageGenerationRequest, "prompt")}  # image_routes adds its own

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        metrics.requests.labels("invalid").inc()
        model, required = body_models.get(request.url.path, (ImageGenerationRequest, "prompt"))
        param, message = _describe_validation_error(exc.errors(), model, required, rule.hint())
        return error(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        status, headers, param = exc.status_code, getattr(exc, "headers", None), None  # 405 carries Allow
        message = str(exc.detail)
        if status == 405 and headers and "Allow" in headers:
            message = f"method {request.method} not allowed on {request.url.path}; allowed: {headers['Allow']}"
        elif status == 400 and client_gone(exc):  # FastAPI's 400 for a client that left mid-body
            return disconnected("while sending its body")
        elif status == 400:  # FastAPI could not read the body (e.g. not UTF-8): the JSON decoder never ran
            metrics.requests.labels("invalid").inc()
            required = body_models.get(request.url.path, (None, "prompt"))[1]
            param, message = "body", f"body: {message}; send a UTF-8 JSON object with at least a '{required}' field"
        return error(status, message, param, type_="not_found" if status == 404 else "invalid_request_error",
                     headers=headers)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):  # a bug: say so, keep serving
        log.exception("unhandled error on %s", request.url.path)
        return error(500, f"internal error: {type(exc).__name__}", type_="server_error")

    @app.post("/v1/images/generations", summary="Generate images (OpenAI images.generate)",
              responses={200: {"model": openapi.ImagesResponse}, **openapi.errors(400, 404, 408, 413, 429, 500, 503)})
    async def generations(body: ImageGenerationRequest, request: Request):
        t0 = time.monotonic()
        bad = _check_request(body, limits, model_name)
        if bad is not None:
            metrics.requests.labels("invalid").inc()
            return error(bad[0], bad[2], bad[1])
        dims = {}
        if body.size:  # omitted: the engine's default size
            dims["width"], dims["height"] = _parse_size(body.size)
        seed = random.randrange(1 << 31) if body.seed is None else body.seed
        reqs = [GenerationRequest(prompt=body.prompt, **dims, steps=body.steps,
                                  guidance_scale=body.guidance_scale, seed=seed + i,  # <= MAX_SEED: checked
                                  negative_prompt=body.negative_prompt) for i in range(body.n)]
        done = await serve_and_encode(reqs, request, t0)
        if not isinstance(done, tuple):
            return done  # the error answer
        outs, pngs = done
        height, width = outs[0].image.shape[:2]  # a release model snaps sizes to its buckets
        return {
            "created": int(time.time()),
            "size": f"{width}x{height}",
            "data": [{"b64_json": b, "revised_prompt": o.revised_prompt} for b, o in zip(pngs, outs)],
            "ditkv": image_info(outs, reqs),
        }

    async def serve_requests(reqs, request: Request, size_note: str | None = None):
        """Run validated requests: refuse when dead, draining or full, await the images (aborting
        them if the client goes away) and map failures. The outputs, or the error response to send.
        `size_note`: where the size came from, for the engine's errors about it (size=auto)."""
        s = engine.stats()
        if not s.get("alive", True):  # a stage failed closed: nothing could finish
            metrics.requests.labels("rejected").inc()
            return error(503, "the engine failed closed (every replica of a stage is dead, see GET /health and "
                         "the server log); retry on another replica", type_="server_error")
        if state["draining"] or not engine.accepting:
            metrics.requests.labels("rejected").inc()
            return error(503, "server is shutting down; retry on another replica", type_="server_error")
        if s.get("in_flight", 0) + len(reqs) > limits.max_queue:
            metrics.requests.labels("rejected").inc()
            return error(429, f"server busy: {s['in_flight']} images in flight (max_queue={limits.max_queue}); "
                         "retry later", type_="rate_limit_error")
        try:
            outs = await _run_until_disconnect(engine, reqs, request)
        except DisconnectedError:
            return disconnected(f"before its answer; aborted {len(reqs)} request(s)")
        except (EngineClosedError, UnavailableError) as e:  # not the client's fault: retry elsewhere
            metrics.requests.labels("rejected").inc()
            return error(503, str(e), type_="server_error")
        except DitkvError as e:  # the engine's verdict on the request: a client error
            metrics.requests.labels("invalid").inc()
            param, message = _describe_engine_error(e, size_note)
            return error(400, message, param)
        failed = [o for o in outs if not o.ok]
        if failed:
            cancelled = all(o.status == "cancelled" for o in failed)
            metrics.requests.labels("cancelled" if cancelled else "error").inc()
            if cancelled:
                return error(503, f"request cancelled: {failed[0].error or 'server shutting down'}",
                             type_="server_error")
            return error(500, f"generation failed: {failed[0].error}", type_="server_error")
        return outs

    async def serve_and_encode(reqs, request: Request, t0: float, size_note: str | None = None):
        """`serve_requests`, then the images as base64 PNGs (off the event loop) and the success
        counted: (outputs, pngs), or the error response to send."""
        outs = await serve_requests(reqs, request, size_note)
        if not isinstance(outs, list):
            return outs
        pngs = await asyncio.to_thread(lambda: [_png_b64(o.image) for o in outs])
        finish(outs, t0)
        return outs, pngs

    def finish(outs, t0: float) -> None:
        """Count a successful request (after its images were encoded)."""
        for o in outs:
            metrics.queue_time.observe(o.stats.queue_time_s)
            metrics.run_time.observe(o.stats.run_time_s)
        metrics.images.inc(len(outs))
        metrics.requests.labels("ok").inc()
        metrics.latency.observe(time.monotonic() - t0)

    def image_info(outs, reqs) -> list[dict]:
        """The per-image `ditkv` entries of a response."""
        return [{"request_id": o.request_id, "seed": r.seed, "steps": o.stats.steps,
                 "queue_time_s": o.stats.queue_time_s, "run_time_s": o.stats.run_time_s,
                 "kv_blocks": o.stats.blocks, "prefix_tokens_reused": o.stats.prefix_tokens_reused,
                 **({"imported_tokens": o.stats.imported_tokens} if staged else {})}
                for o, r in zip(outs, reqs)]

    image_routes.install(app, image_routes.Context(
        limits=limits, model_name=model_name, max_steps=engine.config.max_steps, error=error,
        serve=serve_and_encode, image_info=image_info, disconnected=disconnected,
        check=lambda body: _check_request(body, limits, model_name), metrics=metrics, body_models=body_models,
        rule=rule))
    openapi.install(app, exact=(ImageGenerationRequest,))

    @app.get("/health", summary="Health, queue and KV pool state", responses={
        200: {"model": openapi.Health},
        503: {"model": openapi.Health, "description": "draining (shutting down) or dead (the engine failed closed)"},
        **openapi.errors(500)})
    async def health():
        s = engine.stats()
        status = "draining" if state["draining"] or not s.get("accepting") else "ok"
        if not s.get("alive"):
            status = "dead"
        body = {"status": status, "model": model_name, **engine.info,
                "waiting": s.get("waiting", 0), "running": s.get("running", 0), "in_flight": s.get("in_flight", 0)}
        for key in ("num_blocks", "used_blocks", "free_blocks"):
            if key in s:
                body[f"kv_{key}"] = s[key]
        for key in ("pools_full", "stages", "transfers", "remote_ar"):  # stage graphs: per-stage pools, transfer totals
            if key in s:
                body[key] = s[key]
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    card = {"id": model_name, "object": "model", "created": state["started"], "owned_by": "ditkv"}

    @app.get("/v1/models", summary="List models", response_model=openapi.ModelList,
             responses=openapi.errors(500))
    async def models():
        return {"object": "list", "data": [card]}

    # :path so that a served name with a slash ("org/model") can be retrieved too
    @app.get("/v1/models/{model:path}", summary="Retrieve a model", response_model=openapi.Model,
             responses=openapi.errors(404, 500))
    async def model_card(model: str):
        if model != model_name:
            return error(404, f"model: the model {model!r} does not exist; this server serves {model_name!r}",
                         "model", code="model_not_found")
        return card

    class MetricsResponse(Response):
        media_type = openapi.METRICS_MEDIA_TYPE  # documents the content type in /openapi.json

    @app.get("/metrics", summary="Prometheus metrics", response_class=MetricsResponse, responses={
        200: {"description": "Prometheus text exposition format 0.0.4"}, **openapi.errors(500)})
    async def prometheus():
        data, ctype = metrics.render()
        return MetricsResponse(data, media_type=ctype)

    async def drain(timeout: float):
        """Shutdown step 1 (before uvicorn waits for open requests): refuse new work, let in-flight
        requests finish for `timeout` s, then cancel them so their handlers answer 503."""
        state["draining"] = True
        engine.stop_accepting()
        deadline = time.monotonic() + timeout
        while engine.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if engine.num_in_flight:
            log.warning("cancelling %d in-flight request(s) after %.1fs", engine.num_in_flight, timeout)
            engine.abort_all()

    app.state.drain = drain
    return app


class DisconnectedError(Exception):
    pass


async def _run_until_disconnect(engine, reqs, request):
    """Await all images; if the client goes away first, cancel them (=> engine aborts, blocks free)."""
    tasks = [asyncio.ensure_future(engine.add(r)) for r in reqs]
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


# ---- PNG ---------------------------------------------------------------------------------------
def _png_b64(image) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


# ---- CLI ---------------------------------------------------------------------------------------
def _limits_from_args(a) -> ServeLimits:
    for flag, v in (("--max-n", a.max_n), ("--max-image-size", a.max_image_size),
                    ("--max-queue", a.max_queue)):
        if v < 1:
            raise SystemExit(f"ditkv serve: error: {flag}={v} must be >= 1")
    if not (math.isfinite(a.shutdown_timeout) and a.shutdown_timeout >= 0):
        raise SystemExit(f"ditkv serve: error: --shutdown-timeout={a.shutdown_timeout} must be >= 0")
    if not (math.isfinite(a.body_timeout) and a.body_timeout > 0):
        raise SystemExit(f"ditkv serve: error: --body-timeout={a.body_timeout} must be > 0 seconds")
    if not 0 <= a.port <= 65535:
        raise SystemExit(f"ditkv serve: error: --port={a.port} must be in 0..65535")
    for flag, v, top, why in (("--max-input-images", a.max_input_images, MAX_INPUT_IMAGES, "the engine's cap"),
                              ("--max-input-image-bytes", a.max_input_image_bytes, 1 << 30, "1 GiB"),
                              ("--max-input-image-pixels", a.max_input_image_pixels, MAX_INPUT_IMAGE_PIXELS,
                               "the engine's cap")):
        if not 1 <= v <= top:
            raise SystemExit(f"ditkv serve: error: {flag}={v} must be in 1..{top} ({why})")
    return ServeLimits(a.max_n, a.max_image_size, a.max_queue, a.shutdown_timeout, a.body_timeout,
                       a.max_input_images, a.max_input_image_bytes, a.max_input_image_pixels)


def _start_backend(a):
    """A stage file (`stages:`) -> the AR -> DiT graph behind the orchestrator; else one engine."""
    if a.config and is_stage_file(a.config):
        from ..stages.async_orchestrator import AsyncOrchestrator

        return AsyncOrchestrator(stage_graph_from_args(a, "ditkv serve"))
    from ..engine.async_engine import AsyncEngine

    # serve defaults to the headline mode: scheduler-managed paged KV, two CFG rows per request
    return AsyncEngine(config_from_args(a, diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2))


def run(a) -> None:
    limits = _limits_from_args(a)
    try:
        import uvicorn  # noqa: F401 (listen.run_server serves with it; checked before anything starts)
    except ImportError as e:
        raise SystemExit(f"ditkv serve: error: {e}; install the server extra: pip install 'ditkv[serve]'") from None
    from .listen import bind_sockets, run_server

    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sockets = bind_sockets(a.host, a.port)  # a bad --host or a taken --port fails before the model loads
    try:
        engine = _start_backend(a)
    except BaseException:  # let go of the port now, not at exit
        for sock in sockets:
            sock.close()
        raise
    try:
        name = a.served_model_name or str(engine.config.model).rstrip("/").split("/")[-1]
        app = create_app(engine, limits, name)
        log.info("engine ready: model=%s %s %s", name, " ".join(f"{k}={v}" for k, v in engine.info.items()),
                 engine.stats())
        run_server(app, sockets, host=a.host, port=a.port, log_level=a.log_level,
                   shutdown_timeout=limits.shutdown_timeout)
    finally:
        engine.shutdown()  # idempotent; covers a failed startup where lifespan shutdown never ran
