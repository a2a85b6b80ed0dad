"""Request-body limits of `ditkv serve`, enforced on the bytes as they arrive.

A Content-Length header is only a claim: a chunked body has none, so the size is counted on
every `http.request` message and the request is refused with 413 as soon as it passes the
limit, without reading (or buffering) the rest. A client that sends part of a body and stalls
gets 408 once `timeout` seconds have passed since its headers arrived; a fixed deadline (rather
than a per-chunk one) also drops a client that trickles one byte at a time.

Either answer is in the OpenAI error shape with `Connection: close`, so the server closes the
connection instead of reading the rest of a body it will never use.

Routes whose bodies carry images (`/v1/images/edits`, `/v1/chat/completions`) get their own,
larger limit, derived from the server's input-image limits (`BodyLimit(routes=...)`).

Pure ASGI on purpose: a `BaseHTTPMiddleware` would wrap `receive` itself and hide client
disconnects from the handlers.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from ..engine.request_check import MAX_INPUT_IMAGE_BYTES, MAX_INPUT_IMAGE_PIXELS

MAX_BODY_BYTES = 1 << 20  # a generation request is a few KB; refuse megabyte bodies before parsing
DEFAULT_BODY_TIMEOUT = 30.0  # seconds from the request's headers to the end of its body


@dataclass
class ServeLimits:
    max_n: int = 4
    max_image_size: int = 2048  # pixels per side
    max_queue: int = 256  # queued + running images before 429
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish on shutdown
    body_timeout: float = DEFAULT_BODY_TIMEOUT  # seconds from a request's headers to the end of its body
    max_input_images: int = 4  # input images per edit / chat request (the model's max_input_images bounds it too)
    max_input_image_bytes: int = MAX_INPUT_IMAGE_BYTES  # per encoded image file
    max_input_image_pixels: int = MAX_INPUT_IMAGE_PIXELS  # per decoded image



class BodyAborted(Exception):
    """Raised out of `receive` once the middleware has answered (413/408) for the app."""


class BodyLimit:
    """`routes`: path -> (max bytes, what a body that large should shrink) for routes whose bodies
    carry images; every other path gets `max_bytes`."""

    def __init__(self, app, max_bytes: int = MAX_BODY_BYTES, timeout: float = DEFAULT_BODY_TIMEOUT,
                 routes: dict[str, tuple[int, str]] | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.routes = dict(routes or {})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit, hint = self.routes.get(scope.get("path", ""), (self.max_bytes, None))
        declared = _content_length(scope)
        if declared is not None and declared > limit:  # refused before a byte of body is read
            return await _answer(send, 413, self._too_large(limit, hint))
        guard = _BodyGuard(self, receive, send, limit, hint)
        try:
            await self.app(scope, guard.receive, guard.send)
        except BodyAborted:
            pass  # already answered; whatever the app made of the exception was dropped

    def _too_large(self, limit: int | None = None, hint: str | None = None) -> str:
        limit = self.max_bytes if limit is None else limit
        return (f"body: larger than {limit} bytes; "
                + (hint or "a generation request is a few KB (shorten prompt / negative_prompt)"))

    def _too_slow(self) -> str:
        return (f"body: not received within {self.timeout:g} s (the server's --body-timeout); "
                "send the whole request body at once")


class _BodyGuard:
    """One request's `receive` / `send`: counts body bytes and enforces the deadline until the
    body is complete, then passes messages through untouched (the handler's later wait for a
    disconnect must not time out)."""

    def __init__(self, limit: BodyLimit, receive, send, max_bytes: int | None = None, hint: str | None = None):
        self.limit, self._receive, self._send = limit, receive, send
        self.max_bytes = limit.max_bytes if max_bytes is None else max_bytes
        self.hint = hint
        self.deadline = asyncio.get_running_loop().time() + limit.timeout
        self.size = 0
        self.body_done = False
        self.started = False  # the app sent its response start
        self.answered = False  # we answered in the app's place; drop what it sends after

    async def receive(self):
        if self.body_done:
            return await self._receive()
        remaining = self.deadline - asyncio.get_running_loop().time()
        try:
            message = await asyncio.wait_for(self._receive(), max(remaining, 0.0))
        except TimeoutError:
            await self._abort(408, self.limit._too_slow())
        if message["type"] == "http.request":
            self.size += len(message.get("body", b""))
            if self.size > self.max_bytes:
                await self._abort(413, self.limit._too_large(self.max_bytes, self.hint))
            self.body_done = not message.get("more_body", False)
        return message

    async def send(self, message):
        if self.answered:
            return
        self.started |= message["type"] == "http.response.start"
        await self._send(message)

    async def _abort(self, status: int, message: str):
        if not self.started:  # otherwise the response is under way: all we can do is stop reading
            await _answer(self._send, status, message)
            self.answered = True
        raise BodyAborted(message)


def _content_length(scope) -> int | None:
    """The declared body size; a malformed header counts as too large (h11 refuses most of them
    before the app sees the request)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else 1 << 62
    return None


async def _answer(send, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": "body",
                                 "code": None}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})  # never read the rest of this body
    await send({"type": "http.response.body", "body": body})


def client_gone(exc: BaseException | None) -> bool:
    """Whether `exc` is, or was raised from, the client closing its connection mid-body
    (starlette's `ClientDisconnect`; FastAPI re-raises it as a 400 "error parsing the body")."""
    from starlette.requests import ClientDisconnect

    while exc is not None:
        if isinstance(exc, ClientDisconnect):
            return True
        exc = exc.__cause__
    return False
