"""Input images for the front ends (`ditkv generate --image`, `/v1/images/edits`, chat
`image_url` parts): bytes -> a decoded RGB uint8 array [H, W, 3], with the limits checked in an
order that never decodes more than it must.

1. the encoded size (`max_bytes`), before Pillow sees a byte;
2. the format, from the file's own header (never the client's file name or content type):
   PNG, JPEG or WEBP, as OpenAI's images API accepts;
3. the pixel count (`max_pixels`), from the header, before the pixels are decoded (a small file
   can declare a huge image: a decompression bomb is refused here);
4. the decode itself: a truncated or corrupt file is a 400, not a half-black image.

The image is then turned upright (EXIF orientation) and converted to RGB (alpha dropped, palette
and grey expanded). Data URIs (`data:image/png;base64,...`) are the only URLs accepted: the
server never fetches a remote URL.

Errors are `ImageInputError`, a `DitkvError` whose `field` names the request field (`image`,
`image[1]`, `messages[0].content[1]`) and whose `status` is the HTTP status to answer (413 for
too many bytes, else 400).
"""

from __future__ import annotations

import binascii
import io
import re

from ..engine.request_check import MAX_INPUT_IMAGE_BYTES, MAX_INPUT_IMAGE_PIXELS
from ..errors import DitkvError

FORMATS = ("PNG", "JPEG", "WEBP")  # what OpenAI's images API accepts
B64_SLICE = 1 << 20  # base64 characters decoded per call (whole 4-character groups)
_DATA_URI = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[^;,]*)*)(?P<b64>;base64)?,",
                       re.IGNORECASE)


class ImageInputError(DitkvError, ValueError):
    """A bad input image; `status` is the HTTP status (413: too many bytes, 400: anything else)."""

    def __init__(self, message: str, field: str = "image", status: int = 400):
        super().__init__(message, field=field)
        self.status = status


def decode_image(data: bytes, *, what: str = "image", field: str | None = None,
                 max_bytes: int = MAX_INPUT_IMAGE_BYTES, max_pixels: int = MAX_INPUT_IMAGE_PIXELS):
    """Encoded image bytes -> C-contiguous uint8 RGB array [H, W, 3]. `what` names the image in
    messages (`image[1]`, a file path); `field` is the request field (default: `what`)."""
    import numpy as np
    from PIL import Image, ImageOps, UnidentifiedImageError

    field = field or what
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ImageInputError(f"{what}: must be image file bytes, got {type(data).__name__}", field)
    n = len(data)
    if n == 0:
        raise ImageInputError(f"{what}: empty file; send a PNG, JPEG or WEBP image", field)
    if n > max_bytes:
        raise ImageInputError(f"{what}: {n} bytes, above the limit of {max_bytes} bytes per image; send a smaller "
                              "file (downscale it, or use JPEG/WEBP)", field, status=413)
    try:
        img = Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:  # Pillow says so for a file that merely fails to parse, too
        fmt = _signature(data)
        if fmt is not None:
            raise ImageInputError(f"{what}: corrupt or truncated {fmt} image (it starts as a {fmt} file, but its "
                                  "header does not parse)", field) from None
        raise ImageInputError(f"{what}: not a PNG, JPEG or WEBP image (the file's header matches none of "
                              f"{', '.join(FORMATS)})", field) from None
    except Image.DecompressionBombError as e:  # Pillow's own, higher limit: quote only the one enforced here
        declared = re.search(r"\((\d+) pixels\)", str(e))
        size = f"{declared.group(1)} pixels" if declared else "a huge image"
        raise ImageInputError(f"{what}: its header declares {size}, above the limit of {max_pixels} pixels per "
                              "image; downscale it", field) from None
    except Exception as e:  # a header Pillow recognises but cannot parse
        fmt = _signature(data) or "image"
        raise ImageInputError(f"{what}: corrupt or truncated {fmt} image header ({type(e).__name__}: {e})",
                              field) from None
    with img:
        w, h = img.size
        if w < 1 or h < 1:
            raise ImageInputError(f"{what}: empty image ({w}x{h} pixels)", field)
        if w * h > max_pixels:
            raise ImageInputError(f"{what}: {w}x{h} = {w * h} pixels, above the limit of {max_pixels} pixels per "
                                  "image; downscale it", field)
        try:
            img.load()  # the pixels: a truncated or corrupt body fails here
            rgb = ImageOps.exif_transpose(img).convert("RGB")
        except Exception as e:
            raise ImageInputError(f"{what}: corrupt or truncated {img.format} image ({type(e).__name__}: {e})",
                                  field) from None
    return np.ascontiguousarray(np.asarray(rgb, dtype=np.uint8))


