"""Native AR->DiT imports behind one shared system text, the DiT stage's prefix cache off vs on (issue 36).

    PYTHONPATH=. taskset -c 0 python tools/prefix_imports_cpu.py

A two-stage graph on the CPU (bundled tiny model, fp32, shared-memory transfer): 8 requests one after
another, each the same system text plus its own prompt (32x32, 2 steps, CFG). With the cache on, an
import's rows look up the DiT stage's cache and the transfer skips the pages found (`RowDest.skip_pages`).
Prints the transfer bytes, the skipped bytes, imported / hit / computed tokens per setting and whether the
images are bit-identical. Times are printed too; on a shared CPU they are noise.
"""
import json
import time

import numpy as np
import torch

from ditkv.engine.types import GenerationRequest
from ditkv.models.loader import load_model
from ditkv.stages.graph import load_stage_graph
from ditkv.stages.orchestrator import Orchestrator

SYSTEM = "you are a careful painter who draws exactly what is asked, in flat colours, with thick lines. " * 2
TAILS = ["a small red", "a big blue", "a green tree", "two cats", "a red house", "the sea", "one star", "a dog"]


def graph(cache: bool):
    t = {"kv_connector": "shm", "kv_role": "kv_producer", "engine_id": "ar"}
    return load_stage_graph({"stages": [
        {"stage_id": 0, "kind": "ar", "max_new_tokens": 0,
         "engine": {"model": "tiny", "device": "cpu", "block_size": 16, "num_kv_blocks": 64}, "kv_transfer_config": t},
        {"stage_id": 1, "kind": "dit", "inputs": [0],
         "engine": {"model": "tiny", "device": "cpu", "block_size": 16, "num_kv_blocks": 256, "max_prompt_tokens": 300,
                    "enable_prefix_caching": cache},
         "kv_transfer_config": {**t, "kv_role": "kv_consumer", "engine_id": "dit"}}]})


def run(bundle, cache: bool):
    orch = Orchestrator(graph(cache), bundle)
    outs, secs = [], []
    try:
        for i, tail in enumerate(TAILS):
            t0 = time.perf_counter()
            outs.append(orch.generate(GenerationRequest(prompt=SYSTEM + tail, height=32, width=32, steps=2,
                                                        guidance_scale=2.0, seed=i)))
            secs.append(time.perf_counter() - t0)
        time.sleep(0.5)  # the last transfer's report
        snap = orch.transfers.snapshot()
    finally:
        orch.shutdown()
    bad = [o.error for o in outs if not o.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed: {bad[0]}")
    return [o.image for o in outs], {
        "bytes": snap["bytes"], "skipped_bytes": snap["skipped_bytes"],
        "imported_tokens": sum(o.stats.imported_tokens for o in outs),
        "hit_tokens": sum(o.stats.prefix_cache_hit_tokens for o in outs),
        "tokens_computed": sum(o.stats.tokens_computed for o in outs),
        "mean_s_after_first": float(np.mean(secs[1:]))}


def main() -> None:
    bundle = load_model("tiny", torch.device("cpu"), torch.float32)
    (img_off, off), (img_on, on) = run(bundle, False), run(bundle, True)
    same = all(np.array_equal(a, b) for a, b in zip(img_off, img_on))
    print(json.dumps({"off": off, "on": on, "bytes_saved": 1 - on["bytes"] / off["bytes"], "bit_identical": same},
                     indent=1))


if __name__ == "__main__":
    main()
