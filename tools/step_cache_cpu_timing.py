"""CPU timing of step caching on the bundled tiny model at 28 steps (docs/step-cache.md): whole-request
time, cached steps and the mean pixel difference against no cache, per cache_config. One run, one thread."""
import time, json, sys, numpy as np
from ditkv.config import EngineConfig
from ditkv.engine.engine import Engine
from ditkv.engine.types import GenerationRequest
CACHES = [None, {"type": "fbcache"}, {"type": "fbcache", "residual_threshold": 0.12, "warmup_steps": 4},
          {"type": "fbcache", "residual_threshold": 0.12, "warmup_steps": 4, "taylorseer": 1},
          {"type": "fbcache", "residual_threshold": "inf", "warmup_steps": 1}]
eng = Engine(EngineConfig(device="cpu"))
print("layers", eng.executor.model_config.num_hidden_layers)
prompts = ["a large blue square", "a small red circle in the top left"]
eng.generate(GenerationRequest(prompt=prompts[0], steps=28, seed=0))  # warm-up
base = {}
for c in CACHES:
    ts, cs, diffs = [], [], []
    for i, p in enumerate(prompts):
        r = GenerationRequest(prompt=p, steps=28, seed=i, cache_config=c if c else None)
        t = time.perf_counter(); o = eng.generate(r); ts.append(time.perf_counter() - t)
        assert o.ok, o.error
        cs.append(o.stats.cached_steps)
        if c is None: base[i] = o.image
        diffs.append(float(np.abs(o.image.astype(int) - base[i].astype(int)).mean()))
    print(json.dumps({"cache": c, "time_s": [round(x, 3) for x in ts], "cached": cs, "mean_abs_px_diff": [round(d, 2) for d in diffs],
                      "size": list(o.image.shape)}))
