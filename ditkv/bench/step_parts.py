"""Parts the step benchmarks share (`step.py`, `step_release.py`, `step_e2e.py`): the --moe-impl and
--quantization choices, timing, the FLOP model, the per-layer clock and the kernel profile with its
buckets."""

from __future__ import annotations

import statistics
import time

import torch

from ..models import fp8_quack


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
                                    ("--e2e-request", args.e2e_request),
                                    ("--compare-backend", getattr(args, "compare_backend", None) is not None)) if on]
    if release_only and args.preset != "release":
        raise SystemExit(f"ditkv bench step: {', '.join(release_only)} need --preset release")
    if args.compare_bf16 and quant is None:
        raise SystemExit("ditkv bench step: --compare-bf16 compares against --quantization fp8; add it")
    if getattr(args, "compare_backend", None) is not None and args.e2e_request:
        raise SystemExit("ditkv bench step: --compare-backend times single steps; drop --e2e-request")
    if args.max_num_seqs != [1] and not args.e2e_request:
        raise SystemExit("ditkv bench step: --max-num-seqs sizes the --e2e-request engines; add --e2e-request")
    return [None, quant] if args.compare_bf16 else [quant]


def fp8_fast_accum() -> bool:
    """Whether this run's FP8 GEMMs used `use_fast_accum` (`--fp8-fast-accum`), for the JSON."""
    from ..models import fp8

    return fp8.FAST_ACCUM["on"]


def fp8_grouped_gemm(device) -> str:
    """The kernel this run's routed FP8 expert GEMMs took (`--fp8-grouped-gemm`), for the JSON."""
    from ..models import fp8

    return fp8.grouped_gemm_impl(device)


def fast_image_path() -> bool:
    """Whether the image path ran channels-last (`--no-fast-image-path` turns it off), for the JSON."""
    from ..models.hunyuan.image_layers import FAST

    return FAST["on"]


def fp8_layer_fusion() -> bool:
    """Whether the FP8 decoder layers ran fused (`--no-fp8-layer-fusion` turns it off), for the JSON."""
    from ..models.hunyuan.fp8_layer import FUSED

    return FUSED["on"]


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
# quack's routed FP8 GEMM (models/fp8_quack.py) launches through the CUDA driver (tvm-ffi), and the profiler
# does not tie those kernels to the CPU ranges they ran in: they are counted by name (the epilogue's) and
# added to the MoE and its GEMMs where the ranges missed them
QUACK_RANGE, QUACK_KERNEL = fp8_quack.RANGE, fp8_quack.rowwise_scaled.__name__
# ops whose kernels are matrix products; only the outermost counts (none of these nests another today)
GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_mm", "aten::_grouped_mm",
                      "aten::_scaled_grouped_mm", QUACK_RANGE})
# record_function ranges around each decoder layer's modules (router and shared MLP nest in moe)
RANGES = ("attn_block", "moe", "router", "shared_mlp")
BUCKET_RULES = {
    "total_kernel_us": "every CUDA kernel of the step (device time; GPU-side user annotations excluded)",
    "act_quant_us": "kernels whose name contains " + " or ".join(QUANT_KERNELS) + " (models/fp8_kernels.py)",
    "<range>_us": "kernels launched inside ditkv.<range>, a record_function around each layer's self_attn "
                  "(attn_block), mlp (moe), mlp.gate (router), mlp.shared_mlp (shared_mlp)",
    "<range>_gemm_us": "device time of the GEMM ops (" + ", ".join(sorted(GEMM_OPS)) + ") whose innermost "
                       "range is <range>; outside_gemm_us: in no range",
    "quack_unranged_us": "kernels whose name contains quack and " + QUACK_KERNEL + " that no " + QUACK_RANGE
                         + " range holds (driver launches the profiler does not correlate): added to moe and moe_gemm",
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
    quack = sum(e.device_time_total for e in kernels if "quack" in e.name and QUACK_KERNEL in e.name)
    ranged = sum(time_of(e) for e in events if e.device_type == DeviceType.CPU and e.name == QUACK_RANGE)
    out["quack_unranged_us"] = max(0.0, quack - ranged)
    out["moe_us"] += out["quack_unranged_us"]
    out["moe_gemm_us"] += out["quack_unranged_us"]
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
