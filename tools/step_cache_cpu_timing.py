"""CPU timing of step caching on the bundled tiny model at 28 steps (docs/step-cache.md): whole-request
time, cached steps and the mean pixel difference against no cache, per cache_config. One run, one thread:
run it alone on a core (`taskset -c 0 python tools/step_cache_cpu_timing.py`)."""

import json
import time

import numpy as np

from ditkv.config import EngineConfig
from ditkv.engine.engine import Engine
from ditkv.engine.types import GenerationRequest

CACHES = [None, {"type": "fbcache"}, {"type": "fbcache", "residual_threshold": 0.12, "warmup_steps": 4},
          {"type": "fbcache", "residual_threshold": 0.12, "warmup_steps": 4, "taylorseer": 1},
          {"type": "fbcache", "residual_threshold": "inf", "warmup_steps": 1}]
PROMPTS = ["a large blue square", "a small red circle in the top left"]


def main() -> None:
    eng = Engine(EngineConfig(device="cpu"))
    eng.generate(GenerationRequest(prompt=PROMPTS[0], steps=28, seed=0))  # warm-up
    base = {}
    for c in CACHES:
        times, cached, diffs = [], [], []
        for i, p in enumerate(PROMPTS):
            t = time.perf_counter()
            o = eng.generate(GenerationRequest(prompt=p, steps=28, seed=i, cache_config=c))
            times.append(round(time.perf_counter() - t, 3))
            assert o.ok, o.error
            cached.append(o.stats.cached_steps)
            base.setdefault(i, o.image)  # the first config is no cache
            diffs.append(round(float(np.abs(o.image.astype(int) - base[i].astype(int)).mean()), 2))
        print(json.dumps({"cache": c, "time_s": times, "cached": cached, "mean_abs_px_diff": diffs}))
    eng.shutdown()


if __name__ == "__main__":
    main()
