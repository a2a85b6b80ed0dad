"""`ditkv bench handoff`: AR -> DiT handoff latency at editing prefix sizes, native vs legacy.

Handoff = t(the DiT's first denoising step starts) - t(the AR stage finished the prefill), per
request, requests run one at a time after a full-size warm-up. It covers everything in between:
the orchestrator's intake, the DiT's reservation and registration, the producer's write (legacy:
the gather into its staging buffer first), the completion notice, scheduling, and for legacy the
dense-cache allocation and the copy from the receive slot. The step itself is not included.

The model has the release's KV geometry (`--kv-geometry release`: 32 layers, 8 KV heads, head_dim
128, i.e. 128 KiB per token per row in bf16, 256 KiB in fp32) and random weights; everything else
is as small as the config allows. The config requires hidden = query heads x head_dim with query
heads a multiple of KV heads, so hidden is 8 x 128 = 1024 (not the release's 4096): that only makes
the AR prefill and the DiT step cheaper, not the KV.

Timestamps come from wrappers installed on this run's stage objects (`handoff_probe.Probe`, no stage code changes):
the AR stage delivering a finished job (`ARReplica._deliver`: AR end), the producer's `_send` and its
transport's `write`, the DiT
consumer's `poll` (notices), the DiT stepper's `start` (run start: the request joins the batch) and
the first `DiTRunner.step` of a request (first step). On CUDA each mark synchronizes the
device first, so a mark is when the GPU work before it finished. GPU memory: peak allocated between
the two marks minus what was allocated at the AR mark (`torch.cuda` allocator statistics).

    ditkv bench handoff --transports shm,mooncake --prefix-tokens 1024,6700 --requests 3
    ditkv bench handoff --transports cuda --guidance 1.0,2.0 --requests 5 --out handoff_gpu.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

from .. import argtypes as at
from .common import emit, machine
from .handoff_probe import Probe, norm_device
from .transfer_setup import synthetic_prompt

GOAL_RATIO = 1.5  # issue 16: native >= 1.5x faster than legacy
MODES = ("legacy", "native")


def add_arguments(p):
    p.add_argument("--json", action="store_true", help="print one JSON object only")
    p.add_argument("--out", default=None, type=at.writable_file,
                   help="also write the JSON object to this file (default: not written)")
    p.add_argument("--kv-geometry", choices=["release", "tiny"], default="release",
                   help="release: 32 layers x 8 KV heads x head_dim 128; tiny: the tiny preset (tests)")
    p.add_argument("--prefix-tokens", type=at.positive_int_list, default=[1024, 6700],
                   help="comma list of prompt lengths in text tokens (synthetic prompts, as bench transfer's)")
    p.add_argument("--transports", default="shm,mooncake,cuda", help="comma list: shm, mooncake (CPU pools), cuda")
    p.add_argument("--requests", type=at.positive_int, default=3, help="measured requests per transport and path")
    p.add_argument("--warmup", type=at.nonneg_int, default=1, help="full-size requests before measuring (each path)")
    p.add_argument("--guidance", type=_guidance_list, default=[1.0], help="comma list; <= 1: one row, > 1: two CFG rows")
    p.add_argument("--height", type=at.positive_int, default=64, help="image height in pixels")
    p.add_argument("--width", type=at.positive_int, default=64, help="image width in pixels")
    p.add_argument("--steps", type=at.positive_int, default=1, help="denoising steps per request")
    p.add_argument("--block-size", type=at.positive_int, default=64, help="KV page size of both stages, in tokens")
    p.add_argument("--dtype", default="auto", help="auto: float32 on CPU, bfloat16 on GPU")
    p.add_argument("--ar-device", default="auto", help="cuda transport: AR GPU (auto: cuda:0)")
    p.add_argument("--dit-device", default="auto", help="cuda transport: DiT GPU (auto: cuda:1, or the AR's GPU)")
    p.add_argument("--attention-backend", default="torch", help="both stages (torch: images compare bitwise)")
    p.add_argument("--torch-threads", type=at.positive_int, default=min(4, os.cpu_count() or 1),
                   help="torch threads of every stage process (default here: min(4, CPU count))")
    p.add_argument("--timeout", type=at.positive_float, default=900.0, help="seconds per request")


def _guidance_list(text: str) -> list[float]:
    vals = [at.finite_float(x.strip()) for x in text.split(",") if x.strip()]
    if not vals or any(v < 0 for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r}: give guidance scales >= 0, e.g. 1.0,2.0")
    return vals


# ---- model and workload ---------------------------------------------------------------------------
def model_config(geometry: str, max_positions: int = 0):
    from ..models.hunyuan import HunyuanImage3Config

    tiny = HunyuanImage3Config.tiny()
    if geometry == "tiny":
        return tiny.replace(max_position_embeddings=max(tiny.max_position_embeddings, max_positions))
    # release KV geometry; the rest minimal: 2 experts top-2, 32-wide MLPs, a 4x4 latent grid at 64 px
    return tiny.replace(hidden_size=1024, num_hidden_layers=32, num_attention_heads=8, num_key_value_heads=8,
                        attention_head_dim=128, intermediate_size=32, moe_intermediate_size=32, num_experts=2,
                        moe_topk=2, patch_embed_hidden_dim=32, image_token_downsample=16,
                        latent_channels=3 * 16 * 16, max_position_embeddings=max(22800, max_positions))


def build_bundle(geometry: str, device, dtype, max_positions: int = 0):
    from ..models.hunyuan import ByteTokenizer, HunyuanImage3Model
    from ..models.hunyuan.codec import make_codec

    cfg = model_config(geometry, max_positions)
    model = HunyuanImage3Model.from_config(cfg, seed=0).to(device=device, dtype=dtype).eval()
    return model, ByteTokenizer(), make_codec(cfg)


def kv_token_bytes(cfg, dtype) -> int:
    """K and V of every layer for one token of one row."""
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.attention_head_dim * \
        torch.empty((), dtype=dtype).element_size()


def request(n: int, i: int, args, guidance: float):
    from ..engine.types import GenerationRequest

    return GenerationRequest(prompt=synthetic_prompt(n, i), seed=i, height=args.height, width=args.width,
                             steps=args.steps, guidance_scale=guidance)


def row_layout(cfg, n: int, args, guidance: float):
    from ..models.hunyuan import ByteTokenizer
    from ..models.hunyuan.layout import build_request_layout

    return build_request_layout(cfg, ByteTokenizer(), synthetic_prompt(n), args.height, args.width, guidance)


def graph_data(mode: str, kind: str, args, layout, devices, dtype: str) -> dict:
    """AR(0) -> DiT(1) for one request in flight: pools and legacy buffers sized to this prefix."""
    from ..core.kv_manager import blocks_for

    bs, rows = args.block_size, len(layout.rows)
    prefix = layout.rows[0].prefix_len  # what the AR prefills (cond row: <bos> prompt <boi> <size> <ratio>)
    common = {"kv_connector": kind, "legacy_slots": 1, "legacy_max_tokens": prefix}
    eng = {"model": "tiny", "block_size": bs, "dtype": dtype, "attention_backend": args.attention_backend,
           "torch_threads": args.torch_threads, "torch_compile": False}  # no compile time in a latency bench
    dit = {**eng, "device": devices[1], "diffusion_kv_mode": "dense_legacy", "max_image_height": args.height,
           "max_image_width": args.width, "max_prompt_tokens": max(256, layout.prompt_tokens), "cuda_graphs": "off"}
    if mode == "native":
        # the prefix cache off: this times the transfer, and a repeated request would skip cached pages
        dit.update(diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=rows,
                   num_kv_blocks=rows * blocks_for(layout.rows[0].seq_len, bs) + 1, enable_prefix_caching=False)
    key = "kv_transfer_config" if mode == "native" else "legacy_kv_transfer"
    return {"stages": [
        {"stage_id": 0, "kind": "ar", "engine": {**eng, "device": devices[0],
                                                 "num_kv_blocks": blocks_for(prefix, bs) + 1},
         key: {**common, "engine_id": "ar", "kv_role": "kv_producer"}},
        {"stage_id": 1, "kind": "dit", "inputs": [0], "engine": dit,
         key: {**common, "engine_id": "dit", "kv_role": "kv_consumer", "transfer_timeout": 120.0}}],
        "orchestrator": {"max_inflight": 1}}


def stage_devices(args, kind: str) -> tuple[str, str]:
    """CPU for shm / mooncake. cuda: AR cuda:0, DiT cuda:1 when there is one, else cuda:0 too."""
    if kind != "cuda":
        return "cpu", "cpu"
    ar = args.ar_device if args.ar_device != "auto" else "cuda:0"
    dit = args.dit_device if args.dit_device != "auto" else ("cuda:1" if torch.cuda.device_count() > 1 else ar)
    return ar, dit


def load_graph(data: dict, devices):
    """The stage graph; two stages on one GPU are validated with the DiT on `auto` and then pinned.
    The placement check refuses two stages naming one cuda:N because each would size its pool from
    the whole GPU; here every pool is sized explicitly, and one H200 is the setup to measure."""
    from dataclasses import replace

    from ..stages.graph import load_stage_graph

    shared = devices[0] == devices[1] and devices[0].startswith("cuda")
    if shared:
        data["stages"][1]["engine"]["device"] = "auto"
    graph = load_stage_graph(data)
    if shared:
        graph.dit.engine = replace(graph.dit.engine, device=devices[1])
    return graph


def skip_reason(kind: str) -> str | None:
    if kind == "cuda" and not torch.cuda.is_available():
        return "no CUDA device visible (the cuda transport moves GPU pools)"
    if kind == "mooncake" and importlib.util.find_spec("mooncake") is None:
        return "the Mooncake Transfer Engine is not installed (pip install ditkv[transfer])"
    if kind not in ("shm", "mooncake", "cuda"):
        return f"unknown transport {kind!r}"
    return None


# ---- observation ------------------------------------------------------------------------------
def _wait_quiet(orch, timeout: float = 30.0) -> bool:
    """Every page back (the AR lease returns when the producer's write settled)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if orch.pools_full() and not any(d.num_quarantined for d in orch.dit):
            return True
        time.sleep(0.005)
    return False


def _stats(xs: list[float]) -> dict:
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"p50": None, "mean": None, "min": None, "max": None}
    return {"p50": statistics.median(xs), "mean": statistics.mean(xs), "min": min(xs), "max": max(xs)}


