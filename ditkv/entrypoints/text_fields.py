"""The AR text settings as HTTP extra fields (issue 34 item 2): `max_new_tokens`, `temperature`,
`top_k`, `top_p` and `do_sample` on every image route, each optional (omitted: the AR stage's
default, else the checkpoint's).

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
}
# the edit form's properties (form parts are text: `edit_form.form_text` reads them as JSON would)
FORM_SCHEMA = {
    "max_new_tokens": {"type": "integer", "minimum": 0, "maximum": INT64_MAX},
    "temperature": {"type": "number", "minimum": 0},
    "top_k": {"type": "integer", "minimum": -1, "maximum": INT64_MAX},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "do_sample": {"type": "string", "enum": ["true", "false"]},
}
FORM_SCHEMA = {k: {**v, "description": HELP[k]} for k, v in FORM_SCHEMA.items()}


def text_model():
    """A pydantic base for the JSON bodies' models, with the five fields (strict, as theirs)."""
    from pydantic import BaseModel, ConfigDict, Field, field_validator

    class TextSettings(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        max_new_tokens: int | None = Field(None, ge=0, le=INT64_MAX, description=HELP["max_new_tokens"])
        temperature: float | None = Field(None, ge=0, allow_inf_nan=False, description=HELP["temperature"])
        top_k: int | None = Field(None, ge=-1, le=INT64_MAX, description=HELP["top_k"])
        top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False, description=HELP["top_p"])
        do_sample: bool | None = Field(None, description=HELP["do_sample"])

        @field_validator("max_new_tokens", "top_k", mode="before")
        @classmethod
        def _integral_text(cls, v):  # JSON Schema counts 3.0 as an integer, so the server does too (not 2.5)
            return int(v) if isinstance(v, float) and v.is_integer() else v

    return TextSettings


def text_of(body) -> dict:
    """The settings a validated body gives, for `build_requests(text=...)` (None: not given)."""
    return {k: getattr(body, k) for k in TEXT_FIELDS}
