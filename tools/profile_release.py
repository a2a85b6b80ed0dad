"""Profile the release-geometry denoise step (random weights, grouped MoE, CUDA): the top CUDA
kernels, and the time per module class outside the decoder layers (the `rest` of bench step).

    python tools/profile_release.py --layers 4 --image 1024 --prefix 1024
"""

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from ditkv.bench.step_release import _release_engine, random_model_on_device, release_config
from ditkv.worker.rows import DENOISE, PREFILL


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--prefix", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--image", type=int, default=1024)
    p.add_argument("--rows", type=int, default=40)
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    cfg = release_config(a.layers)
    model = random_model_on_device(cfg, dev, torch.bfloat16)
    args = argparse.Namespace(prefix=a.prefix, block_size=64, backend="auto", guidance=4.0)
    e, rid, layout = _release_engine(args, model, cfg, dev, a.image)
    r = e.worker.runner
    x = torch.randn(1, cfg.latent_channels, layout.h, layout.w, device=dev)
    t = torch.tensor([500.0], device=dev)
    # label the top-level modules so their CUDA time shows up by name
    m = model.model if hasattr(model, "model") else model
    named = [(n, mod) for n, mod in model.named_children()] + [(f"model.{n}", mod) for n, mod in m.named_children()]
    handles = []
    for n, mod in named:
        if n in ("model", "model.layers"):
            continue
        ctx = {}
        handles.append(mod.register_forward_pre_hook(
            lambda _m, _i, n=n, ctx=ctx: ctx.__setitem__("r", record_function(f"## {n}").__enter__())))
        handles.append(mod.register_forward_hook(lambda _m, _i, _o, ctx=ctx: ctx.pop("r").__exit__(None, None, None)))
    with torch.inference_mode():
        r.forward_step(rid, layout, x, t, PREFILL, True)
        for _ in range(2):
            r.forward_step(rid, layout, x, t, DENOISE, False)  # warm-up
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            r.forward_step(rid, layout, x, t, DENOISE, False)
            torch.cuda.synchronize()
    for h in handles:
        h.remove()
    print(f"==== denoise step, release geometry, {a.layers} layers, prefix {a.prefix}, image {a.image}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.rows, max_name_column_width=70))
    print("==== labelled modules")
    for ev in prof.key_averages():
        if ev.key.startswith("## "):
            print(f"{ev.key:40s} cpu {ev.cpu_time_total / 1e3:8.2f} ms  cuda {getattr(ev, "device_time_total", 0) / 1e3:8.2f} ms")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
