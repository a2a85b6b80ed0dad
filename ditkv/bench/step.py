"""`ditkv bench step`: one denoise step with prefix reuse vs full recompute, and paged vs dense.

CPU figures are ratios measured side by side in one run; absolute times only mean something on
a GPU. `--preset wide` uses real HunyuanImage-3 widths (hidden 4096, 32/8 heads, head_dim 128)
with few layers and experts so it fits and runs quickly. `--preset release` is the release
geometry (64 experts top-8 + shared, release ResBlocks and VAE latents) with random weights and
`--layers L` decoder layers: time, memory and MFU per step and per layer, extrapolated to 32
layers, for each `--moe-impl` (`run_release`; the real preset needs a GPU, `--shrink` runs
its code path at toy widths on a CPU).
"""

from __future__ import annotations

import statistics
import time

import torch

from ..argtypes import finite_float, nonneg_int, positive_int
from .common import emit, machine

def add_arguments(p):
    p.add_argument("--preset", choices=["tiny", "wide", "release"], default="tiny")
    p.add_argument("--prefix", type=nonneg_int, default=1024, help="prefix tokens per row (prompt + specials)")
    p.add_argument("--image", type=positive_int, default=None,
                   help="image side in pixels (default 64: tiny -> 257 target tokens; release: 1024 -> 4097)")
    p.add_argument("--layers", type=positive_int, default=2, help="decoder layers for --preset wide / release")
    p.add_argument("--experts", type=positive_int, default=8, help="routed experts for --preset wide (top-2)")
    p.add_argument("--guidance", type=finite_float, default=4.0, help="> 1: two CFG rows")
    p.add_argument("--block-size", type=positive_int, default=64)
    p.add_argument("--device", default="auto")
    p.add_argument("--backend", default="auto", help="attention backend for the paged run")
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--e2e-steps", type=positive_int, default=4, help="steps of the end-to-end paged vs dense run")
    p.add_argument("--moe-impl", default="auto",
                   help="routed experts: auto|loop|grouped; --preset release takes a comma list "
                        "(loop,grouped) and measures each on the same weights")
    p.add_argument("--shrink", action="store_true",
                   help="--preset release at toy widths (same expert count, top-k, heads ratio, VAE "
                        "latents): runs the release code path on a CPU")
    p.add_argument("--json", action="store_true")


def moe_impls(args) -> list[str]:
    from ..models.hunyuan.layers import check_moe_impl

    try:
        impls = [check_moe_impl(i.strip()) for i in args.moe_impl.split(",") if i.strip()]
    except ValueError as e:
        raise SystemExit(f"ditkv bench step: --moe-impl: {e}") from None
    if not impls or (len(impls) > 1 and args.preset != "release"):
        raise SystemExit("ditkv bench step: --moe-impl takes one of auto|loop|grouped "
                         "(a comma list only with --preset release)")
    return impls


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
    if args.preset == "release":
        return run_release(args)
    impl = moe_impls(args)[0]
    args.image = 64 if args.image is None else args.image
    from ..config import EngineConfig
    from ..engine.engine import Engine
    from ..engine.types import GenerationRequest
    from ..models.loader import resolve_device, resolve_dtype
    from ..worker.rows import DENOISE, PREFILL

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


# ------------------------------------------------------------------------- release preset
H200_BF16_MEASURED = 788e12  # this H200's measured bf16 matmul rate (8192^3 products, random data)
H200_BF16_NOMINAL = 989.4e12  # NVIDIA's dense bf16 peak of the H200 SXM
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


