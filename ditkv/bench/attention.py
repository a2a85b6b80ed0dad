"""`ditkv bench attention`: the Triton paged kernel against SDPA / FlexAttention (and the fa4
backend where flash-attn-4 is installed) on one GPU.

Denoise shape (HunyuanImage-3): R rows (CFG branches), Hq query heads, Hkv KV heads, head_dim D;
queries = target T, keys = prefix P + target T, the target one full-attention span, so every
query sees all P + T keys (the same work as non-causal SDPA: 4 * R * Hq * T * (P + T) * D FLOPs).
Prefill shape: queries = the whole row, causal prefix then a full span for the target; FLOPs count
only unmasked (query, key) pairs.

Ours runs on a block-major pool `[num_blocks, layers, 2, Hkv, bs, D]` (layer view strided) with
randomly permuted pages ("paged") and with an identity page table ("ident"). Baselines get
contiguous `[R, H, L, D]` K/V (GQA heads expanded, as SDPA's fused backends need).

Entry points: `add_arguments(parser)`, `run(args)` (prints a table; `--json` prints one JSON
object), `run_attention_bench(args) -> dict`, `main(argv)`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ..argtypes import nonneg_int, positive_int, writable_file

DEFAULT_SHAPES = "256x1025,1024x1025,4096x1025,6700x1025,256x4097,1024x4097,4096x4097,6700x4097"


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of PREFIXxTARGET (denoise shapes)")
    p.add_argument("--block-size", type=positive_int, default=64, help="page size for the main table")
    p.add_argument("--extra-block-sizes", default="16,128,256",
                   help="page sizes measured at --extra-shape only")
    p.add_argument("--extra-shape", default="4096x4097", help="PREFIXxTARGET of the page-size and tile sweeps")
    p.add_argument("--prefill-shapes", default="1024x4097,4096x4097",
                   help="PREFIXxTARGET shapes for the prefill (whole-row, mixed mask) comparison; '' = skip")
    p.add_argument("--flex-shapes", default="256x1025,1024x4097,4096x4097",
                   help="denoise shapes that also run compiled FlexAttention ('' = none, 'all')")
    p.add_argument("--rows", type=positive_int, default=2, help="rows R (CFG branches) per shape")
    p.add_argument("--heads", type=positive_int, default=32, help="query heads Hq")
    p.add_argument("--kv-heads", type=positive_int, default=8, help="KV heads Hkv (GQA)")
    p.add_argument("--head-dim", type=positive_int, default=128, help="head_dim D")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"], help="Q/K/V dtype")
    p.add_argument("--layers", type=positive_int, default=2, help="layers in the pool (the view of layer 1 is timed)")
    p.add_argument("--config", default="", help="force kernel tiles: BLOCK_M,BLOCK_N,GROUP,WARPS,STAGES[,TMA[,WS]] "
                   "(default: the tuned pick per shape)")
    p.add_argument("--sweep", default="",
                   help="time tile configs (';'-separated M,N,G,W,S[,TMA[,WS]]) at --extra-shape, page --block-size "
                   "(default: no sweep)")
    p.add_argument("--warmup", type=nonneg_int, default=25, help="do_bench warm-up (ms)")
    p.add_argument("--rep", type=positive_int, default=100, help="do_bench repetitions (ms)")
    p.add_argument("--seed", type=nonneg_int, default=0, help="seed of the random Q/K/V and page permutations")
    p.add_argument("--json", action="store_true", help="print one JSON object after the table")
    p.add_argument("--json-out", default="", type=writable_file,
                   help="also write the JSON object to this file (default: not written)")
    return p


def _parse_shapes(s: str) -> list[tuple[int, int]]:
    out = []
    for part in filter(None, (x.strip() for x in s.split(","))):
        a, b = part.lower().split("x")
        out.append((int(a), int(b)))
    return out


def _parse_cfg(s: str):
    from ..attention.triton_backend import AttnConfig
    parts = [int(x) for x in s.split(",")]
    m, n, g, w, st = parts[:5]
    return AttnConfig(block_m=m, block_n=n, group=g, num_warps=w, num_stages=st,
                      tma=bool(parts[5]) if len(parts) > 5 else False,
                      warp_spec=bool(parts[6]) if len(parts) > 6 else False)


class _Case:
    """Pool, page tables (permuted + identity), metadata and contiguous K/V for one shape."""

    def __init__(self, a, prefix: int, target: int, bs: int, phase: str, dev, dtype):
        import torch

        from ..attention.metadata import RowPhase, build_paged_metadata

        R, hq, hkv, d = a.rows, a.heads, a.kv_heads, a.head_dim
        L = prefix + target
        spans = ((prefix, L),)
        if phase == "denoise":
            rows = [RowPhase(r * target, prefix, target, L, spans) for r in range(R)]
        else:
            rows = [RowPhase(r * L, 0, L, L, spans) for r in range(R)]
        nblk = (L + bs - 1) // bs
        total = R * nblk + 8
        g = torch.Generator().manual_seed(a.seed + L + bs)
        perm = torch.randperm(total, generator=g).tolist()
        ids_perm = [perm[r * nblk:(r + 1) * nblk] for r in range(R)]
        ids_ident = [list(range(r * nblk, (r + 1) * nblk)) for r in range(R)]
        self.meta = build_paged_metadata(rows, ids_perm, bs, device=dev)
        self.meta_ident = build_paged_metadata(rows, ids_ident, bs, device=dev)
        self.pool = torch.randn(total, a.layers, 2, hkv, bs, d, device=dev, dtype=dtype)
        self.kv = self.pool[:, 1]
        nq = self.meta.num_tokens
        self.q = torch.randn(nq, hq, d, device=dev, dtype=dtype)
        self.scale = d ** -0.5
        # contiguous K/V of each row as the permuted table sees it, then the identity pool gets the same data
        from ..attention.torch_backend import gather_kv
        ks, vs = zip(*(gather_kv(self.kv, self.meta.block_table[r], L, bs) for r in range(R)))
        k = torch.stack(ks).transpose(1, 2)  # [R, Hkv, L, D]
        v = torch.stack(vs).transpose(1, 2)
        self.pool_ident = torch.empty_like(self.pool)
        self.pool_ident.copy_(self.pool)
        kvi = self.pool_ident[:, 1]
        for r in range(R):
            idx = torch.tensor(ids_ident[r], device=dev)
            kk = k[r].transpose(0, 1)  # [L, Hkv, D]
            pad = nblk * bs - L
            kk = torch.nn.functional.pad(kk, (0, 0, 0, 0, 0, pad)).view(nblk, bs, hkv, d).permute(0, 2, 1, 3)
            vv = torch.nn.functional.pad(v[r].transpose(0, 1), (0, 0, 0, 0, 0, pad)).view(nblk, bs, hkv, d)
            kvi[idx, 0] = kk
            kvi[idx, 1] = vv.permute(0, 2, 1, 3)
        self.kv_ident = kvi
        self.k_gqa, self.v_gqa = k.contiguous(), v.contiguous()
        rep = hq // hkv
        self.k_full = k.repeat_interleave(rep, dim=1).contiguous()
        self.v_full = v.repeat_interleave(rep, dim=1).contiguous()
        qlen = nq // R
        self.q_b = self.q.view(R, qlen, hq, d).transpose(1, 2).contiguous()  # [R, Hq, Lq, D]
        self.limits = self.meta.key_limit.view(R, qlen)
        self.flops = 4.0 * hq * d * float(self.meta.key_limit.double().sum().item())
        self.prefix, self.target, self.L, self.bs, self.phase = prefix, target, L, bs, phase


def _bench(fn, a) -> float:
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=a.warmup, rep=a.rep, return_mode="median"))


def _tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def _rel(x, ref) -> float:
    x, ref = x.float(), ref.float()
    return float((x - ref).norm() / ref.norm())


def _sdpa(case, backend):
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    def fn():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(case.q_b, case.k_full, case.v_full, scale=case.scale)
    return fn


def _flex_fn(case, R):
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    lim = case.limits.contiguous()
    qlen = lim.shape[1]

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx < lim[b, q_idx]

    bm = create_block_mask(mask_mod, B=R, H=None, Q_LEN=qlen, KV_LEN=case.L, device=case.q.device)
    compiled = torch.compile(flex_attention, dynamic=False)

    def fn():
        return compiled(case.q_b, case.k_gqa, case.v_gqa, block_mask=bm, scale=case.scale, enable_gqa=True)
    return fn


def _ours(case, kv, meta, cfg):
    from ..attention.triton_backend import paged_attention
    out = case.q.new_empty(case.q.shape)

    def fn():
        return paged_attention(case.q, kv, meta, case.scale, config=cfg, out=out)
    return fn


def _fa4_backend(res: dict, dev):
    """The fa4 backend where it runs (its import time in `res`), else None with the reason."""
    from ..attention.fa4_backend import Fa4Backend, fa4_unusable

    t0 = time.perf_counter()
    why = fa4_unusable(dev)
    if why is not None:
        res["fa4_error"] = why
        return None
    res["fa4_import_s"] = time.perf_counter() - t0
    return Fa4Backend(dev)


def _fa4_columns(row: dict, fa4, case, ref, a) -> None:
    """FA4's paged denoise on the permuted pool: TFLOP/s, first-call (compile) time, error, ratios."""
    out = case.q.new_empty(case.q.shape)

    def fn():
        out.copy_(fa4.denoise(case.q, case.kv, case.meta, case.scale))
        return out
    t0 = time.perf_counter()
    got = fn()
    import torch
    torch.cuda.synchronize()
    row["fa4_first_call_s"] = time.perf_counter() - t0
    row["rel_err_fa4"] = _rel(_as_b(got, case), ref)
    row["fa4"] = _tflops(case.flops, _bench(fn, a))


