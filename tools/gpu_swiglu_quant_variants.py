"""Issue 24 probe (H200): variants of the SwiGLU + FP8 quantization kernel (models/fp8_kernels.py
`_silu_mul_quant_kernel`) at the release step's routed shape (65 552 slots x 2 x 3072 bf16), timed in one
run against the engine's kernel, each checked against the reference formula (`fp8.quantize_rows_ref`).

    python tools/gpu_swiglu_quant_variants.py --json-out OUT.json
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from gpu_quack_grouped import emit, timed as timed_ms  # tools/ is on sys.path when run as a script

from ditkv.models import fp8_kernels
from ditkv.models.fp8_format import AMAX_MIN, FP8, FP8_MAX, quantize_rows_ref


@triton.jit
def _variant(x_ptr, q_ptr, s_ptr, I, stride_x, stride_q, AMAX_FLOOR: tl.constexpr, QMAX: tl.constexpr,
             BLOCK: tl.constexpr, ROWS: tl.constexpr, RECIP: tl.constexpr, SIGMOID: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    offs = tl.arange(0, BLOCK)[None, :]
    mask = offs < I
    x1 = tl.load(x_ptr + rows * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + rows * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    if SIGMOID:
        h = x1 * (x2 * tl.sigmoid(x2))
    else:
        h = x1 * (x2 / (1.0 + tl.exp(-x2)))
    s = tl.div_rn(tl.maximum(tl.max(tl.abs(h), axis=1), AMAX_FLOOR), QMAX)
    if RECIP:
        q = tl.clamp(h * (1.0 / s)[:, None], -QMAX, QMAX)
    else:
        q = tl.clamp(h / s[:, None], -QMAX, QMAX)
    tl.store(q_ptr + rows * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows, s[:, None])


def timed(fn) -> float:
    return timed_ms(fn, warmup=5, rep=50) * 1e3  # microseconds


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=65552)
    p.add_argument("--inter", type=int, default=3072)
    p.add_argument("--json-out", default="")
    a = p.parse_args()
    torch.manual_seed(0)
    m, i = a.rows, a.inter
    x = torch.randn(m, 2 * i, device="cuda", dtype=torch.bfloat16) * 2
    x1, x2 = x.chunk(2, dim=-1)
    rq, rs = quantize_rows_ref(x1 * torch.nn.functional.silu(x2))
    q = torch.empty(m, i, dtype=FP8, device="cuda")
    s = torch.empty(m, 1, dtype=torch.float32, device="cuda")
    gbytes = (x.numel() * 2 + q.numel() + s.numel() * 4) / 1e9
    res = {"rows": m, "inter": i, "bytes_GB": gbytes}

    def check(qq, ss):
        off = (qq.float() != rq.float()).float().mean().item()
        return {"codes_off": off, "scales_equal": bool(torch.equal(ss, rs)),
                "max_abs_code_diff": (qq.float() - rq.float()).abs().max().item()}

    us = timed(lambda: fp8_kernels.silu_mul_quant(x))
    res["engine"] = {"us": us, "TBps": gbytes / us * 1e6 / 1e3, **check(*fp8_kernels.silu_mul_quant(x))}
    print("engine", res["engine"], file=sys.stderr, flush=True)
    block = triton.next_power_of_2(i)
    for rows in (1, 2, 4):
        for warps in (4, 8, 16):
            for recip in (False, True):
                for sig in (False, True):
                    if rows * block // (32 * warps) > 128:  # too many elements per thread
                        continue
                    key = f"rows{rows}_w{warps}_recip{int(recip)}_sig{int(sig)}"

                    def run(rows=rows, warps=warps, recip=recip, sig=sig):
                        _variant[(triton.cdiv(m, rows),)](x, q, s, i, x.stride(0), q.stride(0), AMAX_FLOOR=AMAX_MIN,
                                                         QMAX=FP8_MAX, BLOCK=block, ROWS=rows, RECIP=recip,
                                                         SIGMOID=sig, num_warps=warps)
                    try:
                        run()
                        torch.cuda.synchronize()
                        res[key] = {"us": timed(run), **check(q, s)}
                        res[key]["TBps"] = gbytes / res[key]["us"] * 1e6 / 1e3
                    except Exception as exc:  # noqa: BLE001 - a variant that does not compile: record it
                        res[key] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                    print(key, res[key], file=sys.stderr, flush=True)
    emit(res, a.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
