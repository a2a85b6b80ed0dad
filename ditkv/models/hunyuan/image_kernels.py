"""GroupNorm of channels-last activations in Triton: the image path's ResBlocks and the VAE decoder.

torch's CUDA GroupNorm makes its input NCHW-contiguous and returns NCHW, so a channels-last conv
stack pays a transpose before and after every norm (and the conv after it one more back). These
kernels read the activation in its channels-last layout `[N, S, C]` (S = every spatial position,
also frames for the VAE's 3D tensors) and write the result in the same layout:

- `_gn_partial_kernel`: per (sample, split of S, block of whole groups), the count, mean and sum
  of squared deviations of each group (two passes over the tile in registers, tiles merged by
  Chan's formula: no E[x^2] - E[x]^2 cancellation);
- `_gn_finalize_kernel`: merges the splits into each group's mean and 1/sqrt(var + eps);
- `_gn_apply_kernel`: the affine norm, then optionally the ResBlock's time modulation
  `* (1 + scale) + shift` and SiLU, one pass.

Rounding follows the eager ops it replaces: the norm's result is rounded to the output dtype (as
`GroupNorm` returns it), `1 + scale`, the product and the sum each once (bf16 tensor ops), SiLU
computed in fp32 from the rounded value and rounded again. Statistics are fp32 and their order
differs from torch's, so results agree to the last bit of the output dtype, not bit for bit.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK_S = 64  # positions per tile
BLOCK_C = 128  # channels per tile (whole groups; C must be a multiple)
TARGET_PROGRAMS = 1024  # partial-statistics programs to aim for (the H200 has 132 SMs)


@triton.jit
def _gn_partial_kernel(x_ptr, mean_ptr, m2_ptr, S, C, G, n_split, rows_per_prog,
                       CPG: tl.constexpr, GPB: tl.constexpr, BLOCK: tl.constexpr):
    sp = tl.program_id(0)
    cb = tl.program_id(1)
    n = tl.program_id(2).to(tl.int64)
    WIDTH: tl.constexpr = GPB * CPG
    offs_c = cb * WIDTH + tl.arange(0, WIDTH)
    s_lo = sp * rows_per_prog
    s_hi = tl.minimum(s_lo + rows_per_prog, S)
    cnt = tl.zeros([GPB], dtype=tl.float32)  # positions x channels merged so far (the same for every group)
    mean = tl.zeros([GPB], dtype=tl.float32)
    m2 = tl.zeros([GPB], dtype=tl.float32)
    base = x_ptr + n * S * C
    for s0 in range(s_lo, s_hi, BLOCK):
        offs_s = s0 + tl.arange(0, BLOCK)
        ms = offs_s < s_hi
        x = tl.load(base + offs_s.to(tl.int64)[:, None] * C + offs_c[None, :], mask=ms[:, None], other=0.0)
        x3 = tl.reshape(x.to(tl.float32), (BLOCK, GPB, CPG))
        nt = tl.sum(ms.to(tl.float32), axis=0) * CPG
        tmean = tl.sum(tl.sum(x3, axis=2), axis=0) / nt
        d = tl.where(tl.reshape(ms, (BLOCK, 1, 1)), x3 - tl.reshape(tmean, (1, GPB, 1)), 0.0)
        tm2 = tl.sum(tl.sum(d * d, axis=2), axis=0)
        tot = cnt + nt
        delta = tmean - mean
        mean += delta * (nt / tot)
        m2 += tm2 + delta * delta * (cnt * nt / tot)
        cnt = tot
    offs_g = cb * GPB + tl.arange(0, GPB)
    out = (n * n_split + sp) * G + offs_g
    tl.store(mean_ptr + out, mean)
    tl.store(m2_ptr + out, m2)


@triton.jit
def _gn_finalize_kernel(mean_ptr, m2_ptr, stat_ptr, S, G, n_split, rows_per_prog, inv_total, eps,
                        CPG: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_G: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    offs_g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    mg = offs_g < G
    acc = tl.zeros([BLOCK_G], dtype=tl.float32)
    for p0 in range(0, n_split, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        mp = offs_p < n_split
        rows = tl.minimum(rows_per_prog, S - offs_p * rows_per_prog)
        cnt = tl.where(mp, rows, 0).to(tl.float32) * CPG
        idx = (n * n_split + offs_p)[:, None] * G + offs_g[None, :]
        m = tl.load(mean_ptr + idx, mask=mp[:, None] & mg[None, :], other=0.0)
        acc += tl.sum(m * cnt[:, None], axis=0)
    mean = acc * inv_total
    acc2 = tl.zeros([BLOCK_G], dtype=tl.float32)
    for p0 in range(0, n_split, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        mp = offs_p < n_split
        rows = tl.minimum(rows_per_prog, S - offs_p * rows_per_prog)
        cnt = tl.where(mp, rows, 0).to(tl.float32) * CPG
        idx = (n * n_split + offs_p)[:, None] * G + offs_g[None, :]
        mk = mp[:, None] & mg[None, :]
        m = tl.load(mean_ptr + idx, mask=mk, other=0.0)
        q = tl.load(m2_ptr + idx, mask=mk, other=0.0)
        d = m - mean[None, :]
        acc2 += tl.sum(q + cnt[:, None] * d * d, axis=0)
    rstd = 1.0 / tl.sqrt(acc2 * inv_total + eps)
    tl.store(stat_ptr + (n * G + offs_g) * 2, mean, mask=mg)
    tl.store(stat_ptr + (n * G + offs_g) * 2 + 1, rstd, mask=mg)


@triton.jit
def _gn_apply_kernel(x_ptr, y_ptr, stat_ptr, w_ptr, b_ptr, mod_ptr, S, C, G, stride_mod,
                     CPG: tl.constexpr, BLOCK: tl.constexpr, WIDTH: tl.constexpr,
                     MOD: tl.constexpr, SILU: tl.constexpr):
    offs_s = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # axis 0: up to 2^31 - 1 programs
    offs_c = tl.program_id(1) * WIDTH + tl.arange(0, WIDTH)
    n = tl.program_id(2).to(tl.int64)
    ms = offs_s < S
    g = offs_c // CPG
    mean = tl.load(stat_ptr + (n * G + g) * 2)
    rstd = tl.load(stat_ptr + (n * G + g) * 2 + 1)
    a = rstd * tl.load(w_ptr + offs_c).to(tl.float32)
    b = tl.load(b_ptr + offs_c).to(tl.float32)
    idx = n * S * C + offs_s.to(tl.int64)[:, None] * C + offs_c[None, :]
    x = tl.load(x_ptr + idx, mask=ms[:, None], other=0.0).to(tl.float32)
    odt = y_ptr.dtype.element_ty
    y = ((x - mean[None, :]) * a[None, :] + b[None, :]).to(odt).to(tl.float32)  # what GroupNorm returns
    if MOD:  # h * (1 + scale) + shift, each op rounded like the eager tensor ops
        sc = tl.load(mod_ptr + n * stride_mod + offs_c).to(tl.float32)
        sh = tl.load(mod_ptr + n * stride_mod + C + offs_c).to(tl.float32)
        onep = (1.0 + sc).to(odt).to(tl.float32)
        y = (y * onep[None, :]).to(odt).to(tl.float32)
        y = (y + sh[None, :]).to(odt).to(tl.float32)
    if SILU:
        y = y / (1.0 + tl.exp(-y))
    tl.store(y_ptr + idx, y.to(odt), mask=ms[:, None])


def supports(x: torch.Tensor, groups: int) -> bool:
    """Whether the kernels take `x` [N, C, *spatial]: CUDA (or the Triton interpreter), channels-last
    in memory (C the fastest dimension), power-of-two groups filling whole 128-channel tiles."""
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")  # tests: CPU tensors, interpreter
    if not (x.is_cuda or interpreted) or x.dim() < 3 or x.numel() == 0:
        return False
    n, c = x.shape[:2]
    cpg = c // groups if c % groups == 0 else 0
    if not cpg or cpg & (cpg - 1) or c % max(BLOCK_C, cpg):  # power-of-two groups, whole tiles
        return False
    return x.stride(1) == 1 and x.permute(0, *range(2, x.dim()), 1).is_contiguous()


def group_norm_cl(x: torch.Tensor, groups: int, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                  mod: torch.Tensor | None = None, silu: bool = False) -> torch.Tensor:
    """GroupNorm (affine) of channels-last x [N, C, *spatial], optionally `* (1 + scale) + shift` with
    `mod` [N, 2C] = [scale | shift] (in x's dtype) and SiLU; the result in x's dtype and layout."""
    if not supports(x, groups):
        raise ValueError(f"group_norm_cl takes channels-last CUDA tensors with whole groups per {BLOCK_C} "
                         f"channels; got {tuple(x.shape)} strides {x.stride()}, {groups} groups")
    n, c = x.shape[:2]
    s = x.numel() // (n * c)
    cpg = c // groups
    width = max(BLOCK_C, cpg)
    gpb = width // cpg
    n_cb = c // width
    n_split = max(1, min(triton.cdiv(s, BLOCK_S), TARGET_PROGRAMS // max(1, n * n_cb)))
    rows = triton.cdiv(s, n_split)
    n_split = triton.cdiv(s, rows)  # every split holds at least one position
    dev = x.device
    mean = torch.empty(n, n_split, groups, dtype=torch.float32, device=dev)
    m2 = torch.empty_like(mean)
    # grids put the long axis first: CUDA caps grid axes 1 and 2 at 65535 programs
    _gn_partial_kernel[(n_split, n_cb, n)](x, mean, m2, s, c, groups, n_split, rows, CPG=cpg, GPB=gpb,
                                           BLOCK=BLOCK_S, num_warps=4)
    stat = torch.empty(n, groups, 2, dtype=torch.float32, device=dev)
    _gn_finalize_kernel[(n, triton.cdiv(groups, 32))](mean, m2, stat, s, groups, n_split, rows, 1.0 / (s * cpg),
                                                      float(eps),
                                                      CPG=cpg, BLOCK_P=64, BLOCK_G=32, num_warps=4)
    y = torch.empty_like(x)  # same strides: channels-last
    if mod is not None:
        if mod.shape != (n, 2 * c) or mod.stride(1) != 1:
            raise ValueError(f"mod must be [N, 2C] = {(n, 2 * c)} with unit channel stride, got {tuple(mod.shape)}")
    _gn_apply_kernel[(triton.cdiv(s, BLOCK_S), n_cb, n)](
        x, y, stat, weight, bias, mod if mod is not None else x, s, c, groups,
        mod.stride(0) if mod is not None else 0, CPG=cpg, BLOCK=BLOCK_S, WIDTH=width,
        MOD=mod is not None, SILU=bool(silu), num_warps=4)
    return y
