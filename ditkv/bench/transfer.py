"""`ditkv bench transfer`: AR -> DiT end to end, legacy vs native KV transfer, per transport.

1. Throughput: the whole AR(0) -> DiT(1) graph (tiny model, in-process stages on their own
   threads) at a fixed concurrency over `--runs` x `--requests` requests per implementation, from
   a fixed prompt/seed set. Runs alternate legacy / native so machine noise hits both alike.
   `bit_exact`: every request's image is byte-identical between the two implementations.
2. Page bandwidth: the native descriptors of `--pages` scattered pages (block 64) through the
   transport vs one contiguous write of the same bytes.
3. `kv_exact` / `attention_exact`: one prefix moved legacy and native over the transport between
   the stage devices; received KV and the attention over it are compared bit for bit.

    ditkv bench transfer --json
    ditkv bench transfer --transports cuda --height 512 --width 512   # AR cuda:0 -> DiT cuda:1
    ditkv bench transfer --remote-ar --json   # in-process vs `ditkv stage` AR server (transfer_remote.py)
    ditkv bench transfer --prompt-tokens 2048 --height 32 --width 32   # prefix-heavy: long synthetic prompts
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np

from ..argtypes import finite_float, positive_int
from .common import emit, machine
from .transfer_exact import kv_attention_exact
from .transfer_setup import _graph, _positions, _requests, dit_blocks, prompt_lengths, prompt_set, stage_devices


def add_arguments(p):
    p.add_argument("--json", action="store_true", help="print one JSON object only")
    p.add_argument("--requests", type=positive_int, default=100, help="requests per run")
    p.add_argument("--runs", type=positive_int, default=2, help="runs per implementation")
    p.add_argument("--concurrency", type=positive_int, default=8, help="requests in flight at once")
    p.add_argument("--transports", default="shm,mooncake",
                   help="comma list of kv_connector values: shm, mooncake (CPU pools), cuda (GPU pools)")
    p.add_argument("--height", type=positive_int, default=64, help="image height in pixels")
    p.add_argument("--width", type=positive_int, default=64, help="image width in pixels")
    p.add_argument("--steps", type=positive_int, default=2, help="denoising steps per request")
    p.add_argument("--guidance", type=finite_float, default=2.0, help="CFG scale; > 1: two rows per request")
    p.add_argument("--block-size", type=positive_int, default=64, help="KV page size of both stages, in tokens")
    p.add_argument("--pages", type=positive_int, default=64, help="pages per bandwidth measurement")
    p.add_argument("--ar-device", default="auto", help="AR stage device (auto: cpu; cuda:0 for --transports cuda)")
    p.add_argument("--dit-device", default="auto",
                   help="DiT stage device (auto: cpu; for cuda the second GPU when there is one)")
    p.add_argument("--dtype", default="auto", help="both stages' dtype (auto: float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--attention-backend", default="torch",
                   help="both stages; torch (default) gives legacy and native the same attention math, so "
                        "images compare bit for bit")
    p.add_argument("--prompt-tokens", type=positive_int, default=None, metavar="N",
                   help="synthetic prompts of exactly N text tokens (repeated caption words) instead of the "
                        "fixed caption set; the stage graph's prompt envelope, legacy slot and pools grow to fit "
                        "(default: the caption set)")
    p.add_argument("--remote-ar", action="store_true",
                   help="instead: in-process vs a separately deployed AR stage (`ditkv stage` subprocess), "
                        "same workload, alternating runs (bench/transfer_remote.py)")
    p.add_argument("--remote-modes", default="native,legacy",
                   help="with --remote-ar: comma list of transfer paths to compare (native, legacy)")


def throughput(args, kind: str, bundle) -> dict:
    from ..stages.orchestrator import Orchestrator

    blocks = dit_blocks(args, bundle[0].config)
    orchs = {m: Orchestrator(_graph(m, kind, args.block_size, args, blocks), bundle).start()
             for m in ("legacy", "native")}
    rps = {m: [] for m in orchs}
    images = {m: [] for m in orchs}
    imported = {m: [] for m in orchs}
    failed, oom, errors = 0, 0, []
    try:
        for o in orchs.values():
            o.run(_requests(args, args.concurrency), args.concurrency)  # warm-up
        for _ in range(args.runs):
            for m, o in orchs.items():
                t0 = time.perf_counter()
                outs = o.run(_requests(args, args.requests), args.concurrency)
                rps[m].append(len(outs) / (time.perf_counter() - t0))
                print(f"[bench transfer] {kind} {m} run {len(rps[m])}: {rps[m][-1]:.2f} req/s", file=sys.stderr)
                bad = [x.error or x.status for x in outs if not x.ok]
                failed += len(bad)
                oom += sum("out of memory" in e.lower() for e in bad)
                errors += bad[:3]
                images[m].append([x.image for x in outs])
                imported[m] += [x.stats.imported_tokens for x in outs if x.ok]
    finally:
        for o in orchs.values():
            o.shutdown()
    full = all(o.pools_full() for o in orchs.values())
    exact = failed == 0 and all(np.array_equal(a, b) for ra, rb in zip(images["legacy"], images["native"])
                                for a, b in zip(ra, rb))
    leg, nat = statistics.mean(rps["legacy"]), statistics.mean(rps["native"])
    return {"transport": kind, "legacy_rps": leg, "native_rps": nat, "ratio": nat / leg,
            "legacy_runs": rps["legacy"], "native_runs": rps["native"], "bit_exact": exact,
            "imported_tokens": {m: statistics.mean(v) if v else 0 for m, v in imported.items()},
            "failed": failed, "oom": oom, "errors": errors[:5], "pools_full": full,
            "devices": dict(zip(("ar", "dit"), stage_devices(args, kind)))}


def page_bandwidth(kind: str, pages: int, block_size: int = 64, repeats: int = 15, devices=("cpu", "cpu"),
                   dtype=None) -> dict:
    """Scattered pages (every other destination page: no merging) vs one contiguous write."""
    import torch

    from ..models.hunyuan import HunyuanImage3Config
    from ..transfer.connector import transfer_pool
    from ..transfer.descriptors import geometry_of, page_descriptors
    from ..transfer.transport import make_transport
    from ..worker.page_pool import PagePool

    c = HunyuanImage3Config.tiny()
    dtype = dtype or torch.float32
    src, dst = (PagePool(2 * pages, c.num_hidden_layers, c.num_key_value_heads, block_size, c.attention_head_dim,
                         dtype, dev) for dev in devices)
    for p in (src, dst):
        transfer_pool(p, kind)
    src.kv.normal_()
    a, b = make_transport(kind), make_transport(kind)
    try:
        a.register("pool", src.kv)
        region = b.register("pool", dst.kv)
        g = geometry_of(src)
        descs = page_descriptors(g, g, list(range(0, 2 * pages, 2)), list(range(1, 2 * pages, 2)))
        nbytes = pages * g.page_bytes
        one = [(0, 0, nbytes)]
        t_pages, t_one = [], []
        for _ in range(repeats):  # interleaved, best-of: robust to neighbours on a shared machine
            for d, ts in ((descs, t_pages), (one, t_one)):
                t0 = time.perf_counter()
                a.write("pool", region, d)
                ts.append(time.perf_counter() - t0)
        dst.kv.zero_()
        a.write("pool", region, descs)
        ok = torch.equal(dst.kv[1::2][:pages].cpu(), src.kv[0::2][:pages].cpu())
    finally:
        a.close()
        b.close()
    bw_p, bw_1 = nbytes / min(t_pages) / 1e9, nbytes / min(t_one) / 1e9
    return {"transport": kind, "devices": list(devices), "block_size": block_size, "pages": pages, "bytes": nbytes,
            "descriptors": len(descs), "page_gbps": bw_p, "contiguous_gbps": bw_1, "ratio": bw_p / bw_1,
            "exact": ok}


def _guarded(fn, kind, *a, **kw) -> dict:
    """A side measurement that fails is reported, not fatal: the throughput numbers still count."""
    try:
        return fn(kind, *a, **kw)
    except Exception as e:  # noqa: BLE001
        return {"transport": kind, "error": f"{type(e).__name__}: {e}", "ratio": float("nan"), "exact": False,
                "kv_exact": False, "attention_exact": False, "page_gbps": float("nan"),
                "contiguous_gbps": float("nan")}


def run(args) -> dict:
    import torch

    from ..stages.replicas import norm_device
    from ..models.loader import load_model, resolve_dtype

    if getattr(args, "remote_ar", False):
        from .transfer_remote import run as run_remote

        return run_remote(args)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    kinds = [k.strip() for k in args.transports.split(",") if k.strip()]
    e2e, bw, exact = [], [], []
    for k in kinds:
        devs = stage_devices(args, k)
        dev = norm_device(torch.device(devs[1]))
        dtype = resolve_dtype(args.dtype, dev)
        bundle = load_model("tiny", dev, dtype)
        n = getattr(args, "prompt_tokens", None)
        if n is not None:  # a long prompt must fit the model's own positions; only big images raise the limit
            from ..models.hunyuan import max_prompt_tokens

            fit = max_prompt_tokens(bundle[0].config, args.height, args.width)
            if not 1 <= n <= fit:
                raise SystemExit(f"--prompt-tokens {n}: must be 1..{fit} at {args.width}x{args.height} "
                                 f"(max_position_embeddings={bundle[0].config.max_position_embeddings})")
        need = _positions(args, bundle[0].config)
        if need > bundle[0].config.max_position_embeddings:  # RoPE has no table: only the limit moves
            bundle[0].config.max_position_embeddings = need
        exact.append(_guarded(kv_attention_exact, k, devs[0], devs[1], dtype, args.block_size))
        e2e.append(throughput(args, k, bundle))
        bw.append(_guarded(page_bandwidth, k, args.pages, devices=devs, dtype=dtype))
    # headline: the network transport when measured (Mooncake), else the first one
    head = next((r for r in e2e if r["transport"] == "mooncake"), e2e[0])
    head_bw = next((r for r in bw if r["transport"] == head["transport"]), bw[0])
    lengths = prompt_lengths(args)
    out = {
        "prompt_tokens": max(lengths), "prompt_tokens_min": min(lengths),
        "legacy_rps": head["legacy_rps"], "native_rps": head["native_rps"], "ratio": head["ratio"],
        "bit_exact": all(r["bit_exact"] for r in e2e), "page_bandwidth_ratio": head_bw["ratio"],
        "kv_exact": all(r["kv_exact"] and r["attention_exact"] for r in exact), "exactness": exact,
        "headline_transport": head["transport"], "goals": {"ratio": 1.10, "page_bandwidth_ratio": 0.8},
        "throughput": e2e, "bandwidth": bw,
        "workload": {"requests": args.requests, "runs": args.runs, "concurrency": args.concurrency,
                     "size": f"{args.width}x{args.height}", "steps": args.steps, "guidance": args.guidance,
                     "block_size": args.block_size, "prompts": len(prompt_set()), "dtype": args.dtype,
                     "attention_backend": args.attention_backend, "prompt_tokens_flag": args.prompt_tokens},
        "machine": machine(),
    }
    rows = [{k: r[k] for k in ("transport", "legacy_rps", "native_rps", "ratio", "bit_exact")} for r in e2e]
    rows += [{"transport": f"{r['transport']} pages", "legacy_rps": r["contiguous_gbps"],
              "native_rps": r["page_gbps"], "ratio": r["ratio"], "bit_exact": r["exact"]} for r in bw]
    emit(out, args.json, rows, ["transport", "legacy_rps", "native_rps", "ratio", "bit_exact"])
    return out
