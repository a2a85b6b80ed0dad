"""Request checks of `ditkv serve` that the JSON schema cannot express, and the OpenAI-shaped
messages for FastAPI's validation errors and the engine's own refusals (`param` names the field)."""

from __future__ import annotations

from ..engine.request_check import MAX_SEED

SIZE_PATTERN = r"^[1-9][0-9]{0,4}x[1-9][0-9]{0,4}$"  # any positive size; a model's own: sizes.SizeRule.pattern


class Refused(Exception):
    """A request the image routes refuse: the status, the field (`param`) and the message."""

    def __init__(self, status: int, param: str, message: str):
        super().__init__(message)
        self.status, self.param, self.message = status, param, message


def too_many_images(where: str, limit: int) -> Refused:
    """The 400 for more input images than --max-input-images, one wording for both routes (the
    model's own limit is the engine's: `models.family.check_input_image_count`)."""
    return Refused(400, "messages" if where.startswith("messages") else "image",
                   f"{where}: more than {limit} input images; this server takes at most {limit} per request "
                   "(--max-input-images)")


def one_of(body, a: str, b: str):
    """`steps` under either name (vllm-omni says num_inference_steps); both must agree."""
    x, y = getattr(body, a), getattr(body, b)
    if x is not None and y is not None and x != y:
        raise Refused(400, b, f"{b}: {y} differs from {a}={x}; give one of them")
    return x if x is not None else y


def json_content_type(ctype: str | None) -> bool:
    """Whether a body with this Content-Type is read as JSON (FastAPI's rule: application/json or
    application/*+json; no Content-Type is not JSON, against cross-site form posts)."""
    mime = (ctype or "").split(";", 1)[0].strip().lower()
    return mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))


def not_json_body(ctype: str | None = None) -> str:
    """The 400 for a JSON route's body that was not sent as JSON; `ctype`: its Content-Type, when known."""
    got = ("has no Content-Type header" if ctype == "" else f"was sent as {ctype!r}" if ctype
           else "was not sent as application/json")
    return (f"body: the request {got}, so its body was not read as JSON; send the JSON object with the header "
            "Content-Type: application/json (curl: -H 'Content-Type: application/json')")


# ---- validation ------------------------------------------------------------------------------
def _parse_size(size: str) -> tuple[int, int]:
    w, h = (int(x) for x in size.split("x"))
    return w, h


def _check_request(body, limits, model_name: str):
    """Checks the schema cannot express; returns (status, param, message) or None."""
    if body.model is not None and body.model != model_name:
        return 404, "model", f"model: unknown model {body.model!r}; this server serves {model_name!r}"
    if body.response_format != "b64_json":
        if body.response_format == "url":
            return 400, "response_format", ("response_format: 'url' is not supported (the server keeps no "
                                            "images); use 'b64_json'")
        return 400, "response_format", f"response_format: {body.response_format!r} is not supported; use 'b64_json'"
    if body.output_format not in (None, "png"):
        return 400, "output_format", f"output_format: {body.output_format!r} is not supported; use 'png'"
    if not body.prompt.strip():
        return 400, "prompt", "prompt: must contain non-whitespace text"
    if body.seed is not None and body.seed + body.n - 1 > MAX_SEED:  # image i uses seed + i: never clamp
        return 400, "seed", (f"seed: {body.seed} with n={body.n} would use seeds up to {body.seed + body.n - 1}, "
                             f"above {MAX_SEED} (image i uses seed + i); use seed <= {MAX_SEED - body.n + 1}")
    if body.size and body.size != "auto":  # auto: checked by the schema's pattern, judged by the engine
        w, h = _parse_size(body.size)
        if max(w, h) > limits.max_image_size:
            return 400, "size", (f"size: {body.size} exceeds this server's max_image_size="
                                 f"{limits.max_image_size} pixels per side")
    return None


def _describe_engine_error(e, size_note: str | None = None) -> tuple[str, str]:
    """(param, message) of an engine `DitkvError`; its `field` names the request field. Without
    one the error is about the request's length, which the prompt drives. `size_note`: where the
    size came from when the client did not give it (size=auto), added to errors about the size."""
    param = getattr(e, "field", None) or "prompt"
    message = str(e)
    named = message.startswith(param) and message[len(param):len(param) + 1] in (":", "=", " ")
    message = message if named else f"{param}: {message}"
    return param, f"{message}; {size_note}" if size_note and param == "size" else message


def _describe_validation_error(errors, model, required: str = "prompt",
                               size_hint: str = "'WIDTHxHEIGHT' in pixels, e.g. '64x64'") -> tuple[str, str]:
    if not errors:
        return "body", "invalid request"
    e = errors[0]
    # a union (chat `content`: text or parts) reports one error per branch: the deepest is the useful one
    head = tuple(e.get("loc", ()))[:3]
    e = max((x for x in errors if tuple(x.get("loc", ()))[:3] == head), key=lambda x: len(x.get("loc", ())))
    loc = [p for p in e.get("loc", ()) if p != "body"]
    param = str(loc[0]) if loc else "body"
    where = _location(loc) if len(loc) > 1 else param  # nested (chat messages): messages[0].content[1].type
    kind, msg = e.get("type", ""), e.get("msg", "invalid")
    if kind == "json_invalid":
        return "body", f"body: not valid JSON ({e.get('ctx', {}).get('error', msg)})"
    if param == "body":
        if kind == "value_error":  # a model-level check (chat: extra_body)
            return "body", f"body: {msg.removeprefix('Value error, ')}"
        if isinstance(e.get("input"), (bytes, bytearray)):  # FastAPI reads a body as JSON only if it says so
            return "body", not_json_body()
        return "body", f"body: must be a JSON object with at least a '{required}' field"
    if kind == "extra_forbidden":
        if len(loc) > 1:
            return param, f"{where}: unknown field"
        known = ", ".join(sorted(model.model_fields))
        return param, f"{param}: unknown field; accepted fields: {known}"
    if kind == "missing":
        return param, f"{where}: field required"
    if param == "size" and kind == "string_pattern_mismatch":
        auto = "auto|" in str(e.get("ctx", {}).get("pattern", ""))  # chat's size may also be 'auto'
        return param, f"size: must be {size_hint}" + (", or 'auto'" if auto else "")
    if kind == "value_error":  # a field's own check: its message names the field
        return param, f"{where}: {msg.removeprefix('Value error, ')}"
    got = repr(e.get("input"))
    got = got if len(got) <= 60 else got[:57] + "..."
    if kind in ("dict_type", "model_type", "model_attributes_type"):  # chat's extra_body, a message
        return param, f"{where}: must be a JSON object (got {got})"
    return param, f"{where}: {msg} (got {got})"


def _location(loc) -> str:
    """('messages', 0, 'content', 1, 'type') -> 'messages[0].content[1].type' (pydantic's union
    branch names, such as 'str' or 'list[...]', are dropped)."""
    out = ""
    for p in loc:
        if isinstance(p, int):
            out += f"[{p}]"
        elif p in ("str",) or "[" in str(p) or str(p).startswith("function-"):
            continue
        else:
            out += f".{p}" if out else str(p)
    return out
