"""Triton kernels that produce FP8 activations (`fp8.py`): one program per row, the row read once.

- `quantize_rows`: bf16/fp32 row -> amax -> e4m3 row + fp32 scale;
- `silu_mul_quant`: the SwiGLU gate x1 * silu(x2) computed in fp32 and quantized in the same pass,
  so the gated activation never goes to memory in bf16;
- `add_rms_norm_quant`: the residual add, the RMSNorm and the next projection's quantization in one
  pass (the FP8 decoder layer, `models/hunyuan/fp8_layer.py`). It rounds where the unfused ops round
  (the sum and the norm's output to the model dtype), so it quantizes the same values they would.

The math is `fp8.quantize_rows_ref`'s (fp32, amax floored, scale = amax / 448, clamp, round to
nearest). The scale is divided with IEEE rounding (`tl.div_rn`, once per row), so it is the
reference's bit for bit; the elements use Triton's plain `/` (the approximate PTX division), which puts
a value on the other side of an e4m3 rounding boundary now and then (codes one step off, under 1 % of
them: bf16 inputs land on e4m3 ties now and then): an IEEE division per element made the SwiGLU
quantizer 1.6x slower (307 -> 485 us per release layer, H200, 2026-12-02). A row of up to 16k
elements fits one program; wider rows take the torch ops.
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
    s = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), AMAX_FLOOR), QMAX)
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
    s = tl.div_rn(tl.maximum(tl.max(tl.abs(h), axis=0), AMAX_FLOOR), QMAX)
    q = tl.clamp(h / s, -QMAX, QMAX)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, s)


@triton.jit
def _add_rms_norm_quant_kernel(h_ptr, d_ptr, w_ptr, hout_ptr, y_ptr, q_ptr, s_ptr, K, eps,
                               HAS_DELTA: tl.constexpr, WRITE_Y: tl.constexpr, AMAX_FLOOR: tl.constexpr,
                               QMAX: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(h_ptr + row * K + offs, mask=mask, other=0.0)
    if HAS_DELTA:  # h + delta in the model dtype, as the residual add rounds it
        x = (x.to(tl.float32) + tl.load(d_ptr + row * K + offs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(hout_ptr + row * K + offs, x, mask=mask)
    xf = x.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / K + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = ((xf * r).to(x.dtype).to(tl.float32) * w).to(x.dtype)  # weight * normed.to(dtype), like RMSNorm
    if WRITE_Y:
        tl.store(y_ptr + row * K + offs, y, mask=mask)
    yf = y.to(tl.float32)
    s = tl.div_rn(tl.maximum(tl.max(tl.abs(yf), axis=0), AMAX_FLOOR), QMAX)
    q = tl.clamp(yf / s, -QMAX, QMAX)
    tl.store(q_ptr + row * K + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, s)


def add_rms_norm_quant(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                       write_y: bool = True):
    """h, delta [M, K] contiguous (delta may be None) -> (h + delta, y = RMSNorm(h + delta) * weight,
    q [M, K] e4m3, s [M, 1] fp32) with y ~ q * s; without delta the first is h itself, and with
    write_y=False y is None (a caller that only feeds the quantized projection)."""
    m, k = h.shape
    hout = torch.empty_like(h) if delta is not None else h
    y = torch.empty_like(h) if write_y else None
    q = torch.empty(m, k, dtype=FP8, device=h.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=h.device)
    if m:
        block = triton.next_power_of_2(k)
        _add_rms_norm_quant_kernel[(m,)](h, h if delta is None else delta, weight, hout, h if y is None else y, q, s,
                                         k, eps, HAS_DELTA=delta is not None, WRITE_Y=write_y, AMAX_FLOOR=AMAX_MIN,
                                         QMAX=FP8_MAX, BLOCK=block, num_warps=min(16, max(1, block // 512)))
    return hout, y, q, s


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
