"""`ditkv bench step`: one denoise step with prefix reuse vs full recompute, and paged vs dense.

CPU figures are ratios measured side by side in one run; absolute times only mean something on
a GPU. `--preset wide` uses real HunyuanImage-3 widths (hidden 4096, 32/8 heads, head_dim 128)
with few layers and experts so it fits and runs quickly.
"""

from __future__ import annotations

import statistics
import time

import torch

from .common import emit, machine


def add_arguments(p):
    p.add_argument("--preset", choices=["tiny", "wide"], default="tiny")
    p.add_argument("--prefix", type=int, default=1024, help="prefix tokens per row (prompt + specials)")
    p.add_argument("--image", type=int, default=64, help="image side in pixels (tiny: 64 -> 257 target tokens)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers for --preset wide")
    p.add_argument("--experts", type=int, default=8, help="routed experts for --preset wide (top-2)")
    p.add_argument("--guidance", type=float, default=4.0, help="> 1: two CFG rows")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--device", default="auto")
    p.add_argument("--backend", default="auto", help="attention backend for the paged run")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--e2e-steps", type=int, default=4, help="steps of the end-to-end paged vs dense run")
    p.add_argument("--json", action="store_true")


def _bundle(args, device, dtype):
    from ..models.hunyuan import ByteTokenizer, HunyuanImage3Config, HunyuanImage3Model

    if args.preset == "tiny":
        cfg = HunyuanImage3Config.tiny()
    else:
        base = HunyuanImage3Config.release().to_dict()
        base.update(num_hidden_layers=args.layers, num_experts=args.experts, moe_topk=2,
                    vocab_size=1024, **_byte_specials())
        cfg = HunyuanImage3Config.from_dict(base)
    torch.manual_seed(0)
    model = HunyuanImage3Model.from_config(cfg, seed=0, zero_init_resblocks=False).to(device=device, dtype=dtype).eval()
    from ..models.hunyuan.codec import make_codec

    return model, ByteTokenizer(), make_codec(cfg)  # wide: VAE interface, never decoded here


def _byte_specials() -> dict:
    from ..models.hunyuan.config import HunyuanImage3Config

    tiny = HunyuanImage3Config.tiny().to_dict()
    return {k: v for k, v in tiny.items() if k.endswith("_token_id")}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, repeats) -> float:
    fn()  # warm-up
    _sync(device)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def run(args) -> dict:
    from ..config import EngineConfig
    from ..engine.engine import Engine
    from ..engine.types import GenerationRequest
    from ..models.loader import resolve_device, resolve_dtype
    from ..worker.rows import DENOISE, PREFILL

    device = resolve_device(args.device)
    dtype = resolve_dtype("auto", device)
    bundle = _bundle(args, device, dtype)
    model = bundle[0]
    n_prompt = args.prefix - 4  # prefix = <bos> prompt <boi> <img_size> <img_ratio>
    req = GenerationRequest(prompt="a" * n_prompt, height=args.image, width=args.image, steps=args.e2e_steps,
                            guidance_scale=args.guidance, seed=0)
    engines, steps_t = {}, {}
    for mode in ("paged_scheduler", "dense_legacy"):
        paged = mode == "paged_scheduler"
        cfg = EngineConfig(diffusion_kv_mode=mode, diffusion_kv_max_rows_per_request=2 if paged else None,
                           block_size=args.block_size, device=str(device),
                           attention_backend=args.backend if paged else "auto",
                           num_kv_blocks=2 * (-(-(args.prefix + 4200) // args.block_size)) if paged else None,
                           max_prompt_tokens=max(args.prefix, 16), max_image_height=args.image,
                           max_image_width=args.image)
        e = Engine(cfg, model_bundle=bundle)
        rid = e.add_request(req)
        sreq = e.scheduler.schedule().admitted[0]
        layout = sreq.payload[0]
        if sreq.metadata is not None:
            e.worker.install(sreq.metadata)
        runner = e.worker.runner
        cache = runner.new_dense_cache(layout)
        x = torch.randn(1, model.config.latent_channels, layout.h, layout.w, device=device)
        t = torch.tensor([500.0], device=device)
        steps_t.setdefault("e2e", {})[mode] = _time(
            lambda: runner.generate(rid, layout, args.e2e_steps, args.guidance, 0), device, max(1, args.repeats // 2))
        with torch.inference_mode():
            runner.forward_step(rid, layout, x, t, PREFILL, True, cache)  # fill the prefix once
            steps_t[mode] = {
                "denoise_s": _time(lambda: runner.forward_step(rid, layout, x, t, DENOISE, False, cache),
                                   device, args.repeats),
                "recompute_s": _time(lambda: runner.forward_step(rid, layout, x, t, PREFILL, False, cache),
                                     device, args.repeats),
            }
        e.scheduler.finish(rid)
        e._retire(e.scheduler.take_finished())
        engines[mode] = e
    row = layout.rows[0]
    P, T = row.prefix_len, row.target_len
    e2e = steps_t.pop("e2e")
    pg, dn = steps_t["paged_scheduler"], steps_t["dense_legacy"]
    result = {
        "preset": args.preset, "prefix_tokens": P, "target_tokens": T, "rows": len(layout.rows),
        "block_size": args.block_size, "device": str(device), "dtype": str(dtype).replace("torch.", ""),
        "backend": engines["paged_scheduler"].worker.backend.name,
        "paged_denoise_ms": pg["denoise_s"] * 1e3, "paged_recompute_ms": pg["recompute_s"] * 1e3,
        "dense_denoise_ms": dn["denoise_s"] * 1e3, "dense_recompute_ms": dn["recompute_s"] * 1e3,
        "reuse_speedup": pg["recompute_s"] / pg["denoise_s"],
        "reuse_speedup_ideal": (P + T) / T,
        "reuse_goal": 0.9 * (P + T) / T,
        "paged_over_dense_step": pg["denoise_s"] / dn["denoise_s"],
        "paged_over_dense_e2e": e2e["paged_scheduler"] / e2e["dense_legacy"],
        "e2e_steps": args.e2e_steps,
        "machine": machine(),
    }
    table = [
        {"measure": "denoise step (prefix reuse), paged", "value": f"{result['paged_denoise_ms']:.2f} ms"},
        {"measure": "full recompute step, paged", "value": f"{result['paged_recompute_ms']:.2f} ms"},
        {"measure": "reuse speedup (goal >= 0.9 (P+T)/T)",
         "value": f"{result['reuse_speedup']:.2f}x (ideal {result['reuse_speedup_ideal']:.2f}x)"},
        {"measure": "paged / dense denoise step", "value": f"{result['paged_over_dense_step']:.3f}"},
        {"measure": f"paged / dense end to end ({args.e2e_steps} steps)", "value": f"{result['paged_over_dense_e2e']:.3f}"},
    ]
    emit(result, args.json, table, ["measure", "value"])
    return result
