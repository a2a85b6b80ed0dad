"""Transfer counters: how many AR -> DiT KV transfers ended and how, and how many bytes moved.

One `TransferStats` per orchestrator (plain Python, thread-safe): the DiT replica reports each
ticket's verdict, the producer reports bytes after every write that returned ok. Readers (the
server's /metrics and /health) take `snapshot()`; the transfer layer never imports the HTTP layer.

A verdict is counted once per ticket, only for tickets that reached the DiT's receive side:
- ok:        every rank received every row (the request may run);
- failed:    timeout, producer write error, registration refused, invalid endpoints, fail-closed;
- cancelled: the request was cancelled (client disconnect, shutdown) while its KV was in flight.
Bytes are what producers wrote; a write that lands after its request was cancelled or timed
out still moved those bytes, so they count too. `skipped_bytes` are the pages a native import did
not move because the DiT stage's prefix cache held them (`RowDest.skip_pages`), counted when the
DiT side starts the transfer: `bytes` shows the saving, `skipped_bytes` its size.
"""

from __future__ import annotations

import threading

OUTCOMES = ("ok", "failed", "cancelled")


class TransferStats:
    def __init__(self):
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(OUTCOMES, 0)
        self.bytes = 0
        self.skipped_bytes = 0

    def finished(self, ticket, outcome: str) -> None:
        """Count `ticket`'s verdict; later verdicts for the same ticket are ignored."""
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown transfer outcome {outcome!r}; one of {OUTCOMES}")
        with self._lock:
            if getattr(ticket, "counted", None) is not None:
                return
            ticket.counted = outcome
            self.counts[outcome] += 1

    def add_bytes(self, nbytes: int) -> None:
        with self._lock:
            self.bytes += int(nbytes)

    def add_skipped(self, nbytes: int) -> None:
        with self._lock:
            self.skipped_bytes += int(nbytes)

    def record(self, ok: bool = True, nbytes: int = 0) -> None:
        """Ticket-less report (the process-wide `record_transfer` hook): bytes count only if ok."""
        with self._lock:
            self.counts["ok" if ok else "failed"] += 1
            if ok:
                self.bytes += int(nbytes)

    def snapshot(self) -> dict:
        with self._lock:
            c = dict(self.counts)
            return {"transfers": c["ok"] + c["failed"], "ok": c["ok"], "failures": c["failed"],
                    "cancelled": c["cancelled"], "bytes": self.bytes,
                    "skipped_bytes": self.skipped_bytes}
