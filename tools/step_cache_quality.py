"""Held-out caption accuracy of the bundled tiny model with and without step caching, as `ditkv bench
quality` scores it (`ditkv.data.accuracy` over every held-out caption), plus the whole-request time:
one paged engine, the same seed per caption in every config (docs/step-cache.md). CPU, one thread:

    taskset -c 0 python tools/step_cache_quality.py [--steps 28] [--seeds 1] [--captions N]

The configs are interleaved: for each caption every config generates once, in an order rotated by one
per caption, so that load from other processes on the core hits each config alike. Each config's time
is the sum of its requests' wall times; the speedup is against the first config (the baseline).
A repeated config (e.g. null first and last) measures the timing noise.
"""

import argparse
import json
import sys
import time

import torch

CACHES = [None, {"type": "fbcache"}, {"type": "fbcache", "residual_threshold": 0.12, "warmup_steps": 4},
          {"type": "fbcache", "residual_threshold": 0.12, "warmup_steps": 4, "taylorseer": 1},
          {"type": "fbcache", "residual_threshold": 0.2, "warmup_steps": 4}]


def subset(specs: list, n: int | None) -> list:
    """`n` captions evenly spaced over the held-out list (every caption without `n`)."""
    if n is None or n >= len(specs):
        return specs
    return [specs[i * len(specs) // n] for i in range(n)]


def main() -> None:
    from ditkv.config import EngineConfig
    from ditkv.data import accuracy, heldout_specs
    from ditkv.engine.engine import Engine
    from ditkv.engine.types import GenerationRequest
    from ditkv.train.quality_check import FIELDS, load_bundle

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--captions", type=int, default=None, help="an evenly spaced subset of the held-out captions")
    p.add_argument("--configs", type=json.loads, default=CACHES,
                   help="JSON list of cache_config values (null: no cache; the first is the baseline)")
    a = p.parse_args()
    torch.set_num_threads(1)
    specs = [s for s in subset(heldout_specs(), a.captions) for _ in range(a.seeds)]
    engine = Engine(EngineConfig(device="cpu", num_kv_blocks=64), model_bundle=load_bundle("tiny"))
    engine.generate(GenerationRequest(prompt=specs[0].caption(), steps=2, seed=0, request_id="warm-up"))
    n = len(a.configs)
    seconds, images, cached = [0.0] * n, [[None] * len(specs) for _ in range(n)], [0] * n
    t_start = time.monotonic()
    for i, s in enumerate(specs):
        for k in [(i + j) % n for j in range(n)]:
            t0 = time.perf_counter()
            out = engine.generate(GenerationRequest(prompt=s.caption(), steps=a.steps, seed=i, request_id=f"q{i}-{k}",
                                                    cache_config=a.configs[k]))
            seconds[k] += time.perf_counter() - t0
            assert out.ok, out.error
            images[k][i] = out.image
            cached[k] += out.stats.cached_steps
        if (i + 1) % 8 == 0:
            print(f"{i + 1}/{len(specs)} captions, {time.monotonic() - t_start:.0f} s", file=sys.stderr, flush=True)
    base = accuracy(images[0], specs)
    for k, cache in enumerate(a.configs):
        acc = accuracy(images[k], specs)
        fraction = cached[k] / (a.steps * len(specs))
        delta = {f: round(acc[f] - base[f], 3) for f in FIELDS}
        print(json.dumps({"cache": cache, "steps": a.steps, "cached_fraction": round(fraction, 3),
                          "seconds": round(seconds[k], 1), "speedup": round(seconds[0] / seconds[k], 2),
                          **{f: acc[f] for f in FIELDS}, "delta_vs_none": delta, "n": acc["n"]}), flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