def random_model_on_device(cfg, device, dtype, seed: int = 0):
    """Random weights made on the device in their final dtype (a CPU fp32 init of four release
    layers is 40 GB and minutes): `from_config`'s per-name seeding, no zero-initialised ResBlock,
    router in fp32."""
    import zlib

    from ..models.hunyuan.model import INIT_STD, HunyuanImage3Model, _is_norm_weight

    with torch.device("meta"):
        model = HunyuanImage3Model(cfg).to(dtype)
    for layer in model.model.layers:
        layer.mlp.gate.float()
    model = model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
            elif _is_norm_weight(name, p):
                p.fill_(1.0)
            else:
                g = torch.Generator(device=device).manual_seed((seed * 0x9E3779B1 + zlib.crc32(name.encode())) % 2**63)
                p.normal_(0.0, INIT_STD, generator=g)
    return model.requires_grad_(False).eval()


def _attended_keys(row, lo: int, hi: int) -> int:
    """Keys that queries [lo, hi) of a row attend to under the mixed mask: j < limit(i)."""
    pos = torch.arange(lo, hi)
    limit = pos + 1
    for a, b in row.full_attn_spans:
        limit = torch.where((pos >= a) & (pos < b), torch.full_like(limit, b), limit)
    return int(limit.sum())


def flop_model(model, layout, phase: str) -> dict:
    """FLOPs of one step: 2 * active params per token * tokens + attention, per decoder layer, and
    the image path (a conv's weight count is its MACs per latent position)."""
    cfg, layer = model.config, model.model.layers[0]
    moe = layer.mlp
    numel = lambda mod: sum(p.numel() for p in mod.parameters())  # noqa: E731
    attn_params = sum(p.numel() for p in layer.self_attn.parameters() if p.dim() == 2)  # qkv, o (not norms)
    moe_params = moe.topk * numel(moe.experts[0]) + moe.gate.wg.weight.numel() \
        + (numel(moe.shared_mlp) if moe.shared_mlp is not None else 0)
    spans = [(r.prefix_len, r.prefix_len + r.target_len) if phase == "denoise" else (0, r.seq_len)
             for r in layout.rows]
    tokens = sum(hi - lo for lo, hi in spans)
    keys = sum(_attended_keys(r, lo, hi) for r, (lo, hi) in zip(layout.rows, spans))
    attn = 4 * cfg.num_attention_heads * cfg.attention_head_dim * keys  # QK^T and PV
    macs = lambda mod: sum(p.numel() for p in mod.parameters() if p.dim() == 4)  # noqa: E731
    # the rows share latents and timestep: the patch embed runs once, the final layer per row
    image_macs = macs(model.patch_embed) + macs(model.final_layer) * len(layout.rows)
    return {"tokens": tokens, "attended_keys": keys, "active_params_per_token_per_layer": attn_params + moe_params,
            "layer": 2 * (attn_params + moe_params) * tokens + attn, "attention": attn,
            "moe": 2 * moe_params * tokens, "image": 2 * image_macs * layout.num_image_tokens}


