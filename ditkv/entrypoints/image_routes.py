"""The image-input routes of `ditkv serve`:

- `POST /v1/images/edits`: multipart/form-data exactly as OpenAI's `images.edit` sends it: the
  image(s) as file parts named `image` (one) or `image[]` (several; OpenAI's clients), `prompt`,
  `n`, `size` (`WIDTHxHEIGHT` or `auto`), `response_format` (`b64_json`), plus the engine's extras
  (`steps` or vllm-omni's `num_inference_steps`, `guidance_scale`, `seed`, `negative_prompt`).
  `mask` is refused (no inpainting). Answers like `/v1/images/generations`.
- `POST /v1/chat/completions` with `"modalities": ["image"]` (the default): the prompt is the text of
  the user messages, input images are their `image_url` parts as data URIs (a remote URL is
  refused: the server fetches nothing), and each choice's assistant message holds the image as a
  data URI in an `image_url` content part, as vllm-omni answers. Generation extras go at the top
  level (the OpenAI SDK's `extra_body=` puts them there) or in a nested `"extra_body"` object (vllm-omni's
  curl examples).

Images are decoded and checked by `images.py` (bytes, format, pixels, corruption); their count is
bounded by `--max-input-images` here and by the model's `max_input_images` in the engine, which
refuses every image for a model that reads none (400 naming `image`).

(No `from __future__ import annotations`: FastAPI must see the real request classes.)
"""

import asyncio
import importlib.util
import math
import random
import re
import time
import uuid
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

from ..engine.request_check import MAX_PROMPT_CHARS, MAX_SEED
from .http_limits import MAX_BODY_BYTES

EDITS, CHAT = "/v1/images/edits", "/v1/chat/completions"
SIZE_OR_AUTO = r"^(auto|[1-9][0-9]{0,4}x[1-9][0-9]{0,4})$"
_INT = re.compile(r"^[+-]?[0-9]{1,20}(\.0*)?$")  # form fields are text; "3" and "3.0" are integers, as in JSON
EDIT_TEXT_FIELDS = ("prompt", "model", "n", "size", "response_format", "output_format", "background", "stream",
                    "user", "steps", "num_inference_steps", "guidance_scale", "seed", "negative_prompt")


@dataclass
class Context:
    """What the routes share with `create_app` (serve.py)."""
    limits: Any
    model_name: str
    max_steps: int
    error: Callable  # (status, message, param=None, type_=...) -> JSONResponse
    serve: Callable  # async (reqs, request, t0) -> (outputs, base64 PNGs), or the error response
    image_info: Callable  # (outs, reqs) -> the `ditkv` list
    check: Callable  # (namespace with model, n, size, seed, prompt, ...) -> (status, param, message) | None
    metrics: Any
    body_models: dict


class Refused(Exception):
    def __init__(self, status: int, param: str, message: str):
        super().__init__(message)
        self.status, self.param, self.message = status, param, message


def body_limits(limits) -> dict[str, tuple[int, str]]:
    """Per-route body limits for `BodyLimit`: room for every allowed image plus the other fields
    (base64 grows a chat body by 4/3)."""
    n, b = limits.max_input_images, limits.max_input_image_bytes
    hint = f"at most {n} input image(s) of at most {b} bytes each (--max-input-images, --max-input-image-bytes)"
    return {EDITS: (n * b + MAX_BODY_BYTES, hint), CHAT: (n * (math.ceil(b / 3) * 4 + 64) + MAX_BODY_BYTES, hint)}