def _as_b(out, case):
    R = case.q_b.shape[0]
    return out.view(R, -1, *out.shape[1:]).transpose(1, 2)


def run_attention_bench(a) -> dict:
    import torch
    from torch.nn.attention import SDPBackend

    from ..attention.triton_backend import pick_config, write_kv

    if not torch.cuda.is_available():
        raise SystemExit("ditkv bench attention needs a CUDA GPU")
    dev = torch.device("cuda")
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    torch.manual_seed(a.seed)
    cfg = _parse_cfg(a.config) if a.config else None
    flex_all = a.flex_shapes.strip() == "all"
    flex_shapes = set() if flex_all else set(_parse_shapes(a.flex_shapes))
    res: dict = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": __import__("triton").__version__, "dtype": a.dtype, "rows": a.rows, "heads": a.heads,
        "kv_heads": a.kv_heads, "head_dim": a.head_dim, "date": time.strftime("%Y-%m-%d"),
        "denoise": [], "prefill": [], "sweep": [],
    }
    sdpa = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}
    fa4 = _fa4_backend(res, dev)

    def denoise(P, T, bs, baselines: bool):
        case = _Case(a, P, T, bs, "denoise", dev, dtype)
        used = cfg or pick_config(a.head_dim, dtype, bs, a.heads // a.kv_heads, case.meta.max_q_len, True)
        row = {"P": P, "T": T, "block_size": bs, "config": list(used.__dict__.values())}
        f_paged = _ours(case, case.kv, case.meta, cfg)
        out = f_paged().clone()
        ref = _sdpa(case, SDPBackend.FLASH_ATTENTION)()
        row["rel_err_vs_flash"] = _rel(_as_b(out, case), ref)
        row["paged"] = _tflops(case.flops, _bench(f_paged, a))
        f_ident = _ours(case, case.kv_ident, case.meta_ident, cfg)
        row["rel_err_ident"] = _rel(f_ident(), out)
        row["ident"] = _tflops(case.flops, _bench(f_ident, a))
        if fa4 is not None:  # before the write kernel's timing overwrites the target's K/V
            _fa4_columns(row, fa4, case, ref, a)
        # write kernel: the phase's K/V (R*T tokens) into the pool
        kw = torch.randn(case.meta.num_tokens, a.kv_heads, a.head_dim, device=dev, dtype=dtype)
        ms_w = _bench(lambda: write_kv(case.kv, kw, kw, case.meta.slot_mapping), a)
        row["write_GBps"] = 4 * kw.numel() * kw.element_size() / (ms_w * 1e-3) / 1e9
        if baselines:
            for name, b in sdpa.items():
                try:
                    row[name] = _tflops(case.flops, _bench(_sdpa(case, b), a))
                except RuntimeError as e:  # backend not available for this shape
                    row[name] = None
                    row[name + "_error"] = str(e).splitlines()[0][:120]
            if flex_all or (P, T) in flex_shapes:
                try:
                    fx = _flex_fn(case, a.rows)
                    row["rel_err_flex"] = _rel(fx(), ref)
                    row["flex"] = _tflops(case.flops, _bench(fx, a))
                except Exception as e:  # noqa: BLE001 - report, keep benchmarking
                    row["flex"] = None
                    row["flex_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            for name in ("cudnn", "flash"):
                if row.get(name):
                    row["paged/" + name] = row["paged"] / row[name]
        if fa4 is not None:
            for name in ("cudnn", "paged"):
                if row.get(name):
                    row["fa4/" + name] = row["fa4"] / row[name]
        row["paged/ident"] = row["paged"] / row["ident"]
        del case
        torch.cuda.empty_cache()
        return row

    for P, T in _parse_shapes(a.shapes):
        r = denoise(P, T, a.block_size, True)
        res["denoise"].append(r)
        _print_row(r)
    for bs in [int(x) for x in a.extra_block_sizes.split(",") if x.strip()]:
        (P, T), = _parse_shapes(a.extra_shape)
        r = denoise(P, T, bs, False)
        res["denoise"].append(r)
        _print_row(r)

    for P, T in _parse_shapes(a.prefill_shapes):
        case = _Case(a, P, T, a.block_size, "prefill", dev, dtype)
        row = {"P": P, "T": T, "block_size": a.block_size}
        f_paged = _ours(case, case.kv, case.meta, cfg)
        out = f_paged().clone()
        L = case.L
        pos = torch.arange(L, device=dev)
        allowed = pos[None, :] < case.limits[0][:, None]  # equal layouts: one mask for all rows
        import torch.nn.functional as F

        def masked():
            return F.scaled_dot_product_attention(case.q_b, case.k_full, case.v_full,
                                                  attn_mask=allowed[None, None], scale=case.scale)
        ref = masked()
        row["rel_err_vs_masked_sdpa"] = _rel(_as_b(out, case), ref)
        row["paged"] = _tflops(case.flops, _bench(f_paged, a))
        row["sdpa_masked"] = _tflops(case.flops, _bench(masked, a))

        def segments():  # what a causal-or-not backend does: causal prefix + full target (flash)
            from torch.nn.attention import sdpa_kernel
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                o1 = F.scaled_dot_product_attention(case.q_b[:, :, :P], case.k_full[:, :, :P],
                                                    case.v_full[:, :, :P], is_causal=True, scale=case.scale)
                o2 = F.scaled_dot_product_attention(case.q_b[:, :, P:], case.k_full, case.v_full,
                                                    scale=case.scale)
            return torch.cat([o1, o2], dim=2)
        row["rel_err_segments"] = _rel(segments(), ref)
        row["segments_flash"] = _tflops(case.flops, _bench(segments, a))
        row["paged/sdpa_masked"] = row["paged"] / row["sdpa_masked"]
        row["paged/segments_flash"] = row["paged"] / row["segments_flash"]
        if fa4 is not None:  # FA4 segment calls through the page table, as Fa4Backend.prefill runs them
            def fa4_prefill():
                return fa4.prefill(case.q, case.kv, case.meta, case.scale)
            row["rel_err_fa4"] = _rel(_as_b(fa4_prefill(), case), ref)
            row["fa4"] = _tflops(case.flops, _bench(fa4_prefill, a))
            row["fa4/paged"] = row["fa4"] / row["paged"]
        res["prefill"].append(row)
        print("prefill", json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}),
              flush=True)
        del case, allowed
        torch.cuda.empty_cache()

    if a.sweep:
        (P, T), = _parse_shapes(a.extra_shape)
        case = _Case(a, P, T, a.block_size, "denoise", dev, dtype)
        ref = _sdpa(case, SDPBackend.FLASH_ATTENTION)()
        for spec in filter(None, (s.strip() for s in a.sweep.split(";"))):
            c = _parse_cfg(spec)
            item = {"config": spec}
            try:
                t0 = time.time()
                f = _ours(case, case.kv, case.meta, c)
                item["rel_err"] = _rel(_as_b(f(), case), ref)
                torch.cuda.synchronize()
                item["compile_s"] = time.time() - t0
                item["paged"] = _tflops(case.flops, _bench(f, a))
            except Exception as e:  # noqa: BLE001 - out of resources etc.: report and go on
                item["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            res["sweep"].append(item)
            print("sweep", json.dumps(item), flush=True)
    _print_table(res)
    return res


def _fmt(v, nd=1):
    if v is None:
        return "-"
    return f"{v:.{nd}f}"


def _print_row(r):
    print("denoise", json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}),
          flush=True)


