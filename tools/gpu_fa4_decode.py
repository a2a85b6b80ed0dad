"""FA4 against Triton where issue 26 left Triton: AR decode (one query per row at its last position),
and the dense-legacy baseline's attention (SDPA segments vs FA4 dense segments). One GPU, bf16,
32 / 8 heads, head_dim 128, permuted pages.

    python tools/gpu_fa4_decode.py [--json-out OUT.json]

Decode: `TritonBackend.paged_attention` vs `Fa4Backend(decode=True).paged_attention` (FA4's plain paged
call with one query per row), microseconds (do_bench medians), rel. error vs the torch backend in fp32.
Dense: `DenseAttention(segments=True)` with SDPA vs `fa4=True`, the prefill (causal prefix + full
target) and the denoise call of a 2-row CFG request, milliseconds.
"""

import argparse
import json
import time

import torch
import triton.testing

from ditkv.attention.fa4_backend import Fa4Backend
from ditkv.attention.metadata import RowPhase, build_paged_metadata
from ditkv.attention.torch_backend import TorchBackend
from ditkv.attention.triton_backend import TritonBackend
from ditkv.worker.dense_cache import DenseAttention, DenseKVCache


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def decode_case(batch, kv, bs, dev):
    rows = [RowPhase(i, kv - 1, 1, kv, ()) for i in range(batch)]
    per = -(-kv // bs)
    total = per * batch + 3
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(kv + batch)).tolist()
    meta = build_paged_metadata(rows, [perm[i * per:(i + 1) * per] for i in range(batch)], bs, device=dev)
    pool = torch.randn(total, 1, 2, 8, bs, 128, device=dev, dtype=torch.bfloat16)
    q = torch.randn(batch, 32, 128, device=dev, dtype=torch.bfloat16)
    return meta, pool[:, 0], q


def decode(dev, out, bs):
    tri, fa4 = TritonBackend(), Fa4Backend(dev, decode=True)
    res = []
    for batch in (1, 4, 16, 64):
        for kv in (1024, 4096, 8192):
            meta, kvl, q = decode_case(batch, kv, bs, dev)
            ref = TorchBackend().paged_attention(q.float(), kvl.float(), meta, 0.088)
            t0 = time.perf_counter()
            got = fa4.paged_attention(q, kvl, meta, 0.088)
            first = time.perf_counter() - t0
            assert fa4.last_path == "fa4-decode", fa4.last_path
            r = {"batch": batch, "kv": kv, "page": bs,
                 "triton_us": bench(lambda: tri.paged_attention(q, kvl, meta, 0.088)) * 1e3,
                 "fa4_us": bench(lambda: fa4.paged_attention(q, kvl, meta, 0.088)) * 1e3,
                 "fa4_first_call_s": first, "rel_fa4": rel(got, ref),
                 "rel_triton": rel(tri.paged_attention(q, kvl, meta, 0.088), ref)}
            r["fa4/triton"] = r["fa4_us"] / r["triton_us"]
            kv_bytes = batch * kv * 2 * 8 * 128 * 2
            r["fa4_gbps"] = kv_bytes / (r["fa4_us"] * 1e-6) / 1e9
            r["triton_gbps"] = kv_bytes / (r["triton_us"] * 1e-6) / 1e9
            res.append(r)
            print("decode", json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
    out[f"decode_bs{bs}"] = res


def dense(dev, out):
    res = []
    for p, t in ((1024, 1025), (1024, 4097), (6700, 4097)):
        for phase, rows in (("prefill", [RowPhase(0, 0, p + t, p + t, ((p, p + t),)), RowPhase(p + t, 0, p + t, p + t, ((p, p + t),))]),
                            ("denoise", [RowPhase(0, p, t, p + t, ((p, p + t),)), RowPhase(t, p, t, p + t, ((p, p + t),))])):
            cache = DenseKVCache(1, 2, p + t, 8, 128, torch.bfloat16, dev)
            cache.k[0].normal_()
            cache.v[0].normal_()
            n = 2 * rows[0].q_len
            q, k, v = (torch.randn(n, h, 128, device=dev, dtype=torch.bfloat16) for h in (32, 8, 8))
            sdpa, fa4 = DenseAttention(cache, rows, 0.088, True), DenseAttention(cache, rows, 0.088, True, fa4=True)
            a, b = sdpa(0, q, k, v), fa4(0, q, k, v)
            r = {"P": p, "T": t, "phase": phase, "sdpa_segments_ms": bench(lambda: sdpa(0, q, k, v)),
                 "fa4_segments_ms": bench(lambda: fa4(0, q, k, v)), "rel": rel(b, a)}
            r["fa4/sdpa"] = r["fa4_segments_ms"] / r["sdpa_segments_ms"]
            res.append(r)
            print("dense", json.dumps({k2: round(v2, 4) if isinstance(v2, float) else v2 for k2, v2 in r.items()}), flush=True)
    out["dense_legacy"] = res


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json-out", default=None)
    a = p.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    with torch.inference_mode():
        for name, fn in (("decode64", lambda: decode(dev, out, 64)), ("dense", lambda: dense(dev, out))):
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - report, go on
                out[f"{name}_error"] = f"{type(e).__name__}: {e}"
                print(f"{name} FAILED: {type(e).__name__}: {e}", flush=True)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
