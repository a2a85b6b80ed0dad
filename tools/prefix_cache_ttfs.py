"""Time to the first denoise step, prefix cache on vs off (CPU fp32, tiny model): 4 requests whose
prompts share a long system text, after one earlier request with that text warmed the cache.

    PYTHONPATH=. taskset -c 1 python tools/prefix_cache_ttfs.py [image size, default 64]

Prints, per setting, the wall time of the engine step that admits the 4 and runs their prefill, the
prefix-cache hit tokens and the first step's query tokens, then the time ratio and the shared share
of the first step's tokens (the issue-36 goal: time saved >= 0.9 x that share)."""
import sys
import time

import numpy as np
import torch

from ditkv.config import EngineConfig
from ditkv.engine.engine import Engine
from ditkv.engine.types import GenerationRequest
from ditkv.models.loader import load_model

SYSTEM = ("You are a careful illustrator. Draw exactly what is asked, with flat colours, clean outlines, a plain "
          "background and no text. ") * 8


def main(size: int) -> None:
    bundle = load_model("tiny", torch.device("cpu"), torch.float32)

    def req(i, seed):
        return GenerationRequest(prompt=SYSTEM + f"request {i}: a blue square", request_id=f"r{i}", seed=seed,
                                 height=size, width=size, steps=2, guidance_scale=2.0)

    res = {}
    for cache in (False, True):
        eng = Engine(EngineConfig(device="cpu", dtype="float32", block_size=16, num_kv_blocks=2048, max_num_seqs=4,
                                  max_prompt_tokens=1200, enable_prefix_caching=cache), model_bundle=bundle)
        eng.generate(req(99, 99))  # warms the cache (and the process) with the shared text
        t0 = time.perf_counter()
        for i in range(4):
            eng.add_request(req(i, i))
        eng.step()  # admits the 4 and runs their first (prefill) step
        dt = time.perf_counter() - t0
        denoise = {rid: r.denoise_tokens for rid, r in eng.scheduler.running.items()}  # step 2's query tokens
        outs = {o.request_id: o for o in eng.run_until_complete()}
        first = sum(o.stats.tokens_computed - denoise[rid] for rid, o in outs.items())
        res[cache] = dt, outs, first
        print(f"cache={'on ' if cache else 'off'}: first step of 4 requests {dt * 1000:.1f} ms; hit tokens per "
              f"request {[o.stats.prefix_cache_hit_tokens for o in outs.values()]}; tokens computed (2 steps) "
              f"{[o.stats.tokens_computed for o in outs.values()]}; first step's query tokens {first}")
        eng.shutdown()
    off, on = res[False], res[True]
    same = all(np.array_equal(on[1][k].image, off[1][k].image) for k in off[1])
    share = 1 - on[2] / off[2]
    saved = 1 - on[0] / off[0]
    print(f"bit-identical: {same}; time to first denoise step off/on = {off[0] / on[0]:.2f}x; time saved "
          f"{saved:.1%} of a shared share of {share:.1%} ({saved / share:.2f} x the share)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 64)
