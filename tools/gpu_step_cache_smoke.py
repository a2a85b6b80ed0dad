"""GPU smoke of step caching (issue 35) on the bundled tiny model: three requests with different caches,
batched and alone, eager (a cache does not capture graphs yet), with and without batch_invariant; prints one
JSON object (cached steps, whether batched equals alone, the largest pixel difference)."""

import json
import sys

import numpy as np
import torch

sys.path.insert(0, "tests")
from stage_helpers import tiny_bundle  # noqa: E402

from ditkv.config import EngineConfig  # noqa: E402
from ditkv.engine.engine import Engine  # noqa: E402
from ditkv.engine.types import GenerationRequest  # noqa: E402

PROMPTS = ["a large red circle", "blue", "a small green square on grey"]
CACHES = [{"type": "fbcache", "residual_threshold": 0.2, "warmup_steps": 2},
          {"type": "fbcache", "residual_threshold": "inf", "warmup_steps": 1, "steps_mask": [5], "taylorseer": 1},
          None]


def req(i):
    return GenerationRequest(prompt=PROMPTS[i], height=32, width=32, steps=12, guidance_scale=2.0, seed=10 + i,
                             cache_config=CACHES[i])


def run(bundle, reqs, **kw):
    eng = Engine(EngineConfig(device="cuda", block_size=16, num_kv_blocks=256, max_num_seqs=4, max_image_height=32,
                              max_image_width=32, cuda_graphs="off", **kw), model_bundle=bundle)
    try:
        ids = [eng.add_request(r) for r in reqs]
        outs = {o.request_id: o for o in eng.run_until_complete()}
        assert eng.manager.pool.num_free == eng.manager.pool.num_blocks
        return [outs[i] for i in ids]
    finally:
        eng.shutdown()


result = {}
model, tok, codec = tiny_bundle()
bundle = (model.to("cuda"), tok, codec)
for inv in (False, True):
    batched = run(bundle, [req(i) for i in range(3)], batch_invariant=inv)
    solo = [run(bundle, [req(i)], batch_invariant=inv)[0] for i in range(3)]
    result[f"batch_invariant={inv}"] = {
        "ok": [o.status for o in batched], "errors": [o.error for o in batched if not o.ok],
        "cached_steps": [o.stats.cached_steps for o in batched], "solo_cached_steps": [o.stats.cached_steps for o in solo],
        "image_max_diff": [int(np.abs(a.image.astype(int) - b.image.astype(int)).max()) if a.ok and b.ok else None
                           for a, b in zip(batched, solo)]}
result["gpu"] = torch.cuda.get_device_name(0)
print(json.dumps(result))
