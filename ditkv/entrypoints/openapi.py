"""What `ditkv serve` publishes at /openapi.json: the response models, the OpenAI error shape
and the status codes each route really answers.

FastAPI documents every route with a body as answering 422 in its own validation-error shape;
this server answers 400 in OpenAI's shape instead (see `serve.py`), so `install` removes the
422s and their component schemas from the generated document.
"""

from __future__ import annotations

import copy
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .text_fields import form_schema

# Prometheus text exposition format 0.0.4: what every Prometheus version scrapes
METRICS_MEDIA_TYPE = "text/plain; version=0.0.4"


class ErrorDetail(BaseModel):
    message: str = Field(description="what was wrong and how to fix it; starts with the field's name")
    type: str = Field(description="invalid_request_error, not_found, rate_limit_error or server_error")
    param: str | None = Field(description="the request field the error is about ('body' for the body as a whole)")
    code: str | None = Field(description="OpenAI's error code where one applies (model_not_found), else null")


class ErrorResponse(BaseModel):
    """OpenAI's error shape, used by every error this server answers."""

    error: ErrorDetail


class ImageData(BaseModel):
    b64_json: str = Field(description="the image as a base64 PNG")
    revised_prompt: str | None = Field(None, description="the prompt the DiT drew (the AR stage may add text)")


class ImageInfo(BaseModel):
    """Per-image details (a ditkv extension; OpenAI clients ignore it)."""

    request_id: str
    seed: int
    steps: int
    queue_time_s: float
    run_time_s: float
    kv_blocks: int
    prefix_tokens_reused: int
    imported_tokens: int | None = Field(None, description="stage graphs only: prefix tokens from the AR stage")
    prefix_cache_hit_tokens: int | None = Field(None, description="prefix tokens (all rows) taken from the prefix "
                                                                  "cache instead of computed; absent when none")
    encoder_cache_hits: int | None = Field(None, description="input images whose embeddings came from the encoder "
                                                             "cache instead of being encoded; absent when none")
    ar_generated_tokens: int | None = Field(None, description="single engine, a request with AR text: its tokens")
    ar_seconds: float | None = Field(None, description="single engine, a request with AR text: its AR phase's time")
    ar_time_to_first_token_s: float | None = Field(None, description="single engine, AR text: time to its first "
                                                                     "token")
    auto_size: str | None = Field(None, description="size=auto where the model picks (generations; edits "
                                                    "and chat with input images): the WIDTHxHEIGHT it chose")
    computed_steps: int | None = Field(None, description="step caching: steps that ran every layer (given when "
                                                         "some step was cached)")
    cached_steps: int | None = Field(None, description="step caching: steps that reused the middle blocks' "
                                                       "residual (given when some step was cached)")


class ImagesResponse(BaseModel):
    created: int
    size: str = Field(description="WIDTHxHEIGHT of the images made: the requested size, or the resolution "
                                  "bucket a release model snapped it to")
    data: list[ImageData]
    ditkv: list[ImageInfo]


class ImageURL(BaseModel):
    url: str = Field(description="the image as a data URI: data:image/png;base64,...")


class ImageContentPart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


class AssistantImageMessage(BaseModel):
    role: Literal["assistant"]
    content: list[ImageContentPart] = Field(description="the generated image (vllm-omni's shape: image_url parts)")


