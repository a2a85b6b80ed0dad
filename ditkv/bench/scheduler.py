"""`ditkv bench scheduler`: control-plane cost of admitting one request and encoding its metadata.

Each timed iteration is `reserve_request` (2 rows) + `encode_metadata`; frees are timed separately
so the pool never runs dry. Pure Python + numpy: no torch needed.
"""

from __future__ import annotations

import time

from ..core.kv_manager import DiffusionKVCacheManager
from ..core.layout import RowLayout
from ..core.metadata import encode_metadata
from ..argtypes import positive_int
from .common import emit, machine


def add_arguments(p):
    p.add_argument("--json", action="store_true", help="print one JSON object only")
    p.add_argument("--requests", type=positive_int, default=2000, help="requests per measurement")
    p.add_argument("--repeats", type=positive_int, default=5, help="take the best of this many measurements")
    p.add_argument("--block-size", type=positive_int, default=64, help="KV page size in tokens")


def measure(blocks_per_row: int, block_size: int, requests: int, repeats: int) -> dict:
    seq = blocks_per_row * block_size
    prefix = seq // 4
    rows = [RowLayout(i, prefix, seq - prefix - 1, seq, ((prefix + 1, seq - 1),)) for i in range(2)]
    batch = 64
    mgr = DiffusionKVCacheManager(2 * blocks_per_row * batch, block_size, 2)
    admit, free = [], []
    ids = [f"req-{i}" for i in range(requests)]
    for _ in range(repeats):
        t_admit = t_free = 0.0
        for start in range(0, requests, batch):
            chunk = ids[start:start + batch]
            t0 = time.perf_counter()
            for rid in chunk:
                encode_metadata(mgr.reserve_request(rid, rows))
            t1 = time.perf_counter()
            for rid in chunk:
                mgr.free_request(rid)
            t2 = time.perf_counter()
            t_admit += t1 - t0
            t_free += t2 - t1
        admit.append(t_admit / requests * 1e6)
        free.append(t_free / requests * 1e6)
    assert mgr.pool.num_free == mgr.pool.num_blocks
    return {"blocks_per_row": blocks_per_row, "rows": 2, "admit_us": min(admit), "free_us": min(free)}


def run(args) -> dict:
    results = [measure(n, args.block_size, args.requests, args.repeats) for n in (128, 1024)]
    out = {
        "admit_us_per_request": results[0]["admit_us"],
        "admit_us_per_request_1024": results[1]["admit_us"],
        "free_us_per_request": results[0]["free_us"],
        "free_us_per_request_1024": results[1]["free_us"],
        "goal_us": 50.0,
        "cases": results,
        "machine": machine(),
    }
    emit(out, args.json, results, ["blocks_per_row", "rows", "admit_us", "free_us"])
    return out
