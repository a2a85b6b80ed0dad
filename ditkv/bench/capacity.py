"""`ditkv bench capacity`: how many requests a KV byte budget holds at once, paged vs dense.

Dense legacy reserves a model-owned max-shape cache per request (2 CFG rows x max_model_len);
paged reserves ceil(seq_len / block_size) blocks per actual row. The trace mixes image sizes
from 256^2 to 1024^2 (HunyuanImage-3: 16 px per latent cell), prompts of 16-1000 tokens and CFG
on/off. Admission runs through the real `DiffusionKVCacheManager`.
"""

from __future__ import annotations

import random

from ..core.kv_manager import DiffusionKVCacheManager
from ..core.layout import RowLayout
from ..errors import ConfigError
from ..argtypes import nonneg_int, positive_float, positive_int
from .common import emit, machine

# HunyuanImage-3 release geometry: 32 layers x 2 (K, V) x 8 KV heads x 128 dims x 2 bytes (bf16)
KV_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2
FIXED_TOKENS = 6  # <bos> <boi> <img_size> <img_ratio> <timestep> ... <eoi>


def add_arguments(p):
    p.add_argument("--budget-gib", type=positive_float, default=64.0, help="KV byte budget (GiB) per rank")
    p.add_argument("--block-size", type=positive_int, default=64, help="paged layout's page size in tokens")
    p.add_argument("--requests", type=positive_int, default=2000, help="trace length (more than fit)")
    p.add_argument("--seed", type=nonneg_int, default=0, help="seed of the request trace")
    p.add_argument("--json", action="store_true", help="print one JSON object only (else a table, then the JSON)")


def trace(n: int, seed: int) -> list[list[RowLayout]]:
    rng = random.Random(seed)
    sides = list(range(256, 1025, 64))
    out = []
    for _ in range(n):
        h, w = rng.choice(sides), rng.choice(sides)
        image = (h // 16) * (w // 16)
        prompt = rng.randint(16, 1000)
        prefix = prompt + 4
        seq = prefix + 1 + image + 1
        span = ((prefix + 1, prefix + 1 + image),)
        n_rows = 2 if rng.random() < 0.5 else 1
        out.append([RowLayout(i, prefix, 1 + image, seq, span) for i in range(n_rows)])
    return out


def run(args) -> dict:
    budget = int(args.budget_gib * (1 << 30))
    max_len = 1000 + FIXED_TOKENS + (1024 // 16) ** 2
    dense_bytes = 2 * max_len * KV_BYTES_PER_TOKEN  # max shape, CFG on
    dense_requests = budget // dense_bytes
    block_bytes = args.block_size * KV_BYTES_PER_TOKEN
    if budget < block_bytes:
        raise ConfigError("budget_gib", args.budget_gib,
                          f"holds no block of {block_bytes} bytes; give at least {block_bytes / (1 << 30):.6f}")
    mgr = DiffusionKVCacheManager(budget // block_bytes, args.block_size, 2, max_len)
    held = 0
    for i, rows in enumerate(trace(args.requests, args.seed)):
        if mgr.reserve_request(f"r{i}", rows) is None:
            break  # FIFO: the head does not fit, the pool is full
        held += 1
    st = mgr.stats()
    result = {
        "paged_requests": held,
        "dense_requests": int(dense_requests),
        "ratio": held / dense_requests if dense_requests else float("inf"),
        "waste": st["internal_waste"],
        "pool_used_fraction": st["used_blocks"] / st["num_blocks"],
        "block_size": args.block_size,
        "budget_bytes": budget,
        "dense_bytes_per_request": dense_bytes,
        "goal_ratio": 2.5,
        "goal_waste": 0.02,
        "machine": machine(),
    }
    table = [{"layout": "dense max-shape", "requests": result["dense_requests"], "waste": "-"},
             {"layout": f"paged (block {args.block_size})", "requests": held, "waste": f"{result['waste']:.4f}"}]
    emit(result, args.json, table, ["layout", "requests", "waste"])
    return result
