"""`POST /v1/images/generations` (OpenAI `images.generate`): text to image(s).

The body model is built per app (`request_model`) so that /openapi.json carries this server's
limits (`n`, `steps`) and the served model's size pattern; fields it cannot express are checked by
`ApiContext.check`. Answers in OpenAI's images shape plus a `ditkv` list per image.

(No `from __future__ import annotations`: FastAPI must see the real request class.)
"""

import time

from fastapi import APIRouter, Request

from ..engine.request_check import MAX_PROMPT_CHARS, MAX_SEED
from . import openapi
from .api_context import ApiContext
from .http_validation import _parse_size
from .request_builder import build_requests
from .text_fields import text_model, text_of

PATH = "/v1/images/generations"
CACHE_HELP = ("step caching for this request, replacing the engine's cache_config: {type: none | fbcache | dbcache, "
              "Fn, Bn, residual_threshold, warmup_steps, max_cached_steps, max_continuous_cached_steps, steps_mask, "
              "taylorseer} (docs/step-cache.md). Default: the engine's")


def request_model(ctx: ApiContext):
    """The body model of /v1/images/generations, with this server's limits and the model's sizes."""
    from pydantic import ConfigDict, Field, field_validator

    rule, model_name = ctx.rule, ctx.model_name

    class ImageGenerationRequest(text_model(ctx.bot_tasks)):  # + the AR text settings and bot_task
        """OpenAI `images.generate` fields that apply, plus the engine's sampling extras."""

        # strict: "3" is not a number, 2.5 is not an integer; unknown fields are errors (typos)
        model_config = ConfigDict(extra="forbid", strict=True)
        prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
        # the enums document the one accepted value; others get a 400 (404 for model) with a hint
        model: str | None = Field(None, description=f"'{model_name}' or omitted",
                                  json_schema_extra={"enum": [model_name, None]})
        n: int = Field(1, ge=1, le=ctx.limits.max_n, description="images to generate (seeds seed, seed+1, ...)")
        size: str | None = Field(None, pattern=rule.pattern(auto=rule.auto), description=_size_help(rule))
        response_format: str = Field("b64_json", description="only 'b64_json' ('url' is refused)",
                                     json_schema_extra={"enum": ["b64_json"]})
        output_format: str | None = Field(None, description="only 'png'", json_schema_extra={"enum": ["png", None]})
        user: str | None = Field(None, max_length=256)
        steps: int | None = Field(None, ge=1, le=ctx.max_steps,
                                  description="default: the model's; the largest is the engine's max_steps")
        guidance_scale: float | None = Field(None, ge=0, allow_inf_nan=False,
                                             description="CFG scale; <= 1 disables CFG. Default: the model's")
        seed: int | None = Field(None, ge=0, le=MAX_SEED,
                                 description="default: random; image i uses seed + i, so seed + n - 1 <= 2^63-1")
        negative_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
        cache_config: dict | None = Field(None, description=CACHE_HELP)

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

    return ImageGenerationRequest


def _size_help(rule) -> str:
    if not rule.auto:
        return rule.hint()
    default = "auto" if rule.auto_default else "the engine's default"
    return (f"{rule.hint()}, or 'auto': the model picks one of its resolution buckets after the prompt (the "
            f"release's image_size='auto'; ditkv[i].auto_size says which). Default: {default}")


def router(ctx: ApiContext) -> APIRouter:
    """The route, over `ctx`; registers its body model in `ctx.body_models` (validation messages)."""
    ImageGenerationRequest = request_model(ctx)
    ctx.body_models[PATH] = (ImageGenerationRequest, "prompt")
    api = APIRouter()

    @api.post(PATH, summary="Generate images (OpenAI images.generate)",
              responses={200: {"model": openapi.ImagesResponse}, **openapi.errors(400, 404, 408, 413, 429, 500, 503)})
    async def generations(body: ImageGenerationRequest, request: Request):
        t0 = time.monotonic()
        bad = ctx.check(body)
        if bad is not None:
            return ctx.refused(*bad)
        size = body.size or ("auto" if ctx.rule.auto_default else None)
        reqs = build_requests(body.prompt, body.n, size=size if size in (None, "auto") else _parse_size(size),
                              steps=body.steps, guidance_scale=body.guidance_scale, seed=body.seed,
                              negative_prompt=body.negative_prompt,  # seed + n - 1 <= MAX_SEED: checked
                              text=text_of(body), cache_config=body.cache_config)
        done = await ctx.serve(reqs, request, t0)
        if not isinstance(done, tuple):
            return done  # the error answer
        outs, pngs = done
        return ctx.images_response(outs, pngs, reqs)

    return api
