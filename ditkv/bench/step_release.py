"""`ditkv bench step --preset release`: one step at the release geometry with random weights.

`--layers L` decoder layers (64 experts top-8 + shared, release ResBlocks and VAE latents): time,
memory and MFU per step and per layer, extrapolated to 32 layers, for each `--moe-impl` on the same
weights, eager and as the engine's CUDA graph. `--quantization fp8` makes the decoder linears W8A8
e4m3 (quantized layer by layer as the weights are made, so 32 layers fit one H200);
`--compare-bf16` runs the unquantized model on the same weights in the same run and reports
fp8 / bf16. On a GPU a profiled step splits the kernel time (activation quantization, MoE parts).
`--shrink` runs the code path at toy widths on a CPU (tests/test_bench_step_release.py).
"""

from __future__ import annotations

import gc
import resource
import statistics
import time
import zlib

import torch

from .common import (
    H200_BF16_MEASURED,
    H200_BF16_NOMINAL,
    H200_FP8_MEASURED,
    emit,
    machine,
)
from .step_parts import (
    _byte_specials,
    _LayerClock,
    _sync,
    _time,
    flop_model,
    fast_image_path,
    fp8_layer_fusion,
    fp8_fast_accum,
    fp8_grouped_gemm,
    kernel_profile,
    moe_impls,
    quantizations,
)

FULL_LAYERS = 32
# --shrink: the release structure (64 experts top-8 + shared, 4:1 GQA, VAE latents, ResBlocks)
# at toy widths, so a test can run the release code path on a CPU
_SHRINK = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 1, "attention_head_dim": 16,
           "intermediate_size": 32, "moe_intermediate_size": 32, "patch_embed_hidden_dim": 32}


def release_config(layers: int, shrink: bool = False):
    from ..models.hunyuan import HunyuanImage3Config

    base = HunyuanImage3Config.release().to_dict()
    # byte vocabulary: the DiT step never reads the 133k-row text tables, so skip their 2 GB
    base.update(num_hidden_layers=layers, vocab_size=1024, **_byte_specials())
    # no bucket snapping: the benchmark picks its image sizes (T=1025 at 512 px) itself, where the
    # release would snap every request to its ~1 MP buckets
    base["image_base_size"] = None
    if shrink:
        base.update(_SHRINK)
    return HunyuanImage3Config.from_dict(base)


# ------------------------------------------------------------------------ random weights
def random_model_on_device(cfg, device, dtype, seed: int = 0, quantization: str | None = None, ignored=()):
    """Random weights made on the device in their final dtype, one decoder layer at a time: a CPU
    fp32 init of four release layers is 40 GB and minutes, and the whole bf16 model at 32 layers
    (160 GB) does not fit one H200. `from_config`'s per-name seeding, no zero-initialised ResBlock,
    router in fp32. `quantization` "fp8": each layer's target linears turn e4m3 (quantize.py, minus
    `ignored`) before the next layer is made, so the peak is about one bf16 layer over the FP8 model;
    the result equals `quantize_model` of the same seed's bf16 model bit for bit."""
    from torch import nn

    from ..models.hunyuan.model import HunyuanImage3Model
    from ..models.hunyuan.quantize import quantize_model, target_names

    if quantization not in (None, "fp8"):
        raise ValueError(f"quantization={quantization!r}: use None or 'fp8'")
    device = torch.device(device)
    with torch.device("meta"):
        model = HunyuanImage3Model(cfg).to(dtype)
    for layer in model.model.layers:
        layer.mlp.gate.float()
    _check_fits(model, device, quantization, ignored)
    layers = model.model.layers
    model.model.layers = nn.ModuleList()  # detached while the rest (embeddings, image path, head) is made
    model.to_empty(device=device)
    _init_random_(model.named_parameters(), device, seed)
    model.model.layers = layers  # same slot of `model.model`: names and order as before
    targets = target_names(model) if quantization else []
    for i, layer in enumerate(layers):
        prefix = f"model.layers.{i}"
        layer.to_empty(device=device)
        _init_random_(layer.named_parameters(prefix), device, seed)
        if quantization:  # never a Module.to(dtype) after this: it would cast the e4m3 weights
            with torch.no_grad():
                quantize_model(model, ignored, names=[n for n in targets if n.startswith(prefix + ".")])
    return model.requires_grad_(False).eval()


