"""The AR text settings as HTTP extra fields (issue 34 item 2): `max_new_tokens`, `temperature`,
`top_k`, `top_p` and `do_sample` on every image route, each optional (omitted: the AR stage's
default, else the checkpoint's).

Their bounds are `models.text_settings.TextSampling`'s, so /openapi.json says what the engine
refuses (tests/test_openapi_fuzz.py holds the server to it). The integers also stop at 2^63-1:
the stage messages carry them as msgpack int64. A single-stage engine writes no text and refuses
any of them (`request_check.refuse_text_settings`: 400 naming the field); a stage graph's AR stage
draws with them, and refuses a `max_new_tokens` above its own.
"""

from __future__ import annotations

import math

from ..engine.request_check import MAX_SEED as INT64_MAX
from ..engine.request_check import TEXT_FIELDS
from .http_validation import Refused

AR = "AR text (stage graphs only: a single-stage engine refuses it). "
HELP = {
    "max_new_tokens": AR + "At most this many text tokens, up to the AR stage's max_new_tokens. Default: the stage's",
    "temperature": AR + "Sampling temperature; 0 = greedy. Default: the stage's, else the checkpoint's",
    "top_k": AR + "Sample among the k most likely tokens; 0 or -1 = no cut. Default: the checkpoint's",
    "top_p": AR + "Sample within the smallest set of this probability mass; 1 = no cut. Default: the checkpoint's",
    "do_sample": AR + "false = greedy. Default: the checkpoint's",
}
# the edit form's properties (form parts are text: `form_text` reads them as JSON would)
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


def form_text(f: dict[str, str]) -> dict:
    """The settings of the edit form's text parts, checked against `FORM_SCHEMA` (400 naming the field)."""
    from .edit_form import form_int

    out = {"max_new_tokens": form_int(f, "max_new_tokens", 0, INT64_MAX, None),
           "top_k": form_int(f, "top_k", -1, INT64_MAX, None)}
    for key, ok, valid in (("temperature", lambda x: x >= 0, "a finite number >= 0 (0 = greedy)"),
                           ("top_p", lambda x: 0 < x <= 1, "a number in (0, 1] (1 = no top-p cut)")):
        v = f.get(key)
        try:
            x = None if v is None else float(v)
        except ValueError:
            raise Refused(400, key, f"{key}: must be a number, got {v[:40]!r}") from None
        if x is not None and not (math.isfinite(x) and ok(x)):
            raise Refused(400, key, f"{key}: {v[:40]} must be {valid}")
        out[key] = x
    v = f.get("do_sample")
    if v not in (None, "true", "false"):  # exactly the schema's enum
        raise Refused(400, "do_sample", f"do_sample: must be 'true' or 'false', got {v[:40]!r}")
    out["do_sample"] = None if v is None else v == "true"
    return out
