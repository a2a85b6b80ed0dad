"""FP8 vs bf16 at release geometry on random weights (same seed, same noise): the relative error of
one step's velocity, and of the latents after a whole denoising loop (CFG, 50 steps by default).

    python tools/fp8_accuracy_release.py --layers 4 16 --steps 50 [--shrink] [--json-out F]

bf16 at 32 layers does not fit one H200 (160 GB), so the deepest comparison is as deep as bf16 fits.
"""

import argparse
import json
import types

import torch

from ditkv.bench.step_release import _release_engine, random_model_on_device, release_config
from ditkv.models.loader import resolve_device
from ditkv.worker.denoising import denoise
from ditkv.worker.rows import PREFILL


def run_one(layers, quant, a, device, fast_accum=None):
    cfg = release_config(layers, a.shrink)
    image = a.image or (64 if a.shrink else 1024)
    model = random_model_on_device(cfg, device, torch.bfloat16 if device.type == "cuda" else torch.float32,
                                   seed=0, quantization=quant)
    args = types.SimpleNamespace(prefix=a.prefix, block_size=64, backend="auto", guidance=4.0, fp8_fast_accum=fast_accum)
    e, rid, layout = _release_engine(args, model, cfg, device, image, quantization=quant)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1, cfg.latent_channels, layout.h, layout.w, device=device, generator=g)
    t = torch.tensor([500.0], device=device)
    with torch.inference_mode():
        v = e.worker.runner.forward_step(rid, layout, x, t, PREFILL, True)[0].float().cpu()
        lat, _ = denoise(e.worker.runner, rid, layout, a.steps, 4.0, 0)
    out = (v, lat.float().cpu())
    e.shutdown()
    del e, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, nargs="+", default=[4])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--prefix", type=int, default=1024)
    p.add_argument("--image", type=int, default=None)
    p.add_argument("--shrink", action="store_true")
    p.add_argument("--device", default="auto")
    p.add_argument("--json-out", default=None)
    a = p.parse_args()
    device = resolve_device(a.device)
    res = []
    from ditkv.models import fp8

    for layers in a.layers:
        vb, lb = run_one(layers, None, a, device)
        for accum in (False, True):  # the FP8 GEMMs' fp32 promotion, then fast accumulation (the default)
            vf, lf = run_one(layers, "fp8", a, device, accum)  # the engine applies it to the process
            assert fp8.FAST_ACCUM["on"] == accum
            row = {"layers": layers, "steps": a.steps, "fp8_fast_accum": accum, "velocity_rel_err": rel(vf, vb),
                   "latent_rel_err": rel(lf, lb), "latent_std_bf16": lb.std().item()}
            print(json.dumps(row), flush=True)
            res.append(row)
    if a.json_out:
        with open(a.json_out, "w") as fh:
            json.dump({"device": str(device), "prefix": a.prefix, "shrink": a.shrink, "rows": res}, fh, indent=1)


if __name__ == "__main__":
    main()
