"""Triton kernels of the batch-invariant mode (`invariant.py`): dense and grouped GEMM, RMSNorm.

Each output row depends only on its input row, whatever else is in the batch:
- the tile sizes, warps and stages are a function of (dtype, N, K) only, never of M (no autotune);
- no split-K: a program walks the whole K range in one fixed order, accumulating in fp32;
- `M` is not specialised on (`do_not_specialize`), so one compiled kernel serves every batch size;
- a row's products do not depend on its position inside a tile (the MMA treats every row alike),
  which is what makes the grouped GEMM invariant: a token's tile offset changes with the number
  of tokens its expert got, its arithmetic does not.
The RMSNorm reduces one row in a layout fixed by the row width.

Under the Triton interpreter (CPU tests, `UPCAST`) `tl.dot` is numpy's matmul, i.e. the BLAS, whose
bits depend on the CPU's instruction set and on a row's position inside the BLAS's own tile (OpenBLAS
on AVX2 rounds rows of one tile differently). There the tile product is an elementwise fp32 multiply
and a numpy sum over k instead: IEEE products and one summation order for every row on any x86-64
CPU. (The interpreter also truncates fp32 -> bf16 casts where the GPU rounds to nearest: CPU bf16
results are up to one bf16 ulp off, invariance unaffected.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class MMConfig:
    bm: int
    bn: int
    bk: int
    warps: int
    stages: int
    group_m: int = 8


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def mm_config(dtype: torch.dtype, n: int, k: int, on_gpu: bool) -> MMConfig:
    """The tiling of x[M, K] @ w[N, K].T: a function of dtype, N and K only (batch invariance)."""
    if not on_gpu:  # interpreter: small tiles keep numpy quick
        return MMConfig(16, 16, 16, 4, 1)
    bn = max(16, min(_pow2(n), 256))
    if dtype == torch.float32:
        return MMConfig(64, min(bn, 64), 32, 4, 3)
    # Hopper bf16: 128 x 256 x 64, 8 warps, 3 stages (Triton's matmul tutorial best on H100)
    return MMConfig(128, bn, 64, 8 if bn >= 128 else 4, 3)


def _precision(dtype: torch.dtype, upcast: bool) -> str:
    if upcast or (dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32):
        return "ieee"
    return "tf32"  # ignored for 16-bit inputs; TF32 for fp32 only where torch allows it too


@triton.jit
def _dot_k(acc, x_ptr, w_ptr, rm, rn, mask_m, mask_n, K, s_xm, s_xk, s_wn, s_wk,
           BK: tl.constexpr, EVEN_K: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """acc += x[rm, :] @ w[rn, :].T over the whole K range, BK at a time, always in this order."""
    rk = tl.arange(0, BK)
    xp = x_ptr + rm[:, None] * s_xm + rk[None, :] * s_xk
    wp = w_ptr + rn[None, :] * s_wn + rk[:, None] * s_wk
    for k0 in range(0, K, BK):
        if EVEN_K:
            a = tl.load(xp, mask=mask_m[:, None], other=0.0)
            b = tl.load(wp, mask=mask_n[None, :], other=0.0)
        else:
            kin = (k0 + rk) < K
            a = tl.load(xp, mask=mask_m[:, None] & kin[None, :], other=0.0)
            b = tl.load(wp, mask=mask_n[None, :] & kin[:, None], other=0.0)
        if UPCAST:  # interpreter: exact fp32 products, summed over k in one order for every row
            acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        else:
            acc = tl.dot(a, b, acc, input_precision=PREC)
        xp += BK * s_xk
        wp += BK * s_wk
    return acc


@triton.jit(do_not_specialize=["M"])
def _mm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, s_xm, s_xk, s_wn, s_wk, s_ym, s_yn,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
               HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN)
    # grouped launch order (L2 reuse of w tiles); it moves tiles between programs, not the math
    per_group = GROUP_M * n_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rn = pid_n * BN + tl.arange(0, BN)
    mask_m = rm < M
    mask_n = rn < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    acc = _dot_k(acc, x_ptr, w_ptr, rm, rn, mask_m, mask_n, K, s_xm, s_xk, s_wn, s_wk, BK, EVEN_K, PREC, UPCAST)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * s_ym + rn[None, :] * s_yn, acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _grouped_mm_kernel(x_ptr, w_ptr, y_ptr, tile_expert_ptr, tile_row_ptr, ends_ptr, E, N, K,
                       s_xm, s_xk, s_we, s_wn, s_wk, s_ym, s_yn,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       EVEN_K: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    # axis 0: row tiles (consecutive programs share an expert's weight tile), axis 1: N tiles
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_expert_ptr + t)
    if e >= E:  # the grid is an upper bound on the tiles (fixed for a CUDA graph); spare ones stop
        return
    row0 = tl.load(tile_row_ptr + t).to(tl.int64)
    row_end = tl.load(ends_ptr + e).to(tl.int64)
    rm = row0 + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mask_m = rm < row_end
    mask_n = rn < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    acc = _dot_k(acc, x_ptr, w_ptr + e.to(tl.int64) * s_we, rm, rn, mask_m, mask_n, K,
                 s_xm, s_xk, s_wn, s_wk, BK, EVEN_K, PREC, UPCAST)
    tl.store(y_ptr + rm[:, None] * s_ym + rn[None, :] * s_yn, acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["R"])
def _rms_kernel(x_ptr, cos_ptr, sin_ptr, w_ptr, y_ptr, R, H, D, s_xn, s_xh, s_cn, s_yn, s_yh, eps,
                BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ROPE: tl.constexpr):
    """Rows r = (token r // H, head r % H): [optional rotate-half RoPE, rounded to x's dtype as
    `apply_rope` does] -> x * rsqrt(mean(x^2) + eps), rounded -> weight * that. fp32 math."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < R
    n = (r // H).to(tl.int64)
    h = (r % H).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    m2 = rmask[:, None] & dmask[None, :]
    row = x_ptr + n[:, None] * s_xn + h[:, None] * s_xh
    x = tl.load(row + d[None, :], mask=m2, other=0.0).to(tl.float32)
    if ROPE:
        half = D // 2
        other = tl.load(row + ((d + half) % D)[None, :], mask=m2, other=0.0).to(tl.float32)
        rot = tl.where((d < half)[None, :], -other, other)  # rotate_half: [-x2, x1]
        c = tl.load(cos_ptr + n[:, None] * s_cn + d[None, :], mask=m2, other=0.0)
        s = tl.load(sin_ptr + n[:, None] * s_cn + d[None, :], mask=m2, other=0.0)
        x = (x * c + rot * s).to(x_ptr.dtype.element_ty).to(tl.float32)
    ms = tl.sum(x * x, 1) / D
    y = (x * (1.0 / tl.sqrt(ms + eps))[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + d, mask=dmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + n[:, None] * s_yn + h[:, None] * s_yh + d[None, :],
             (w[None, :] * y).to(y_ptr.dtype.element_ty), mask=m2)


# ---------------------------------------------------------------------------------- launchers


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check(x: torch.Tensor, w: torch.Tensor) -> None:
    if x.dtype != w.dtype:
        raise ValueError(f"batch-invariant matmul: input {x.dtype} and weight {w.dtype} differ")
    if x.shape[-1] != w.shape[-1]:
        raise ValueError(f"batch-invariant matmul: input width {x.shape[-1]} != weight width {w.shape[-1]}")


def matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, w, bias)` (x [..., K], w [N, K]); each output row a function of its input row."""
    _check(x, w)
    k, n = x.shape[-1], w.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        up = interpreting()
        cfg = mm_config(x.dtype, n, k, not up)
        grid = (_cdiv(m, cfg.bm) * _cdiv(n, cfg.bn),)
        _mm_kernel[grid](x2, w, bias if bias is not None else w, y, m, n, k,
                         x2.stride(0), x2.stride(1), w.stride(0), w.stride(1), y.stride(0), y.stride(1),
                         BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m, HAS_BIAS=bias is not None,
                         EVEN_K=k % cfg.bk == 0, PREC=_precision(x.dtype, up), UPCAST=up,
                         num_warps=cfg.warps, num_stages=cfg.stages)
    return y.view(*x.shape[:-1], n)


def tile_map(ends: torch.Tensor, bm: int, max_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For row tiles 0..max_tiles-1 of rows grouped by expert (`ends`: cumulative, int): the expert
    of each tile (E past the last real tile) and its first row. Device ops only: no host sync."""
    ends = ends.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    tiles = (ends - starts + bm - 1) // bm
    tile_end = torch.cumsum(tiles, 0)
    t = torch.arange(max_tiles, device=ends.device, dtype=torch.int64)
    e = torch.searchsorted(tile_end, t, right=True)
    ec = e.clamp(max=ends.shape[0] - 1)
    row0 = starts[ec] + (t - (tile_end[ec] - tiles[ec])) * bm
    return e.to(torch.int32), row0.to(torch.int32)


def grouped_tiles(ends: torch.Tensor, rows: int, w: torch.Tensor):
    """The tile map of `grouped_matmul` for `rows` rows and weights `w` [E, N, K] (reusable by every
    grouped GEMM over the same rows whose config has the same BM)."""
    e, n, k = w.shape
    bm = mm_config(w.dtype, n, k, not interpreting()).bm
    max_tiles = min(rows, _cdiv(rows, bm) + e)
    return (bm, *tile_map(ends, bm, max_tiles))


def grouped_matmul(x: torch.Tensor, ends: torch.Tensor, w: torch.Tensor, tiles=None) -> torch.Tensor:
    """Rows [ends[e-1], ends[e]) of x [S, K] times w[e].T (w [E, N, K], out x in) for every e -> [S, N]."""
    _check(x, w)
    s, k = x.shape
    e, n, _ = w.shape
    y = torch.empty((s, n), dtype=x.dtype, device=x.device)
    if s == 0 or n == 0:
        return y
    up = interpreting()
    cfg = mm_config(x.dtype, n, k, not up)
    _, tile_expert, tile_row = tiles if tiles is not None and tiles[0] == cfg.bm else grouped_tiles(ends, s, w)
    grid = (tile_expert.shape[0], _cdiv(n, cfg.bn))
    _grouped_mm_kernel[grid](x, w, y, tile_expert, tile_row, ends, e, n, k,
                             x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
                             y.stride(0), y.stride(1),
                             BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, EVEN_K=k % cfg.bk == 0,
                             PREC=_precision(x.dtype, up), UPCAST=up, num_warps=cfg.warps, num_stages=cfg.stages)
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor | None = None,
             sin: torch.Tensor | None = None) -> torch.Tensor:
    """`layers._rms_norm` (with cos/sin: `layers._rope_rms_norm`) over the last dim of x [N, (H,) D]."""
    d = x.shape[-1]
    x3 = x.reshape(x.shape[0], -1, d) if x.dim() >= 2 else x.reshape(1, 1, d)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    n, h, _ = x3.shape
    y = torch.empty(x3.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    rows = n * h
    if rows:
        rope = cos is not None
        if rope:
            cos = cos.reshape(n, d).float().contiguous()  # [N, 1, D] tables, one per token
            sin = sin.reshape(n, d).float().contiguous()
        block_d = _pow2(d)
        block_r = 1 if interpreting() else max(1, 2048 // block_d)  # from D only, never from N
        _rms_kernel[(_cdiv(rows, block_r),)](
            x3, cos if rope else x3, sin if rope else x3, weight, y, rows, h, d,
            x3.stride(0), x3.stride(1), cos.stride(0) if rope else 0, y.stride(0), y.stride(1), float(eps),
            BLOCK_R=block_r, BLOCK_D=block_d, ROPE=rope, num_warps=8 if block_d >= 4096 else 4)
    return y.view(x.shape)