def _init_random_(named_params, device, seed: int) -> None:
    """`from_config`'s init (N(0, 0.02) from a generator per (seed, name), biases 0, norms 1), in place."""
    from ..models.hunyuan.model import INIT_STD, _is_norm_weight

    with torch.no_grad():
        for name, p in named_params:
            if name.endswith(".bias"):
                p.zero_()
            elif _is_norm_weight(name, p):
                p.fill_(1.0)
            else:
                g = torch.Generator(device=device).manual_seed((seed * 0x9E3779B1 + zlib.crc32(name.encode())) % 2**63)
                p.normal_(0.0, INIT_STD, generator=g)


def model_bytes(meta_model, quantization: str | None = None, ignored=()) -> int:
    """Parameter bytes `meta_model` holds once made (FP8 targets: 1-byte weights + fp32 row scales)."""
    from ..models.hunyuan.quantize import ignored_by, target_names

    quant = {n for n in target_names(meta_model) if not ignored_by(n, ignored)} if quantization else set()
    total = 0
    for name, mod in meta_model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            fp8 = name in quant and pname == "weight"
            total += p.numel() + 4 * p.shape[0] if fp8 else p.numel() * p.element_size()
    return total


def _check_fits(meta_model, device, quantization, ignored) -> None:
    """Refuse before allocating (a clear message, not an OOM minutes in): the weights plus one
    layer made unquantized must fit the device's free memory."""
    if device.type != "cuda":
        return
    layer = meta_model.model.layers[0] if len(meta_model.model.layers) else None
    transient = sum(p.numel() * p.element_size() for p in layer.parameters()) if layer is not None else 0
    need = model_bytes(meta_model, quantization, ignored) + transient
    free, _ = torch.cuda.mem_get_info(device)
    if need > free:
        what = "fp8" if quantization else str(meta_model.model.ln_f.weight.dtype).replace("torch.", "")
        raise MemoryError(f"{what} weights of {len(meta_model.model.layers)} layers need {need / 2**30:.1f} GiB "
                          f"(one layer made unquantized included), {free / 2**30:.1f} GiB are free on {device}: "
                          "use fewer --layers (--compare-bf16 at 4 layers), or --quantization fp8 alone")


