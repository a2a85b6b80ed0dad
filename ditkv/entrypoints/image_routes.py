"""The image-input routes of `ditkv serve`:

- `POST /v1/images/edits`: multipart/form-data exactly as OpenAI's `images.edit` sends it: the
  image(s) as file parts named `image` (one) or `image[]` (several; OpenAI's clients), `prompt`,
  `n`, `size` (`WIDTHxHEIGHT` or `auto`), `response_format` (`b64_json`), plus the engine's extras
  (`steps` or vllm-omni's `num_inference_steps`, `guidance_scale`, `seed`, `negative_prompt`).
  `mask` is refused (no inpainting). The form is read and parsed by `edit_form.py`. Answers like
  `/v1/images/generations`.
- `POST /v1/chat/completions` with `"modalities": ["image"]` (the default): the prompt is the text of
  the user messages, input images are their `image_url` parts as data URIs (a remote URL is
  refused: the server fetches nothing), and each choice's assistant message holds the image as a
  data URI in an `image_url` content part, as vllm-omni answers. Generation extras go at the top
  level (the OpenAI SDK's `extra_body=` puts them there) or in a nested `"extra_body"` object (vllm-omni's
  curl examples; one level: an `extra_body` inside it is refused, like any other unknown field).

Sizes (`WIDTHxHEIGHT`, and what `auto` takes from the first input image) follow the served model's
rule, `sizes.py`: the same pattern in the server's checks and in /openapi.json.

Images are decoded and checked by `images.py` (bytes, format, pixels, corruption); their count is
bounded by `--max-input-images` here and by the model's `max_input_images` in the engine, which
refuses every image for a model that reads none (400 naming `image`).

(No `from __future__ import annotations`: FastAPI must see the real request classes.)
"""

import asyncio
import math
import random
import time
import uuid
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Annotated, Any, Callable

from ..engine.request_check import MAX_PROMPT_CHARS, MAX_SEED
from .edit_form import EDITS, edit_fields, read_form
from .http_limits import MAX_BODY_BYTES
from .http_validation import Refused, one_of
from .sizes import SizeRule, auto_note

CHAT = "/v1/chat/completions"
IMAGE_ONLY = {"anyOf": [{"type": "array", "items": {"enum": ["image"]}, "minItems": 1, "maxItems": 1},
                        {"type": "null"}]}  # chat's `modalities`: ['image'] or omitted


@dataclass
class Context:
    """What the routes share with `create_app` (serve.py)."""
    limits: Any
    model_name: str
    max_steps: int
    error: Callable  # (status, message, param=None, type_=...) -> JSONResponse
    serve: Callable  # async (reqs, request, t0, size_note=None) -> (outputs, base64 PNGs), or the error response
    disconnected: Callable  # (when) -> the response to a client that left (counted)
    image_info: Callable  # (outs, reqs) -> the `ditkv` list
    check: Callable  # (namespace with model, n, size, seed, prompt, ...) -> (status, param, message) | None
    metrics: Any
    body_models: dict
    rule: SizeRule  # the sizes the model makes (sizes.py)


def body_limits(limits) -> dict[str, tuple[int, str]]:
    """Per-route body limits for `BodyLimit`: room for every allowed image plus the other fields
    (base64 grows a chat body by 4/3)."""
    n, b = limits.max_input_images, limits.max_input_image_bytes
    hint = f"at most {n} input image(s) of at most {b} bytes each (--max-input-images, --max-input-image-bytes)"
    return {EDITS: (n * b + MAX_BODY_BYTES, hint), CHAT: (n * (math.ceil(b / 3) * 4 + 64) + MAX_BODY_BYTES, hint)}