def install(app, ctx: Context) -> None:
    from fastapi import Request
    from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

    from ..engine.types import GenerationRequest
    from . import openapi

    L = ctx.limits

    # ---- /v1/images/edits ---------------------------------------------------------------------
    form_schema = openapi.image_edit_form(L.max_n, L.max_input_images, ctx.max_steps, MAX_SEED)

    @app.post(EDITS, summary="Edit images (OpenAI images.edit; multipart/form-data)",
              responses={200: {"model": openapi.ImagesResponse}, **openapi.errors(400, 404, 408, 413, 429, 500, 503)},
              openapi_extra={"requestBody": {"required": True,
                                             "content": {"multipart/form-data": {"schema": form_schema}}}})
    async def edits(request: Request):
        t0 = time.monotonic()
        try:
            fields, files = await _read_form(request, L)
            body, extras = _edit_fields(fields, L, ctx.max_steps)
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
        w, h = _size_of(body.size, images, L)
        seed = random.randrange(1 << 31) if body.seed is None else body.seed
        reqs = [GenerationRequest(prompt=body.prompt, width=w, height=h, seed=seed + i, images=images, **extras)
                for i in range(body.n)]
        done = await ctx.serve(reqs, request, t0)
        if not isinstance(done, tuple):
            return done
        outs, pngs = done
        height, width = outs[0].image.shape[:2]
        return {"created": int(time.time()), "size": f"{width}x{height}",
                "data": [{"b64_json": b, "revised_prompt": o.revised_prompt} for b, o in zip(pngs, outs)],
                "ditkv": ctx.image_info(outs, reqs)}

    # ---- /v1/chat/completions -----------------------------------------------------------------
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
        model: str | None = Field(None, description=f"'{ctx.model_name}' or omitted")
        modalities: list[str] | None = Field(None, description="['image'] or omitted: the answer is an image")
        n: int = Field(1, ge=1, le=L.max_n, description="images (choices) to generate; seeds seed, seed+1, ...")
        stream: bool | None = Field(None, description="only false")
        user: str | None = Field(None, max_length=256)
        size: str | None = Field(None, pattern=SIZE_OR_AUTO,
                                 description="WIDTHxHEIGHT or auto (default: the first input image's size; "
                                             "without input images the engine's default)")
        width: int | None = Field(None, ge=1, le=L.max_image_size, description="vllm-omni: with height, instead of size")
        height: int | None = Field(None, ge=1, le=L.max_image_size)
        steps: int | None = Field(None, ge=1, le=ctx.max_steps)
        num_inference_steps: int | None = Field(None, ge=1, le=ctx.max_steps, description="vllm-omni's name for steps")
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
                    if k in data and data[k] != v:
                        raise ValueError(f"extra_body.{k} and the top-level {k} differ; give it once")
                    data[k] = v
            return data

        @field_validator("n", "steps", "num_inference_steps", "seed", "width", "height", mode="before")
        @classmethod
        def _integral(cls, v):
            return int(v) if isinstance(v, float) and v.is_integer() else v

    ctx.body_models[CHAT] = (ChatImageRequest, "messages")

    @app.post(CHAT, summary="Generate or edit an image through chat (modalities ['image'], vllm-omni's shape)",
              responses={200: {"model": openapi.ChatCompletionResponse},
                         **openapi.errors(400, 404, 408, 413, 429, 500, 503)})
    async def chat(body: ChatImageRequest, request: Request):
        t0 = time.monotonic()
        try:
            prompt, uris = _chat_prompt_and_images(body, L)
            steps = _one_of(body, "steps", "num_inference_steps")
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
        dims = {}
        if images or ns.size:
            dims["width"], dims["height"] = _size_of(ns.size, images, L)
        seed = random.randrange(1 << 31) if body.seed is None else body.seed
        reqs = [GenerationRequest(prompt=prompt, **dims, steps=steps, guidance_scale=body.guidance_scale,
                                  seed=seed + i, negative_prompt=body.negative_prompt, images=images)
                for i in range(body.n)]
        done = await ctx.serve(reqs, request, t0)
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


# ---- multipart ---------------------------------------------------------------------------------
async def _read_form(request, L) -> tuple[dict[str, str], list[tuple[str, bytes]]]:
    """The text fields (each at most once) and the image files, in order, of a multipart body."""
    from starlette.datastructures import UploadFile
    from starlette.exceptions import HTTPException

    ctype = request.headers.get("content-type", "")
    # a url-encoded form can carry no file: read it anyway, so the answer names what is missing
    if not ctype.lower().startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        raise Refused(400, "body", f"body: {EDITS} takes multipart/form-data (OpenAI images.edit: the image(s) as file "
                                   f"parts, the other fields as text parts); got {ctype or 'no content type'!r}")
    if importlib.util.find_spec("python_multipart") is None and importlib.util.find_spec("multipart") is None:
        raise Refused(500, "body", "the server cannot read multipart bodies: python-multipart is not installed "
                                   "(pip install 'ditkv[serve]')")
    try:
        form = await request.form(max_files=L.max_input_images + 1, max_fields=2 * len(EDIT_TEXT_FIELDS))
    except HTTPException as e:  # python-multipart refused the body
        detail = str(e.detail)
        if "Too many files" in detail:
            raise Refused(400, "image", f"image: more than {L.max_input_images} images; this server takes at most "
                                        f"{L.max_input_images} per request (--max-input-images)") from None
        raise Refused(400, "body", f"body: malformed multipart/form-data ({detail})") from None
    try:
        fields: dict[str, str] = {}
        files: list[tuple[str, bytes]] = []
        uploads = [(k, v) for k, v in form.multi_items() if k in ("image", "image[]")]
        if len(uploads) > L.max_input_images:
            raise Refused(400, "image", f"image: {len(uploads)} images, above this server's limit of "
                                        f"{L.max_input_images} per request (--max-input-images)")
        for key, value in form.multi_items():
            if key in ("image", "image[]"):
                if not isinstance(value, UploadFile):
                    raise Refused(400, "image", f"{key}: must be a file part (Content-Disposition with a filename), "
                                                "got a text field")
                what = f"image[{len(files)}]" if len(uploads) > 1 else "image"
                if value.size is not None and value.size > L.max_input_image_bytes:
                    raise Refused(413, "image", f"{what}: {value.size} bytes, above this server's limit of "
                                                f"{L.max_input_image_bytes} bytes per image (--max-input-image-bytes)")
                files.append((what, await value.read(L.max_input_image_bytes + 1)))
            elif key == "mask":
                raise Refused(400, "mask", "mask: inpainting masks are not supported; send the image(s) and describe "
                                           "the edit in prompt")
            elif key not in EDIT_TEXT_FIELDS:
                raise Refused(400, key, f"{key}: unknown field; accepted fields: image (or image[]), "
                                        + ", ".join(sorted(EDIT_TEXT_FIELDS)))
            elif isinstance(value, UploadFile):
                raise Refused(400, key, f"{key}: must be a text field, got a file")
            elif key in fields:
                raise Refused(400, key, f"{key}: given more than once")
            else:
                fields[key] = value
        return fields, files
    finally:
        await form.close()


