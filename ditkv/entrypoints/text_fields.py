"""The AR text settings as HTTP extra fields (issue 34 item 2): `max_new_tokens`, `temperature`,
`top_k`, `top_p` and `do_sample` on every image route, each optional (omitted: the AR stage's
default, else the checkpoint's), and `bot_task`: the prompt template's task, one of the served model
family's (`bot_tasks_of`: the release's image / auto / think / recaption; omitted: the checkpoint's).

Their bounds are `models.text_settings.TextSampling`'s, so /openapi.json says what the engine
refuses (tests/test_openapi_fuzz.py holds the server to it). The integers also stop at 2^63-1:
the stage messages carry them as msgpack int64. A single engine runs the AR phase in its own step
loop (a request with `max_new_tokens` > 0, or every request of a think/recaption checkpoint) and
refuses a setting for text a request does not write (400 naming the field); a stage graph's AR
stage draws with them, and refuses a `max_new_tokens` above its own.
"""

from __future__ import annotations

from ..engine.request_check import MAX_SEED as INT64_MAX
from ..engine.request_check import TEXT_FIELDS

AR = "AR text before the image (bot_task image: only with max_new_tokens > 0). "
HELP = {
    "max_new_tokens": AR + "At most this many text tokens (a stage graph: up to its AR stage's). Default: 0 for "
                           "bot_task image, else the stage's or the checkpoint's",
    "temperature": AR + "Sampling temperature; 0 = greedy. Default: the stage's, else the checkpoint's",
    "top_k": AR + "Sample among the k most likely tokens; 0 or -1 = no cut. Default: the checkpoint's",
    "top_p": AR + "Sample within the smallest set of this probability mass; 1 = no cut. Default: the checkpoint's",
    "do_sample": AR + "false = greedy. Default: the checkpoint's",
    "bot_task": "The prompt template's task, as the release's generate_image bot_task: 'image' draws from the "
                "prompt; 'think' / 'recaption' first write the release's rewrite in the AR phase (needs "
                "max_new_tokens > 0: the request's, else the checkpoint's); 'auto' is generate_image's auto: no "
                "text, and under use_system_prompt dynamic the checkpoint's custom system prompt. Default: the "
                "checkpoint's generation_config.json bot_task (a stage graph: its AR stage's bot_task, else that)",
}
FORM_FIELDS = (*TEXT_FIELDS, "bot_task")  # the extra fields every image route takes
# the edit form's properties (form parts are text: `edit_form.form_text` reads them as JSON would)
FORM_SCHEMA = {
    "max_new_tokens": {"type": "integer", "minimum": 0, "maximum": INT64_MAX},
    "temperature": {"type": "number", "minimum": 0},
    "top_k": {"type": "integer", "minimum": -1, "maximum": INT64_MAX},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "do_sample": {"type": "string", "enum": ["true", "false"]},
}
FORM_SCHEMA = {k: {**v, "description": HELP[k]} for k, v in FORM_SCHEMA.items()}


def form_schema(bot_tasks: tuple[str, ...]) -> dict:
    """The edit form's properties of these fields; `bot_tasks`: the served model's (`bot_tasks_of`)."""
    return {**FORM_SCHEMA, "bot_task": {"type": "string", "enum": list(bot_tasks), "description": HELP["bot_task"]}}


def bot_tasks_of(service) -> tuple[str, ...]:
    """The bot tasks the served model's family takes (its template's `BOT_TASKS`); a stand-in service
    without a model config: the default family's."""
    from ..models.family import DEFAULT_FAMILY, family_named, family_of
    from .sizes import _model_config

    cfg = _model_config(service)
    return tuple((family_named(DEFAULT_FAMILY) if cfg is None else family_of(cfg)).template.BOT_TASKS)


def text_model(bot_tasks: tuple[str, ...]):
    """A pydantic base for the JSON bodies' models, with the six fields (strict, as theirs); `bot_task`
    is one of `bot_tasks` (published as the schema's enum)."""
    from typing import Literal

    from pydantic import BaseModel, ConfigDict, Field, field_validator

    Task = Literal[tuple(bot_tasks)]  # noqa: N806 - a type

    class TextSettings(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        max_new_tokens: int | None = Field(None, ge=0, le=INT64_MAX, description=HELP["max_new_tokens"])
        temperature: float | None = Field(None, ge=0, allow_inf_nan=False, description=HELP["temperature"])
        top_k: int | None = Field(None, ge=-1, le=INT64_MAX, description=HELP["top_k"])
        top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False, description=HELP["top_p"])
        do_sample: bool | None = Field(None, description=HELP["do_sample"])
        bot_task: Task | None = Field(None, description=HELP["bot_task"])

        @field_validator("max_new_tokens", "top_k", mode="before")
        @classmethod
        def _integral_text(cls, v):  # JSON Schema counts 3.0 as an integer, so the server does too (not 2.5)
            return int(v) if isinstance(v, float) and v.is_integer() else v

    return TextSettings


def text_of(body) -> dict:
    """The settings a validated body gives, for `build_requests(text=...)` (None: not given)."""
    return {k: getattr(body, k) for k in FORM_FIELDS}