def install(app, ctx: Context) -> None:
    from fastapi import Request
    from starlette.requests import ClientDisconnect

    from ..engine.types import GenerationRequest
    from . import openapi

    L, rule = ctx.limits, ctx.rule

    # ---- /v1/images/edits ---------------------------------------------------------------------
    form_schema = openapi.image_edit_form(L.max_n, L.max_input_images, ctx.max_steps, MAX_SEED,
                                          rule.pattern(auto=True))

    @app.post(EDITS, summary="Edit images (OpenAI images.edit; multipart/form-data)",
              responses={200: {"model": openapi.ImagesResponse}, **openapi.errors(400, 404, 408, 413, 429, 500, 503)},
              openapi_extra={"requestBody": {"required": True,
                                             "content": {"multipart/form-data": {"schema": form_schema}}}})
    async def edits(request: Request):
        t0 = time.monotonic()
        try:
            fields, files = await read_form(request, L)
            body, extras = edit_fields(fields, L, ctx.max_steps, rule)
            bad = ctx.check(body)
            if bad is not None:
                raise Refused(*bad)
            if not files:
                raise Refused(400, "image", "image: field required; send the image(s) to edit as file part(s) named "
                                            "'image' (or 'image[]' for several) of a multipart/form-data body")
            images = await asyncio.to_thread(_decode_all, files, L)
        except Refused as r:
            ctx.metrics.requests.labels("invalid").inc()
            return ctx.error(r.status, r.message, r.param)
        except ClientDisconnect:  # gone mid-upload, as the JSON routes' clients can be
            return ctx.disconnected("while sending its form")
        w, h, note = _size_of(body.size, images, L, rule)
        seed = random.randrange(1 << 31) if body.seed is None else body.seed
        reqs = [GenerationRequest(prompt=body.prompt, width=w, height=h, seed=seed + i, images=images, **extras)
                for i in range(body.n)]
        done = await ctx.serve(reqs, request, t0, size_note=note)
        if not isinstance(done, tuple):
            return done
        outs, pngs = done
        height, width = outs[0].image.shape[:2]
        return {"created": int(time.time()), "size": f"{width}x{height}",
                "data": [{"b64_json": b, "revised_prompt": o.revised_prompt} for b, o in zip(pngs, outs)],
                "ditkv": ctx.image_info(outs, reqs)}

    # ---- /v1/chat/completions -----------------------------------------------------------------
    ChatImageRequest = _chat_request_model(L, rule, ctx.model_name, ctx.max_steps)
    ctx.body_models[CHAT] = (ChatImageRequest, "messages")

    @app.post(CHAT, summary="Generate or edit an image through chat (modalities ['image'], vllm-omni's shape)",
              responses={200: {"model": openapi.ChatCompletionResponse},
                         **openapi.errors(400, 404, 408, 413, 429, 500, 503)})
    async def chat(body: ChatImageRequest, request: Request):
        t0 = time.monotonic()
        try:
            prompt, uris = _chat_prompt_and_images(body, L)
            steps = one_of(body, "steps", "num_inference_steps")
            size = body.size
            if body.width is not None or body.height is not None:
                if body.width is None or body.height is None:
                    raise Refused(400, "width" if body.width is None else "height",
                                  "width, height: give both (or size='WIDTHxHEIGHT')")
                if size not in (None, "auto") and size != f"{body.width}x{body.height}":
                    raise Refused(400, "size", f"size: {size} differs from width x height = {body.width}x{body.height}")
                size = f"{body.width}x{body.height}"
            ns = SimpleNamespace(model=body.model, response_format="b64_json", output_format=None, prompt=prompt,
                                 seed=body.seed, n=body.n, size=None if size == "auto" else size)
            bad = ctx.check(ns)
            if bad is not None:
                raise Refused(*bad)
            images = await asyncio.to_thread(_decode_all, uris, L) if uris else None
        except Refused as r:
            ctx.metrics.requests.labels("invalid").inc()
            return ctx.error(r.status, r.message, r.param)
        dims, note = {}, None
        if images or ns.size:
            dims["width"], dims["height"], note = _size_of(ns.size, images, L, rule)
        seed = random.randrange(1 << 31) if body.seed is None else body.seed
        reqs = [GenerationRequest(prompt=prompt, **dims, steps=steps, guidance_scale=body.guidance_scale,
                                  seed=seed + i, negative_prompt=body.negative_prompt, images=images)
                for i in range(body.n)]
        done = await ctx.serve(reqs, request, t0, size_note=note)
        if not isinstance(done, tuple):
            return done
        outs, pngs = done
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": ctx.model_name,
                "choices": [{"index": i, "finish_reason": "stop", "logprobs": None,
                             "message": {"role": "assistant", "content": [
                                 {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b}}]}}
                            for i, b in enumerate(pngs)],
                "ditkv": ctx.image_info(outs, reqs)}