# ---- one (prefix, guidance, transport, path) ------------------------------------------------------
def measure(args, mode: str, kind: str, n: int, guidance: float, bundle, devices) -> dict:
    from ..stages.orchestrator import Orchestrator

    cfg, dtype = bundle[0].config, bundle[0].dtype
    layout = row_layout(cfg, n, args, guidance)
    data = graph_data(mode, kind, args, layout, devices, str(dtype).removeprefix("torch."))
    base = {str(norm_device(d)): torch.cuda.memory_allocated(norm_device(d)) for d in devices if d.startswith("cuda")}
    orch = Orchestrator(load_graph(data, devices), bundle).start()
    static = {d: torch.cuda.memory_allocated(d) - base[d] for d in base}  # pools, staging, slots
    probe = Probe(orch)
    outs, nbytes, rids, failed = [], [], [], []
    try:
        for i in range(args.warmup):  # same size: first touch of every buffer, Mooncake handshake
            _check(orch.generate(request(n, 1000 + i, args, guidance), args.timeout), failed)
            _wait_quiet(orch)
        for i in range(args.requests):
            b0 = orch.transfers.snapshot()["bytes"]
            out = orch.generate(request(n, i, args, guidance), args.timeout)
            quiet = _wait_quiet(orch)  # bytes are counted when the write returns, maybe after the notice
            _check(out, failed)
            outs.append(out)
            rids.append(out.request_id)
            nbytes.append(orch.transfers.snapshot()["bytes"] - b0 if quiet else None)
            print(f"[bench handoff] {kind} {mode} prefix {n} rows {len(layout.rows)} #{i}: "
                  f"{probe.breakdown(out.request_id)['handoff']:.1f} ms", file=sys.stderr)
        full = _wait_quiet(orch)
    finally:
        orch.shutdown()
    parts = [probe.breakdown(r) for r in rids]
    hand = _stats([p["handoff"] for p in parts])
    per_req = nbytes[0] if nbytes and all(b == nbytes[0] for b in nbytes) else nbytes
    token_bytes = kv_token_bytes(cfg, dtype)
    imported = [o.stats.imported_tokens for o in outs if o.ok]
    gpu = None
    if probe.devs:
        peaks = [probe.gpu[r]["peak_extra_bytes"] for r in rids if "peak_extra_bytes" in probe.gpu.get(r, {})]
        gpu = {"peak_extra_bytes": max(peaks) if peaks else None, "static_bytes": static}
    return {
        "mode": mode, "handoff_ms": hand, "handoff_ms_all": [p["handoff"] for p in parts],
        "breakdown_ms_p50": {k: _stats([p[k] for p in parts])["p50"] for k in parts[0] if k != "handoff"}
        if parts else {},
        "descriptors": [probe.marks[r].get("descriptors") for r in rids],
        "bytes_per_request": per_req, "imported_tokens": imported[0] if imported else None,
        "payload_bytes": imported[0] * token_bytes if imported else None,
        "gbps": (per_req / (hand["p50"] / 1e3) / 1e9) if isinstance(per_req, int) and hand["p50"] else None,
        "staging_bytes": probe.staging_bytes, "receive_slot_bytes": probe.slot_bytes,
        "extra_buffer_bytes": probe.staging_bytes + probe.slot_bytes,
        "dense_cache_bytes": max(probe.dense_bytes.values()) if probe.dense_bytes else 0,
        "gpu": gpu, "failed": failed, "pools_full": full, "_images": [o.image for o in outs],
    }