class ChatChoice(BaseModel):
    index: int
    message: AssistantImageMessage
    finish_reason: Literal["stop"]
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    """OpenAI's chat.completion with the image in the assistant message, as vllm-omni answers."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice] = Field(description="one per image (`n`), each holding one image")
    ditkv: list[ImageInfo]


def image_edit_form(max_n: int, max_images: int, max_steps: int, max_seed: int, size_pattern: str,
                    bot_tasks: tuple[str, ...]) -> dict:
    """The multipart/form-data body of POST /v1/images/edits (OpenAI's images.edit), published as
    the component `ImageEditRequest` (exact integers: `install`). Only the fields the server
    accepts: any other part (`mask` too: no inpainting) is a 400 naming it."""
    binary = {"type": "string", "format": "binary"}
    files = {"type": "array", "items": binary, "maxItems": max_images}
    text = {"type": "string"}
    return {
        "title": "ImageEditRequest",
        "type": "object",
        "required": ["prompt"],
        "additionalProperties": False,
        "properties": {
            "image": {**files, "description": f"the image(s) to edit, PNG/JPEG/WEBP, 1..{max_images} in all "
                                              "(OpenAI's clients name several 'image[]'); required"},
            "image[]": {**files, "description": "same as 'image'"},
            "prompt": {**text, "minLength": 1, "description": "the edit to make"},
            "model": text,
            "n": {"type": "integer", "minimum": 1, "maximum": max_n},
            "size": {**text, "pattern": size_pattern,
                     "description": "WIDTHxHEIGHT, or 'auto' (the default): the model picks one of its resolution "
                                    "buckets with the images in its context where the served engine can "
                                    "(ditkv[i].auto_size says which), else the first image's size, rounded "
                                    "down to whole 16 px and latent cells, longest side at most --max-image-size"},
            "response_format": {**text, "enum": ["b64_json"]},
            "output_format": {**text, "enum": ["png"]},
            "background": {**text, "enum": ["auto", "opaque"]},
            "stream": {**text, "enum": ["false"]},
            "user": text,
            "steps": {"type": "integer", "minimum": 1, "maximum": max_steps},
            "num_inference_steps": {"type": "integer", "minimum": 1, "maximum": max_steps,
                                    "description": "vllm-omni's name for steps"},
            "guidance_scale": {"type": "number", "minimum": 0},
            "seed": {"type": "integer", "minimum": 0, "maximum": max_seed},
            "negative_prompt": text,
            **form_schema(bot_tasks),  # the AR text settings and bot_task
        },
    }


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


class Health(BaseModel):
    """Queue and pool counters; stage graphs add `graph`, `transfer`, `stages`, `transfers`, ..."""

    model_config = ConfigDict(extra="allow")
    status: Literal["ok", "draining", "dead"]
    model: str
    mode: str
    waiting: int
    running: int
    in_flight: int
    kv_num_blocks: int | None = None
    kv_used_blocks: int | None = None
    kv_free_blocks: int | None = None  # free + evictable (prefix-cache pages no request holds)
    kv_evictable_blocks: int | None = None


ERROR_MEANINGS = {
    400: "invalid field, or a request the model or KV pool can never run (`param` names the field)",
    404: "unknown model",
    408: "the request body did not arrive within the server's --body-timeout",
    413: "request body over the size limit",
    429: "queue full (--max-queue); retry later",
    500: "internal error or failed generation (a bug; see the server log)",
    503: "shutting down, cancelled by shutdown, or the engine failed closed; retry on another replica",
}


def errors(*codes: int) -> dict:
    """`responses=` entries for these status codes, each in the OpenAI error shape (JSON, also on
    a route whose own responses are text: FastAPI would give a `model` the route's media type)."""
    return {code: {"description": ERROR_MEANINGS[code],
                   "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
            for code in codes}


def install(app, exact: tuple = (), components: dict | None = None) -> None:
    """Publish the schema without FastAPI's 422 responses (this server never sends one) and with
    the error model that `errors()` refers to. FastAPI stores every bound it sees as a float
    (seed's maximum 2^63-1 would read 2^63), so the request bodies are published past it:
    `exact`, models whose components (their nested models too) are pydantic's own schemas, and
    `components`, hand-written schemas by name (the edit form), which routes refer to by `$ref`."""
    generate = app.openapi

    def openapi() -> dict:
        schema = generate()  # FastAPI caches it; what follows is idempotent
        for path in schema.get("paths", {}).values():
            for op in path.values():
                op.get("responses", {}).pop("422", None)
        published = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            published.pop(name, None)
        for model in (ErrorResponse, *exact):
            _publish(published, model)
        published.update(copy.deepcopy(components or {}))
        return schema

    app.openapi = openapi


def _publish(components: dict, model) -> None:
    """`model`'s schema and its nested models' as components, refusing to replace another model's
    component of the same name (a response model's, say)."""
    own = model.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, sub in {**own.pop("$defs", {}), model.__name__: own}.items():
        kept = components.get(name)
        if kept is not None and _shape(kept) != _shape(sub):
            raise RuntimeError(f"two models publish the component {name!r}; rename one of them")
        components[name] = sub


def _shape(component: dict) -> tuple:
    """What tells two components apart (FastAPI's copy has float bounds, pydantic's exact ones)."""
    return component.get("title"), sorted(component.get("properties", {}))
