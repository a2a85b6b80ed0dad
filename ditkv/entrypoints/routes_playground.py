"""The playground of `ditkv serve` (issue 37): GET / returns one static page (package data,
`playground/index.html`: inline JS and CSS, no external requests) that drives the public API, and
GET /playground/options tells it what the served model accepts. `--no-playground` leaves both out
(then `/` is a 404 as before). See docs/playground.md.

The options repeat only what /openapi.json already publishes (the size pattern's cell and cap,
`size=auto`, max steps, max n, the input-image limit) plus the model's own input-image count, which
an edit's 400 already names; nothing about the host, the weights or the engine's internals. Both
routes stay out of /openapi.json: they are the page's, not the images API's.

(No `from __future__ import annotations`: FastAPI reads the routes' signatures.)
"""

import math
from functools import lru_cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from .api_context import ApiContext
from .sizes import SizeRule, _model_config

PAGE = "/"
OPTIONS = "/playground/options"
MAX_LISTED_SIZES = 16  # a cell model takes every multiple: the page lists the first squares (and takes any typed)


@lru_cache(maxsize=1)
def page_html() -> str:
    """The page's text, read once from the package."""
    return resources.files("ditkv.entrypoints").joinpath("playground/index.html").read_text(encoding="utf-8")


def router(ctx: ApiContext) -> APIRouter:
    api = APIRouter()
    options = page_options(ctx)  # fixed for the app's life: the model and the limits do not change

    @api.get(PAGE, include_in_schema=False, response_class=HTMLResponse)
    async def page():
        # no-store: a server restarted on another model must not meet a cached page
        return HTMLResponse(page_html(), headers={"Cache-Control": "no-store"})

    @api.get(OPTIONS, include_in_schema=False)
    async def playground_options():
        return options

    return api


def page_options(ctx: ApiContext) -> dict:
    """What the page's controls offer: sizes (those the engine admits), `auto`, and the limits a
    request is checked against."""
    rule = ctx.rule
    cfg = _model_config(ctx.service)
    model_images = int(getattr(cfg, "max_input_images", 0) or 0) if cfg is not None else ctx.limits.max_input_images
    fits = getattr(_processor(ctx.service), "fits", None)  # the engine's profiled envelope (its 400 names it)
    sizes = [s for s in listed_sizes(rule, cfg) if fits is None or fits(*map(int, reversed(s.split("x"))))]
    return {"model": ctx.model_name, "sizes": sizes,
            "size_auto": rule.auto, "size_auto_default": rule.auto_default,
            "size_cell": rule.cell, "size_snaps": rule.snaps, "max_side": rule.max_side,
            "max_steps": ctx.max_steps, "max_n": ctx.limits.max_n,
            "max_input_images": min(ctx.limits.max_input_images, model_images)}


def _processor(service):
    # the intake that checks a request's size: a single engine's, or a stage graph's orchestrator's
    return getattr(getattr(service, "_engine", None), "processor", None) \
        or getattr(getattr(service, "orch", None), "processor", None)


def listed_sizes(rule: SizeRule, cfg) -> list[str]:
    """'WIDTHxHEIGHT' choices: a release model's resolution buckets (the sizes it snaps to), else the
    first squares in whole latent cells and whole 16 px; every one within --max-image-size."""
    if rule.snaps and cfg is not None:
        from ..models.hunyuan.buckets import bucket_table
        from ..models.hunyuan.template import instruct_code

        table = bucket_table(cfg.image_base_size, instruct_code(cfg))
        return [f"{w}x{h}" for h, w in table if max(h, w) <= rule.max_side]
    step = math.lcm(rule.cell, 16)  # whole 16 px: 4x4 is a valid tiny size, but not one worth a menu entry
    top = min(rule.max_side // step, MAX_LISTED_SIZES)
    return [f"{k * step}x{k * step}" for k in range(1, top + 1)]
