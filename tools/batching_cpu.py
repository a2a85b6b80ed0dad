"""Engine-level CPU timing of step-level batching: N requests solo (max_num_seqs=1) vs together.

    python tools/batching_cpu.py --requests 8 --steps 8 --size 64
Prints one JSON line per setting. CPU figures are ratios, measured side by side in one run.
"""

import argparse
import json
import time

from ditkv.config import EngineConfig
from ditkv.engine.engine import Engine
from ditkv.engine.types import GenerationRequest


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--size", type=int, default=64)
    a = p.parse_args()
    base = dict(diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2, num_kv_blocks=512,
                device="cpu", dtype="float32")
    res = {}
    for seqs in (1, a.requests):
        eng = Engine(EngineConfig(**base, max_num_seqs=seqs))
        eng.generate(GenerationRequest(prompt="warm up", height=a.size, width=a.size, steps=2))
        t = time.perf_counter()
        for i in range(a.requests):
            eng.add_request(GenerationRequest(prompt="a large blue square", request_id=f"r{i}", seed=i,
                                              height=a.size, width=a.size, steps=a.steps))
        eng.run_until_complete()
        res[seqs] = time.perf_counter() - t
        print(json.dumps({"max_num_seqs": seqs, "seconds": round(res[seqs], 3),
                          "batch_sizes": eng.stats().get("batch_sizes")}))
    print(json.dumps({"speedup": round(res[1] / res[a.requests], 3)}))


if __name__ == "__main__":
    main()