class _LayerClock:
    """Per decoder layer: time of the layer, its attention block and its MoE (CUDA events on a GPU,
    so the step runs without extra syncs; wall time on a CPU)."""

    PARTS = ("layer", "attn", "moe")

    def __init__(self, model, device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: dict = {}
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            for part, mod in zip(self.PARTS, (layer, layer.self_attn, layer.mlp)):
                self.handles.append(mod.register_forward_pre_hook(self._hook((i, part), 0)))
                self.handles.append(mod.register_forward_hook(self._hook((i, part), 1)))

    def _hook(self, key, end: int):
        def hook(*_):
            self.marks.setdefault(key, [None, None])[end] = self._now()
        return hook

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def take(self) -> dict:
        """Seconds per (layer, part) of the run just finished (the caller has synchronised)."""
        out = {k: (a.elapsed_time(b) / 1e3 if self.cuda else b - a) for k, (a, b) in self.marks.items()}
        self.marks = {}
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()


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


def phase_report(step: float, parts: dict, peak, before, flops: dict, layers: int) -> dict:
    """Per step and per layer: times, the 32-layer extrapolation (rest + 32 mean layers), MFU, peak memory."""
    mean = lambda part: statistics.fmean(parts[i, part] for i in range(layers))  # noqa: E731
    rest = parts["rest"]
    step32 = rest + FULL_LAYERS * mean("layer")
    total, total32 = layers * flops["layer"] + flops["image"], FULL_LAYERS * flops["layer"] + flops["image"]
    gib = lambda b: None if b is None else b / 2**30  # noqa: E731
    return {
        "step_ms": step * 1e3, "layer_ms": mean("layer") * 1e3, "attn_block_ms": mean("attn") * 1e3,
        "moe_ms": mean("moe") * 1e3, "rest_ms": rest * 1e3,
        "per_layer_ms": [parts[i, "layer"] * 1e3 for i in range(layers)],
        "step_ms_32_layers": step32 * 1e3, "flops": total, "flops_32_layers": total32,
        "mfu": total / step / H200_BF16_MEASURED, "mfu_nominal": total / step / H200_BF16_NOMINAL,
        "layer_mfu": flops["layer"] / mean("layer") / H200_BF16_MEASURED,
        "moe_mfu": flops["moe"] / mean("moe") / H200_BF16_MEASURED,
        "mfu_32_layers": total32 / step32 / H200_BF16_MEASURED,
        "mfu_32_layers_nominal": total32 / step32 / H200_BF16_NOMINAL,
        "peak_gib": gib(peak), "step_transient_gib": gib(None if peak is None else peak - before),
    }


def _release_engine(args, model, cfg, device, image: int):
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
                        max_image_height=image, max_image_width=image, profile_memory=False, cuda_graphs="off")
    e = Engine(ecfg, model_bundle=(model, ByteTokenizer(), make_codec(cfg)))  # VAE: never decoded here
    rid = e.add_request(GenerationRequest(prompt="a" * (args.prefix - 4), height=image, width=image, steps=2,
                                          guidance_scale=args.guidance, seed=0))
    sreq = e.scheduler.schedule().admitted[0]
    e.worker.install(sreq.metadata)
    return e, rid, sreq.payload[0]


