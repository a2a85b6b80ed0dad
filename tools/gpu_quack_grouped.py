"""Issue 24 probe (H200, flash-attn-4 extra installed): quack's CuTe-DSL varlen GEMM as the routed FP8
expert GEMM, against torch._scaled_grouped_mm, at the release step's shapes (8194 tokens, 64 experts, top-8).

quack (a dependency of flash-attn-4) runs a grouped GEMM as `cu_seqlens_m` segments, can gather the rows of A
itself (`A_idx`), and takes a user epilogue: here acc * token_scale[m] * weight_scale[e, n], which is the
rowwise-scaled W8A8 product. Its sm90 kernel promotes FP8 partial sums every k-tile by default; the fast mode
is set through `post_init_attrs` (fp8_slow_accum=False). The engine's path is models/fp8_quack.py; `--sweep`
also times the tile configs its choice came from. Prints one JSON object.

    python tools/gpu_quack_grouped.py [--sweep] --json-out OUT.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

FP8 = torch.float8_e4m3fn


def rowwise(acc, sa, sb):
    return {"D": acc * sa * sb}


def quantize_rows(x: torch.Tensor):
    s = x.abs().amax(-1, keepdim=True).float().clamp_min(1e-12) / 448.0
    return (x.float() / s).clamp(-448, 448).to(FP8), s


def timed(fn, warmup=3, rep=20):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(rep):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / rep


def emit(res: dict, path: str) -> None:
    """The result as JSON on stdout, and in `path` when given."""
    print(json.dumps(res, indent=1))
    if path:
        with open(path, "w") as fh:
            json.dump(res, fh, indent=1)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _tflops(g, slots, ms):
    return 2.0 * slots * g["K"] * g["N"] / ms / 1e9


def _torch_vs_quack(g, ends, slots, sweep):
    from ditkv.models import fp8_quack

    rows = None if g["gather"] is None else g["gather"].long()
    A = g["A"] if rows is None else g["A"].index_select(0, rows)
    sa = g["sa"] if rows is None else g["sa"].index_select(0, rows)
    out = {}
    refs = {}
    for fast in (True, False):
        def f(fast=fast):
            return torch._scaled_grouped_mm(A, g["B"].transpose(1, 2), sa.view(-1), g["sb"], offs=ends,
                                            out_dtype=torch.bfloat16, use_fast_accum=fast)
        refs[fast] = f()
        ms = timed(f)
        out[f"torch_fast{int(fast)}"] = {"ms": ms, "tflops": _tflops(g, slots, ms)}
    if rows is not None:
        def gathered():
            return torch._scaled_grouped_mm(g["A"].index_select(0, rows), g["B"].transpose(1, 2),
                                            g["sa"].index_select(0, rows).view(-1), g["sb"], offs=ends,
                                            out_dtype=torch.bfloat16, use_fast_accum=True)
        out["torch_fast1_with_gather"] = {"ms": timed(gathered)}
    ref = refs[True]

    def quack():
        return fp8_quack.grouped_mm(g["A"], g["sa"], ends, g["B"], g["sb"], torch.bfloat16, rows)
    t0 = time.time()
    got = quack()
    torch.cuda.synchronize()
    first = time.time() - t0
    ms = timed(quack)
    out["quack_engine_path"] = {"ms": ms, "tflops": _tflops(g, slots, ms), "first_call_s": first,
                                "rel_vs_torch_fast": rel(got, ref), "bit_equal": bool(torch.equal(got, ref)),
                                "tiles": fp8_quack.TILES["plain" if rows is None else "gather"]}
    print(out, file=sys.stderr, flush=True)
    if sweep:
        out["sweep"] = _sweep(g, ends, slots, ref)
    return out


def _sweep(g, ends, slots, ref):
    """The tile configs the choice in fp8_quack.TILES came from, each with both accumulation modes."""
    from quack.epilogue.frontend import EpiMod

    mod = EpiMod(rowwise)
    cu = torch.cat([ends.new_zeros(1), ends])
    rows = g["gather"]
    sa = (g["sa"] if rows is None else g["sa"].index_select(0, rows.long())).view(-1).contiguous()
    out = {}
    for tm, tn, cm, cn, pp in [(128, 192, 2, 1, True), (128, 256, 2, 1, False), (256, 128, 2, 1, False),
                               (256, 192, 2, 1, False), (128, 128, 2, 1, True), (128, 208, 2, 1, True),
                               (256, 128, 1, 2, False), (128, 192, 1, 2, True)]:
        for fast in (True, False):
            key = f"{tm}x{tn}_c{cm}{cn}_{'pp' if pp else 'coop'}_fast{int(fast)}"
            D = torch.empty(slots, g["N"], device="cuda", dtype=torch.bfloat16)
            kw = {"epi_args": {"sa": sa, "sb": g["sb"]}, "tile_M": tm, "tile_N": tn, "cluster_M": cm,
                  "cluster_N": cn, "pingpong": pp, "persistent": True, "cu_seqlens_m": cu,
                  "post_init_attrs": (("fp8_slow_accum", False),) if fast else ()}
            if rows is not None:
                kw["A_idx"] = rows.to(torch.int32)
            try:
                mod.gemm(g["A"], g["B"], D, **kw)
                ms = timed(lambda D=D, kw=kw: mod.gemm(g["A"], g["B"], D, **kw))
                out[key] = {"ms": ms, "tflops": _tflops(g, slots, ms), "rel_vs_torch_fast": rel(D, ref)}
            except (ValueError, RuntimeError, TypeError) as exc:  # a config the kernel refuses
                out[key] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(key, out[key], file=sys.stderr, flush=True)
    return out


def _new_shape(g, e, k, h):
    """A token count never seen: the first call builds a host plan (the kernel is compiled already)."""
    from ditkv.models import fp8_quack

    n2 = 3001
    x = torch.randn(n2, h, device="cuda", dtype=torch.bfloat16)
    q, s = quantize_rows(x)
    ids = torch.rand(n2, e, device="cuda").topk(k, dim=-1).indices.reshape(-1)
    order = ids.argsort(stable=True)
    ends = torch.bincount(ids, minlength=e).cumsum(0).to(torch.int32)
    rows = order // k
    t0 = time.time()
    fp8_quack.grouped_mm(q, s, ends, g["B"], g["sb"], torch.bfloat16, rows)
    torch.cuda.synchronize()
    first = time.time() - t0
    t0 = time.time()
    fp8_quack.grouped_mm(q, s, ends, g["B"], g["sb"], torch.bfloat16, rows)
    torch.cuda.synchronize()
    return {"tokens": n2, "first_call_s": first, "second_call_s": time.time() - t0}


def _graph(g, ends):
    """The engine path captured in a CUDA graph, replayed after the routing inputs were refilled."""
    from ditkv.models import fp8_quack

    rows = g["gather"].long().clone()
    args = (g["A"], g["sa"], ends.clone(), g["B"], g["sb"], torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fp8_quack.grouped_mm(*args, rows)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_quack.grouped_mm(*args, rows)
    rows.copy_(rows.flip(0))  # new routing, same shapes
    graph.replay()
    torch.cuda.synchronize()
    want = fp8_quack.grouped_mm(*args, rows)
    return {"replay_equal_eager": bool(torch.equal(out, want)), "replay_ms": timed(graph.replay)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8194)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=3072)
    p.add_argument("--sweep", action="store_true", help="also time the 8 tile configs behind fp8_quack.TILES")
    p.add_argument("--json-out", default="")
    a = p.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    n, e, k, h, i = a.tokens, a.experts, a.topk, a.hidden, a.inter
    x = torch.randn(n, h, device=dev, dtype=torch.bfloat16)
    ids = torch.rand(n, e, device=dev).topk(k, dim=-1).indices.reshape(-1)
    order = ids.argsort(stable=True)
    src = (order // k).to(torch.int32)
    counts = torch.bincount(ids, minlength=e)
    ends = counts.cumsum(0).to(torch.int32)
    xq, xs = quantize_rows(x)
    w13 = (torch.randn(e, 2 * i, h, device=dev) * 0.02).to(FP8)
    w13s = torch.rand(e, 2 * i, device=dev) * 1e-3 + 1e-4
    hq = (torch.randn(n * k, i, device=dev)).to(FP8)
    hs = torch.rand(n * k, 1, device=dev) + 0.1
    w2 = (torch.randn(e, h, i, device=dev) * 0.02).to(FP8)
    w2s = torch.rand(e, h, device=dev) * 1e-3 + 1e-4
    res = {"shapes": {"tokens": n, "experts": e, "topk": k, "hidden": h, "inter": i, "slots": n * k,
                      "max_per_expert": int(counts.max()), "min_per_expert": int(counts.min())}}

    gemms = {
        "gate_up": {"A": xq, "gather": src, "sa": xs, "B": w13, "sb": w13s, "K": h, "N": 2 * i},
        "down": {"A": hq, "gather": None, "sa": hs, "B": w2, "sb": w2s, "K": i, "N": h},
    }
    for name, g in gemms.items():
        res[name] = _torch_vs_quack(g, ends, n * k, a.sweep)
    res["new_shape"] = _new_shape(gemms["gate_up"], e, k, h)
    res["graph"] = _graph(gemms["gate_up"], ends)
    emit(res, a.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
