"""The image path on one GPU at release geometry: before (NCHW modules, torch GroupNorm) against after
(channels-last convs, Triton GroupNorm + modulation + SiLU, `image_layers.fast_path`), same weights.

    python tools/gpu_image_path.py [--json-out OUT.json] [--skip-vae]

Measures (CUDA events through triton.testing.do_bench, medians): patch embed (1 row: a request's CFG
rows share the latents), final layer (2 rows), each conv alone NCHW / channels-last against a cuBLAS
GEMM of the same FLOPs (the ceiling), the GroupNorm kernels against torch's, and the VAE decode of
one 1024^2 image (random release-VAE weights). "before" runs the same modules with autograd enabled
(no parameter needs grad), which is the eager NCHW path; "rel" is ||after - before|| / ||before||.
"""

import argparse
import copy
import json
import time

import torch
import torch.nn.functional as F
import triton.testing

from ditkv.bench.step_e2e import RELEASE_VAE, random_vae_on_device
from ditkv.bench.step_release import _init_random_, release_config
from ditkv.models.hunyuan import image_kernels
from ditkv.models.hunyuan.model import FinalLayer, PatchEmbed
from ditkv.models.hunyuan.image_layers import TimestepEmbedder
from ditkv.models.hunyuan.vae import VAEConfig


def bench(fn, rep=100):
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def make(module, dev, seed):
    module = module.to(torch.bfloat16).to_empty(device=dev)
    _init_random_(module.named_parameters(), dev, seed)
    return module.requires_grad_(False).eval()


def before(fn):
    """The eager NCHW path: autograd on (nothing requires grad), so `fast_path` is False."""
    with torch.enable_grad():
        return fn()


def after(fn):
    with torch.inference_mode():
        return fn()


