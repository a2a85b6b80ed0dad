"""`ditkv bench step`: one denoise step with prefix reuse vs full recompute, and paged vs dense.

CPU figures are ratios measured side by side in one run; absolute times only mean something on
a GPU. `--preset wide` uses real HunyuanImage-3 widths (hidden 4096, 32/8 heads, head_dim 128)
with few layers and experts so it fits and runs quickly. `--preset release` is the release
geometry (64 experts top-8 + shared, release ResBlocks and VAE latents) with random weights and
`--layers L` decoder layers: time, memory and MFU per step and per layer, extrapolated to 32
layers, for each `--moe-impl`, in bf16 or FP8 W8A8 (`--quantization fp8`, `--compare-bf16`:
both in one run) (step_release.py); `--e2e-request` times whole requests through the engine,
VAE decode included (step_e2e.py). The real preset needs a GPU; `--shrink` runs its code path at
toy widths on a CPU.

This module: the CLI, the tiny / wide presets, and the timing, FLOP-count and kernel-profile
helpers all three share are in step_parts.py.
"""

from __future__ import annotations

import argparse

import torch

from ..argtypes import finite_float, nonneg_int, positive_int
from ..config import FP8_GROUPED_GEMMS
from .common import emit, machine
from .step_parts import _byte_specials, _time, moe_impls, quantizations
from ..worker.denoising import denoise


def add_arguments(p):
    p.add_argument("--preset", choices=["tiny", "wide", "release"], default="tiny",
                   help="tiny: the bundled model's shape; wide: HunyuanImage-3 widths, few layers and experts; "
                        "release: the release geometry, random weights (GPU, or --shrink)")
    p.add_argument("--prefix", type=nonneg_int, default=1024, help="prefix tokens per row (prompt + specials)")
    p.add_argument("--image", type=positive_int, default=None,
                   help="image side in pixels (default 64: tiny -> 257 target tokens; release: 1024 -> 4097)")
    p.add_argument("--layers", type=positive_int, default=2, help="decoder layers for --preset wide / release")
    p.add_argument("--experts", type=positive_int, default=8, help="routed experts for --preset wide (top-2)")
    p.add_argument("--guidance", type=finite_float, default=4.0, help="> 1: two CFG rows")
    p.add_argument("--block-size", type=positive_int, default=64, help="KV page size in tokens")
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--backend", "--attention-backend", dest="backend", default="auto",
                   help="attention backend for the paged run (auto|torch|triton|cudnn|fa4)")
    p.add_argument("--compare-backend", default=None, metavar="B",
                   help="--preset release: also time the denoise step on attention backend B, same weights, "
                        "alternated with --attention-backend in this run; reports main / B, eager and graph "
                        "(default: no comparison)")
    p.add_argument("--repeats", type=positive_int, default=5, help="timed runs per measurement (the median is kept)")
    p.add_argument("--e2e-steps", type=positive_int, default=None,
                   help="steps of the end-to-end run: tiny / wide paged vs dense (default 4), release "
                        "--e2e-request (default 50)")
    p.add_argument("--moe-impl", default="auto",
                   help="routed experts: auto|loop|grouped; --preset release takes a comma list "
                        "(loop,grouped) and measures each on the same weights")
    p.add_argument("--shrink", action="store_true",
                   help="--preset release at toy widths (same expert count, top-k, heads ratio, VAE "
                        "latents): runs the release code path on a CPU")
    p.add_argument("--quantization", choices=["fp8", "none"], default="none",
                   help="--preset release: fp8 = W8A8 e4m3 decoder-layer linears, each layer quantized as "
                        "its random weights are made")
    p.add_argument("--compare-bf16", action="store_true",
                   help="with --quantization fp8: also run the unquantized model (same weights) in this run "
                        "and report fp8 / bf16, eager and graph")
    p.add_argument("--fp8-fast-accum", action=argparse.BooleanOptionalAction, default=None,
                   help="with --quantization fp8 on CUDA: the FP8 GEMMs' use_fast_accum (faster, less accurate; "
                        "docs/quantization.md has its error); on by default like the engine's, "
                        "--no-fp8-fast-accum for fp32 promotion")
    p.add_argument("--fp8-grouped-gemm", choices=FP8_GROUPED_GEMMS, default=None,
                   help="with --quantization fp8 on CUDA: the routed experts' grouped FP8 GEMM "
                        "(default: auto, quack's varlen GEMM where ditkv[fa4] runs it, else torch._scaled_grouped_mm)")
    p.add_argument("--no-fast-image-path", action="store_true",
                   help="run the image path (patch embed, final layer, VAE decode) as the plain NCHW modules "
                        "instead of the channels-last CUDA path, to measure what that path saves")
    p.add_argument("--no-fp8-layer-fusion", action="store_true",
                   help="with --quantization fp8 on CUDA: run the decoder layers unfused (separate norm, "
                        "quantization and add kernels) instead of models/hunyuan/fp8_layer.py, to measure it")
    p.add_argument("--e2e-request", action="store_true",
                   help="--preset release: time whole CFG requests through the engine (prefill, --e2e-steps "
                        "denoising steps, VAE decode with random weights) instead of single steps")
    p.add_argument("--max-num-seqs", type=positive_int, nargs="+", default=[1],
                   help="--e2e-request: engine max_num_seqs values; N > 1 runs N requests at once "
                        "(step-level batching) and reports images per minute")
    p.add_argument("--cache-config", default=None, metavar="JSON",
                   help="--e2e-request: the engines' cache_config (docs/step-cache.md), e.g. "
                        "'{\"type\": \"fbcache\"}'; with --cached-fraction its type, Fn, Bn and taylorseer "
                        "(default fbcache)")
    p.add_argument("--cached-fraction", default=None, metavar="F[,F...]",
                   help="--e2e-request: force these cached fractions (an infinite threshold outside an evenly "
                        "spread steps_mask) and time each against no cache, alternated in one run: whole request, "
                        "computed / cached steps, cached step / full step (step_cache_e2e.py; default: none)")
    p.add_argument("--cache-none-ab", action="store_true",
                   help="--e2e-request: time an engine with cache_config unset against one with {\"type\": "
                        "\"none\"}, alternated in one run (the goal: step time ratio >= 0.99)")
    p.add_argument("--json", action="store_true", help="print one JSON object only (else a table, then the JSON)")