# ---- chat ------------------------------------------------------------------------------------
ROLES = ("system", "developer", "user", "assistant")


def _chat_request_model(L, rule: SizeRule, model_name: str, max_steps: int):
    """The body model of /v1/chat/completions, with this server's limits and the model's sizes."""
    from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

    cell = rule.cell if rule.cell > 1 else None  # width/height: whole latent cells

    class ImageURL(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        url: str = Field(description="a data URI, data:image/png;base64,... (remote URLs are refused)")
        detail: str | None = None

    class ContentPart(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        type: str = Field(description="'text' or 'image_url'")
        text: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
        image_url: ImageURL | None = None

    class ChatMessage(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        role: str = Field(description="system, developer, user or assistant; only user messages are read")
        content: str | list[ContentPart] | None = None
        name: str | None = None

    class ChatImageRequest(BaseModel):
        """OpenAI chat.completions with image output (vllm-omni's shape), plus the engine's extras."""

        model_config = ConfigDict(extra="forbid", strict=True)
        messages: list[ChatMessage] = Field(min_length=1, max_length=256)
        model: str | None = Field(None, description=f"'{model_name}' or omitted")
        # the schema says what the server accepts; the server's own check gives the clearer message
        modalities: Annotated[list[str] | None, WithJsonSchema(IMAGE_ONLY)] = Field(
            None, description="['image'] or omitted: the answer is an image")
        n: int = Field(1, ge=1, le=L.max_n, description="images (choices) to generate; seeds seed, seed+1, ...")
        stream: bool | None = Field(None, description="only false")
        user: str | None = Field(None, max_length=256)
        size: str | None = Field(None, pattern=rule.pattern(auto=True),
                                 description=f"{rule.hint()}, or auto (default: the first input image's size; "
                                             "without input images the engine's default)")
        width: int | None = Field(None, ge=1, le=L.max_image_size, multiple_of=cell,
                                  description="vllm-omni: with height, instead of size")
        height: int | None = Field(None, ge=1, le=L.max_image_size, multiple_of=cell)
        steps: int | None = Field(None, ge=1, le=max_steps)
        num_inference_steps: int | None = Field(None, ge=1, le=max_steps, description="vllm-omni's name for steps")
        guidance_scale: float | None = Field(None, ge=0, allow_inf_nan=False)
        seed: int | None = Field(None, ge=0, le=MAX_SEED)
        negative_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
        extra_body: dict | None = Field(None, description="vllm-omni's curl form: the extras nested here")

        @model_validator(mode="before")
        @classmethod
        def _merge_extra_body(cls, data):
            if isinstance(data, dict) and isinstance(data.get("extra_body"), dict):
                data = dict(data)
                nested = data.pop("extra_body")
                for k, v in nested.items():
                    if k == "extra_body":  # nested twice: kept for `_nested_once` to refuse
                        v = {k: v}
                    elif k in data and data[k] != v:
                        raise ValueError(f"extra_body.{k} and the top-level {k} differ; give it once")
                    data[k] = v
            return data

        @field_validator("extra_body")
        @classmethod
        def _nested_once(cls, v):  # the merge took the extras out: what is left here was nested twice
            if v is not None:
                raise ValueError("unknown field extra_body.extra_body; nest the extras once, "
                                 "{\"extra_body\": {\"steps\": 30}}, or give them at the top level")
            return v

        @field_validator("n", "steps", "num_inference_steps", "seed", "width", "height", mode="before")
        @classmethod
        def _integral(cls, v):
            return int(v) if isinstance(v, float) and v.is_integer() else v

    return ChatImageRequest


def _chat_prompt_and_images(body, L) -> tuple[str, list[tuple[str, str]]]:
    """The prompt (user text parts, space-joined, as vllm-omni builds it) and the user messages'
    image data URIs (named for errors), in order."""
    from .images import ImageInputError, data_uri_bytes

    if body.stream:
        raise Refused(400, "stream", "stream: streaming is not supported; leave it out or set false")
    if body.modalities is not None and list(body.modalities) != ["image"]:
        raise Refused(400, "modalities", f"modalities: this server answers with images only; use ['image'] "
                                         f"(got {list(body.modalities)!r})")
    texts, uris = [], []
    for i, m in enumerate(body.messages):
        if m.role not in ROLES:
            raise Refused(400, "messages", f"messages[{i}].role: {m.role!r} is not one of {', '.join(ROLES)}")
        if m.role != "user" or m.content is None:
            continue  # the prompt is the user's text; earlier assistant images are not re-read
        if isinstance(m.content, str):
            texts.append(m.content)
            continue
        for j, part in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if part.type == "text":
                if part.text is None:
                    raise Refused(400, "messages", f"{where}.text: field required for a 'text' part")
                texts.append(part.text)
            elif part.type == "image_url":
                if part.image_url is None:
                    raise Refused(400, "messages", f"{where}.image_url: field required for an 'image_url' part")
                if len(uris) >= L.max_input_images:
                    raise Refused(400, "messages", f"{where}: more than {L.max_input_images} input images; this "
                                                   "server takes at most that many per request (--max-input-images)")
                try:  # the data URI's syntax and size now; its pixels when decoding
                    uris.append((where, data_uri_bytes(part.image_url.url, what=f"{where}.image_url.url",
                                                       max_bytes=L.max_input_image_bytes)))
                except ImageInputError as e:
                    raise Refused(e.status, "messages", str(e)) from None
            else:
                raise Refused(400, "messages", f"{where}.type: {part.type!r} is not supported; use 'text' or "
                                               "'image_url'")
    prompt = " ".join(t for t in texts if t.strip()).strip()
    if not prompt:
        raise Refused(400, "messages", "messages: no text in the user message(s); say what to draw or how to edit")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise Refused(400, "messages", f"messages: the user text is {len(prompt)} characters, above the limit of "
                                       f"{MAX_PROMPT_CHARS}")
    return prompt, uris


# ---- shared --------------------------------------------------------------------------------------
def _decode_all(items: list[tuple[str, bytes]], L) -> list:
    """Decode (name, bytes) pairs; the first bad one is refused with its status (413 for bytes)."""
    from .images import ImageInputError, decode_image

    out = []
    for what, data in items:
        try:
            out.append(decode_image(data, what=what, max_bytes=L.max_input_image_bytes,
                                    max_pixels=L.max_input_image_pixels))
        except ImageInputError as e:
            raise Refused(e.status, "messages" if what.startswith("messages") else "image", str(e)) from None
    return out


def _size_of(size: str | None, images, L, rule: SizeRule) -> tuple[int, int, str | None]:
    """(width, height) to generate: `size` as given, else (auto) from the first input image, in
    whole cells of the model (`rule`); and for auto, the note the engine's errors about it get."""
    from .images import auto_size

    if size is not None:
        w, h = (int(x) for x in size.split("x"))
        return w, h, None
    h, w = images[0].shape[:2]
    aw, ah = auto_size(w, h, L.max_image_size, rule.auto_multiple())
    return aw, ah, auto_note((aw, ah), (w, h), rule)
