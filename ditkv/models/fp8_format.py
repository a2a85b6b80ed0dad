"""The e4m3 format and the one quantization formula every FP8 path uses (`fp8.py`, `fp8_kernels.py`)."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
AMAX_MIN = 1e-12  # floor of a row's amax: an all-zero row quantizes to zeros with a tiny scale


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` in torch ops: the reference (CPU) and the weight quantizer (any device)."""
    x32 = x.float()
    amax = x32.abs().amax(-1, keepdim=True).clamp_min(AMAX_MIN)
    # divide by a tensor, not the Python scalar: CUDA turns `t / 448.0` into a multiply by a rounded
    # reciprocal, so CPU and GPU scales (and a folder quantized on either) would differ in the last bit
    scale = amax / torch.full_like(amax, FP8_MAX)
    return (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