def _bundle(args, device, dtype):
    from ..models.hunyuan import ByteTokenizer, HunyuanImage3Config, HunyuanImage3Model

    if args.preset == "tiny":
        cfg = HunyuanImage3Config.tiny()
    else:
        base = HunyuanImage3Config.release().to_dict()
        base.update(num_hidden_layers=args.layers, num_experts=args.experts, moe_topk=2,
                    vocab_size=1024, image_base_size=None, **_byte_specials())  # --image, not snapped
        cfg = HunyuanImage3Config.from_dict(base)
    torch.manual_seed(0)
    model = HunyuanImage3Model.from_config(cfg, seed=0, zero_init_resblocks=False).to(device=device, dtype=dtype).eval()
    from ..models.hunyuan.codec import make_codec

    return model, ByteTokenizer(), make_codec(cfg)  # wide: VAE interface, never decoded here




def run(args) -> dict:
    from ..models import fp8
    from ..models.hunyuan.image_layers import set_fast_image_path

    from ..models.hunyuan.fp8_layer import set_fp8_layer_fusion

    set_fast_image_path(not getattr(args, "no_fast_image_path", False))
    set_fp8_layer_fusion(not getattr(args, "no_fp8_layer_fusion", False))
    accum = getattr(args, "fp8_fast_accum", None)
    if accum is not None and (args.preset != "release" or args.quantization != "fp8"):
        raise SystemExit("ditkv bench step: --[no-]fp8-fast-accum needs --preset release --quantization fp8")
    grouped = getattr(args, "fp8_grouped_gemm", None)
    if grouped is not None and (args.preset != "release" or args.quantization != "fp8"):
        raise SystemExit("ditkv bench step: --fp8-grouped-gemm needs --preset release --quantization fp8")
    _check_cache_flags(args)
    fp8.set_fast_accum(accum is not False)  # process-wide settings only after every check passed
    fp8.set_grouped_gemm(grouped)
    try:
        if args.preset == "release" and args.e2e_request and (args.cached_fraction is not None or args.cache_none_ab):
            from . import step_cache_e2e

            return step_cache_e2e.run(args)
        if args.preset == "release" and args.e2e_request:
            from .step_e2e import run_e2e

            return run_e2e(args)
        if args.preset == "release":
            from .step_release import run_release

            return run_release(args)
        return _run_small(args)
    finally:
        fp8.set_fast_accum(True)  # the process defaults
        fp8.set_grouped_gemm(None)
        set_fast_image_path(True)
        set_fp8_layer_fusion(True)


