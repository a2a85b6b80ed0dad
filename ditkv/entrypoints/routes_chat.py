"""`POST /v1/chat/completions` with `"modalities": ["image"]` (the default), vllm-omni's shape.

The prompt is the text of the user messages; input images are their `image_url` parts as data URIs
(a remote URL is refused: the server fetches nothing), and each choice's assistant message holds
the image as a data URI in an `image_url` content part, as vllm-omni answers. Generation extras go
at the top level (the OpenAI SDK's `extra_body=` puts them there) or in a nested `"extra_body"`
object (vllm-omni's curl examples; one level: an `extra_body` inside it is refused, like any other
unknown field). Sizes (`WIDTHxHEIGHT`, `auto`, or vllm-omni's `width` and `height`) follow the
served model's rule, `sizes.py`; images are decoded and checked by `images.py`, at most
`--max-input-images` of them (and the model's `max_input_images`, in the engine).

The body is read here, not by FastAPI: at its limit (`serve.body_limits`, ~108 MiB by default)
its JSON, base64 and images take about a second to parse, which runs in a worker thread
(`_parse_chat`), in steps that each hold the GIL briefly, so that the event loop keeps answering
(/health, other requests) meanwhile.

(No `from __future__ import annotations`: FastAPI must see the real request classes.)
"""

import asyncio
import json
import time
import uuid
from types import SimpleNamespace
from typing import Annotated

from fastapi import APIRouter, Request
from starlette.requests import ClientDisconnect

from ..engine.request_check import MAX_PROMPT_CHARS, MAX_SEED
from . import json_body, openapi
from .api_context import ApiContext
from .http_validation import (Refused, _describe_validation_error, json_content_type, not_json_body, one_of,
                              too_many_images)
from .request_builder import build_requests, decode_all, size_of
from .sizes import SizeRule
from .text_fields import text_model, text_of

PATH = CHAT = "/v1/chat/completions"
IMAGE_ONLY = {"anyOf": [{"type": "array", "items": {"enum": ["image"]}, "minItems": 1, "maxItems": 1},
                        {"type": "null"}]}  # chat's `modalities`: ['image'] or omitted


def router(ctx: ApiContext) -> APIRouter:
    """The route, over `ctx`; registers its body model in `ctx.body_models` (validation messages)."""
    L, rule = ctx.limits, ctx.rule
    ChatImageRequest = _chat_request_model(L, rule, ctx.model_name, ctx.max_steps, ctx.bot_tasks)
    ctx.body_models[PATH] = (ChatImageRequest, "messages")
    api = APIRouter()

    @api.post(PATH, summary="Generate or edit an image through chat (modalities ['image'], vllm-omni's shape)",
              responses={200: {"model": openapi.ChatCompletionResponse},
                         **openapi.errors(400, 404, 408, 413, 429, 500, 503)},
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": {"$ref": f"#/components/schemas/{ChatImageRequest.__name__}"}}}}})
    async def chat(request: Request):
        t0 = time.monotonic()
        try:
            raw = bytearray()
            async for chunk in request.stream():  # one buffer, grown in place: no 108 MB join
                raw += chunk
            body, prompt, uris = await asyncio.to_thread(_parse_chat, raw, request.headers.get("content-type", ""),
                                                         ChatImageRequest, L, rule.hint())
            steps = one_of(body, "steps", "num_inference_steps")
            ns = SimpleNamespace(model=body.model, response_format="b64_json", output_format=None, prompt=prompt,
                                 seed=body.seed, n=body.n, size=_chat_size(body))
            bad = ctx.check(ns)
            if bad is not None:
                raise Refused(*bad)
            images = await asyncio.to_thread(decode_all, uris, L) if uris else None
        except Refused as r:
            return ctx.refused(r.status, r.param, r.message)
        except ClientDisconnect:  # gone mid-body
            return ctx.disconnected("while sending its body")
        size, note = None, None
        if images or ns.size:
            size, note = size_of(ns.size, images, L, rule)
        reqs = build_requests(prompt, body.n, size=size, steps=steps,
                              guidance_scale=body.guidance_scale, seed=body.seed,
                              negative_prompt=body.negative_prompt, images=images, text=text_of(body))
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

    return api


def _chat_size(body) -> str | None:
    """The size asked for, 'WIDTHxHEIGHT' from `size` or from `width` and `height` (which must then
    agree with it); None for auto (with input images the model's choice or the first image's size,
    `request_builder.size_of`; without, the engine's default)."""
    size = body.size
    if body.width is not None or body.height is not None:
        if body.width is None or body.height is None:
            raise Refused(400, "width" if body.width is None else "height",
                          "width, height: give both (or size='WIDTHxHEIGHT')")
        if size not in (None, "auto") and size != f"{body.width}x{body.height}":
            raise Refused(400, "size", f"size: {size} differs from width x height = {body.width}x{body.height}")
        size = f"{body.width}x{body.height}"
    return None if size == "auto" else size


# ---- the body and its messages --------------------------------------------------------------
ROLES = ("system", "developer", "user", "assistant")


def _chat_request_model(L, rule: SizeRule, model_name: str, max_steps: int, bot_tasks: tuple[str, ...]):
    """The body model of /v1/chat/completions, with this server's limits and the model's sizes."""
    from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

    cell = rule.cell if rule.cell > 1 else None  # width/height: whole latent cells

    class ChatImageURL(BaseModel):  # not `ImageURL`: the answer's model has that component name
        model_config = ConfigDict(extra="forbid", strict=True)
        url: str = Field(description="a data URI, data:image/png;base64,... (remote URLs are refused)")
        detail: str | None = None

    class ContentPart(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        type: str = Field(description="'text' or 'image_url'")
        text: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
        image_url: ChatImageURL | None = None

    class ChatMessage(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        role: str = Field(description="system, developer, user or assistant; only user messages are read",
                          json_schema_extra={"enum": list(ROLES)})  # the server's check names the field
        content: str | list[ContentPart] | None = None
        name: str | None = None

    class ChatImageRequest(text_model(bot_tasks)):  # + the AR text settings and bot_task
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
                                 description=f"{rule.hint()}, or auto (the default): with input images "
                                             "the model's choice where the served engine can pick, else the first "
                                             "input image's size; without input images the engine's default")
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


def _parse_chat(raw: bytearray, ctype: str, model, L, size_hint: str):
    """(body, prompt, image data URIs' bytes) of a chat request's body, or `Refused` naming what
    is wrong. Runs in a worker thread, in steps that each hold the GIL briefly (`json_body`, the
    base64 in slices: `images.data_uri_bytes`), so the event loop keeps answering meanwhile."""
    from pydantic import ValidationError

    if not json_content_type(ctype):
        raise Refused(400, "body", not_json_body(ctype))
    try:
        data = json_body.loads(raw) if raw else None  # no body: the model says what is required
    except UnicodeDecodeError:
        raise Refused(400, "body", "body: not valid UTF-8; send a UTF-8 JSON object with at least a 'messages' "
                                   "field") from None
    except json.JSONDecodeError as e:
        raise Refused(400, "body", f"body: not valid JSON ({e})") from None
    except RecursionError:
        raise Refused(400, "body", "body: JSON nested too deeply to read") from None
    try:
        body = model.model_validate(data)
    except ValidationError as e:
        raise Refused(400, *_describe_validation_error(e.errors(), model, "messages", size_hint)) from None
    return body, *_chat_prompt_and_images(body, L)


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
                    raise too_many_images(where, L.max_input_images)
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
