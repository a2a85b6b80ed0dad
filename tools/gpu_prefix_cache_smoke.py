"""GPU smoke of the prefix cache (issue 36): the bench's `edits` and `system` cases (ditkv/bench/prefix.py, tiny
models, 6 requests one after another) on CUDA with the cache off and on, under batch_invariant and without; prints
one JSON object: hit tokens per request and the largest pixel difference on vs off (0 = bit-identical)."""

import json
import types

import numpy as np
import torch

from ditkv.bench import prefix
from ditkv.config import EngineConfig
from ditkv.engine.engine import Engine


def one_by_one(model, bundle, requests, cache, inv):
    longest = max(len(r.prompt) for r in requests)
    eng = Engine(EngineConfig(model=model, device="cuda", block_size=16, num_kv_blocks=4096, batch_invariant=inv,
                              diffusion_kv_max_rows_per_request=2, max_prompt_tokens=max(256, longest),
                              enable_prefix_caching=cache), model_bundle=bundle)
    outs = []
    try:
        for r in requests:
            eng.add_request(r)
            o = eng.run_until_complete()[0]
            assert o.ok, o.error
            outs.append(o)
        assert eng.manager.pool.num_free == eng.manager.pool.num_blocks
    finally:
        eng.shutdown()
    return outs


args = types.SimpleNamespace(size=64, steps=6, system_tokens=1000)
result = {"gpu": torch.cuda.get_device_name(0)}
for name, build in (("edits", prefix._edits_tiny), ("system", prefix._system_tiny)):
    model, change, requests = build(args, 6)
    bundle = prefix._bundle(model, change)
    bundle = (bundle[0].to("cuda"),) + tuple(bundle[1:])
    for inv in (True, False):
        off = one_by_one(model, bundle, requests, False, inv)
        on = one_by_one(model, bundle, requests, True, inv)
        result[f"{name} batch_invariant={inv}"] = {
            "hit_tokens": [o.stats.prefix_cache_hit_tokens for o in on],
            "max_diff": [int(np.abs(a.image.astype(int) - b.image.astype(int)).max()) for a, b in zip(off, on)]}
print(json.dumps(result))
