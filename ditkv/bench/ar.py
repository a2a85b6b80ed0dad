"""`ditkv bench ar`: the single engine's AR phase at the release geometry with random weights.

For each concurrency R, R requests arrive at once, each with a `--prompt-tokens` head and exactly
`--new-tokens` text tokens (`ignore_eos`), then a one-step DiT phase at a small image (guidance 1:
one row, which adopts the AR row's pages), after R short warm-up requests. Every engine step is timed around the executor call
(which returns only after the sampled ids reached the host), with what the step fed: the
**decode** figures come from steps whose AR work was R one-token decodes and nothing else, so
ms per step at R rows and tokens/s = R / step. The run's whole AR phase (prefill chunks, decode,
the DiT phases interleaved) is reported too. The decoder is the release's (64 experts top-8 +
shared, 4:1 GQA) with the release vocabulary (133,120: the text head is read every decode step);
`--quantization fp8` makes the decoder linears W8A8 e4m3, built layer by layer so 32 layers fit
one H200. `--graphs both` (the default) runs every concurrency eagerly, then with the decode CUDA
graphs (`worker/ar_graph.py`; a bucket is captured on its third decode step, so the median is the
replays'). `--shrink` runs the code path at toy widths on a CPU (tests/test_bench_ar.py).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from .. import argtypes as at
from .common import emit, machine
from .step_release import build_model, free_device, release_config


def add_arguments(p):
    p.add_argument("--json", action="store_true", help="print one JSON object only")
    p.add_argument("--out", default=None, type=at.writable_file,
                   help="also write the JSON result to this file (default: none)")
    p.add_argument("--layers", type=at.positive_int, default=32, help="decoder layers (the release has 32)")
    p.add_argument("--quantization", choices=["none", "fp8"], default="fp8", help="decoder linears (CUDA only)")
    p.add_argument("--concurrency", type=at.positive_int_list, default=[1, 16, 64],
                   help="comma list: requests that arrive at once")
    p.add_argument("--prompt-tokens", type=at.positive_int, default=1000, help="head tokens per request")
    p.add_argument("--new-tokens", type=at.positive_int, default=128, help="text tokens per request (ignore_eos)")
    p.add_argument("--image", type=at.positive_int, default=256, help="the DiT phase's image side in pixels")
    p.add_argument("--steps", type=at.positive_int, default=1, help="the DiT phase's denoise steps (one row)")
    p.add_argument("--plain", action="store_true",
                   help="also run each concurrency without AR text (the same images): images/min and peak memory")
    p.add_argument("--instruct", action="store_true",
                   help="also run the issue's Instruct case on the same weights: 8 requests of 512 text tokens, "
                        "then 1024^2 in 8 steps (one row), with and without the text")
    p.add_argument("--block-size", type=at.positive_int, default=64, help="KV page size in tokens")
    p.add_argument("--max-batched-tokens", type=at.positive_int, default=8192,
                   help="max_num_batched_tokens: the step's query tokens (prefill is chunked under it)")
    p.add_argument("--backend", default="auto", help="attention backend")
    p.add_argument("--device", default="auto", help="auto: cuda if available, else cpu")
    p.add_argument("--graphs", choices=["both", "off", "on"], default="both",
                   help="decode CUDA graphs: off (eager), on, or both (each concurrency eager, then graphs)")
    p.add_argument("--fp8-gemv-rows", type=at.nonneg_int_list, default=None,
                   help="comma list: run each case with FP8 products of at most N token rows on the Triton GEMV "
                        "(fp8_gemv.py; 0: off), alternated in one run for an A/B (default: the built-in 2)")
    p.add_argument("--shrink", action="store_true", help="toy widths on the CPU (tests the code path)")


def _engine(args, model, codec, cfg, device, r: int, graphs: str):
    from ..config import EngineConfig
    from ..engine.engine import Engine
    from ..models.hunyuan import ByteTokenizer

    img = (args.image // cfg.image_token_downsample) ** 2
    row = args.prompt_tokens + args.new_tokens + img + 64  # template tokens, the tail, <eoi>
    pages = r * (2 * -(-row // args.block_size) + 2)
    prompt = args.prompt_tokens + args.new_tokens + 32
    ecfg = EngineConfig(device=str(device), block_size=args.block_size, num_kv_blocks=pages, max_num_seqs=r,
                        max_num_batched_tokens=max(args.max_batched_tokens, 2 * (prompt + img + 64)),
                        max_prompt_tokens=prompt, max_image_height=args.image, max_image_width=args.image,
                        attention_backend=args.backend, profile_memory=False, cuda_graphs=graphs,
                        enable_prefix_caching=False,  # repeated prompts: time the compute, not cache hits
                        quantization=None if args.quantization == "none" or device.type != "cuda" else "fp8")
    return Engine(ecfg, model_bundle=(model, ByteTokenizer(), codec))


def _timed(engine) -> list[tuple[float, list]]:
    """Wrap the executor: every step's seconds and its AR work [(start, tokens, sample)]."""
    log, ex = [], engine.executor
    queue, step = ex.queue_ar, ex.step_batch
    pending: list = []

    def queue_ar(works):
        pending[:] = [(w.start, len(w.token_ids)) for w in works]
        queue(works)

    def step_batch():
        t0 = time.perf_counter()
        out = step()
        log.append((time.perf_counter() - t0, list(pending), len(engine._started)))
        pending.clear()
        return out
    ex.queue_ar, ex.step_batch = queue_ar, step_batch
    return log


