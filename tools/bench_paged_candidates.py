"""Paged attention candidates at the HunyuanImage-3 denoise shapes (issue 14 item 4), one GPU.

Times, in the same process and interleaved round by round, the denoise-phase attention (R CFG
rows, T target queries each, attending non-causally to all P + T keys of the row):

- `sdpa_cudnn` / `sdpa_flash`: dense SDPA (`sdpa_kernel(CUDNN_ATTENTION | FLASH_ATTENTION)`) on
  contiguous `[R, Hq, L, D]` K/V with the GQA heads expanded (as in `ditkv bench attention`);
- `triton`: ditkv's Triton paged kernel (`triton_backend.paged_attention`, default tiles);
- `cudnn_paged`: cuDNN's paged SDPA through `nvidia-cudnn-frontend`
  (`ditkv.attention.cudnn_backend.CudnnPaged`, the code `--attention-backend cudnn` runs);
- `cudnn_fe_dense`: diagnostic, the frontend's non-paged SDPA on contiguous GQA K/V
  `[R, Hkv, L, D]` (no page table, no padding mask): what paging costs cuDNN;
- `*_ident`: the same paged kernels with an identity page table (pages in order).

All paged kernels read the same block-major pool `[num_blocks, layers, 2, Hkv, bs, D]` through
its strided per-layer view `[num_blocks, 2, Hkv, bs, D]` (`worker/page_pool.py`), with randomly
permuted pages. FlashInfer and flash-attn-4 are listed as not run when they cannot be imported
(see docs/benchmarks.md for why they were not carried to the H200).

    python tools/bench_paged_candidates.py [--shapes 1024x4097,1024x1025,6700x4097,6700x1025]
        [--block-size 64] [--rounds 3] [--out DIR]

Prints a table (µs per call, ratio = SDPA-cuDNN dense time / candidate time, so > 1 is faster
than cuDNN dense) and writes `paged_candidates.json` to `--out` (default `$OUT` or `.`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = "1024x4097,1024x1025,6700x4097,6700x1025"
PAGED = ("triton", "cudnn_paged")


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"


def _probe_others() -> dict:
    """Import-only probes of the other candidates (they are not benchmarked when absent)."""
    out = {}
    for name, mod in (("flashinfer", "flashinfer"), ("flash_attn_4", "flash_attn.cute")):
        try:
            m = __import__(mod, fromlist=["_"])
            out[name] = f"importable ({getattr(m, '__version__', '?')}) but not wired into this script"
        except Exception as e:  # noqa: BLE001 - report why
            out[name] = f"not run: {_err(e)}"
    return out


def _fe_dense(cudnn, case, a):
    """The frontend's non-paged SDPA over contiguous GQA K/V (diagnostic baseline)."""
    import torch

    R, T, L = a.rows, case.target, case.L
    hq, hkv, d = a.heads, a.kv_heads, a.head_dim
    dt = cudnn.data_type.BFLOAT16
    handle = cudnn.create_handle()
    g = cudnn.pygraph(io_data_type=dt, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    q_dim, q_stride = (R, hq, T, d), (T * hq * d, d, hq * d, 1)
    qt = g.tensor(name="q", dim=q_dim, stride=q_stride, data_type=dt)
    kt = g.tensor(name="k", dim=(R, hkv, L, d), stride=tuple(case.k_gqa.stride()), data_type=dt)
    vt = g.tensor(name="v", dim=(R, hkv, L, d), stride=tuple(case.v_gqa.stride()), data_type=dt)
    o, _ = g.sdpa(name="sdpa", q=qt, k=kt, v=vt, attn_scale=case.scale, generate_stats=False,
                  compute_data_type=cudnn.data_type.FLOAT)
    o.set_output(True).set_dim(list(q_dim)).set_stride(list(q_stride)).set_data_type(dt)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    ws = torch.empty(max(1, g.get_workspace_size()), dtype=torch.uint8, device="cuda")
    out = torch.empty_like(case.q)
    pack = {qt: case.q, kt: case.k_gqa, vt: case.v_gqa, o: out}

    def fn():
        cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
        g.execute(pack, ws, handle=handle)
        return out
    return fn


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=SHAPES, help="comma list of PREFIXxTARGET")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (min of round medians)")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up (ms)")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetitions (ms)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args(argv)

    import torch
    import torch.nn.functional as F
    import triton
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ditkv.attention.triton_backend import paged_attention, pick_config
    from ditkv.bench.attention import _Case, _parse_shapes

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    dev, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(a.seed)
    res: dict = {"device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
                 "torch": torch.__version__, "triton": triton.__version__,
                 "cudnn_backend_version": torch.backends.cudnn.version(), "date": time.strftime("%Y-%m-%d"),
                 "rows": a.rows, "heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim,
                 "block_size": a.block_size, "dtype": "bf16", "command": " ".join(sys.argv), "shapes": []}
    cudnn_paged = None
    try:
        import cudnn

        from ditkv.attention.cudnn_backend import CudnnPaged
        cudnn_paged = CudnnPaged()
        res["cudnn_frontend"] = getattr(cudnn, "__version__", "?")
        res["cudnn_frontend_backend_version"] = cudnn.backend_version()
    except Exception as e:  # noqa: BLE001
        res["cudnn_paged_error"] = _err(e)
    res["others"] = _probe_others()
    print(json.dumps({k: v for k, v in res.items() if k != "shapes"}), flush=True)

    args = SimpleNamespace(rows=a.rows, heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim, layers=2,
                           seed=a.seed)
    for P, T in _parse_shapes(a.shapes):
        case = _Case(args, P, T, a.block_size, "denoise", dev, dtype)
        R = a.rows
        row: dict = {"P": P, "T": T, "flops": case.flops, "us": {}, "max_abs_err": {}, "errors": {}}
        cfg = pick_config(a.head_dim, dtype, a.block_size, a.heads // a.kv_heads, case.meta.max_q_len, True)
        row["triton_config"] = list(cfg.__dict__.values())
        out_t = torch.empty_like(case.q)
        out_c = torch.empty_like(case.q)

        def dense(b):
            def fn():
                with sdpa_kernel(b):
                    return F.scaled_dot_product_attention(case.q_b, case.k_full, case.v_full, scale=case.scale)
            return fn

        fns = {"sdpa_cudnn": dense(SDPBackend.CUDNN_ATTENTION), "sdpa_flash": dense(SDPBackend.FLASH_ATTENTION),
               "triton": lambda: paged_attention(case.q, case.kv, case.meta, case.scale, out=out_t),
               "triton_ident": lambda: paged_attention(case.q, case.kv_ident, case.meta_ident, case.scale,
                                                       out=out_t)}
        if cudnn_paged is not None:
            fns["cudnn_paged"] = lambda: cudnn_paged(case.q, case.kv, case.meta, case.scale, out=out_c)
            fns["cudnn_paged_ident"] = lambda: cudnn_paged(case.q, case.kv_ident, case.meta_ident, case.scale,
                                                           out=out_c)
            try:
                fns["cudnn_fe_dense"] = _fe_dense(cudnn, case, a)
            except Exception as e:  # noqa: BLE001
                row["errors"]["cudnn_fe_dense"] = _err(e)
        ref_flash = fns["sdpa_flash"]().float()
        ref_cudnn = None
        outs = {}
        for name, fn in list(fns.items()):  # first call: build/compile, correctness
            try:
                t0 = time.time()
                o = fn()
                torch.cuda.synchronize()
                row.setdefault("first_call_s", {})[name] = round(time.time() - t0, 3)
                o = o.float() if name.startswith("sdpa") else o.view(R, T, a.heads, a.head_dim).transpose(1, 2).float()
                outs[name] = o
                if name == "sdpa_cudnn":
                    ref_cudnn = o
            except Exception as e:  # noqa: BLE001 - record and keep going
                row["errors"][name] = _err(e)
                traceback.print_exc()
                fns.pop(name)
        for name, o in outs.items():
            row["max_abs_err"][name] = {"vs_flash": float((o - ref_flash).abs().max())}
            if ref_cudnn is not None:
                row["max_abs_err"][name]["vs_cudnn"] = float((o - ref_cudnn).abs().max())
        best: dict = {}
        for _ in range(max(1, a.rounds)):
            for name, fn in fns.items():
                ms = float(triton.testing.do_bench(fn, warmup=a.warmup, rep=a.rep, return_mode="median"))
                best[name] = min(best.get(name, float("inf")), ms)
        row["us"] = {k: round(v * 1e3, 1) for k, v in best.items()}
        row["tflops"] = {k: round(case.flops / (v * 1e-3) / 1e12, 1) for k, v in best.items()}
        if "sdpa_cudnn" in best:
            row["vs_sdpa_cudnn"] = {k: round(best["sdpa_cudnn"] / v, 3) for k, v in best.items()}
        if "triton" in best and "cudnn_paged" in best:
            row["cudnn_paged_vs_triton"] = round(best["triton"] / best["cudnn_paged"], 3)
        res["shapes"].append(row)
        print("shape", json.dumps(row), flush=True)
        del case, fns, outs, ref_flash, ref_cudnn
        torch.cuda.empty_cache()

    names = ["sdpa_cudnn", "sdpa_flash", "cudnn_fe_dense", "triton", "triton_ident", "cudnn_paged",
             "cudnn_paged_ident"]
    print(f"\n# {res['device']} torch {res['torch']} triton {res['triton']} cuDNN {res['cudnn_backend_version']} "
          f"frontend {res.get('cudnn_frontend', '-')}; R={a.rows} Hq={a.heads} Hkv={a.kv_heads} D={a.head_dim} "
          f"bf16 page {a.block_size}; µs per call (x = SDPA-cuDNN dense time / this)")
    print("| P | T | " + " | ".join(names) + " | max abs err vs flash (triton / cudnn_paged) |")
    print("|" + "---|" * (len(names) + 3))
    for r in res["shapes"]:
        cells = []
        for n in names:
            us = r["us"].get(n)
            cells.append("-" if us is None else f"{us:.0f} ({r.get('vs_sdpa_cudnn', {}).get(n, 0):.2f}x)")
        errs = "/".join(f"{r['max_abs_err'].get(n, {}).get('vs_flash', float('nan')):.1e}" for n in PAGED)
        print(f"| {r['P']} | {r['T']} | " + " | ".join(cells) + f" | {errs} |")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "paged_candidates.json").write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out / 'paged_candidates.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
