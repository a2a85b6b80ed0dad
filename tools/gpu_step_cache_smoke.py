"""GPU smoke of step caching (issue 35) on the bundled tiny model: three requests with different caches,
batched and alone, eager (a cache does not capture graphs yet), with and without batch_invariant; prints one
JSON object (cached steps, whether batched equals alone, the largest pixel difference)."""

import json
import sys

import torch

sys.path.insert(0, "tests")
from gpu_smoke_common import batched_vs_solo  # noqa: E402
from stage_helpers import tiny_bundle  # noqa: E402

from ditkv.engine.types import GenerationRequest  # noqa: E402

PROMPTS = ["a large red circle", "blue", "a small green square on grey"]
CACHES = [{"type": "fbcache", "residual_threshold": 0.2, "warmup_steps": 2},
          {"type": "fbcache", "residual_threshold": "inf", "warmup_steps": 1, "steps_mask": [5], "taylorseer": 1},
          None]


def req(i):
    return GenerationRequest(prompt=PROMPTS[i], height=32, width=32, steps=12, guidance_scale=2.0, seed=10 + i,
                             cache_config=CACHES[i])


def counts(batched, solo):
    return {"cached_steps": [o.stats.cached_steps for o in batched],
            "solo_cached_steps": [o.stats.cached_steps for o in solo]}


model, tok, codec = tiny_bundle()
bundle = (model.to("cuda"), tok, codec)
result = {f"batch_invariant={inv}": batched_vs_solo(bundle, [req(i) for i in range(3)], counts, cuda_graphs="off",
                                                    batch_invariant=inv) for inv in (False, True)}
result["gpu"] = torch.cuda.get_device_name(0)
print(json.dumps(result))
