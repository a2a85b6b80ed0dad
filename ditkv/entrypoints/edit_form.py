"""The multipart/form-data body of `POST /v1/images/edits` (OpenAI's `images.edit`), read and
parsed: the image file parts, in order, within the server's limits, and the text fields, each
at most once.

Form fields are text, read as JSON reads the same values: "3" and "3.0" are the integer 3
(exactly: "9223372036854775807.0" is the largest seed, never a float that rounds up past it),
"2.5" is not an integer. A text part must decode in the body's charset (UTF-8 unless its
Content-Type says otherwise): starlette would fall back to latin-1 and hand on mojibake, so
`read_form` parses multipart bodies with a strict subclass of starlette's parser.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import re
from types import SimpleNamespace

from ..engine.request_check import MAX_PROMPT_CHARS, MAX_SEED
from .http_validation import Refused, one_of, too_many_images
from .text_fields import FORM_FIELDS

EDITS = "/v1/images/edits"
EDIT_TEXT_FIELDS = ("prompt", "model", "n", "size", "response_format", "output_format", "background", "stream",
                    "user", "steps", "num_inference_steps", "guidance_scale", "seed", "negative_prompt", *FORM_FIELDS)
# "3", "+3", "3.", "3.000": integers, as 3.0 is in JSON; the fraction part must be zeros
_INT = re.compile(r"^[+-]?[0-9]{1,20}(\.0*)?$")



# ---- multipart ---------------------------------------------------------------------------------
async def read_form(request, L) -> tuple[dict[str, str], list[tuple[str, bytes]]]:
    """The text fields (each at most once) and the image files, in order, of a multipart body.
    A client that leaves mid-body raises starlette's `ClientDisconnect` (the route counts it)."""
    from starlette.datastructures import UploadFile

    form = await _parse(request, L)
    try:
        fields: dict[str, str] = {}
        files: list[tuple[str, bytes]] = []
        uploads = [(k, v) for k, v in form.multi_items() if k in ("image", "image[]")]
        if len(uploads) > L.max_input_images:
            raise too_many_images("image", L.max_input_images)
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


HOW_TO_SEND = ("send the image(s) as file parts and the other fields as text parts, as OpenAI's images.edit "
               "does (curl: -F image=@in.png -F prompt='...', not -d; httpx: files=...)")


async def _parse(request, L):
    """The form: a multipart body through `_strict_parser()`. Any other body is refused naming
    the content type the route takes and how to send it (a url-encoded form cannot carry files)."""
    from starlette.exceptions import HTTPException
    from starlette.formparsers import MultiPartException

    ctype = request.headers.get("content-type", "")
    if not ctype.lower().startswith("multipart/form-data"):
        raise Refused(400, "body", f"body: {EDITS} takes multipart/form-data, got {ctype or 'no content type'!r}; "
                                   + HOW_TO_SEND)
    if importlib.util.find_spec("python_multipart") is None and importlib.util.find_spec("multipart") is None:
        raise Refused(500, "body", "the server cannot read multipart bodies: python-multipart is not installed "
                                   "(pip install 'ditkv[serve]')")
    limits = {"max_files": L.max_input_images + 1, "max_fields": 2 * len(EDIT_TEXT_FIELDS)}
    try:
        async with contextlib.aclosing(request.stream()) as stream:
            return await _strict_parser()(request.headers, stream, **limits).parse()
    except (HTTPException, MultiPartException) as e:  # python-multipart refused the body
        detail = str(getattr(e, "detail", None) or getattr(e, "message", e))
        if "Too many files" in detail:
            raise too_many_images("image", L.max_input_images) from None
        raise Refused(400, "body", f"body: malformed multipart/form-data ({detail})") from None


