"""`POST /v1/images/edits`: multipart/form-data exactly as OpenAI's `images.edit` sends it.

The image(s) come as file parts named `image` (one) or `image[]` (several; OpenAI's clients), with
`prompt`, `n`, `size` (`WIDTHxHEIGHT` or `auto`: the model's choice with the images in its context
where the served engine can pick, else the first input image's size, in the served model's sizes,
`sizes.py`), `response_format` (`b64_json`), plus the engine's extras (`steps` or
vllm-omni's `num_inference_steps`, `guidance_scale`, `seed`, `negative_prompt`, and the AR text
settings and `bot_task` of `text_fields.py`). `mask` is refused
(no inpainting). The form is read and parsed by `edit_form.py`, the images decoded and checked by
`images.py`; their count is bounded by `--max-input-images` here and by the model's
`max_input_images` in the engine, which refuses every image for a model that reads none (400
naming `image`). Answers like `/v1/images/generations`.
"""

import asyncio
import time

from fastapi import APIRouter, Request
from starlette.requests import ClientDisconnect

from ..engine.request_check import MAX_SEED
from . import openapi
from .api_context import ApiContext
from .edit_form import EDITS, edit_fields, read_form
from .http_validation import Refused
from .request_builder import build_requests, decode_all, size_of

PATH = EDITS


def router(ctx: ApiContext) -> APIRouter:
    """The route, over `ctx` (its body is a form: no body model for FastAPI to validate)."""
    L, rule = ctx.limits, ctx.rule
    # a component, not inline: FastAPI would publish the inline form's integer bounds as floats
    ctx.schemas["ImageEditRequest"] = openapi.image_edit_form(L.max_n, L.max_input_images, ctx.max_steps, MAX_SEED,
                                                              rule.pattern(auto=True), ctx.bot_tasks)
    form_schema = {"$ref": "#/components/schemas/ImageEditRequest"}
    api = APIRouter()

    @api.post(PATH, summary="Edit images (OpenAI images.edit; multipart/form-data)",
              responses={200: {"model": openapi.ImagesResponse}, **openapi.errors(400, 404, 408, 413, 429, 500, 503)},
              openapi_extra={"requestBody": {"required": True,
                                             "content": {"multipart/form-data": {"schema": form_schema}}}})
    async def edits(request: Request):
        t0 = time.monotonic()
        try:
            fields, files = await read_form(request, L)
            body, extras = edit_fields(fields, L, ctx.max_steps, rule, ctx.bot_tasks)
            bad = ctx.check(body)
            if bad is not None:
                raise Refused(*bad)
            if not files:
                raise Refused(400, "image", "image: field required; send the image(s) to edit as file part(s) named "
                                            "'image' (or 'image[]' for several) of a multipart/form-data body")
            images = await asyncio.to_thread(decode_all, files, L)
        except Refused as r:
            return ctx.refused(r.status, r.param, r.message)
        except ClientDisconnect:  # gone mid-upload, as the JSON routes' clients can be
            return ctx.disconnected("while sending its form")
        size, note = size_of(body.size, images, L, rule)
        reqs = build_requests(body.prompt, body.n, size=size, seed=body.seed, images=images, **extras)
        done = await ctx.serve(reqs, request, t0, size_note=note)
        if not isinstance(done, tuple):
            return done
        outs, pngs = done
        return ctx.images_response(outs, pngs, reqs)

    return api
