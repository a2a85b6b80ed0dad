"""GPU smoke of step caching (issue 35) on the bundled tiny model; prints one JSON object.

- eager (fp32): three requests with different caches, batched and alone, with and without batch_invariant
  (cached steps, whether batched equals alone, the largest pixel difference);
- graphs (bf16, Triton attention, cuda_graphs=on): four requests whose caches share Fn = 1, Bn = 0, so
  each step replays the front / middle / back parts (`worker/step_cache_graph.py`): batched and alone,
  the part keys captured, and the images against the same requests run eagerly (cuda_graphs=off)."""

import json
import sys

import torch

sys.path.insert(0, "tests")
from gpu_smoke_common import batched_vs_solo, image_max_diff, run  # noqa: E402
from stage_helpers import tiny_bundle  # noqa: E402

from ditkv.engine.types import GenerationRequest  # noqa: E402

INF = float("inf")
PROMPTS = ["a large red circle", "blue", "a small green square on grey", "two tall towers"]
CACHES = [{"type": "fbcache", "residual_threshold": 0.2, "warmup_steps": 2},
          {"type": "fbcache", "residual_threshold": "inf", "warmup_steps": 1, "steps_mask": [5], "taylorseer": 1},
          None]
SAME_CUTS = [{"type": "fbcache", "residual_threshold": INF, "warmup_steps": 1, "steps_mask": [4]},
             {"type": "fbcache", "residual_threshold": INF, "warmup_steps": 3, "max_continuous_cached_steps": 1,
              "taylorseer": 2},
             None,
             {"type": "fbcache", "residual_threshold": 0.2, "warmup_steps": 2, "taylorseer": 1}]


def req(i, caches=CACHES):
    return GenerationRequest(prompt=PROMPTS[i], height=32, width=32, steps=12, guidance_scale=2.0, seed=10 + i,
                             cache_config=caches[i], request_id=f"r{i}")


def counts(batched, solo):
    return {"cached_steps": [o.stats.cached_steps for o in batched],
            "solo_cached_steps": [o.stats.cached_steps for o in solo]}


def part_keys(eng):
    g = eng.worker.runner.step_graphs
    return {"parts": sorted({f"{k[0]}:{len(k[1][0][0])}" for k in g.parts}), "whole": len(g.graphs),
            "captures": g.captures}


model, tok, codec = tiny_bundle()
bundle = (model.to("cuda"), tok, codec)
result = {f"eager batch_invariant={inv}": batched_vs_solo(bundle, [req(i) for i in range(3)], counts,
                                                          cuda_graphs="off", batch_invariant=inv)
          for inv in (False, True)}
bf16 = (model.to(torch.bfloat16), tok, codec)
reqs = [req(i, SAME_CUTS) for i in range(4)]
kw = {"attention_backend": "triton"}
for inv in (False, True):
    out = batched_vs_solo(bf16, reqs, counts, cuda_graphs="on", batch_invariant=inv, **kw)
    graphs, keys = run(bf16, reqs, inspect=part_keys, cuda_graphs="on", batch_invariant=inv, **kw)
    eager = run(bf16, reqs, cuda_graphs="off", batch_invariant=inv, **kw)
    out |= keys | {"eager_cached_steps": [o.stats.cached_steps for o in eager],
                   "graphs_vs_eager_max_diff": [image_max_diff(a, b) for a, b in zip(graphs, eager)]}
    result[f"graphs batch_invariant={inv}"] = out
result["gpu"] = torch.cuda.get_device_name(0)
print(json.dumps(result))
