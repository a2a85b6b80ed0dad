"""`ditkv serve`: an OpenAI-compatible image generation server (FastAPI + uvicorn).

`create_app` assembles one router per API family, each built from one typed `ApiContext`
(`api_context.py`: the service, limits, model name, size rule, metrics and the serving path they
share): POST /v1/images/generations (`routes_generations.py`), POST /v1/images/edits
(`routes_edits.py`), POST /v1/chat/completions (`routes_chat.py`), and GET /health, GET /v1/models,
GET /v1/models/{model}, GET /metrics (`routes_ops.py`), and unless `--no-playground` the page at GET /
(`routes_playground.py`, docs/playground.md). Every route turns its validated input into
engine requests through `request_builder.py` (the seed default included). The service is an
`AsyncEngine` (one DiT engine) or, for a stage file (`stages:`), an `AsyncOrchestrator` (the
AR -> DiT graph); both fit `ditkv.engine.service.Service`.
Every malformed field gets a 400 naming the field (OpenAI error shape); the engine only sees
requests that passed validation, and its own `DitkvError`s (prompt too long, can never fit)
map to 400 too, with `param` from the error's `field`. Body size and read-time limits:
`http_limits.py`; what /openapi.json documents: `openapi.py`; the sizes a model makes: `sizes.py`;
the socket, bound before the model loads: `listen.py`. See docs/serving.md.
"""

import argparse
import asyncio
import contextlib
import logging
import math

from ..config import is_stage_file
from ..engine.request_check import MAX_INPUT_IMAGE_PIXELS, MAX_INPUT_IMAGES  # the engine's
from ..stages.graph import stage_graph_from_args
from .engine_args import add_engine_arguments, config_from_args
from .http_limits import DEFAULT_BODY_TIMEOUT, MAX_BODY_BYTES, ServeLimits  # noqa: F401 - ServeLimits re-exported
from .http_validation import _describe_validation_error

log = logging.getLogger("ditkv.serve")


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI images API over HTTP",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 = all interfaces)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on (0 = any free port; the log "
                   "names the one bound)")
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
    p.add_argument("--no-playground", action="store_true",
                   help="serve no playground page at / (then / is a 404; docs/playground.md)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="least severe log messages shown (server, engine and uvicorn)")
    add_engine_arguments(p)
    p.set_defaults(func=run)


# ---- app -------------------------------------------------------------------------------------
def create_app(engine, limits: ServeLimits | None = None, model_name: str = "tiny", playground: bool = True):
    """The FastAPI app around a started service (`AsyncEngine` or `AsyncOrchestrator`;
    the app shuts it down on exit): one router per API family over one `ApiContext`, and the
    playground page at / unless `playground` is False."""
    from fastapi import FastAPI

    from . import openapi, routes_chat, routes_edits, routes_generations, routes_ops, routes_playground
    from .api_context import ApiContext
    from .http_limits import BodyLimit

    ctx = ApiContext.create(engine, limits or ServeLimits(), model_name)
    app = FastAPI(title="ditkv", version="0.1.0", summary="Image generation with a paged diffusion KV cache",
                  lifespan=_lifespan(engine))
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES, timeout=ctx.limits.body_timeout,
                       routes=body_limits(ctx.limits))
    for family in (routes_generations, routes_edits, routes_chat, routes_ops):  # this order in /openapi.json
        app.include_router(family.router(ctx))
    if playground:
        app.include_router(routes_playground.router(ctx))
    _install_error_handlers(app, ctx, default_body=ctx.body_models[routes_generations.PATH])
    openapi.install(app, exact=tuple(model for model, _ in ctx.body_models.values() if model is not None),
                    components=ctx.schemas)
    app.state.context = ctx
    app.state.engine, app.state.metrics, app.state.limits, app.state.drain = engine, ctx.metrics, ctx.limits, ctx.drain
    return app


def body_limits(limits: ServeLimits) -> dict[str, tuple[int, str]]:
    """Per-route body limits for `BodyLimit` on the image-input routes: room for every allowed
    image plus the other fields (base64 grows a chat body by 4/3)."""
    from .edit_form import EDITS
    from .routes_chat import CHAT

    n, b = limits.max_input_images, limits.max_input_image_bytes
    hint = f"at most {n} input image(s) of at most {b} bytes each (--max-input-images, --max-input-image-bytes)"
    return {EDITS: (n * b + MAX_BODY_BYTES, hint), CHAT: (n * (math.ceil(b / 3) * 4 + 64) + MAX_BODY_BYTES, hint)}


def _lifespan(engine):
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

    return lifespan


def _install_error_handlers(app, ctx, default_body: tuple) -> None:
    """Every error in OpenAI's shape: FastAPI's validation errors as 400s naming the field (the
    route's body model from `ctx.body_models`, else `default_body`), HTTP errors, and crashes."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from .http_limits import client_gone

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        model, required = ctx.body_models.get(request.url.path, default_body)
        param, message = _describe_validation_error(exc.errors(), model, required, ctx.rule.hint())
        return ctx.refused(400, param, message)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        status, headers, param = exc.status_code, getattr(exc, "headers", None), None  # 405 carries Allow
        message = str(exc.detail)
        if status == 405 and headers and "Allow" in headers:
            message = f"method {request.method} not allowed on {request.url.path}; allowed: {headers['Allow']}"
        elif status == 400 and client_gone(exc):  # FastAPI's 400 for a client that left mid-body
            return ctx.disconnected("while sending its body")
        elif status == 400:  # FastAPI could not read the body (e.g. not UTF-8): the JSON decoder never ran
            ctx.metrics.requests.labels("invalid").inc()
            required = ctx.body_models.get(request.url.path, default_body)[1]
            param, message = "body", f"body: {message}; send a UTF-8 JSON object with at least a '{required}' field"
        return ctx.error(status, message, param, type_="not_found" if status == 404 else "invalid_request_error",
                         headers=headers)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):  # a bug: say so, keep serving
        log.exception("unhandled error on %s", request.url.path)
        return ctx.error(500, f"internal error: {type(exc).__name__}", type_="server_error")


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

    return AsyncEngine(config_from_args(a))  # EngineConfig's defaults: paged_scheduler, 2 rows per request


def run(a) -> None:
    limits = _limits_from_args(a)
    try:
        import uvicorn  # noqa: F401 (listen.run_server serves with it; checked before anything starts)
    except ImportError as e:
        raise SystemExit(f"ditkv serve: error: {e}; install the server extra: pip install 'ditkv[serve]'") from None
    from .listen import bind_sockets, run_server
    from .quantize import graph_weights_label, weights_label

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
        app = create_app(engine, limits, name, playground=not a.no_playground)
        info = " ".join(f"{k}={v}" for k, v in engine.info.items())
        weights = graph_weights_label(engine.graph) if hasattr(engine, "graph") else weights_label(engine.config)
        log.info("engine ready: model=%s %s weights=%s %s", name, info, weights, engine.stats())
        run_server(app, sockets, host=a.host, port=a.port, log_level=a.log_level,
                   shutdown_timeout=limits.shutdown_timeout, about=f" | model {name} | {info} | weights {weights}"
                   + ("" if a.no_playground else " | playground at / (open the address in a browser)"))
    finally:
        engine.shutdown()  # idempotent; covers a failed startup where lifespan shutdown never ran
