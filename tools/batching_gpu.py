"""GPU timing of step-level batching at the release geometry (random weights, few layers):
N requests at 512x512 (T=1025) solo (max_num_seqs=1) vs batched, in one process.

    python tools/batching_gpu.py --layers 4 --requests 8 --steps 8 --seqs 1,4,8
Prints one JSON line per setting (req/s, p50 latency, batch sizes reached).
"""

import argparse
import json
import time

import torch

from ditkv.bench.step_release import release_config, random_model_on_device
from ditkv.config import EngineConfig
from ditkv.engine.engine import Engine
from ditkv.engine.types import GenerationRequest
from ditkv.models.hunyuan import ByteTokenizer
from ditkv.models.hunyuan.codec import VAECodec


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--image", type=int, default=512)
    p.add_argument("--prefix", type=int, default=1024)
    p.add_argument("--seqs", default="1,4,8")
    p.add_argument("--rounds", type=int, default=2,
                   help="run the workload this many times and report the last (earlier rounds warm the "
                        "torch.compile variants of each batch shape)")
    a = p.parse_args()
    dev = torch.device("cuda")
    cfg = release_config(a.layers)
    model = random_model_on_device(cfg, dev, torch.bfloat16)
    # random weights give a noise image anyway: a stand-in decoder keeps the VAE out of the timing
    codec = VAECodec(cfg.latent_channels, cfg.image_token_downsample,
                     decode_fn=lambda z: torch.zeros(z.shape[0], 3, a.image, a.image, device=z.device))
    bundle = (model, ByteTokenizer(), codec)
    tokens = a.prefix + (a.image // cfg.image_token_downsample) ** 2 + 16
    for seqs in [int(s) for s in a.seqs.split(",")]:
        ecfg = EngineConfig(diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2,
                            device="cuda", num_kv_blocks=(seqs + 1) * 2 * -(-tokens // 64),
                            max_prompt_tokens=a.prefix, max_image_height=a.image, max_image_width=a.image,
                            profile_memory=False, max_num_seqs=seqs)
        eng = Engine(ecfg, model_bundle=bundle)
        req = dict(prompt="a" * (a.prefix - 8), height=a.image, width=a.image, steps=a.steps, guidance_scale=5.0)
        eng.generate(GenerationRequest(**req, seed=99))  # warm-up: compile, graphs, autotune
        for _ in range(a.rounds):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(a.requests):
                eng.add_request(GenerationRequest(**req, seed=i, request_id=f"r{i}"))
            outs = eng.run_until_complete()
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
        lat = sorted(o.stats.queue_time_s + o.stats.run_time_s for o in outs)
        print(json.dumps({"max_num_seqs": seqs, "layers": a.layers, "requests": a.requests, "steps": a.steps,
                          "image": a.image, "prefix": a.prefix, "seconds": round(dt, 3), "req_per_s": round(a.requests / dt, 3),
                          "p50_latency_s": round(lat[len(lat) // 2], 3), "status": sorted({o.status for o in outs}),
                          "batch_sizes": eng.stats().get("batch_sizes")}), flush=True)
        eng.shutdown()
        del eng
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
