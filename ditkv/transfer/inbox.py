"""The replica threads' inbox: block for the first message, then take what else is queued."""

from __future__ import annotations

import queue
from collections.abc import Callable


def drain(inbox: queue.Queue, block_s: float, handle: Callable[[str, object], None]) -> bool:
    """Hand every queued `(kind, arg)` to `handle`; wait up to `block_s` only for the first one.
    Returns whether anything arrived."""
    worked = False
    while True:
        try:
            kind, arg = inbox.get(timeout=block_s) if block_s > 0 and not worked else inbox.get_nowait()
        except queue.Empty:
            return worked
        worked = True
        handle(kind, arg)
