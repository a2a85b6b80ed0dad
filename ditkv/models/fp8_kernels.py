"""Triton kernels that produce FP8 activations (`fp8.py`): one program per row, the row read once.

- `quantize_rows`: bf16/fp32 row -> amax -> e4m3 row + fp32 scale;
- `silu_mul_quant`: the SwiGLU gate x1 * silu(x2) computed in fp32 and quantized in the same pass,
  so the gated activation never goes to memory in bf16.

The math is `fp8.quantize_rows_ref`'s (fp32, amax floored, scale = amax / 448, clamp, round to
nearest). A row of up to 16k elements fits one program; wider rows take the torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_format import AMAX_MIN, FP8, FP8_MAX, quantize_rows_ref

MAX_BLOCK = 16384


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, AMAX_FLOOR: tl.constexpr,
                       QMAX: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(x), axis=0), AMAX_FLOOR) / QMAX
    q = tl.clamp(x / s, -QMAX, QMAX)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, s)


@triton.jit
def _silu_mul_quant_kernel(x_ptr, q_ptr, s_ptr, I, stride_x, stride_q, AMAX_FLOOR: tl.constexpr,
                           QMAX: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < I
    x1 = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + row * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    h = x1 * (x2 / (1.0 + tl.exp(-x2)))
    s = tl.maximum(tl.max(tl.abs(h), axis=0), AMAX_FLOOR) / QMAX
    q = tl.clamp(h / s, -QMAX, QMAX)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, s)


def _launch(kernel, x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    m = x.shape[0]
    q = torch.empty(m, width, dtype=FP8, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(width)
        kernel[(m,)](x, q, s, width, x.stride(0), q.stride(0), AMAX_FLOOR=AMAX_MIN, QMAX=FP8_MAX, BLOCK=block,
                     num_warps=min(16, max(1, block // 512)))
    return q, s


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (contiguous) -> (q [M, K] e4m3, s [M, 1] fp32)."""
    if x.shape[1] > MAX_BLOCK:
        return quantize_rows_ref(x)
    return _launch(_quant_rows_kernel, x, x.shape[1])


def silu_mul_quant(x12: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x12 [M, 2I] ([x1 | x2]) -> quantized x1 * silu(x2): (q [M, I] e4m3, s [M, 1] fp32)."""
    inter = x12.shape[1] // 2
    if inter > MAX_BLOCK:
        x1, x2 = x12.chunk(2, dim=-1)
        return quantize_rows_ref(x1 * torch.nn.functional.silu(x2))
    return _launch(_silu_mul_quant_kernel, x12, inter)
