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
helpers the release modules share.
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
    p.add_argument("--e2e-request", action="store_true",
                   help="--preset release: time whole CFG requests through the engine (prefill, --e2e-steps "
                        "denoising steps, VAE decode with random weights) instead of single steps")
    p.add_argument("--max-num-seqs", type=positive_int, nargs="+", default=[1],
                   help="--e2e-request: engine max_num_seqs values; N > 1 runs N requests at once "
                        "(step-level batching) and reports images per minute")
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


def quantizations(args) -> list[str | None]:
    """The model variants to run, in order: the requested one last (the result's top level). Refuses
    the flags that mean nothing with the others given."""
    quant = None if args.quantization == "none" else args.quantization
    release_only = [f for f, on in (("--quantization fp8", quant is not None), ("--compare-bf16", args.compare_bf16),
                                    ("--e2e-request", args.e2e_request)) if on]
    if release_only and args.preset != "release":
        raise SystemExit(f"ditkv bench step: {', '.join(release_only)} need --preset release")
    if args.compare_bf16 and quant is None:
        raise SystemExit("ditkv bench step: --compare-bf16 compares against --quantization fp8; add it")
    if args.max_num_seqs != [1] and not args.e2e_request:
        raise SystemExit("ditkv bench step: --max-num-seqs sizes the --e2e-request engines; add --e2e-request")
    return [None, quant] if args.compare_bf16 else [quant]


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
        from .step_release import run_release

        return run_release(args)
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
    times = {"e2e_s": _time(lambda: runner.generate(rid, layout, args.e2e_steps, args.guidance, 0), device,
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
def _attended_keys(row, lo: int, hi: int) -> int:
    """Keys that queries [lo, hi) of a row attend to under the mixed mask: j < limit(i)."""
    pos = torch.arange(lo, hi)
    limit = pos + 1
    for a, b in row.full_attn_spans:
        limit = torch.where((pos >= a) & (pos < b), torch.full_like(limit, b), limit)
    return int(limit.sum())


def flop_model(model, layout, phase: str) -> dict:
    """FLOPs of one step: 2 * active params per token * tokens + attention, per decoder layer, and
    the image path (a conv's weight count is its MACs per latent position). Matrices only, so an
    FP8 model's row scales do not count as weights."""
    cfg, layer = model.config, model.model.layers[0]
    moe = layer.mlp
    numel = lambda mod: sum(p.numel() for p in mod.parameters() if p.dim() >= 2)
    attn_params = sum(p.numel() for p in layer.self_attn.parameters() if p.dim() == 2)  # qkv, o (not norms)
    moe_params = moe.topk * numel(moe.experts[0]) + moe.gate.wg.weight.numel() \
        + (numel(moe.shared_mlp) if moe.shared_mlp is not None else 0)
    spans = [(r.prefix_len, r.prefix_len + r.target_len) if phase == "denoise" else (0, r.seq_len)
             for r in layout.rows]
    tokens = sum(hi - lo for lo, hi in spans)
    keys = sum(_attended_keys(r, lo, hi) for r, (lo, hi) in zip(layout.rows, spans))
    attn = 4 * cfg.num_attention_heads * cfg.attention_head_dim * keys  # QK^T and PV
    macs = lambda mod: sum(p.numel() for p in mod.parameters() if p.dim() == 4)
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


# ------------------------------------------------------------------- kernel profile of one step
# FP8 activation quantization: the Triton kernels of models/fp8_kernels.py, by their names there
QUANT_KERNELS = ("_quant_rows_kernel", "_silu_mul_quant_kernel")
# ops whose kernels are matrix products; only the outermost counts (none of these nests another today)
GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_mm", "aten::_grouped_mm",
                      "aten::_scaled_grouped_mm"})
# record_function ranges around each decoder layer's modules (router and shared MLP nest in moe)
RANGES = ("attn_block", "moe", "router", "shared_mlp")
BUCKET_RULES = {
    "total_kernel_us": "every CUDA kernel of the step (device time; GPU-side user annotations excluded)",
    "act_quant_us": "kernels whose name contains " + " or ".join(QUANT_KERNELS) + " (models/fp8_kernels.py)",
    "<range>_us": "kernels launched inside ditkv.<range>, a record_function around each layer's self_attn "
                  "(attn_block), mlp (moe), mlp.gate (router), mlp.shared_mlp (shared_mlp)",
    "<range>_gemm_us": "device time of the GEMM ops (" + ", ".join(sorted(GEMM_OPS)) + ") whose innermost "
                       "range is <range>; outside_gemm_us: in no range",
    "routed_us": "moe - router - shared_mlp: the routed experts",
    "routed_other_us": "routed - moe_gemm: sort, gather, activation quantization, un-permute, combine",
    "moe_split": "routed_gemm = moe_gemm; router_sort_gather_combine = router + routed_other; shared_mlp",
}