def _strict_parser():
    """starlette's multipart parser, except that a text part which does not decode in the body's
    charset is refused naming its field (starlette decodes it as latin-1 instead)."""
    from starlette.formparsers import MultiPartParser

    class StrictParser(MultiPartParser):
        def on_part_end(self) -> None:
            part, charset = getattr(self, "_current_part", None), getattr(self, "_charset", "") or "utf-8"
            if part is not None and part.file is None:
                try:
                    bytes(part.data).decode(charset)
                except UnicodeDecodeError:
                    name = part.field_name or "body"
                    raise Refused(400, name, f"{name}: not valid {charset.upper()} text; send text fields "
                                             "UTF-8 encoded") from None
            super().on_part_end()

    return StrictParser


def edit_fields(f: dict[str, str], L, max_steps: int, rule, bot_tasks: tuple[str, ...]):
    """The edit request's fields parsed and range-checked -> (namespace for `check`, engine extras).
    `rule`: the model's `sizes.SizeRule`; `bot_tasks`: the model's (the schema's enum)."""
    prompt = f.get("prompt")
    if prompt is None:
        raise Refused(400, "prompt", "prompt: field required")
    if not 1 <= len(prompt) <= MAX_PROMPT_CHARS:
        raise Refused(400, "prompt", f"prompt: must be 1..{MAX_PROMPT_CHARS} characters")
    size = f.get("size")
    if size is not None and not re.fullmatch(rule.pattern(auto=True), size):  # the schema's pattern
        raise Refused(400, "size", f"size: must be {rule.hint()}, or 'auto'")
    for key, allowed in (("background", ("auto", "opaque")), ("stream", ("false",))):
        if key in f and f[key].lower() not in allowed:
            raise Refused(400, key, f"{key}: {f[key]!r} is not supported; use {' or '.join(map(repr, allowed))}")
    if "user" in f and len(f["user"]) > 256:
        raise Refused(400, "user", "user: at most 256 characters")
    neg = f.get("negative_prompt")
    if neg is not None and len(neg) > MAX_PROMPT_CHARS:
        raise Refused(400, "negative_prompt", f"negative_prompt: at most {MAX_PROMPT_CHARS} characters")
    n = form_int(f, "n", 1, L.max_n, 1)
    steps = {k: form_int(f, k, 1, max_steps, None) for k in ("steps", "num_inference_steps")}
    body = SimpleNamespace(**steps)
    ns = SimpleNamespace(model=f.get("model"), response_format=f.get("response_format", "b64_json"),
                         output_format=f.get("output_format"), prompt=prompt, n=n,
                         seed=form_int(f, "seed", 0, MAX_SEED, None), size=None if size == "auto" else size)
    extras = {"steps": one_of(body, "steps", "num_inference_steps"), "negative_prompt": neg,
              "guidance_scale": form_float(f, "guidance_scale"), "text": form_text(f, bot_tasks)}
    return ns, extras


def form_int(f, key, lo, hi, default):
    v = f.get(key)
    if v is None:
        return default
    if not _INT.fullmatch(v.strip()):
        raise Refused(400, key, f"{key}: must be an integer, got {v[:40]!r}")
    i = int(v.strip().split(".")[0])  # the digits themselves: a float has 53 bits, seeds 63
    if not lo <= i <= hi:
        raise Refused(400, key, f"{key}: {i} must be in {lo}..{hi}")
    return i


def form_float(f, key):
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


def form_text(f: dict[str, str], bot_tasks: tuple[str, ...]) -> dict:
    """The AR text settings and bot_task of the edit form's parts, checked against
    `text_fields.form_schema` (400 naming the field)."""
    out = {"max_new_tokens": form_int(f, "max_new_tokens", 0, MAX_SEED, None),
           "top_k": form_int(f, "top_k", -1, MAX_SEED, None)}
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
    task = f.get("bot_task")
    if task is not None and task not in bot_tasks:  # exactly the schema's enum
        raise Refused(400, "bot_task", f"bot_task: must be one of {', '.join(map(repr, bot_tasks))}, got {task[:40]!r}")
    out["bot_task"] = task
    return out
