"""One H200: a stage graph whose DiT pool is sized at startup from gpu_memory_utilization (no
num_kv_blocks, no byte budget) next to an AR stage with a 4 GiB byte budget on the same GPU, against a
single engine with the same setting; prints both pools, the GPU's memory, and serves one request.

    python tools/gpu_stage_sizing.py [--util 0.5]
"""

import argparse
import gc
import json

import torch

from ditkv.config import EngineConfig
from ditkv.engine.engine import Engine
from ditkv.engine.types import GenerationRequest
from ditkv.stages.graph import load_stage_graph
from ditkv.stages.orchestrator import Orchestrator

GiB = 1 << 30


def stage_run(dit: dict) -> dict:
    g = load_stage_graph({"stages": [
        {"stage_id": 0, "kind": "ar", "engine": {"model": "tiny", "device": "cuda", "block_size": 64,
                                                 "kv_cache_memory_bytes": 4 * GiB},
         "kv_transfer_config": {"kv_connector": "cuda", "engine_id": "ar", "kv_role": "kv_producer"}},
        {"stage_id": 1, "kind": "dit", "inputs": [0], "engine": dit,
         "kv_transfer_config": {"kv_connector": "cuda", "engine_id": "dit", "kv_role": "kv_consumer"}}]})
    orch = Orchestrator(g)
    try:
        d = orch.dit[0]
        stage_bytes = d.manager.pool.num_blocks * d.worker.bytes_per_block()
        free, total = torch.cuda.mem_get_info()
        out = orch.generate(GenerationRequest(prompt="a large red circle", height=64, width=64, steps=4,
                                              guidance_scale=2.0), timeout=120)
    finally:
        orch.shutdown()
    return {"total_gib": total / GiB, "stage_ar_pool_gib": 4.0, "stage_dit_pool_gib": stage_bytes / GiB,
            "free_after_both_gib": free / GiB, "used_share": (total - free) / total, "request_ok": out.ok,
            "error": out.error}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--util", type=float, default=0.5)
    a = p.parse_args()
    dit = {"model": "tiny", "device": "cuda", "block_size": 64, "diffusion_kv_mode": "paged_scheduler",
           "diffusion_kv_max_rows_per_request": 2, "gpu_memory_utilization": a.util}
    res = stage_run(dit)
    print(json.dumps({"util": a.util, **res}, indent=1), flush=True)
    gc.collect()
    torch.cuda.empty_cache()
    res = {"free_after_stage_shutdown_gib": torch.cuda.mem_get_info()[0] / GiB}
    try:  # the same DiT alone on the GPU, in what the stage graph left free
        single = Engine(EngineConfig(**dit))
        res["single_engine_pool_gib"] = single.num_blocks * single.worker.bytes_per_block() / GiB
        single.shutdown()
    except Exception as e:
        res["single_engine_error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