def image_path(dev, out):
    cfg = release_config(1)
    with torch.device("meta"):
        pe, fl, te = PatchEmbed(cfg), FinalLayer(cfg), TimestepEmbedder(cfg.hidden_size, cfg.timestep_embed_dim)
    pe, fl, te = make(pe, dev, 1), make(fl, dev, 2), make(te, dev, 3)
    pe_old, fl_old = copy.deepcopy(pe), copy.deepcopy(fl)
    side = 64
    x = torch.randn(1, cfg.latent_channels, side, side, device=dev).to(torch.bfloat16)
    t = torch.full((1,), 500.0, device=dev)
    emb1 = after(lambda: te(t))
    emb2 = emb1.expand(2, -1).contiguous()
    tok = torch.randn(2, side * side, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
    res = {}
    for name, old, new in (
            ("patch_embed_1row", lambda: pe_old(x, emb1), lambda: pe(x, emb1)),
            ("final_layer_2rows", lambda: fl_old(tok, emb2, side, side), lambda: fl(tok, emb2, side, side))):
        a, b = before(old), after(new)
        res[name] = {"before_ms": before(lambda: bench(old)), "after_ms": after(lambda: bench(new)),
                     "rel": rel(b, a), "max_abs": (b.float() - a.float()).abs().max().item(),
                     "after_channels_last_out": b.is_contiguous(memory_format=torch.channels_last)}
        print(name, json.dumps(res[name]), flush=True)
    tot_b = res["patch_embed_1row"]["before_ms"] + res["final_layer_2rows"]["before_ms"]
    tot_a = res["patch_embed_1row"]["after_ms"] + res["final_layer_2rows"]["after_ms"]
    res["per_step"] = {"before_ms": tot_b, "after_ms": tot_a, "saved_ms": tot_b - tot_a}
    print("image path per step", res["per_step"], flush=True)
    out["image_path"] = res
    with torch.inference_mode(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        pe(x, emb1)
        fl(tok, emb2, side, side)
        torch.cuda.synchronize()
    out["image_path_kernels_after"] = top_kernels(prof)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        before(lambda: (pe_old(x, emb1), fl_old(tok, emb2, side, side)))
        torch.cuda.synchronize()
    out["image_path_kernels_before"] = top_kernels(prof)


def top_kernels(prof, n=14):
    rows = []
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if us:
            rows.append((ev.key[:100], ev.count, us / 1e3))
    rows.sort(key=lambda r: -r[2])
    for r in rows[:n]:
        print(f"  {r[2]:8.3f} ms  x{r[1]:<4d} {r[0]}")
    return rows[:n]


def convs(dev, out):
    """Each image-path conv alone (64x64 latents): NCHW, channels-last, and a GEMM of the same FLOPs."""
    res = {}
    for rows, cin, cout, k in ((1, 1024, 4096, 3), (1, 4096, 4096, 3), (2, 4096, 1024, 3), (2, 1024, 1024, 3),
                               (2, 4096, 1024, 1)):
        w = torch.randn(cout, cin, k, k, device=dev, dtype=torch.bfloat16) * 0.01
        x = torch.randn(rows, cin, 64, 64, device=dev, dtype=torch.bfloat16)
        xc, wc = x.contiguous(memory_format=torch.channels_last), w.contiguous(memory_format=torch.channels_last)
        a = torch.randn(rows * 4096, cin * k * k, device=dev, dtype=torch.bfloat16)
        bm = torch.randn(cin * k * k, cout, device=dev, dtype=torch.bfloat16)
        flop = 2 * rows * 4096 * cin * k * k * cout
        r = {"nchw_ms": bench(lambda: F.conv2d(x, w, padding=k // 2)),
             "cl_ms": bench(lambda: F.conv2d(xc, wc, padding=k // 2)),
             "gemm_ms": bench(lambda: a @ bm)}
        with torch.backends.cudnn.flags(enabled=True, benchmark=True, deterministic=False, allow_tf32=True):
            F.conv2d(xc, wc, padding=k // 2)
            r["cl_benchmark_ms"] = bench(lambda: F.conv2d(xc, wc, padding=k // 2))
        r.update({f"{key[:-3]}_tflops": flop / (v * 1e-3) / 1e12 for key, v in list(r.items())})
        res[f"{rows}x{cin}->{cout} k{k}"] = r
        print("conv", rows, cin, cout, k, {kk: round(v, 3) for kk, v in r.items()}, flush=True)
    out["convs"] = res


def group_norms(dev, out):
    res = {}
    for n, c, s in ((1, 4096, 4096), (2, 4096, 4096), (1, 128, 4 * 1024 * 1024), (1, 512, 4 * 256 * 256)):
        x = torch.randn(n, c, s, device=dev, dtype=torch.bfloat16) * 2 + 0.5
        xc = x.permute(0, 2, 1).contiguous().permute(0, 2, 1)
        w = torch.randn(c, device=dev, dtype=torch.bfloat16)
        b = torch.randn(c, device=dev, dtype=torch.bfloat16)
        ref = F.silu(F.group_norm(x, 32, w, b, 1e-6))
        got = image_kernels.group_norm_cl(xc, 32, w, b, 1e-6, None, True)
        exact = F.silu(F.group_norm(x.double(), 32, w.double(), b.double(), 1e-6))
        r = {"torch_nchw_ms": bench(lambda: F.silu(F.group_norm(x, 32, w, b, 1e-6))),
             "torch_cl_ms": bench(lambda: F.silu(F.group_norm(xc, 32, w, b, 1e-6))),
             "triton_cl_ms": bench(lambda: image_kernels.group_norm_cl(xc, 32, w, b, 1e-6, None, True)),
             "rel_triton_vs_torch": rel(got, ref), "frac_differ": (got != ref).float().mean().item(),
             "rel_torch_vs_fp64": rel(ref, exact), "rel_triton_vs_fp64": rel(got, exact),
             "bytes": x.numel() * 2}
        r["triton_gbps"] = 3 * r["bytes"] / (r["triton_cl_ms"] * 1e-3) / 1e9
        res[f"{n}x{c}x{s}"] = r
        print("groupnorm", n, c, s, {kk: (round(v, 4) if isinstance(v, float) else v) for kk, v in r.items()}, flush=True)
    out["group_norm"] = res


def vae(dev, out):
    vcfg = VAEConfig.from_dict(RELEASE_VAE)
    v = random_vae_on_device(vcfg, dev, torch.bfloat16, seed=5)
    v_old = copy.deepcopy(v)
    lat = torch.randn(1, vcfg.latent_channels, 64, 64, device=dev)
    a = before(lambda: v_old.decode(lat))
    b = after(lambda: v.decode(lat))
    res = {"rel": rel(b, a), "max_abs": (b.float() - a.float()).abs().max().item(), "shape": list(b.shape)}
    for name, fn in (("before", lambda: before(lambda: v_old.decode(lat))), ("after", lambda: after(lambda: v.decode(lat)))):
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        res[f"{name}_ms"] = sorted(ts)[1] * 1e3
    res["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print("vae decode 1024^2", json.dumps(res), flush=True)
    out["vae_decode"] = res
    with torch.inference_mode(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        v.decode(lat)
        torch.cuda.synchronize()
    out["vae_kernels_after"] = top_kernels(prof)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json-out", default=None)
    p.add_argument("--skip-vae", action="store_true")
    p.add_argument("--only", default="image,convs,gn,vae")
    a = p.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "date": time.strftime("%Y-%m-%d")}
    parts = a.only.split(",")
    for key, fn in (("image", image_path), ("convs", convs), ("gn", group_norms), ("vae", vae)):
        if key in parts and not (key == "vae" and a.skip_vae):
            try:
                fn(dev, out)
            except Exception as e:  # noqa: BLE001 - report and go on to the next part
                out[f"{key}_error"] = f"{type(e).__name__}: {e}"
                print(f"{key} FAILED: {type(e).__name__}: {e}", flush=True)
            torch.cuda.empty_cache()
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
