"""One GPU: where a two-stage graph's memory goes (issue 34 item 3). A stage graph (AR stage with a
fixed byte budget, DiT stage with a fixed byte budget, both in this process) serves one request and
shuts down; the GPU's free memory, torch's reserved and allocated bytes are printed before, with
both stages up, after the request, after shutdown, and after `empty_cache` / `ipc_collect`.

    python tools/gpu_stage_memory.py [--connector cuda] [--no-ipc-export] [--ar-gib 4] [--dit-gib 16]

`--no-ipc-export` registers the pools without a CUDA IPC handle (in-process peers need none): the
A/B for whether torch's IPC bookkeeping holds the pools' memory.
"""

import argparse
import gc
import json

import torch

from ditkv.engine.types import GenerationRequest
from ditkv.stages.graph import load_stage_graph
from ditkv.stages.orchestrator import Orchestrator

GiB = 1 << 30


def snap(label: str) -> dict:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"at": label, "free_gib": round(free / GiB, 2), "used_gib": round((total - free) / GiB, 2),
            "reserved_gib": round(torch.cuda.memory_reserved() / GiB, 2),
            "allocated_gib": round(torch.cuda.memory_allocated() / GiB, 2)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--connector", default="cuda")
    p.add_argument("--no-ipc-export", action="store_true")
    p.add_argument("--ar-gib", type=float, default=4.0)
    p.add_argument("--dit-gib", type=float, default=16.0)
    a = p.parse_args()
    if a.no_ipc_export:
        from ditkv.transfer import cuda_transport

        def refuse(t):
            raise RuntimeError("export disabled (--no-ipc-export)")
        cuda_transport.export_ipc = refuse
    rows = [snap("before")]
    eng = {"model": "tiny", "device": "cuda", "block_size": 64}
    g = load_stage_graph({"stages": [
        {"stage_id": 0, "kind": "ar", "engine": {**eng, "kv_cache_memory_bytes": int(a.ar_gib * GiB)},
         "kv_transfer_config": {"kv_connector": a.connector, "engine_id": "ar", "kv_role": "kv_producer"}},
        {"stage_id": 1, "kind": "dit", "inputs": [0],
         "engine": {**eng, "kv_cache_memory_bytes": int(a.dit_gib * GiB), "diffusion_kv_mode": "paged_scheduler"},
         "kv_transfer_config": {"kv_connector": a.connector, "engine_id": "dit", "kv_role": "kv_consumer"}}]})
    orch = Orchestrator(g)
    rows.append(snap("both stages up"))
    try:
        out = orch.generate(GenerationRequest(prompt="a large red circle", height=64, width=64, steps=4,
                                              guidance_scale=2.0), timeout=120)
        rows.append({**snap("after one request"), "ok": out.ok, "error": out.error})
    finally:
        orch.shutdown()
    del orch, g
    gc.collect()
    rows.append(snap("after shutdown + gc"))
    torch.cuda.empty_cache()
    rows.append(snap("after empty_cache"))
    torch.cuda.ipc_collect()
    torch.cuda.empty_cache()
    rows.append(snap("after ipc_collect"))
    print(json.dumps({"connector": a.connector, "ipc_export": not a.no_ipc_export, "ar_gib": a.ar_gib,
                      "dit_gib": a.dit_gib, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