def _request(args, seed: int, text: bool):
    from ..engine.types import GenerationRequest

    sampling = dict(max_new_tokens=args.new_tokens, ignore_eos=True, temperature=1.0, top_k=0, top_p=1.0) if text \
        else {}  # plain: no AR phase (no text settings)
    return GenerationRequest(prompt="a" * (args.prompt_tokens - 4), height=args.image, width=args.image,
                             steps=args.steps, guidance_scale=1.0, seed=seed, **sampling)


def _one(args, model, codec, cfg, device, r: int, graphs: str, text: bool = True) -> dict:
    from ..engine.types import GenerationRequest

    eng = _engine(args, model, codec, cfg, device, r, graphs)
    try:
        # R short requests first: kernels compiled for the batch's shapes (Triton specializes on some
        # sizes, a first 8-row prefill took 2.5 s on an H100), the allocator warm; steady state is timed
        for i in range(r):
            eng.add_request(GenerationRequest(prompt="a" * (args.prompt_tokens - 4), height=args.image,
                                              width=args.image, steps=1, guidance_scale=1.0, seed=i,
                                              max_new_tokens=4, ignore_eos=True, temperature=0.0))
        assert all(o.ok for o in eng.run_until_complete())
        log = _timed(eng)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        ids = [eng.add_request(_request(args, i, text)) for i in range(r)]
        outs = {o.request_id: o for o in eng.run_until_complete()}
        wall = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        g = getattr(eng.executor.stepper.ar, "_graphs", None) or None
        captured = {"captures": g.captures, "replays": g.replays} if g else {"captures": 0, "replays": 0}
    finally:
        eng.shutdown()
        eng = g = None  # the wrapped executor holds the engine in a cycle: free its pool and graphs now
        free_device(device)
    bad = [outs[i].error for i in ids if not outs[i].ok]
    if bad:
        raise SystemExit(f"ditkv bench ar: a request failed: {bad[0]}")
    if not text:
        return {"concurrency": r, "graphs": graphs, "text": False, "wall_s": wall, "steps": len(log),
                "images_per_min": 60 * r / wall, "peak_bytes": peak}
    decode = [s for s, works, dit in log if len(works) == r and not dit and all(n == 1 for _, n in works)]
    stats = [outs[i].stats for i in ids]
    step = statistics.median(decode) if decode else None
    kinds = {"prefill": 0.0, "decode": 0.0, "ar_and_dit": 0.0, "dit": 0.0}
    counts = dict.fromkeys(kinds, 0)
    for s, works, dit in log:  # where the run's time went, by what the step fed
        k = "dit" if not works else "ar_and_dit" if dit else "decode" if all(n == 1 for _, n in works) else "prefill"
        kinds[k] += s
        counts[k] += 1
    return {"concurrency": r, "graphs": graphs, "text": True, **captured, "decode_steps": len(decode),
            "decode_ms_per_step": None if step is None else step * 1e3,
            "decode_tokens_per_s": None if step is None else r / step,
            "ttft_s_mean": statistics.mean(s.ar_time_to_first_token_s for s in stats),
            "ar_s_mean": statistics.mean(s.ar_seconds for s in stats),
            "generated_tokens": sum(s.ar_generated_tokens for s in stats),
            "ar_tokens_per_s_whole_run": sum(s.ar_generated_tokens for s in stats) / max(
                s.ar_seconds for s in stats),
            "wall_s": wall, "steps": len(log), "images_per_min": 60 * r / wall, "peak_bytes": peak,
            "step_seconds": kinds, "step_counts": counts,  # ar_and_dit - dit per step: the separate AR pass's cost
            "first_steps_s": [round(s, 4) for s, _, _ in log[:6]], "outside_steps_s": wall - sum(kinds.values()),
            "ar_pages_bytes_max": r * _row_bytes(args, cfg, device)}


