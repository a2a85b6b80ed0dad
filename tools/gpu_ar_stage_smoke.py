"""GPU smoke of a stage graph whose AR stage is the engine plus a KV export (stages/ar_side.py), on the
bundled tiny model, both stages on cuda:0 over the cuda connector: three requests with AR text run
concurrently vs one at a time (texts, images), the decode graphs of the AR stage's engine, and the
pools at the end; prints one JSON object."""

import json
import sys

import numpy as np

sys.path.insert(0, "tests")
from stage_helpers import tiny_bundle  # noqa: E402

from ditkv.engine.types import GenerationRequest  # noqa: E402
from ditkv.stages.graph import load_stage_graph  # noqa: E402
from ditkv.stages.orchestrator import Orchestrator  # noqa: E402

PROMPTS = ["a large red circle", "blue", "a small green square on grey"]
DEV = sys.argv[1] if len(sys.argv) > 1 else "cuda:0"  # `cpu` (shm connector): a dry run of the script


def graph(cuda_graphs: str):
    t = {"kv_connector": "cuda" if DEV.startswith("cuda") else "shm", "engine_id": "ar", "kv_role": "kv_producer"}
    return load_stage_graph({"stages": [
        {"stage_id": 0, "kind": "ar", "max_new_tokens": 24, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
         "engine": {"model": "tiny", "device": DEV, "block_size": 16, "num_kv_blocks": 128}, "kv_transfer_config": t},
        {"stage_id": 1, "kind": "dit", "inputs": [0],
         "engine": {"model": "tiny", "device": DEV, "block_size": 16, "num_kv_blocks": 512,
                    "diffusion_kv_mode": "paged_scheduler", "diffusion_kv_max_rows_per_request": 2, "max_num_seqs": 4,
                    "cuda_graphs": cuda_graphs},
         "kv_transfer_config": {**t, "kv_role": "kv_consumer", "engine_id": "dit"}}]})


def req(i):
    return GenerationRequest(prompt=PROMPTS[i], height=32, width=32, steps=2, guidance_scale=2.0, seed=10 + i,
                             max_new_tokens=24)


def run(bundle, concurrency: int):
    orch = Orchestrator(graph("auto"), bundle).start()
    try:
        outs = orch.run([req(i) for i in range(3)], concurrency=concurrency)
        ar = orch.ar[0]
        g = ar.engine.executor.stepper.ar._graphs
        graphs = {"captures": g.captures, "replays": g.replays} if g else {"off": True}
        return outs, graphs
    finally:
        orch.shutdown()
        full = orch.pools_full() and all(a.num_leases == 0 for a in orch.ar)
        result.setdefault("pools_full", []).append(full)


result = {}
model, tok, codec = tiny_bundle()
bundle = (model.to(DEV), tok, codec)
batched, graphs = run(bundle, 3)
solo, _ = run(bundle, 1)
result.update({
    "ok": [o.status for o in batched + solo], "errors": [o.error for o in batched + solo if not o.ok],
    "text_equal": [a.revised_prompt == b.revised_prompt for a, b in zip(batched, solo)],
    "image_max_diff": [int(np.abs(a.image.astype(int) - b.image.astype(int)).max()) if a.ok and b.ok else None
                       for a, b in zip(batched, solo)],
    "texts": [o.revised_prompt for o in batched], "ar_graphs_batched": graphs})
print(json.dumps(result))
