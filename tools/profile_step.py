"""Profile one denoise step vs one full recompute step (wide preset, CUDA): top CUDA kernels.

    python tools/profile_step.py --prefix 6700 --layers 8
"""

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from ditkv.bench.step import _bundle
from ditkv.config import EngineConfig
from ditkv.engine.engine import Engine
from ditkv.engine.types import GenerationRequest
from ditkv.worker.rows import DENOISE, PREFILL


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--prefix", type=int, default=6700)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--image", type=int, default=1024)
    a = p.parse_args(argv)
    args = argparse.Namespace(preset="wide", layers=a.layers, experts=8)
    dev = torch.device("cuda")
    bundle = _bundle(args, dev, torch.bfloat16)
    cfg = EngineConfig(diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2, device="cuda",
                       num_kv_blocks=2 * ((a.prefix + 4300) // 64 + 1), max_prompt_tokens=a.prefix,
                       max_image_height=a.image, max_image_width=a.image)
    e = Engine(cfg, model_bundle=bundle)
    rid = e.add_request(GenerationRequest(prompt="a" * (a.prefix - 4), height=a.image, width=a.image, steps=2,
                                          guidance_scale=4.0))
    req = e.scheduler.schedule().admitted[0]
    e.worker.install(req.metadata)
    r, layout = e.worker.runner, req.payload.layout
    x = torch.randn(1, bundle[0].config.latent_channels, layout.h, layout.w, device=dev)
    t = torch.tensor([500.0], device=dev)
    with torch.inference_mode():
        for phase, first in ((PREFILL, True), (DENOISE, False), (PREFILL, False)):
            r.forward_step(rid, layout, x, t, phase, first)  # warm-up
        for name, phase in (("denoise", DENOISE), ("recompute", PREFILL)):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                r.forward_step(rid, layout, x, t, phase, False)
                torch.cuda.synchronize()
            print(f"==== {name} step, prefix {a.prefix}")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