class _Ranges:
    """record_function ranges around the layers' attention block, MoE, router and shared MLP (forward
    hooks), so the profiler can attribute kernels to them."""

    def __init__(self, model) -> None:
        self.handles, self.open = [], []
        for layer in model.model.layers:
            mlp = layer.mlp
            for name, mod in zip(RANGES, (layer.self_attn, mlp, mlp.gate, mlp.shared_mlp)):
                if mod is not None:
                    self.handles.append(mod.register_forward_pre_hook(self._enter(f"ditkv.{name}")))
                    self.handles.append(mod.register_forward_hook(self._exit))

    def _enter(self, name: str):
        def hook(*_):
            rf = torch.autograd.profiler.record_function(name)
            rf.__enter__()
            self.open.append(rf)
        return hook

    def _exit(self, *_):
        self.open.pop().__exit__(None, None, None)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def kernel_profile(fn, model, device) -> dict | None:
    """CUDA kernel time of one call of `fn` by bucket (`BUCKET_RULES`), from torch.profiler; None on
    a CPU (no kernels to time)."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    ranges = _Ranges(model)
    try:
        fn()  # warm-up with the hooks on
        _sync(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            _sync(device)
        return kernel_buckets(prof.events())
    except Exception as e:  # noqa: BLE001 -- diagnostics only: a profiler failure must not cost the run's timings
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        ranges.close()


def _is_kernel(e) -> bool:
    from torch.autograd import DeviceType

    return e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)


def _ancestors(e):
    p = e.cpu_parent
    while p is not None:
        yield p
        p = p.cpu_parent


def kernel_buckets(events, time_of=None) -> dict:
    """`kernel_profile`'s figures from profiler events (FunctionEvent: name, device_type, cpu_parent,
    device_time_total, is_user_annotation), microseconds. `time_of(event)`: another clock for the
    ranges and GEMM ops (a CPU test uses cpu_time_total)."""
    from torch.autograd import DeviceType

    time_of = time_of or (lambda e: e.device_time_total)
    kernels = [e for e in events if _is_kernel(e)]
    total = sum(e.device_time_total for e in kernels)
    quant = sum(e.device_time_total for e in kernels if any(k in e.name for k in QUANT_KERNELS))
    out = {f"{r}_us": 0.0 for r in RANGES} | {f"{r}_gemm_us": 0.0 for r in (*RANGES, "outside")}
    for e in events:
        if e.device_type != DeviceType.CPU:
            continue
        if e.name.startswith("ditkv.") and e.name[6:] in RANGES:
            out[f"{e.name[6:]}_us"] += time_of(e)
        elif e.name in GEMM_OPS and not any(a.name in GEMM_OPS for a in _ancestors(e)):
            inner = next((a.name[6:] for a in _ancestors(e) if a.name.startswith("ditkv.") and a.name[6:] in RANGES),
                         "outside")
            out[f"{inner}_gemm_us"] += time_of(e)
    routed = out["moe_us"] - out["router_us"] - out["shared_mlp_us"]
    by_name: dict[str, list] = {}
    for e in kernels:
        row = by_name.setdefault(e.name, [0.0, 0])
        row[0] += e.device_time_total
        row[1] += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:15]
    out.update(total_kernel_us=total, act_quant_us=quant, act_quant_share=quant / total if total else None,
               routed_us=routed, routed_other_us=routed - out["moe_gemm_us"],
               # the MoE as two parts: its routed-expert GEMMs, and routing around them
               moe_split={"routed_gemm_us": out["moe_gemm_us"],
                          "router_sort_gather_combine_us": out["router_us"] + routed - out["moe_gemm_us"],
                          "shared_mlp_us": out["shared_mlp_us"]},
               top_kernels=[{"name": n[:160], "us": us, "calls": c} for n, (us, c) in top], rules=BUCKET_RULES)
    return out