def _signature(data: bytes) -> str | None:
    """The format whose magic bytes `data` starts with, if any of FORMATS."""
    head = bytes(data[:12])
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if head.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP":
        return "WEBP"
    return None


def data_uri_bytes(url: str, *, what: str, max_bytes: int = MAX_INPUT_IMAGE_BYTES) -> bytes:
    """The bytes of a base64 `data:image/...;base64,...` URI. Remote URLs (http, https, file, ...)
    are refused: the server fetches nothing on a client's behalf."""
    if not isinstance(url, str) or not url:
        raise ImageInputError(f"{what}: must be a data URI (data:image/png;base64,...)", what)
    m = _DATA_URI.match(url[:512])
    if m is None:
        scheme = url.split(":", 1)[0].lower() if ":" in url[:16] else ""
        if scheme in ("http", "https", "ftp", "file", "s3", "gs"):
            raise ImageInputError(f"{what}: remote image URLs ({scheme}://...) are not fetched by this server; inline "
                                  "the image as a data URI: data:image/png;base64,<base64 of the file>", what)
        raise ImageInputError(f"{what}: must be a data URI (data:image/png;base64,<base64 of the file>)", what)
    mime = (m.group("mime") or "").lower()
    if not mime.startswith("image/"):
        raise ImageInputError(f"{what}: data URI of type {mime or 'text/plain'!r}; send an image "
                              "(data:image/png;base64,...)", what)
    if not m.group("b64"):
        raise ImageInputError(f"{what}: the data URI must be base64 encoded (data:{mime};base64,...)", what)
    malformed = ImageInputError(f"{what}: the data URI's base64 payload is malformed", what)
    try:  # base64 is ASCII: bytes from here on (a regex over a 27 MB str held the GIL for 0.3 s)
        payload = url[m.end():].encode("ascii")
    except UnicodeEncodeError:
        raise malformed from None
    # standard base64 as MIME writes it may be broken into lines: ASCII whitespace (space, \t, \n,
    # \r, \v, \f: what bytes.split splits on) is dropped, nothing else
    if any(payload.find(c) >= 0 for c in (b" ", b"\t", b"\n", b"\r", b"\v", b"\f")):
        payload = b"".join(payload.split())
    # base64 grows 4/3: refuse a payload whose decoded size must be above the limit before decoding
    if len(payload) > (max_bytes + 2) // 3 * 4 + 4:
        raise ImageInputError(f"{what}: about {len(payload) * 3 // 4} bytes, above the limit of {max_bytes} bytes "
                              "per image; send a smaller file", what, status=413)
    # decoded a slice at a time: each slice is one C call holding the GIL, so the server's event loop
    # (routes_chat parses in a worker thread) waits ~3 ms at a time, never ~70 ms for a whole image.
    # The slices are whole 4-character groups before any padding, the last one takes the rest: the
    # verdict is one strict decode's
    view, pad = memoryview(payload), payload.find(b"=")
    starts = range(0, max(len(payload) if pad < 0 else pad, 1), B64_SLICE)
    try:
        return b"".join(binascii.a2b_base64(view[a:b], strict_mode=True)
                        for a, b in zip(starts, [*starts[1:], len(payload)]))
    except (binascii.Error, ValueError):
        raise malformed from None


def auto_size(width: int, height: int, max_side: int, multiple: int = 16) -> tuple[int, int]:
    """`size=auto`: the input image's size, scaled down so that neither side exceeds `max_side`,
    then rounded down to a multiple of `multiple` pixels (the server passes whole 16 px and whole
    latent cells of the model, `sizes.SizeRule.auto_multiple`; a release model then snaps to its
    nearest resolution bucket)."""
    scale = min(1.0, max_side / max(width, height))
    w = max(multiple, int(width * scale) // multiple * multiple)
    h = max(multiple, int(height * scale) // multiple * multiple)
    return w, h
