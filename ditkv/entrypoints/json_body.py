"""A large JSON request body read in short steps, for a worker thread beside the event loop.

`json.loads` of a chat body at its limit (four 20 MiB images as data URIs, ~108 MiB) is a few
C calls that each hold the GIL for 30-70 ms (decoding the whole body to one str faults in
108 MB of fresh memory; each 27 MB string is scanned and copied in one go); the event loop then
waits that long for every socket event it handles, and a /health probe, which needs a few,
took 0.2-0.3 s. `loads` returns exactly `json.loads(body)` (the value for a valid body, the
error for an invalid one) but reads the long string literals apart: a literal of more than
`LONG` bytes that JSON copies verbatim (no backslash, no control character) is cut out of the
text, decoded on its own and put back into the parsed value. What is left for `json.loads` is
small, and no single step touches more than one string's bytes.
"""

from __future__ import annotations

import json

LONG = 1 << 16  # string literals above this many bytes are read apart from the JSON text
_NOT_VERBATIM = [bytes([c]) for c in range(0x20)] + [b"\\"]  # what JSON does not copy as is


def loads(body: bytes | bytearray, long: int = LONG):
    """`json.loads(body)`, in steps that each hold the GIL for about one long string's bytes."""
    if len(body) <= long or json.detect_encoding(bytes(body[:4])) not in ("utf-8", "utf-8-sig"):
        return json.loads(bytes(body))
    start = 3 if body[:3] == b"\xef\xbb\xbf" else 0
    spans = _long_literals(body, start, long)
    if not spans:
        return json.loads(bytes(body))
    view, pieces, texts, pos = memoryview(body), [], {}, start
    try:
        for i, j in spans:  # (i, j): a literal's bytes, between its quotes
            pieces.append(bytes(view[pos:i]))
            texts[f"\x00{len(texts)}"] = str(view[i:j], "utf-8", "surrogatepass")  # as json.loads decodes
            pos = j
        pieces.append(bytes(view[pos:]))
    except UnicodeDecodeError:
        return json.loads(bytes(body))  # its error, at its position
    if any(b"\\u0000" in p for p in pieces):  # a string of the body's own could read like a placeholder
        return json.loads(bytes(body))
    skeleton = "".join(p.decode("utf-8", "surrogatepass") + (f"\\u0000{n}" if n < len(spans) else "")
                       for n, p in enumerate(pieces))
    try:
        value = json.loads(skeleton)
    except json.JSONDecodeError:
        return json.loads(bytes(body))  # the same verdict, with positions in the body as sent
    return _restore(value, texts)


def _long_literals(body, start: int, long: int) -> list[tuple[int, int]]:
    """The (first, end) byte offsets of the string literals longer than `long` that JSON copies
    verbatim. Outside a string a JSON text has no quote but a string's opening one, so the
    literals are found with `find` alone (each call one fast C scan); a body that is not valid
    JSON may be cut wrongly, and then `json.loads` of the rest fails and the whole is re-read."""
    spans, pos = [], start
    while (i := body.find(b'"', pos)) >= 0:
        j = i + 1
        while True:
            j = body.find(b'"', j)
            if j < 0:
                return spans  # unterminated: json.loads says so
            k = j
            while body[k - 1] == 0x5C:  # the backslashes before the quote (body[i] is a quote)
                k -= 1
            if (j - k) % 2 == 0:  # not escaped: the literal ends here
                break
            j += 1
        if j - i - 1 > long and all(body.find(c, i + 1, j) < 0 for c in _NOT_VERBATIM):
            spans.append((i + 1, j))
        pos = j + 1
    return spans


def _restore(value, texts: dict[str, str]):
    """`value` with every placeholder string (a key or a value) replaced by its literal's text."""
    if isinstance(value, str):
        return texts.get(value, value)
    if isinstance(value, list):
        return [_restore(v, texts) for v in value]
    if isinstance(value, dict):
        return {texts.get(k, k): _restore(v, texts) for k, v in value.items()}
    return value