def run_release(args) -> dict:
    from ..models.loader import resolve_device, resolve_dtype
    from ..worker.rows import DENOISE, PREFILL

    impls = moe_impls(args)
    device = resolve_device(args.device)
    dtype = resolve_dtype("auto", device)
    cfg = release_config(args.layers, args.shrink)
    image = args.image or (64 if args.shrink else 1024)
    model = random_model_on_device(cfg, device, dtype)
    e, rid, layout = _release_engine(args, model, cfg, device, image)
    runner = e.worker.runner
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1, cfg.latent_channels, layout.h, layout.w, device=device, generator=g)
    t = torch.tensor([500.0], device=device)
    flops = {ph: flop_model(model, layout, ph) for ph in ("denoise", "recompute")}
    results, phases = {}, {"denoise": DENOISE, "recompute": PREFILL}
    with torch.inference_mode():
        runner.forward_step(rid, layout, x, t, PREFILL, True, None)  # write the prefix pages once
        for impl in impls:
            model.set_moe_impl(impl)  # grouped: stacks the experts here, not inside a timed step
            if device.type == "cuda":
                torch.cuda.empty_cache()
            results[impl] = {"resolved": model.model.layers[0].mlp.resolved_impl(device, dtype)}
            for name, phase in phases.items():
                fn = lambda phase=phase: runner.forward_step(rid, layout, x, t, phase, False, None)  # noqa: E731
                results[impl][name] = phase_report(*_measure(fn, model, device, args.repeats), flops[name],
                                                   args.layers)
        graph = _graph_step(runner, rid, layout, x, t, model, device, dtype, args.repeats, flops["denoise"])
    e.scheduler.finish(rid)
    e._retire(e.scheduler.take_finished())
    row = layout.rows[0]
    kv = sum(-(-r.seq_len // args.block_size) for r in layout.rows) * e.worker.bytes_per_block()
    result = {
        "preset": "release", "shrink": args.shrink, "layers": args.layers, "image": image,
        "prefix_tokens": row.prefix_len, "target_tokens": row.target_len, "rows": len(layout.rows),
        "latent_grid": [layout.h, layout.w], "block_size": args.block_size, "device": str(device),
        "dtype": str(dtype).replace("torch.", ""), "backend": e.worker.backend.name,
        "geometry": {k: getattr(cfg, k) for k in (
            "hidden_size", "num_attention_heads", "num_key_value_heads", "attention_head_dim", "num_experts",
            "moe_topk", "num_shared_expert", "moe_intermediate_size", "latent_channels", "patch_embed_hidden_dim",
            "image_token_downsample")},
        "weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "kv_bytes_per_request": kv, "kv_bytes_per_request_32_layers": kv * FULL_LAYERS // args.layers,
        "peak_flops": {"measured_bf16": H200_BF16_MEASURED, "nominal_bf16": H200_BF16_NOMINAL},
        "flops": flops, "moe_impls": results, "machine": machine(),
    }
    if graph is not None:
        result["graph"] = graph
    P, T = row.prefix_len, row.target_len
    # prefix reuse (issue 14 / 16 goal >= 0.9 (P+T)/T): recompute step / reuse step, both eager, per MoE
    # impl, measured at `layers` and extrapolated to 32 (the fixed image-path cost weighs less there)
    result["reuse"] = {impl: {"speedup": r["recompute"]["step_ms"] / r["denoise"]["step_ms"],
                              "speedup_32_layers": r["recompute"]["step_ms_32_layers"] / r["denoise"]["step_ms_32_layers"],
                              "ideal": (P + T) / T, "goal": 0.9 * (P + T) / T} for impl, r in results.items()}
    if "loop" in results and "grouped" in results:
        result["grouped_speedup"] = {ph: {k: results["loop"][ph][k] / results["grouped"][ph][k]
                                          for k in ("step_ms", "moe_ms")} for ph in phases}
    emit(result, args.json, _release_table(result), None)
    return result


def _graph_step(runner, rid, layout, x, t, model, device, dtype, repeats, flops) -> dict | None:
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
    del g  # its memory pool goes with it
    return {"eager_ms": eager * 1e3, "graph_ms": replay * 1e3, "speedup": eager / replay,
            "graph_mfu": total / replay / H200_BF16_MEASURED, "max_abs_diff_vs_eager": same}


def _release_table(result: dict) -> list[dict]:
    kv = f"{result['kv_bytes_per_request'] / 2**20:.1f} / {result['kv_bytes_per_request_32_layers'] / 2**20:.1f}"
    rows = []
    for impl, res in result["moe_impls"].items():
        for ph in ("denoise", "recompute"):
            r = res[ph]
            rows.append({"moe": f"{impl}->{res['resolved']}", "step": ph, "ms": r["step_ms"],
                         "ms/layer": r["layer_ms"], "attn ms/layer": r["attn_block_ms"],
                         "moe ms/layer": r["moe_ms"], "rest ms": r["rest_ms"],
                         "ms @32 layers": r["step_ms_32_layers"], "MFU": r["mfu"], "MFU nominal": r["mfu_nominal"],
                         "MFU @32": r["mfu_32_layers"], "layer MFU": r["layer_mfu"], "MoE MFU": r["moe_mfu"],
                         "peak GiB": "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}",
                         f"KV MiB/req ({result['layers']}L / 32L)": kv})
    for impl, r in result.get("reuse", {}).items():
        rows.append({"moe": impl, "step": "reuse speedup (recompute / denoise)",
                     "ms": f"{r['speedup']:.2f}x", "ms @32 layers": f"{r['speedup_32_layers']:.2f}x",
                     "MFU": f"ideal {r['ideal']:.2f}x, goal {r['goal']:.2f}x"})
    return rows