def _print_table(res):
    print()
    print(f"# {res['device']} torch {res['torch']} triton {res['triton']} {res['dtype']} "
          f"R={res['rows']} Hq={res['heads']} Hkv={res['kv_heads']} D={res['head_dim']}  (TFLOP/s)")
    hdr = ["P", "T", "bs", "paged", "ident", "cudnn", "flash", "effic", "flex", "fa4",
           "p/cudnn", "p/flash", "p/ident", "fa4/cudnn", "fa4/p", "err", "wr GB/s"]
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    for r in res["denoise"]:
        vals = [str(r["P"]), str(r["T"]), str(r["block_size"]), _fmt(r["paged"]), _fmt(r["ident"]),
                _fmt(r.get("cudnn")), _fmt(r.get("flash")), _fmt(r.get("efficient")), _fmt(r.get("flex")),
                _fmt(r.get("fa4")), _fmt(r.get("paged/cudnn"), 2), _fmt(r.get("paged/flash"), 2),
                _fmt(r["paged/ident"], 3), _fmt(r.get("fa4/cudnn"), 2), _fmt(r.get("fa4/paged"), 2),
                f"{r['rel_err_vs_flash']:.1e}", _fmt(r["write_GBps"], 0)]
        print("| " + " | ".join(vals) + " |")
    if res["prefill"]:
        print()
        hdr = ["P", "T", "bs", "paged", "sdpa+mask", "segments(flash)", "fa4 segments", "p/mask", "p/segments",
               "fa4/p", "err"]
        print("| " + " | ".join(hdr) + " |")
        print("|" + "---|" * len(hdr))
        for r in res["prefill"]:
            vals = [str(r["P"]), str(r["T"]), str(r["block_size"]), _fmt(r["paged"]), _fmt(r["sdpa_masked"]),
                    _fmt(r["segments_flash"]), _fmt(r.get("fa4")), _fmt(r["paged/sdpa_masked"], 2),
                    _fmt(r["paged/segments_flash"], 2), _fmt(r.get("fa4/paged"), 2),
                    f"{r['rel_err_vs_masked_sdpa']:.1e}"]
            print("| " + " | ".join(vals) + " |")
    if res["sweep"]:
        print()
        for s in res["sweep"]:
            print(f"sweep {s['config']:>20}: {_fmt(s.get('paged'))} TFLOP/s {s.get('error', '')}")


def run(args) -> int:
    res = run_attention_bench(args)
    blob = json.dumps(res)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(blob + "\n")
    if args.json:
        print(blob)
    return 0


def main(argv=None) -> int:
    p = add_arguments(argparse.ArgumentParser(prog="ditkv bench attention", description=__doc__.splitlines()[0]))
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
