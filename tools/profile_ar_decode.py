"""Profile the single engine's batch-R AR decode steps (release geometry, random weights, CUDA):
the top CUDA kernels over `--profile-steps` decode steps, with decode CUDA graphs on or off.

    python tools/profile_ar_decode.py --layers 16 --rows 1 [--graphs on|off] [--gemv-rows N]
"""

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from ditkv.bench import ar as bench_ar
from ditkv.bench.step_release import build_model, release_config
from ditkv.engine.types import GenerationRequest
from ditkv.models.hunyuan import HunyuanImage3Config
from ditkv.models.hunyuan.codec import make_codec
from ditkv.bench.step_e2e import random_vae_on_device, vae_config


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--graphs", default="on")
    p.add_argument("--profile-steps", type=int, default=20)
    p.add_argument("--gemv-rows", type=int, default=None, help="fp8.set_gemv_rows (default: the built-in)")
    a = p.parse_args(argv)
    if a.gemv_rows is not None:
        from ditkv.models import fp8

        fp8.set_gemv_rows(a.gemv_rows)
    dev = torch.device("cuda")
    cfg = release_config(a.layers).replace(vocab_size=HunyuanImage3Config.release().vocab_size)
    model, _ = build_model(cfg, dev, torch.bfloat16, "fp8")
    codec = make_codec(cfg, random_vae_on_device(vae_config(cfg, False), dev, torch.bfloat16))
    args = argparse.Namespace(image=256, prompt_tokens=1000, new_tokens=256, block_size=64, max_batched_tokens=8192,
                              backend="auto", quantization="fp8")
    eng = bench_ar._engine(args, model, codec, cfg, dev, a.rows, a.graphs)
    ex, seen, prof = eng.executor, [0], []
    step = ex.step_batch

    def step_batch():  # profile decode steps 40 .. 40 + N (graphs captured by then)
        seen[0] += 1
        if seen[0] == 40:
            torch.cuda.synchronize()
            prof.append(profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]))
            prof[0].__enter__()
        out = step()
        if seen[0] == 40 + a.profile_steps:
            torch.cuda.synchronize()
            prof[0].__exit__(None, None, None)
        return out
    ex.step_batch = step_batch
    for i in range(a.rows):
        eng.add_request(GenerationRequest(prompt="a" * 996, height=256, width=256, steps=1, guidance_scale=1.0,
                                          seed=i, max_new_tokens=200, ignore_eos=True, temperature=1.0,
                                          top_k=0, top_p=1.0))
    outs = eng.run_until_complete()
    eng.shutdown()
    assert all(o.ok for o in outs), [o.error for o in outs]
    ka = prof[0].key_averages()
    print(f"==== {a.layers} FP8 layers, R={a.rows}, graphs {a.graphs}, {a.profile_steps} decode steps")
    print(ka.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
    total = sum(e.self_device_time_total for e in ka) / a.profile_steps
    print(f"CUDA kernel time per step: {total / 1e3:.3f} ms")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
