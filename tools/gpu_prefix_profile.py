"""Where a prefix-cache hit's first step spends the time it does not save (issue 36), on a GPU.

    python tools/gpu_prefix_profile.py [LAYERS]     # default 16, FP8, 1024^2 CFG, ~1k-token system prompt

At release geometry a hit first step computes about the queries of a denoise step (the target plus a few
prefix tokens), yet takes longer. This profiles, with the cache on, one warm-up request (it fills the
cache), then one hit request's first step and its next (denoise) step, and prints the wall time of each
and their CUDA kernels by total time, side by side: the difference is the first step's own cost."""
import sys
import time
from types import SimpleNamespace

import torch
from torch.profiler import ProfilerActivity, profile

from ditkv.bench import prefix, prefix_release


def kernels(prof) -> dict:
    """CUDA kernels by total device time, and CPU ops by self CPU time (ms, count)."""
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if t:
            out["cuda " + e.key[:85]] = (t / 1e3, e.count)
        if e.self_cpu_time_total > 50:  # us
            out["cpu  " + e.key[:85]] = (e.self_cpu_time_total / 1e3, e.count)
    return out


def main(layers: int) -> None:
    args = SimpleNamespace(device="cuda", layers=layers, shrink=False, quantization="fp8", block_size=64,
                           batch_invariant=False, size=1024, steps=3, requests=3, system_tokens=1000)
    _, change, reqs = prefix.CASES["system"].tiny(args, 3)
    bundle = prefix_release.bundle(args, change)
    eng = prefix_release.engine_factory(args, bundle, reqs)(True)
    eng.generate(reqs[0])  # warm-up: kernels, and the system prompt's pages into the cache
    eng.generate(reqs[1])
    eng.add_request(reqs[2])
    res = {}
    for name in ("first", "denoise"):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            eng.step()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        res[name] = (wall, kernels(prof))
    eng.run_until_complete()
    print(f"wall: first step {res['first'][0] * 1e3:.1f} ms, denoise step {res['denoise'][0] * 1e3:.1f} ms")
    keys = sorted(set(res["first"][1]) | set(res["denoise"][1]),
                  key=lambda k: -abs(res["first"][1].get(k, (0, 0))[0] - res["denoise"][1].get(k, (0, 0))[0]))
    tot = {n: sum(v[0] for k, v in r[1].items() if k.startswith("cuda")) for n, r in res.items()}
    print(f"CUDA kernel time: first {tot['first']:.1f} ms, denoise {tot['denoise']:.1f} ms")
    print(f"{'first ms':>9} {'n':>5} {'denoise ms':>10} {'n':>5}  kernel (by |difference|)")
    for k in keys[:40]:
        a, b = res["first"][1].get(k, (0.0, 0)), res["denoise"][1].get(k, (0.0, 0))
        print(f"{a[0]:9.2f} {a[1]:5d} {b[0]:10.2f} {b[1]:5d}  {k}")
    eng.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 16)