def _row_bytes(args, cfg, device) -> int:
    """Bytes of one request's whole AR row (head + text, K and V over every layer): what the AR
    phase adds to the pool at most."""
    item = 2 if device.type == "cuda" else 4  # the pool's dtype: the activations'
    pages = -(-(args.prompt_tokens + args.new_tokens + 32) // args.block_size)
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * args.block_size * cfg.attention_head_dim * item * pages


def run(args) -> dict:
    from ..models.loader import resolve_device

    device = torch.device("cpu") if args.shrink else resolve_device(args.device)
    cfg = release_config(args.layers, shrink=args.shrink)
    if not args.shrink:  # the release text head: a decode step reads all 133,120 rows of it
        from ..models.hunyuan import HunyuanImage3Config

        cfg = cfg.replace(vocab_size=HunyuanImage3Config.release().vocab_size)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    quant = "fp8" if args.quantization == "fp8" and device.type == "cuda" else None
    model, build = build_model(cfg, device, dtype, quant)
    from ..models.hunyuan.codec import make_codec
    from .step_e2e import random_vae_on_device, vae_config

    codec = make_codec(cfg, random_vae_on_device(vae_config(cfg, args.shrink), device, dtype))  # images are decoded
    modes = ["off"] if device.type != "cuda" else (["off", "on"] if args.graphs == "both" else [args.graphs])
    rows = [_with_gemv(g, _one, args, model, codec, cfg, device, r, mode)
            for r in args.concurrency for mode in modes for g in args.fp8_gemv_rows or [None]]
    if args.plain:
        rows += [_one(args, model, codec, cfg, device, r, modes[-1], text=False) for r in args.concurrency]
    if args.instruct:  # the goal table's Instruct row, on the weights already built
        size = {"new_tokens": 8, "image": 64, "steps": 2} if args.shrink else {"new_tokens": 512, "image": 1024,
                                                                                "steps": 8}
        case = argparse.Namespace(**{**vars(args), **size})
        rows += [{"case": "instruct", **_one(case, model, codec, cfg, device, 8, modes[-1], text=t)}
                 for t in (True, False)]
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    del model
    free_device(device)
    result = {"bench": "ar", "machine": machine(), "layers": args.layers, "quantization": quant,
              "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "image": args.image,
              "steps": args.steps,
              "build": {k: build[k] for k in ("build_s", "weights_bytes")},
              "peak_bytes": peak, "runs": rows}
    table = [{"case": x.get("case", "-"), "R": x["concurrency"], "graphs": x["graphs"], "text": x["text"],
              "gemv rows": x.get("fp8_gemv_rows", "-"),
              "decode ms/step": _f(x.get("decode_ms_per_step")), "decode tok/s": _f(x.get("decode_tokens_per_s")),
              "TTFT s": _f(x.get("ttft_s_mean")), "AR s": _f(x.get("ar_s_mean")),
              "tok/s whole run": _f(x.get("ar_tokens_per_s_whole_run")), "images/min": _f(x["images_per_min"]),
              "peak GiB": _f(None if x["peak_bytes"] is None else x["peak_bytes"] / 2**30)} for x in rows]
    emit(result, args.json, table)
    if args.out:
        import json

        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return result


def _with_gemv(rows: int | None, fn, *a) -> dict:
    """`fn(*a)` with FP8 GEMV products up to `rows` token rows (None: as set), recorded in its result."""
    from ..models import fp8

    before = fp8.GEMV["rows"]
    if rows is not None:
        fp8.set_gemv_rows(rows)
    try:
        return {**fn(*a), "fp8_gemv_rows": fp8.GEMV["rows"]}
    finally:
        fp8.set_gemv_rows(before)


def _f(v) -> str:
    return "-" if v is None else f"{v:.2f}"