def _check(out, failed: list) -> None:
    if not out.ok:
        failed.append(out.error or out.status)


# ---- driver -----------------------------------------------------------------------------------
def bench(args) -> tuple[dict, dict]:
    """(the JSON result, images per (prefix, guidance, transport, mode)) — the images stay out of the JSON."""
    from ..models.loader import resolve_dtype

    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    prefixes, guidances = list(args.prefix_tokens), list(args.guidance)
    rows_out, skipped, images, bundles = [], [], {}, {}
    geometry = None
    for kind in [k.strip() for k in args.transports.split(",") if k.strip()]:
        why = skip_reason(kind)
        if why:
            skipped.append({"transport": kind, "reason": why})
            print(f"[bench handoff] skip {kind}: {why}", file=sys.stderr)
            continue
        devices = stage_devices(args, kind)
        dev = norm_device(devices[1])
        dtype = resolve_dtype(args.dtype, dev)
        key = (str(dev), dtype)
        if key not in bundles:
            bundles[key] = build_bundle(args.kv_geometry, dev, dtype, max(prefixes) + 64 + _image_tokens(args))
        bundle = bundles[key]
        cfg = bundle[0].config
        geometry = {"layers": cfg.num_hidden_layers, "kv_heads": cfg.num_key_value_heads,
                    "head_dim": cfg.attention_head_dim, "query_heads": cfg.num_attention_heads,
                    "hidden_size": cfg.hidden_size, "experts": cfg.num_experts,
                    "params": sum(p.numel() for p in bundle[0].parameters()),
                    "dtype": str(dtype).removeprefix("torch."), "kv_bytes_per_token_per_row": kv_token_bytes(cfg, dtype)}
        for n in prefixes:
            for g in guidances:
                res = {m: measure(args, m, kind, n, g, bundle, devices) for m in MODES}
                imgs = {m: res[m].pop("_images") for m in MODES}
                images[(n, g, kind)] = imgs
                exact = len(imgs["legacy"]) == len(imgs["native"]) and all(
                    np.array_equal(a, b) for a, b in zip(imgs["legacy"], imgs["native"]))
                lp, np50 = res["legacy"]["handoff_ms"]["p50"], res["native"]["handoff_ms"]["p50"]
                rows_out.append({"prefix_tokens": n, "guidance": g, "rows": 2 if g > 1 else 1, "transport": kind,
                                 "devices": list(devices), "ratio": lp / np50 if lp and np50 else None,
                                 "bit_exact": exact, **{m: res[m] for m in MODES}})
    ok = [r for r in rows_out if r["ratio"] is not None]
    out = {
        "kv_geometry": args.kv_geometry, "model": geometry, "goal": {"ratio": GOAL_RATIO},
        "min_ratio": min(r["ratio"] for r in ok) if ok else None,
        "goal_met": bool(ok) and all(r["ratio"] >= GOAL_RATIO for r in ok),
        "bit_exact": all(r["bit_exact"] for r in rows_out),
        "failed": sum(len(r[m]["failed"]) for r in rows_out for m in MODES),
        "pools_full": all(r[m]["pools_full"] for r in rows_out for m in MODES),
        "results": rows_out, "skipped": skipped,
        "workload": {"prefix_tokens": prefixes, "guidance": guidances, "requests": args.requests,
                     "warmup": args.warmup, "size": f"{args.width}x{args.height}", "steps": args.steps,
                     "block_size": args.block_size, "attention_backend": args.attention_backend,
                     "torch_threads": args.torch_threads, "dtype": args.dtype},
        "machine": machine(),
    }
    return out, images


def _image_tokens(args) -> int:
    return (args.height // 4) * (args.width // 4)  # an upper bound for both geometries (latent cell >= 4 px)


def table_rows(out: dict) -> list[dict]:
    rows = []
    for r in out["results"]:
        for m in MODES:
            x = r[m]
            h = x["handoff_ms"]
            b = x["bytes_per_request"]
            g = x["gpu"] or {}
            rows.append({"prefix": r["prefix_tokens"], "rows": r["rows"], "transport": r["transport"], "path": m,
                         "p50_ms": h["p50"], "mean_ms": h["mean"], "min_ms": h["min"],
                         "MiB/req": b / 2**20 if isinstance(b, int) else b, "GB/s": x["gbps"],
                         "extra_MiB": x["extra_buffer_bytes"] / 2**20,
                         "gpu_peak_MiB": g["peak_extra_bytes"] / 2**20 if g.get("peak_extra_bytes") is not None
                         else "-", "legacy/native": r["ratio"] if m == "native" else "",
                         "exact": r["bit_exact"]})
    return rows


def run(args) -> dict:
    out, _ = bench(args)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1)
            fh.write("\n")
    rows = table_rows(out)
    emit(out, args.json, rows, list(rows[0]) if rows else None)
    return out
