"""FP8 W8A8 products for a few rows (AR decode) as one Triton GEMV pass, on CUDA.

At decode a step has one token per request, so every FP8 projection is a [M, K] x [K, N] product
with M of 1..4, and the routed experts are 8 single-row products per token. cuBLAS's `_scaled_mm`
and the grouped GEMM pad such M to a tensor-core tile and read the weight at about half to two
thirds of the memory bandwidth, and the grouped path also sorts the slots by expert first (a
dozen small kernels per layer). Here one program computes one output row's block of BLOCK_N
columns: it walks K in BLOCK_K chunks, multiplies the row's e4m3 codes by the weight's in fp32
and sums, then applies both rowwise scales, the arithmetic of `fp8.scaled_mm`:

    out[s, n] = (sum_k q[row(s), k] * w[e(s), n, k]) * qs[row(s)] * ws[e(s), n]   (fp32, then rounded once)

`experts` (optional) maps an output row s to its weight (the routed experts: slot s is token s // k
through expert ids[s]; no sort, no gather). Programs are ordered row
fastest, so the M programs that read one weight block run together and all but the first find it in
L2. The sum runs in a fixed order per output element, whatever the other rows: batch-invariant. It
differs from cuBLAS's accumulation order (both fp32), so a decode step's values differ from the
tensor-core path's in the last bits; `fp8.set_gemv_rows(0)` turns this path off (A/B in
`ditkv bench ar --fp8-gemv-rows`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = {"block_n": 8, "block_k": 512, "num_warps": 4, "num_stages": 3}  # tools/gpu_gemv_tune.py: best on an H100


@triton.jit
def _gemv_kernel(q_ptr, qs_ptr, w_ptr, ws_ptr, out_ptr, experts_ptr, N, K,
                 stride_q, stride_we, stride_wn, stride_se, stride_out,
                 INDIRECT: tl.constexpr, TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    row = s // TOPK
    e = 0
    if INDIRECT:
        e = tl.load(experts_ptr + s).to(tl.int64)
    k0 = tl.arange(0, BLOCK_K)
    # products summed per lane across K blocks, then once across the lanes: no reduction per block
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    w_rows = w_ptr + e * stride_we + n[:, None].to(tl.int64) * stride_wn
    for k in range(0, K, BLOCK_K):
        kk = k + k0
        k_ok = kk < K
        x = tl.load(q_ptr + row * stride_q + kk, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += w * x[None, :]
    scale = tl.load(qs_ptr + row) * tl.load(ws_ptr + e * stride_se + n, mask=n_ok, other=0.0)
    tl.store(out_ptr + s * stride_out + n, (tl.sum(acc, axis=1) * scale).to(out_ptr.dtype.element_ty), mask=n_ok)


def gemv(q: torch.Tensor, qs: torch.Tensor, w8: torch.Tensor, ws: torch.Tensor, out_dtype: torch.dtype,
         experts: torch.Tensor | None = None, topk: int = 1, tile: dict | None = None) -> torch.Tensor:
    """q [T, K] e4m3 with qs [T, 1] fp32 (per token) times w8 ([N, K], or [E, N, K] with `experts`) with
    ws ([N] or [E, N]) -> [S, N] in `out_dtype`. Output row s is token s // topk through weight
    experts[s] (None: the one weight); S = len(experts), else T."""
    indirect = experts is not None
    if indirect and (w8.dim() != 3 or experts.dim() != 1 or experts.shape[0] > q.shape[0] * topk):
        raise ValueError("fp8_gemv: experts [S] (S <= tokens * topk) need a [E, N, K] weight stack")
    if not indirect and w8.dim() != 2:
        raise ValueError(f"fp8_gemv: a [N, K] weight without experts, got {tuple(w8.shape)}")
    if q.stride(-1) != 1 or w8.stride(-1) != 1:
        raise ValueError("fp8_gemv: q and the weight must be contiguous along K")
    n, k = w8.shape[-2], w8.shape[-1]
    s = experts.shape[0] if indirect else q.shape[0]
    out = torch.empty(s, n, dtype=out_dtype, device=q.device)
    if s == 0:
        return out
    we = w8.stride(0) if indirect else 0
    se = ws.stride(0) if indirect else 0
    t = TILE if tile is None else tile
    _gemv_kernel[(s, triton.cdiv(n, t["block_n"]))](
        q, qs.reshape(-1), w8, ws, out, experts if indirect else q, n, k,
        q.stride(0), we, w8.stride(-2), se, out.stride(0), INDIRECT=indirect, TOPK=topk,
        BLOCK_N=t["block_n"], BLOCK_K=t["block_k"], num_warps=t["num_warps"], num_stages=t["num_stages"])
    return out


def routed_swiglu(q: torch.Tensor, qs: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  scales: tuple[torch.Tensor, torch.Tensor], topk: int, out_dtype: torch.dtype) -> torch.Tensor:
    """The routed experts' SwiGLU for every slot, in slot order [N * topk, H]: slot s is token s // topk
    through expert ids[s] (pre-quantized tokens q, qs); the gate fused with the down projection's
    quantization as on the grouped path (the same Triton pass `fp8.silu_mul_quant` runs on CUDA)."""
    from .fp8_kernels import silu_mul_quant

    x12 = gemv(q, qs, w13, scales[0], out_dtype, ids, topk)
    hq, hs = silu_mul_quant(x12)
    return gemv(hq, hs, w2, scales[1], out_dtype, ids)
