"""The operational routes of `ditkv serve`: GET /health (queue and KV pool state; 503 while
draining or dead), GET /v1/models and GET /v1/models/{model} (the one served model), GET /metrics
(Prometheus text, `metrics.py`).

(No `from __future__ import annotations`: FastAPI reads the routes' signatures.)
"""

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from . import openapi
from .api_context import ApiContext


class MetricsResponse(Response):
    media_type = openapi.METRICS_MEDIA_TYPE  # documents the content type in /openapi.json


def router(ctx: ApiContext) -> APIRouter:
    """The routes, over `ctx`."""
    api = APIRouter()
    card = {"id": ctx.model_name, "object": "model", "created": ctx.started, "owned_by": "ditkv"}

    @api.get("/health", summary="Health, queue and KV pool state", responses={
        200: {"model": openapi.Health},
        503: {"model": openapi.Health, "description": "draining (shutting down) or dead (the engine failed closed)"},
        **openapi.errors(500)})
    async def health():
        body = health_body(ctx)
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    @api.get("/v1/models", summary="List models", response_model=openapi.ModelList,
             responses=openapi.errors(500))
    async def models():
        return {"object": "list", "data": [card]}

    # :path so that a served name with a slash ("org/model") can be retrieved too
    @api.get("/v1/models/{model:path}", summary="Retrieve a model", response_model=openapi.Model,
             responses=openapi.errors(404, 500))
    async def model_card(model: str):
        if model != ctx.model_name:
            return ctx.error(404, f"model: the model {model!r} does not exist; this server serves "
                             f"{ctx.model_name!r}", "model", code="model_not_found")
        return card

    @api.get("/metrics", summary="Prometheus metrics", response_class=MetricsResponse, responses={
        200: {"description": "Prometheus text exposition format 0.0.4"}, **openapi.errors(500)})
    async def prometheus():
        data, ctype = ctx.metrics.render()
        return MetricsResponse(data, media_type=ctype)

    return api


def health_body(ctx: ApiContext) -> dict:
    """The /health body: status (ok, draining or dead), the service's facts and its counters."""
    s = ctx.service.stats()
    status = "draining" if ctx.draining or not s.get("accepting") else "ok"
    if not s.get("alive"):
        status = "dead"
    body = {"status": status, "model": ctx.model_name, **ctx.service.info,
            "waiting": s.get("waiting", 0), "running": s.get("running", 0), "in_flight": s.get("in_flight", 0)}
    for key in ("num_blocks", "used_blocks", "free_blocks", "evictable_blocks"):
        if key in s:
            body[f"kv_{key}"] = s[key]
    for key in ("pools_full", "stages", "transfers", "remote_ar"):  # stage graphs: per-stage pools, transfer totals
        if key in s:
            body[key] = s[key]
    return body
