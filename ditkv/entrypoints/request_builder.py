"""Engine requests from validated front-end input, built in one place: every HTTP route
(`routes_*.py`) and `ditkv generate` turn their checked fields into `GenerationRequest`s here.

    reqs = build_requests(prompt, n, size=(w, h), steps=..., guidance_scale=..., seed=None, images=...)

- `seed`: image i of a request gets `seed + i` (the routes check `seed + n - 1 <= MAX_SEED`
  first: never clamped); without one a random seed below 2^31 is drawn, once per request.
- `size`: (width, height), or "auto" (height and width None: the model picks, size=auto); None
  leaves the engine's default.
- `request_id`: None lets the engine assign ids; a given id is used as is for one image and
  suffixed `-i` for several (the engine refuses two in-flight requests with one id).

Also the size and image steps the image-input routes share: `size_of` (a given size, or `auto`
from the first input image) and `decode_all` (uploads decoded and checked, `images.py`).
"""

from __future__ import annotations

import random

from ..engine.types import GenerationRequest
from .http_validation import Refused
from .sizes import SizeRule, auto_note

RANDOM_SEED_BOUND = 1 << 31  # a request without a seed draws one in [0, 2^31)


def default_seed(seed: int | None) -> int:
    """The request's base seed: the client's, or a random one."""
    return random.randrange(RANDOM_SEED_BOUND) if seed is None else seed


def build_requests(prompt: str, n: int = 1, *, size: tuple[int, int] | str | None = None, steps: int | None = None,
                   guidance_scale: float | None = None, seed: int | None = None,
                   negative_prompt: str | None = None, images: list | None = None,
                   request_id: str | None = None, text: dict | None = None,
                   cache_config: dict | None = None) -> list[GenerationRequest]:
    """The `n` engine requests of one validated API request (image i: seed + i). `text`: AR text
    settings (`GenerationRequest.max_new_tokens` ... `do_sample`; None values: not given)."""
    base = default_seed(seed)
    dims = {} if size is None else {"width": None, "height": None} if size == "auto" else \
        {"width": size[0], "height": size[1]}
    return [GenerationRequest(prompt=prompt, **dims, steps=steps, guidance_scale=guidance_scale, seed=base + i,
                              negative_prompt=negative_prompt, images=images, **(text or {}),
                              cache_config=cache_config,
                              request_id=request_id if request_id is None or n == 1 else f"{request_id}-{i}")
            for i in range(n)]


def size_of(size: str | None, images, L, rule: SizeRule) -> tuple[tuple[int, int] | str, str | None]:
    """(width, height) to generate with input images, or "auto": `size` as given; else (auto) the model's
    choice where the served engine can pick (`rule.auto`: the release's image_size="auto", the images in
    its context), otherwise the first input image's size in whole cells of the model (`rule`) with the note
    the engine's errors about it get."""
    from .images import auto_size

    if size is not None and size != "auto":
        w, h = (int(x) for x in size.split("x"))
        return (w, h), None
    if rule.auto:
        return "auto", None
    h, w = images[0].shape[:2]
    aw, ah = auto_size(w, h, L.max_image_size, rule.auto_multiple())
    return (aw, ah), auto_note((aw, ah), (w, h), rule)


def decode_all(items: list[tuple[str, bytes]], L) -> list:
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
