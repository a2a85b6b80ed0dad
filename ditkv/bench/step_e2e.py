"""`ditkv bench step --preset release --e2e-request`: whole requests, timed as a user waits for them.

A CFG request (2 rows; 1024² by default) goes through the engine the server runs (`Engine`, paged
KV, CUDA graphs where the step captures, `GenerationRequest` in, uint8 image out): the prefill step,
`--e2e-steps` denoising steps (default 50) and the VAE decode. Random weights for the DiT
(`random_model_on_device`, bf16 or FP8) and for the release VAE (`ReleaseVAE` at the release
config), so no checkpoint folder is needed. Reported: seconds of prefill, denoise loop, decode and
total, images per minute; `--max-num-seqs N ...` also runs N requests at once (step-level
batching) and reports images per minute at each N.
"""

from __future__ import annotations

import statistics
import time

import torch

from .common import emit, machine
from .step_parts import (_sync, fast_image_path, fp8_fast_accum, fp8_grouped_gemm, fp8_layer_fusion, moe_impls,
                         quantizations)
from .step_release import _set_impl, build_model, free_device, release_config

# the release VAE's config.json section (tests/fixtures/release_config_base.json "vae"; a test keeps
# the two equal): used when the model config carries none, as the release preset's does not
RELEASE_VAE = {"block_out_channels": [128, 256, 512, 1024, 1024], "in_channels": 3, "out_channels": 3,
               "latent_channels": 32, "layers_per_block": 2, "ffactor_spatial": 16, "ffactor_temporal": 4,
               "sample_size": 384, "downsample_match_channel": True, "upsample_match_channel": True,
               "scaling_factor": 0.562679178327931}
# --shrink: the same levels and latent shape at the narrowest widths GroupNorm 32 allows
_SHRINK_VAE = {"block_out_channels": [32, 32, 32, 32, 64], "layers_per_block": 1}


def vae_config(cfg, shrink: bool = False):
    from ..models.hunyuan.vae import VAEConfig

    extra = cfg.extra.get("vae") if isinstance(cfg.extra, dict) else None
    section = dict(extra if isinstance(extra, dict) else RELEASE_VAE)
    if shrink:
        section.update(_SHRINK_VAE)
    return VAEConfig.from_dict(section)


def random_vae_on_device(vcfg, device, dtype, seed: int = 0):
    """The release VAE with random weights made on the device (the DiT's init, names under `vae.`)."""
    from ..models.hunyuan.vae import ReleaseVAE
    from .step_release import _init_random_

    with torch.device("meta"):
        vae = ReleaseVAE(vcfg).to(dtype)
    vae = vae.to_empty(device=device)
    _init_random_(vae.named_parameters("vae"), device, seed)
    return vae.requires_grad_(False).eval()


class _StepClock:
    """The engine's `on_step`: when (device synchronised) each request's first, second-to-last and
    last step ended. Three syncs per request: the steps between run as served."""

    def __init__(self, device) -> None:
        self.device, self.marks = device, {}

    def __call__(self, rid: str, i: int, steps: int) -> None:
        if i in (0, steps - 2, steps - 1):
            _sync(self.device)
            self.marks.setdefault(rid, {})[i] = time.perf_counter()


