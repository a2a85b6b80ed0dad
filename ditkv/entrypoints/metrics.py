"""Prometheus metrics of `ditkv serve`, and the transfer-counter hook.

Two kinds of numbers:
- counters/histograms the HTTP layer updates as requests finish (`ServerMetrics`);
- gauges read from the engine's stats snapshot at scrape time (queue, running, KV blocks),
  so a scrape never waits for the engine thread.

Transfer hook: the AR->DiT transfer layer reports each finished ticket with
`record_transfer(ok=..., nbytes=...)`. It is plain Python (no prometheus_client import), so the
transfer code can call it whether or not the server is running; `/metrics` exports the totals as
`ditkv_kv_transfers_total`, `ditkv_kv_transfer_failures_total`, `ditkv_kv_transfer_bytes_total`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class TransferCounters:
    """Process-wide transfer totals; thread-safe because connectors report from their own threads."""

    def __init__(self):
        self._lock = threading.Lock()
        self.transfers = 0
        self.failures = 0
        self.bytes = 0

    def record(self, ok: bool = True, nbytes: int = 0) -> None:
        with self._lock:
            self.transfers += 1
            self.failures += 0 if ok else 1
            self.bytes += int(nbytes) if ok else 0

    def snapshot(self) -> dict:
        with self._lock:
            return {"transfers": self.transfers, "failures": self.failures, "bytes": self.bytes}


TRANSFERS = TransferCounters()


def record_transfer(ok: bool = True, nbytes: int = 0) -> None:
    """Hook for the transfer layer: call once per finished (ok) or failed ticket."""
    TRANSFERS.record(ok, nbytes)


# latency of a text-to-image request spans ~50 ms (tiny model) to minutes (80B model, 1024^2)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0, 600.0)
REQUEST_STATUSES = ("ok", "invalid", "rejected", "cancelled", "disconnected", "error")


class ServerMetrics:
    """One registry per app, so several servers (tests) in one process do not collide."""

    def __init__(self, engine_stats: Callable[[], dict], transfers: TransferCounters = TRANSFERS):
        import prometheus_client
        from prometheus_client import CollectorRegistry, Counter, Histogram

        prometheus_client.disable_created_metrics()  # *_created series only add noise to scrapes
        self.registry = CollectorRegistry()
        self.requests = Counter("ditkv_requests", "Image generation HTTP requests by outcome", ["status"],
                                registry=self.registry)
        for s in REQUEST_STATUSES:  # export every series from the start, at 0
            self.requests.labels(s)
        self.images = Counter("ditkv_images_generated", "Images returned to clients", registry=self.registry)
        self.latency = Histogram("ditkv_request_latency_seconds",
                                 "End-to-end latency of successful generation requests (queue + run + encode)",
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.queue_time = Histogram("ditkv_request_queue_seconds", "Time an image request waited for admission",
                                    buckets=LATENCY_BUCKETS, registry=self.registry)
        self.run_time = Histogram("ditkv_request_run_seconds", "Engine run time of one image request",
                                  buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(engine_stats, transfers))

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _EngineCollector:
    """Gauges from the engine snapshot + transfer totals, computed at scrape time."""

    _GAUGES = (
        ("ditkv_requests_waiting", "waiting", "Requests queued for admission"),
        ("ditkv_requests_running", "running", "Requests being executed"),
        ("ditkv_kv_blocks_total", "num_blocks", "KV cache blocks in the pool (paged mode)"),
        ("ditkv_kv_blocks_used", "used_blocks", "KV cache blocks held by requests (paged mode)"),
        ("ditkv_kv_blocks_free", "free_blocks", "KV cache blocks free (paged mode)"),
    )

    def __init__(self, engine_stats, transfers):
        self.engine_stats = engine_stats
        self.transfers = transfers

    def describe(self):
        return []  # dynamic collector: nothing to check for name clashes at registration

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.engine_stats()
        yield GaugeMetricFamily("ditkv_engine_alive", "1 while the engine thread serves requests",
                                value=1.0 if s.get("alive") else 0.0)
        for name, key, doc in self._GAUGES:
            if key in s:  # KV gauges exist in paged mode only
                yield GaugeMetricFamily(name, doc, value=float(s[key]))
        t = self.transfers.snapshot()
        yield CounterMetricFamily("ditkv_kv_transfers", "AR->DiT KV transfers finished (ok or failed)",
                                  value=t["transfers"])
        yield CounterMetricFamily("ditkv_kv_transfer_failures", "AR->DiT KV transfers that failed",
                                  value=t["failures"])
        yield CounterMetricFamily("ditkv_kv_transfer_bytes", "Bytes moved by successful AR->DiT KV transfers",
                                  value=t["bytes"])
