"""Prometheus metrics of `ditkv serve`.

Two kinds of numbers:
- counters/histograms the HTTP layer updates as requests finish (`ServerMetrics`);
- gauges and transfer totals read from the service at scrape time (queue, running, KV blocks,
  per stage for a stage graph), so a scrape never waits for an engine thread.

Transfer totals come from the service's `TransferStats` (`ditkv.transfer.stats`; the orchestrator
owns one and its replicas report into it). `record_transfer(ok=..., nbytes=...)` remains as a
process-wide hook for transfer code running without an orchestrator; a server without a stage
graph exports those totals (0 unless something calls the hook).
"""

from __future__ import annotations

from collections.abc import Callable

from ..transfer.stats import TransferStats

TransferCounters = TransferStats  # the old name of the counter class
TRANSFERS = TransferStats()


def record_transfer(ok: bool = True, nbytes: int = 0) -> None:
    """Process-wide hook: call once per finished (ok) or failed ticket."""
    TRANSFERS.record(ok, nbytes)


METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# latency of a text-to-image request spans ~50 ms (tiny model) to minutes (80B model, 1024^2)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0, 600.0)
REQUEST_STATUSES = ("ok", "invalid", "rejected", "cancelled", "disconnected", "error")


BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
CACHE_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)  # cached steps / steps


def _histogram(name: str, doc: str, counts: dict[int, int], bounds):
    """A Prometheus histogram from {observed value: times observed}."""
    from prometheus_client.core import HistogramMetricFamily

    buckets = [(str(float(b)), float(sum(c for v, c in counts.items() if v <= b))) for b in bounds]
    buckets.append(("+Inf", float(sum(counts.values()))))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=float(sum(v * c for v, c in counts.items())))


class ServerMetrics:
    """One registry per app, so several servers (tests) in one process do not collide."""

    def __init__(self, engine_stats: Callable[[], dict], transfers: TransferStats | None = None):
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
        self.cached_steps = Counter("ditkv_cached_steps", "Denoising steps that reused the middle blocks' residual "
                                    "(step caching, cache_config)", registry=self.registry)
        self.cache_ratio = Histogram("ditkv_request_cache_ratio", "Cached steps / steps of each successful image "
                                     "request (0 without a cache)", buckets=CACHE_RATIO_BUCKETS,
                                     registry=self.registry)
        self.registry.register(_EngineCollector(engine_stats, TRANSFERS if transfers is None else transfers))

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import generate_latest

        # prometheus_client >= 0.22 calls its output 1.0.0; it is byte-identical to 0.0.4 for these
        # ASCII names, and 0.0.4 is what every Prometheus scrapes (and what /openapi.json documents)
        return generate_latest(self.registry), METRICS_CONTENT_TYPE