def build_model(cfg, device, dtype, quantization=None, ignored=(), seed: int = 0):
    """(`random_model_on_device`, what building it took: seconds, peak memory, the weights' bytes by kind).
    CUDA: the allocator's peak during the build; CPU: the process's peak RSS so far (Linux ru_maxrss)."""
    from ..models.hunyuan.quantize import fp8_bytes

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if cuda else None
    t0 = time.perf_counter()
    try:
        model = random_model_on_device(cfg, device, dtype, seed, quantization, ignored)
    except MemoryError as e:
        raise SystemExit(f"ditkv bench step: {e}") from None
    _sync(device)
    by_kind = fp8_bytes(model)
    mem = {"build_s": time.perf_counter() - t0, "weights_bytes": sum(by_kind.values()),
           "weights_bytes_by_kind": by_kind, "peak_kind": "cuda_max_memory_allocated" if cuda else "cpu_peak_rss",
           "allocated_before_bytes": before,
           "peak_bytes": torch.cuda.max_memory_allocated(device) if cuda
           else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    return model, mem


def free_device(device) -> None:
    """Drop what a finished variant left (engine and model reference cycles, cached blocks)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ timing
def _measure(fn, model, device, repeats: int):
    """(median step seconds, median seconds per (layer, part) and of the rest, peak bytes, bytes
    allocated before the step)."""
    step = _time(fn, device, repeats)  # hooks off: the step as served
    clock, runs = _LayerClock(model, device), []
    try:
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            fn()
            _sync(device)
            wall = time.perf_counter() - t0
            parts = clock.take()
            # outside the layers: embeddings, patch/final ResBlocks, metadata, host work
            parts["rest"] = max(wall - sum(v for (_, part), v in parts.items() if part == "layer"), 0.0)
            runs.append(parts)
    finally:
        clock.close()
    parts = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    if device.type != "cuda":
        return step, parts, None, None
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    _sync(device)
    return step, parts, torch.cuda.max_memory_allocated(device), before


def phase_report(step: float, parts: dict, peak, before, flops: dict, layers: int, fp8: bool = False) -> dict:
    """Per step and per layer: times, the 32-layer extrapolation (rest + 32 mean layers), MFU, peak
    memory. `fp8`: MFU against the FP8 matmul rate as well (`*_fp8_rate`)."""
    mean = lambda part: statistics.fmean(parts[i, part] for i in range(layers))
    rest = parts["rest"]
    step32 = rest + FULL_LAYERS * mean("layer")
    total, total32 = layers * flops["layer"] + flops["image"], FULL_LAYERS * flops["layer"] + flops["image"]
    gib = lambda b: None if b is None else b / 2**30
    rates = {"step": total / step, "layer": flops["layer"] / mean("layer"), "moe": flops["moe"] / mean("moe"),
             "32_layers": total32 / step32}
    out = {
        "step_ms": step * 1e3, "layer_ms": mean("layer") * 1e3, "attn_block_ms": mean("attn") * 1e3,
        "moe_ms": mean("moe") * 1e3, "rest_ms": rest * 1e3,
        "per_layer_ms": [parts[i, "layer"] * 1e3 for i in range(layers)],
        "step_ms_32_layers": step32 * 1e3, "flops": total, "flops_32_layers": total32,
        "mfu": rates["step"] / H200_BF16_MEASURED, "mfu_nominal": rates["step"] / H200_BF16_NOMINAL,
        "layer_mfu": rates["layer"] / H200_BF16_MEASURED, "moe_mfu": rates["moe"] / H200_BF16_MEASURED,
        "mfu_32_layers": rates["32_layers"] / H200_BF16_MEASURED,
        "mfu_32_layers_nominal": rates["32_layers"] / H200_BF16_NOMINAL,
        "peak_gib": gib(peak), "step_transient_gib": gib(None if peak is None else peak - before),
        "step_transient_bytes": None if peak is None else peak - before,
    }
    if fp8:  # the quantized GEMMs' own peak (attention and the image path stay bf16)
        out.update(mfu_fp8_rate=rates["step"] / H200_FP8_MEASURED, layer_mfu_fp8_rate=rates["layer"] / H200_FP8_MEASURED,
                   moe_mfu_fp8_rate=rates["moe"] / H200_FP8_MEASURED,
                   mfu_32_layers_fp8_rate=rates["32_layers"] / H200_FP8_MEASURED)
    return out


# ------------------------------------------------------------------------------ engine
def _release_engine(args, model, cfg, device, image: int, quantization: str | None = None):
    """A paged engine around `model` with one admitted, installed CFG request; (engine, id, layout)."""
    from ..config import EngineConfig
    from ..engine.engine import Engine
    from ..engine.types import GenerationRequest
    from ..models.hunyuan import ByteTokenizer
    from ..models.hunyuan.codec import make_codec

    tokens = args.prefix + (image // cfg.image_token_downsample) ** 2 + 16
    ecfg = EngineConfig(diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2,
                        block_size=args.block_size, device=str(device), attention_backend=args.backend,
                        num_kv_blocks=2 * -(-tokens // args.block_size), max_prompt_tokens=max(args.prefix, 16),
                        max_image_height=image, max_image_width=image, profile_memory=False, cuda_graphs="off",
                        quantization=quantization,
                        fp8_fast_accum=getattr(args, "fp8_fast_accum", None) if quantization is not None else None,
                        fp8_grouped_gemm=getattr(args, "fp8_grouped_gemm", None) if quantization is not None else None)
    e = Engine(ecfg, model_bundle=(model, ByteTokenizer(), make_codec(cfg)))  # VAE: never decoded here
    rid = e.add_request(GenerationRequest(prompt="a" * (args.prefix - 4), height=image, width=image, steps=2,
                                          guidance_scale=args.guidance, seed=0))
    sreq = e.scheduler.schedule().admitted[0]
    e.worker.install(sreq.metadata)
    return e, rid, sreq.payload[0]


def memory_left_for_kv(e, device, transient: int, kv_per_request: int) -> dict | None:
    """What a server on this device could give the KV pool with this model: free memory after the
    build and the steps (cached blocks returned), plus this engine's own small pool, minus the largest
    step transient; and how many requests of this geometry that holds. None on a CPU."""
    if device.type != "cuda":
        return None
    free_device(device)
    free, total = torch.cuda.mem_get_info(device)
    pool = e.num_blocks * e.worker.bytes_per_block()
    budget = max(free + pool - transient, 0)
    return {"free_bytes": free, "device_total_bytes": total, "engine_pool_bytes": pool,
            "step_transient_bytes": transient, "kv_budget_bytes": budget, "kv_bytes_per_request": kv_per_request,
            "requests_fit": budget // kv_per_request}


def _set_impl(model, impl: str) -> None:
    try:
        model.set_moe_impl(impl)  # grouped: stacks the experts here, not inside a timed step
    except ValueError as e:  # e.g. grouped FP8 experts on a CPU
        raise SystemExit(f"ditkv bench step: --moe-impl {impl}: {e}") from None


def _run_variant(args, cfg, device, dtype, image: int, quantization, impls) -> dict:
    """Build the model (`quantization`), measure every MoE impl eagerly and the graph step; the
    variant's result (no machine)."""
    from ..worker.rows import DENOISE, PREFILL

    model, build = build_model(cfg, device, dtype, quantization)
    e, rid, layout = _release_engine(args, model, cfg, device, image, quantization)
    runner = e.worker.runner
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1, cfg.latent_channels, layout.h, layout.w, device=device, generator=g)
    t = torch.tensor([500.0], device=device)
    flops = {ph: flop_model(model, layout, ph) for ph in ("denoise", "recompute")}
    results, phases, fp8 = {}, {"denoise": DENOISE, "recompute": PREFILL}, quantization is not None
    with torch.inference_mode():
        runner.forward_step(rid, layout, x, t, PREFILL, True, None)  # write the prefix pages once
        for impl in impls:
            _set_impl(model, impl)
            free_device(device)
            results[impl] = {"resolved": model.model.layers[0].mlp.resolved_impl(device, dtype)}
            for name, phase in phases.items():
                fn = lambda phase=phase: runner.forward_step(rid, layout, x, t, phase, False, None)
                results[impl][name] = phase_report(*_measure(fn, model, device, args.repeats), flops[name],
                                                   args.layers, fp8)
            results[impl]["denoise"]["kernels"] = kernel_profile(
                lambda: runner.forward_step(rid, layout, x, t, DENOISE, False, None), model, device)
        graph = _graph_step(runner, rid, layout, x, t, model, device, args.repeats, flops["denoise"], fp8)
    backends = None
    if getattr(args, "compare_backend", None):
        from .step_backends import compare_backends

        backends = compare_backends(args, model, cfg, device, image, quantization, args.compare_backend,
                                    _release_engine)
    row = layout.rows[0]
    kv = sum(-(-r.seq_len // args.block_size) for r in layout.rows) * e.worker.bytes_per_block()
    transient = max((r[ph]["step_transient_bytes"] or 0) for r in results.values() for ph in phases)
    result = {
        "preset": "release", "shrink": args.shrink, "layers": args.layers, "image": image,
        "quantization": quantization, "prefix_tokens": row.prefix_len, "target_tokens": row.target_len,
        "rows": len(layout.rows), "latent_grid": [layout.h, layout.w], "block_size": args.block_size,
        "device": str(device), "dtype": str(dtype).replace("torch.", ""), "backend": e.worker.backend.name,
        "attention_calls": dict(getattr(e.worker.backend, "calls", {})),  # which kernel served (split backends)
        "geometry": {k: getattr(cfg, k) for k in (
            "hidden_size", "num_attention_heads", "num_key_value_heads", "attention_head_dim", "num_experts",
            "moe_topk", "num_shared_expert", "moe_intermediate_size", "latent_channels", "patch_embed_hidden_dim",
            "image_token_downsample")},
        "weights_bytes": build["weights_bytes"], "weights_bytes_by_kind": build["weights_bytes_by_kind"],
        "build": build, "kv_bytes_per_request": kv, "kv_bytes_per_request_32_layers": kv * FULL_LAYERS // args.layers,
        "memory_left_for_kv": memory_left_for_kv(e, device, transient, kv),
        "peak_flops": {"measured_bf16": H200_BF16_MEASURED, "nominal_bf16": H200_BF16_NOMINAL,
                       "measured_fp8": H200_FP8_MEASURED},
        "flops": flops, "moe_impls": results, "graph": graph,
    }
    if backends is not None:
        result["compare_backend"] = backends
    e.scheduler.finish(rid)
    e._retire(e.scheduler.take_finished())
    P, T = row.prefix_len, row.target_len
    # prefix reuse (issue 14 / 16 goal >= 0.9 (P+T)/T): recompute step / reuse step, both eager, per MoE
    # impl, measured at `layers` and extrapolated to 32 (the fixed image-path cost weighs less there)
    result["reuse"] = {impl: {"speedup": r["recompute"]["step_ms"] / r["denoise"]["step_ms"],
                              "speedup_32_layers": r["recompute"]["step_ms_32_layers"] / r["denoise"]["step_ms_32_layers"],
                              "ideal": (P + T) / T, "goal": 0.9 * (P + T) / T} for impl, r in results.items()}
    if "loop" in results and "grouped" in results:
        result["grouped_speedup"] = {ph: {k: results["loop"][ph][k] / results["grouped"][ph][k]
                                          for k in ("step_ms", "moe_ms")} for ph in phases}
    return result


def run_release(args) -> dict:
    from ..models.loader import resolve_device, resolve_dtype

    impls, quants = moe_impls(args), quantizations(args)
    device = resolve_device(args.device)
    dtype = resolve_dtype("auto", device)
    cfg = release_config(args.layers, args.shrink)
    image = args.image or (64 if args.shrink else 1024)
    runs = []
    for q in quants:
        runs.append(_run_variant(args, cfg, device, dtype, image, q, impls))
        free_device(device)  # the next variant builds its own model
    result = runs[-1]
    if len(runs) == 2:
        result["compare_bf16"] = compare(runs[0], result)
    result["fp8_fast_accum"] = fp8_fast_accum()
    result["fp8_grouped_gemm"] = fp8_grouped_gemm(device)
    result["fast_image_path"] = fast_image_path()
    result["fp8_layer_fusion"] = fp8_layer_fusion()
    result["machine"] = machine()
    emit(result, args.json, _release_table(result), None)
    return result


def compare(base: dict, fp8: dict) -> dict:
    """fp8 / unquantized (bf16 on a GPU) of the same geometry and weights: step and per-part times,
    eager per MoE impl and phase, and the graph step."""
    eager = {impl: {ph: {k: fp8["moe_impls"][impl][ph][k] / base["moe_impls"][impl][ph][k]
                         for k in ("step_ms", "attn_block_ms", "moe_ms", "step_ms_32_layers")}
                    for ph in ("denoise", "recompute")} for impl in fp8["moe_impls"]}
    graph = None
    if fp8.get("graph") and base.get("graph"):
        graph = fp8["graph"]["graph_ms"] / base["graph"]["graph_ms"]
    return {"baseline_dtype": base["dtype"], "baseline": base,
            "fp8_over_bf16": {"eager": eager, "graph": graph,
                              "weights_bytes": fp8["weights_bytes"] / base["weights_bytes"]}}


def _graph_step(runner, rid, layout, x, t, model, device, repeats, flops, fp8: bool = False) -> dict | None:
    """The denoise step replayed as the engine's CUDA graph (grouped MoE) against the same step run
    eagerly, side by side; None where the step cannot be captured (CPU, no grouped GEMM)."""
    from ..worker.cuda_graph import DenoiseStepGraph, graph_unusable
    from ..worker.rows import DENOISE

    model.set_moe_impl("auto")
    why = graph_unusable(runner)
    if why is not None:
        return None
    g = DenoiseStepGraph(runner, rid, layout)
    eager = _time(lambda: runner.forward_step(rid, layout, x, t, DENOISE, False, None), device, repeats)
    replay = _time(lambda: g.replay(x, t), device, repeats)
    same = (g.replay(x, t) - runner.forward_step(rid, layout, x, t, DENOISE, False, None)[0]).abs().max().item()
    total = flops["layer"] * model.config.num_hidden_layers + flops["image"]
    g = None  # its memory pool goes with it
    out = {"eager_ms": eager * 1e3, "graph_ms": replay * 1e3, "speedup": eager / replay,
           "graph_mfu": total / replay / H200_BF16_MEASURED, "max_abs_diff_vs_eager": same}
    if fp8:
        out["graph_mfu_fp8_rate"] = total / replay / H200_FP8_MEASURED
    return out


def _release_table(result: dict) -> list[dict]:
    runs = [result] + ([result["compare_bf16"]["baseline"]] if "compare_bf16" in result else [])
    rows = []
    for res in runs:
        kv = f"{res['kv_bytes_per_request'] / 2**20:.1f} / {res['kv_bytes_per_request_32_layers'] / 2**20:.1f}"
        weights = res["quantization"] or res["dtype"]
        for impl, r_impl in res["moe_impls"].items():
            for ph in ("denoise", "recompute"):
                r = r_impl[ph]
                rows.append({"weights": weights, "moe": f"{impl}->{r_impl['resolved']}", "step": ph, "ms": r["step_ms"],
                             "ms/layer": r["layer_ms"], "attn ms/layer": r["attn_block_ms"],
                             "moe ms/layer": r["moe_ms"], "rest ms": r["rest_ms"],
                             "ms @32 layers": r["step_ms_32_layers"], "MFU": r["mfu"],
                             "MFU nominal": r["mfu_nominal"], "MFU @32": r["mfu_32_layers"],
                             "layer MFU": r["layer_mfu"], "MoE MFU": r["moe_mfu"],
                             "peak GiB": "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}",
                             f"KV MiB/req ({res['layers']}L / 32L)": kv})
        if res.get("graph"):
            g = res["graph"]
            rows.append({"weights": weights, "moe": "auto", "step": "denoise as CUDA graph", "ms": g["graph_ms"],
                         "MFU": g["graph_mfu"], "ms @32 layers": f"eager {g['eager_ms']:.2f} ms"})
        for impl, r in res.get("reuse", {}).items():
            rows.append({"weights": weights, "moe": impl, "step": "reuse speedup (recompute / denoise)",
                         "ms": f"{r['speedup']:.2f}x", "ms @32 layers": f"{r['speedup_32_layers']:.2f}x",
                         "MFU": f"ideal {r['ideal']:.2f}x, goal {r['goal']:.2f}x"})
    if "compare_bf16" in result:
        c = result["compare_bf16"]["fp8_over_bf16"]
        for impl, phs in c["eager"].items():
            for ph, r in phs.items():
                rows.append({"weights": "fp8 / bf16", "moe": impl, "step": ph, "ms": f"{r['step_ms']:.3f}x",
                             "attn ms/layer": f"{r['attn_block_ms']:.3f}x", "moe ms/layer": f"{r['moe_ms']:.3f}x"})
        if c["graph"] is not None:
            rows.append({"weights": "fp8 / bf16", "moe": "auto", "step": "denoise as CUDA graph",
                         "ms": f"{c['graph']:.3f}x"})
    return rows