def _engine(args, bundle, device, image: int, quantization, max_num_seqs: int, clock, cache_config=None):
    from ..config import EngineConfig
    from ..engine.engine import Engine

    cfg = bundle[0].config
    tokens = args.prefix + (image // cfg.image_token_downsample) ** 2 + 16
    ecfg = EngineConfig(diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2,
                        block_size=args.block_size, device=str(device), attention_backend=args.backend,
                        num_kv_blocks=max_num_seqs * 2 * -(-tokens // args.block_size),
                        max_prompt_tokens=max(args.prefix, 16), max_image_height=image, max_image_width=image,
                        profile_memory=False, cuda_graphs="auto", max_num_seqs=max_num_seqs,
                        enable_prefix_caching=False,  # repeated prompts: time the compute, not cache hits
                        quantization=quantization, cache_config=cache_config,
                        fp8_fast_accum=getattr(args, "fp8_fast_accum", None) if quantization is not None else None,
                        fp8_grouped_gemm=getattr(args, "fp8_grouped_gemm", None) if quantization is not None else None)
    return Engine(ecfg, model_bundle=bundle, on_step=clock)


def _request(args, image: int, steps: int, seed: int):
    from ..engine.types import GenerationRequest

    return GenerationRequest(prompt="a" * (args.prefix - 4), height=image, width=image, steps=steps,
                             guidance_scale=args.guidance, seed=seed)


def _run_requests(engine, reqs, device) -> tuple[float, float, list]:
    """Submit `reqs` at once and run them to the end: (start, end, outputs); the images are on the
    host by then, so no sync is needed at the end."""
    _sync(device)
    t0 = time.perf_counter()
    for r in reqs:
        engine.add_request(r)
    outs = engine.run_until_complete()
    t1 = time.perf_counter()
    bad = [o for o in outs if not o.ok]
    if bad or len(outs) != len(reqs):
        raise SystemExit(f"ditkv bench step: --e2e-request: a request failed: {bad[0].error if bad else outs}")
    return t0, t1, outs


def _time_request(engine, clock, args, image: int, steps: int, seed: int, device, decode_s: float) -> dict:
    """One request alone: prefill (intake + step 0), the denoise loop (steps 1..N-1), decode (VAE,
    uint8 image to the host, the engine's bookkeeping), total, images per minute.

    The engine decodes a finished request inside its last step, before `on_step` reports that step,
    so the last mark includes the VAE decode. With 3 or more steps, `denoise_s` is the mean of the
    steps that decode nothing (1..N-2) times the N-1 denoise steps, and `decode_s` the rest of the
    wall time; with 2 steps there is no such step, and `denoise_s` is the marks' span less the
    decode timed alone on the same codec and shape (`_decode_seconds`), which timing noise can push
    below zero when one step is shorter than that noise. `total_s` is the wall time."""
    clock.marks.clear()
    t0, end, (out,) = _run_requests(engine, [_request(args, image, steps, seed)], device)
    m = clock.marks[out.request_id]
    first, last = m[0], m[steps - 1]
    denoise = (m[steps - 2] - first) * (steps - 1) / (steps - 2) if steps >= 3 else last - first - decode_s
    return {"prefill_s": first - t0, "denoise_s": denoise, "decode_s": end - first - denoise,
            "total_s": end - t0, "images_per_min": 60.0 / (end - t0), "image_shape": list(out.image.shape),
            "marks_span_s": last - first, "after_last_mark_s": end - last,
            "computed_steps": out.stats.computed_steps, "cached_steps": out.stats.cached_steps}


def _decode_seconds(codec, cfg, image: int, device, dtype, repeats: int = 3) -> float:
    """The worker's decode of one request's final latents (codec, clamp, uint8, to the host), alone:
    median seconds of `repeats` after a warm-up."""
    side = image // cfg.image_token_downsample
    lat = torch.randn(1, cfg.latent_channels, side, side, device=device).to(dtype)
    times = []
    with torch.inference_mode():
        for i in range(repeats + 1):
            _sync(device)
            t0 = time.perf_counter()
            img = codec.decode(lat).float().clamp(-1, 1)
            ((img[0] + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).cpu()
            if i:
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _median_runs(runs: list[dict]) -> dict:
    out = {k: statistics.median(r[k] for r in runs) for k in ("prefill_s", "denoise_s", "decode_s", "total_s")}
    out["images_per_min"] = 60.0 / out["total_s"]
    out["cached_steps"] = statistics.median(r["cached_steps"] for r in runs)
    return out


def _run_variant(args, bundle_parts, device, dtype, image: int, quantization, steps: int, impl: str) -> dict:
    """Build the DiT (`quantization`), warm up, time `--repeats` single requests, then the batches."""
    from ..models.hunyuan import ByteTokenizer

    cfg, vae, codec = bundle_parts
    model, build = build_model(cfg, device, dtype, quantization)
    _set_impl(model, impl)
    bundle = (model, ByteTokenizer(), codec)
    clock = _StepClock(device)
    e = _engine(args, bundle, device, image, quantization, 1, clock, getattr(args, "cache_wire", None))
    runner = e.worker.runner
    t0, t1, _ = _run_requests(e, [_request(args, image, min(steps, 2), 0)], device)  # compile, capture, autotune
    warmup = t1 - t0
    decode_s = _decode_seconds(codec, cfg, image, device, dtype)
    runs = [_time_request(e, clock, args, image, steps, 1 + i, device, decode_s) for i in range(args.repeats)]
    layout = e.worker.layout("a" * (args.prefix - 4), image, image, args.guidance)
    result = {
        "preset": "release", "e2e_request": True, "shrink": args.shrink, "layers": args.layers, "image": image,
        "quantization": quantization, "steps": steps, "prefix_tokens": layout.rows[0].prefix_len,
        "target_tokens": layout.rows[0].target_len, "rows": len(layout.rows), "moe_impl": impl,
        "resolved_moe_impl": model.model.layers[0].mlp.resolved_impl(device, dtype), "device": str(device),
        "dtype": str(dtype).replace("torch.", ""), "backend": e.worker.backend.name,
        "attention_calls": dict(getattr(e.worker.backend, "calls", {})),  # which kernel served (split backends)
        "cuda_graphs": runner.step_graphs is not None, "build": build,
        "vae": {"weights_bytes": sum(p.numel() * p.element_size() for p in vae.parameters()),
                "block_out_channels": list(vae.config.block_out_channels),
                "layers_per_block": vae.config.layers_per_block},
        "warmup_s": warmup, "vae_decode_alone_s": decode_s, "request": _median_runs(runs), "request_runs": runs,
    }
    e.shutdown()
    del e, runner
    free_device(device)
    result["throughput"] = {"1": {"requests": 1, **{k: result["request"][k] for k in ("total_s", "images_per_min")}}}
    for n in sorted(set(args.max_num_seqs) - {1}):
        result["throughput"][str(n)] = _throughput(args, bundle, device, image, quantization, steps, n)
    return result


def _throughput(args, bundle, device, image: int, quantization, steps: int, n: int) -> dict:
    """`n` requests submitted together to an engine with max_num_seqs=n (step-level batching)."""
    e = _engine(args, bundle, device, image, quantization, n, None, getattr(args, "cache_wire", None))
    try:
        _run_requests(e, [_request(args, image, min(steps, 2), i) for i in range(n)], device)  # warm-up
        before = dict(e.batch_sizes)
        t0, t1, outs = _run_requests(e, [_request(args, image, steps, 100 + i) for i in range(n)], device)
        wall = t1 - t0
        sizes = {str(k): v - before.get(k, 0) for k, v in e.batch_sizes.items() if v - before.get(k, 0)}
        return {"requests": n, "total_s": wall, "images_per_min": 60.0 * n / wall,
                "latency_s": sorted(o.stats.run_time_s for o in outs), "steps_at_batch_size": sizes}
    finally:
        e.shutdown()
        del e
        free_device(device)


def prepare(args):
    """What every `--e2e-request` run shares: (quantizations, the MoE impl, device, dtype, image side, steps,
    (config, VAE, codec))."""
    from ..models.hunyuan.codec import make_codec
    from ..models.loader import resolve_device, resolve_dtype

    quants, impls = quantizations(args), moe_impls(args)
    if len(impls) > 1:
        raise SystemExit("ditkv bench step: --e2e-request takes one --moe-impl (the engine runs one)")
    device = resolve_device(args.device)
    dtype = resolve_dtype("auto", device)
    cfg = release_config(args.layers, args.shrink)
    image = args.image or (64 if args.shrink else 1024)
    steps = args.e2e_steps or 50
    vae = random_vae_on_device(vae_config(cfg, args.shrink), device, dtype)
    return quants, impls[0], device, dtype, image, steps, (cfg, vae, make_codec(cfg, vae))


def run_e2e(args) -> dict:
    """Whole requests (the step-cache modes are `step_cache_e2e.run`)."""
    quants, impl, device, dtype, image, steps, parts = prepare(args)
    runs = [_run_variant(args, parts, device, dtype, image, q, steps, impl) for q in quants]
    result = runs[-1]
    result["cache_config"] = args.cache_wire
    if len(runs) == 2:
        base = runs[0]
        result["compare_bf16"] = {
            "baseline_dtype": base["dtype"], "baseline": base,
            "fp8_over_bf16": {k: result["request"][k] / base["request"][k]
                              for k in ("prefill_s", "denoise_s", "decode_s", "total_s")}}
    result["fp8_fast_accum"] = fp8_fast_accum()
    result["fp8_grouped_gemm"] = fp8_grouped_gemm(device)
    result["fast_image_path"] = fast_image_path()
    result["fp8_layer_fusion"] = fp8_layer_fusion()
    result["machine"] = machine()
    emit(result, args.json, _table(result), None)
    return result


def _table(result: dict) -> list[dict]:
    runs = [result] + ([result["compare_bf16"]["baseline"]] if "compare_bf16" in result else [])
    rows = []
    for res in runs:
        r = res["request"]
        rows.append({"weights": res["quantization"] or res["dtype"], "requests at once": 1,
                     "prefill s": r["prefill_s"], f"denoise s ({res['steps'] - 1} steps)": r["denoise_s"],
                     "decode s": r["decode_s"], "total s": r["total_s"], "images/min": r["images_per_min"]})
        for n, t in res["throughput"].items():
            if n != "1":
                rows.append({"weights": res["quantization"] or res["dtype"], "requests at once": n,
                             "total s": t["total_s"], "images/min": t["images_per_min"]})
    return rows