class _EngineCollector:
    """Gauges from the service snapshot + transfer totals, computed at scrape time."""

    _GAUGES = (
        ("ditkv_requests_waiting", "waiting", "Requests queued for admission"),
        ("ditkv_requests_running", "running", "Requests being executed"),
        ("ditkv_kv_blocks_total", "num_blocks", "KV cache blocks in the pool (paged mode)"),
        ("ditkv_kv_blocks_used", "used_blocks", "KV cache blocks held by requests (paged mode)"),
        ("ditkv_kv_blocks_free", "free_blocks", "KV cache blocks free, evictable cached ones included (paged mode)"),
        ("ditkv_kv_blocks_evictable", "evictable_blocks",
         "KV cache blocks held only by the prefix cache: free for allocation, reusable until evicted"),
        ("ditkv_prefix_cache_hit_ratio", "prefix_cache_hit_ratio",
         "Prefix tokens found in the prefix cache / prefix tokens looked up (cacheable full pages)"),
        ("ditkv_requests_ar", "ar_running", "Requests in their AR phase (text before the image; also in running)"),
    )
    # stage graphs: the same KV gauges labelled by stage, plus per-stage queues
    _STAGE_GAUGES = (
        ("ditkv_kv_blocks_total", "kv_num_blocks", "KV cache blocks in the pool (paged mode)"),
        ("ditkv_kv_blocks_used", "kv_used_blocks", "KV cache blocks held by requests (paged mode)"),
        ("ditkv_kv_blocks_free", "kv_free_blocks", "KV cache blocks free (paged mode)"),
        ("ditkv_stage_requests_waiting", "waiting", "Requests queued at a stage"),
        ("ditkv_stage_requests_running", "running", "Requests executing at a stage"),
        ("ditkv_kv_transfers_waiting", "waiting_for_kv", "DiT requests with pages reserved, waiting for their KV"),
        ("ditkv_kv_transfer_quarantined", "quarantined",
         "Failed/cancelled transfers whose pages stay quarantined until the write settles"),
        ("ditkv_kv_legacy_slots_free", "legacy_free_slots", "Free legacy receive slots (legacy transfer)"),
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
        if "ar_preempted" in s:  # a single engine's AR phases
            yield CounterMetricFamily("ditkv_ar_preemptions", "AR-phase requests whose pages were taken back for an "
                                      "older request (each is recomputed from its prompt)", value=float(s["ar_preempted"]))
        for key, doc in (("prefix_cache_hit_tokens", "Prefix tokens taken from the prefix cache (not computed)"),
                         ("prefix_cache_query_tokens", "Prefix tokens looked up in the prefix cache"),
                         ("prefix_shared_rows_tokens", "Prefix tokens a row took from row 0 of its request "
                          "(equal keys: computed once per request)"),
                         ("encoder_cache_hits", "Input images whose embeddings came from the encoder cache "
                          "(not encoded)")):
            if key in s:
                yield CounterMetricFamily(f"ditkv_{key}", doc, value=float(s[key]))
        sizes = s.get("batch_sizes")
        if sizes is not None:  # step-level batching: requests per denoising step
            yield _histogram("ditkv_batch_size", "Requests in each batched denoising step (step-level batching)",
                             sizes, BATCH_BUCKETS)
        stages = s.get("stages") or {}
        for name, key, doc in self._STAGE_GAUGES:
            fam = GaugeMetricFamily(name, doc, labels=["stage"])
            for stage, st in stages.items():
                if key in st:
                    fam.add_metric([stage], float(st[key]))
            if fam.samples:
                yield fam
        remote = s.get("remote_ar")
        if remote is not None:  # a separately deployed AR stage (`remote:`): its connection
            yield GaugeMetricFamily("ditkv_remote_ar_up", "1 while connected to the AR stage server",
                                    value=1.0 if remote["state"] == "connected" else 0.0)
            yield CounterMetricFamily("ditkv_remote_ar_reconnects", "Reconnects to the AR stage server",
                                      value=remote["reconnects"])
            yield GaugeMetricFamily("ditkv_remote_ar_quarantined_tickets",
                                    "Tickets of a lost AR server whose writes may still land (pages held)",
                                    value=remote["quarantined_tickets"])
        t = self.transfers.snapshot()
        yield CounterMetricFamily("ditkv_kv_transfers", "AR->DiT KV transfers finished (ok or failed)",
                                  value=t["transfers"])
        yield CounterMetricFamily("ditkv_kv_transfer_failures", "AR->DiT KV transfers that failed",
                                  value=t["failures"])
        yield CounterMetricFamily("ditkv_kv_transfer_cancellations",
                                  "AR->DiT KV transfers cancelled while in flight (disconnect, shutdown)",
                                  value=t.get("cancelled", 0))
        yield CounterMetricFamily("ditkv_kv_transfer_bytes", "Bytes written by AR->DiT KV transfers",
                                  value=t["bytes"])
        yield CounterMetricFamily("ditkv_kv_transfer_skipped_bytes", "Bytes of imported pages the DiT stage's "
                                  "prefix cache already held (not transferred)", value=t.get("skipped_bytes", 0))
