"""Held-out caption accuracy of the bundled tiny model with and without step caching, as `ditkv bench
quality` scores it (`ditkv.data.accuracy` over every held-out caption), plus the whole-run time: one
paged engine, the same seeds, one run per cache_config (docs/step-cache.md). CPU, one thread:

    taskset -c 0 python tools/step_cache_quality.py [--steps 28] [--seeds 1]
"""

import argparse
import json
import time

import torch

CACHES = [None, {"type": "fbcache"}, {"type": "fbcache", "residual_threshold": 0.12, "warmup_steps": 4},
          {"type": "fbcache", "residual_threshold": 0.12, "warmup_steps": 4, "taylorseer": 1},
          {"type": "fbcache", "residual_threshold": 0.2, "warmup_steps": 4}]


def main() -> None:
    from ditkv.config import EngineConfig
    from ditkv.data import accuracy, heldout_specs
    from ditkv.engine.engine import Engine
    from ditkv.engine.types import GenerationRequest
    from ditkv.train.quality_check import FIELDS, load_bundle

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--configs", type=json.loads, default=CACHES,
                   help="JSON list of cache_config values in run order (null: no cache; the first is the baseline)")
    a = p.parse_args()
    torch.set_num_threads(1)
    specs = [s for s in heldout_specs() for _ in range(a.seeds)]
    engine = Engine(EngineConfig(device="cpu", num_kv_blocks=64), model_bundle=load_bundle("tiny"))
    base = None
    for cache in a.configs:
        t0, images, cached = time.monotonic(), [], 0
        for i, s in enumerate(specs):
            out = engine.generate(GenerationRequest(prompt=s.caption(), steps=a.steps, seed=i, request_id=f"q{i}",
                                                    cache_config=cache))
            assert out.ok, out.error
            images.append(out.image)
            cached += out.stats.cached_steps
        acc = accuracy(images, specs)
        seconds = time.monotonic() - t0
        base = base or {**acc, "seconds": seconds}  # the first run
        print(json.dumps({"cache": cache, "cached_fraction": round(cached / (a.steps * len(specs)), 3),
                          "seconds": round(seconds, 1), "speedup": round(base["seconds"] / seconds, 2),
                          **{f: acc[f] for f in FIELDS}, "delta_vs_none": {f: round(acc[f] - base[f], 3) for f in FIELDS},
                          "n": acc["n"]}), flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