def _edit_fields(f: dict[str, str], L, max_steps: int):
    """The edit request's fields parsed and range-checked -> (namespace for `check`, engine extras)."""
    prompt = f.get("prompt")
    if prompt is None:
        raise Refused(400, "prompt", "prompt: field required")
    if not 1 <= len(prompt) <= MAX_PROMPT_CHARS:
        raise Refused(400, "prompt", f"prompt: must be 1..{MAX_PROMPT_CHARS} characters")
    size = f.get("size")
    if size is not None and not re.match(SIZE_OR_AUTO, size):
        raise Refused(400, "size", "size: must be 'WIDTHxHEIGHT' in pixels, e.g. '64x64', or 'auto'")
    for key, allowed in (("background", ("auto", "opaque")), ("stream", ("false",))):
        if key in f and f[key].lower() not in allowed:
            raise Refused(400, key, f"{key}: {f[key]!r} is not supported; use {' or '.join(map(repr, allowed))}")
    if "user" in f and len(f["user"]) > 256:
        raise Refused(400, "user", "user: at most 256 characters")
    neg = f.get("negative_prompt")
    if neg is not None and len(neg) > MAX_PROMPT_CHARS:
        raise Refused(400, "negative_prompt", f"negative_prompt: at most {MAX_PROMPT_CHARS} characters")
    n = _form_int(f, "n", 1, L.max_n, 1)
    steps = {k: _form_int(f, k, 1, max_steps, None) for k in ("steps", "num_inference_steps")}
    body = SimpleNamespace(**steps)
    ns = SimpleNamespace(model=f.get("model"), response_format=f.get("response_format", "b64_json"),
                         output_format=f.get("output_format"), prompt=prompt, n=n,
                         seed=_form_int(f, "seed", 0, MAX_SEED, None), size=None if size == "auto" else size)
    extras = {"steps": _one_of(body, "steps", "num_inference_steps"), "negative_prompt": neg,
              "guidance_scale": _form_float(f, "guidance_scale")}
    return ns, extras


def _form_int(f, key, lo, hi, default):
    v = f.get(key)
    if v is None:
        return default
    if not _INT.match(v.strip()):
        raise Refused(400, key, f"{key}: must be an integer, got {v[:40]!r}")
    i = int(float(v)) if "." in v else int(v)
    if not lo <= i <= hi:
        raise Refused(400, key, f"{key}: {i} must be in {lo}..{hi}")
    return i


def _form_float(f, key):
    v = f.get(key)
    if v is None:
        return None
    try:
        x = float(v)
    except ValueError:
        raise Refused(400, key, f"{key}: must be a number, got {v[:40]!r}") from None
    if not math.isfinite(x) or x < 0:
        raise Refused(400, key, f"{key}: {v[:40]} must be a finite number >= 0 (<= 1 disables CFG)")
    return x


def _one_of(body, a: str, b: str):
    """`steps` under either name (vllm-omni says num_inference_steps); both must agree."""
    x, y = getattr(body, a), getattr(body, b)
    if x is not None and y is not None and x != y:
        raise Refused(400, b, f"{b}: {y} differs from {a}={x}; give one of them")
    return x if x is not None else y


# ---- chat ------------------------------------------------------------------------------------
ROLES = ("system", "developer", "user", "assistant")


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


def _size_of(size: str | None, images, L) -> tuple[int, int]:
    """(width, height) to generate: `size` as given, else (auto) from the first input image."""
    from .images import auto_size

    if size is not None:
        w, h = (int(x) for x in size.split("x"))
        return w, h
    h, w = images[0].shape[:2]
    return auto_size(w, h, L.max_image_size)