def _check_cache_flags(args) -> None:
    """The step-cache flags time whole requests: --e2e-request only. Sets `args.cache_wire` (the parsed
    --cache-config, or None)."""
    from ..errors import ConfigError
    from ..step_cache_config import parse

    cache = getattr(args, "cache_config", None)
    on = [f for f, v in (("--cache-config", cache is not None), ("--cached-fraction", args.cached_fraction is not None),
                         ("--cache-none-ab", args.cache_none_ab)) if v]
    if on and not (args.preset == "release" and args.e2e_request):
        raise SystemExit(f"ditkv bench step: {', '.join(on)} time whole requests: add --preset release --e2e-request")
    try:
        args.cache_wire = parse(cache).to_wire() if cache is not None else None
    except ConfigError as e:
        raise SystemExit(f"ditkv bench step: --cache-config: {e}") from None
    if args.cached_fraction is not None and args.cache_wire is not None and args.cache_wire["type"] == "none":
        raise SystemExit("ditkv bench step: --cached-fraction needs a cache type: --cache-config "
                         "'{\"type\": \"fbcache\"}' (the default) or dbcache")


def _run_small(args) -> dict:
    impl = moe_impls(args)[0]
    quantizations(args)  # refuses the release-only flags
    args.image = 64 if args.image is None else args.image
    args.e2e_steps = args.e2e_steps or 4
    from ..engine.types import GenerationRequest
    from ..models.loader import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    dtype = resolve_dtype("auto", device)
    bundle = _bundle(args, device, dtype)
    model = bundle[0]
    model.set_moe_impl(impl)
    n_prompt = args.prefix - 4  # prefix = <bos> prompt <boi> <img_size> <img_ratio>
    req = GenerationRequest(prompt="a" * n_prompt, height=args.image, width=args.image, steps=args.e2e_steps,
                            guidance_scale=args.guidance, seed=0)
    engines, steps_t = {}, {}
    for mode in ("paged_scheduler", "dense_legacy"):
        engines[mode], layout, steps_t[mode] = _mode_times(args, bundle, mode, req, device)
    steps_t["e2e"] = {mode: times.pop("e2e_s") for mode, times in steps_t.items()}
    row = layout.rows[0]
    P, T = row.prefix_len, row.target_len
    e2e = steps_t.pop("e2e")
    pg, dn = steps_t["paged_scheduler"], steps_t["dense_legacy"]
    result = {
        "preset": args.preset, "prefix_tokens": P, "target_tokens": T, "rows": len(layout.rows),
        "block_size": args.block_size, "moe_impl": impl, "device": str(device), "dtype": str(dtype).replace("torch.", ""),
        "backend": engines["paged_scheduler"].worker.backend.name,
        # dense baseline: fused SDPA per mask segment on a GPU (the fastest dense kernels), masked SDPA on a CPU
        "dense_attention": "segments" if engines["dense_legacy"].worker.runner.dense_segments else "masked",
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


def _mode_times(args, bundle, mode: str, req, device):
    """One engine in `mode` (paged or dense) around `bundle`: (engine, layout, {e2e_s, denoise_s, recompute_s})."""
    from ..config import EngineConfig
    from ..engine.engine import Engine
    from ..worker.rows import DENOISE, PREFILL

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
    x = torch.randn(1, bundle[0].config.latent_channels, layout.h, layout.w, device=device)
    t = torch.tensor([500.0], device=device)
    times = {"e2e_s": _time(lambda: denoise(runner, rid, layout, args.e2e_steps, args.guidance, 0), device,
                            max(1, args.repeats // 2))}
    with torch.inference_mode():
        runner.forward_step(rid, layout, x, t, PREFILL, True, cache)  # fill the prefix once
        times["denoise_s"] = _time(lambda: runner.forward_step(rid, layout, x, t, DENOISE, False, cache),
                                   device, args.repeats)
        times["recompute_s"] = _time(lambda: runner.forward_step(rid, layout, x, t, PREFILL, False, cache),
                                     device, args.repeats)
    e.scheduler.finish(rid)
    e._retire(e.scheduler.take_finished())
    return e, layout, times


# ------------------------------------------------------------------- FLOPs and per-layer clock
