"""FP8 W8A8 arithmetic (e4m3): per-output-channel weight scales, dynamic per-token activation scales.

    y[i, j] = sum_k (q_x[i, k] * s_x[i]) * (q_w[j, k] * s_w[j]),   q = rne_e4m3(v / s),  s = amax(|row|) / 448

Both operands are quantized row by row (a weight's rows are its output channels, an activation's
rows its tokens), with one formula (`quantize_rows`): fp32 math, the amax floored so an all-zero row
gives q = 0 instead of a division by zero.

- CUDA: the activation is quantized in one Triton pass that reads it once (`fp8_kernels.py`; the
  SwiGLU gate is fused into that pass where it produces the activation), then `torch._scaled_mm`
  (projections) or `torch._scaled_grouped_mm` (routed experts) with fp32 accumulation and rowwise
  scales. No host sync, so a CUDA graph can capture it.
- CPU: the reference. The same quantization in torch, both operands dequantized back to fp32, then a
  plain fp32 matmul (one product per row, `invariant.cpu_rows`). The GPU path is tested
  against it; a weight-only simulation would hide the activation error.
- Fast accumulation (`set_fast_accum`, on by default): the GEMMs' `use_fast_accum`, which on Hopper
  keeps the FP8 tensor-core partial sums in a reduced-precision accumulator instead of promoting them
  to fp32 every few k-steps: 5-11 % faster GEMMs for more error (measured in docs/quantization.md).
  On by default because that is how vLLM (vllm-omni's engine) runs FP8 on Hopper: its CUTLASS
  scaled_mm uses the FP8FastAccum schedules and Triton's sm90 FP8 dot accumulates the same way by
  default. `fp8_fast_accum: false` turns it off (process-wide, like `fused.FUSE`).
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..config import FP8_GROUPED_GEMMS
from .fp8_format import AMAX_MIN, FP8, FP8_MAX, quantize_rows_ref  # noqa: F401 - re-exported

log = logging.getLogger(__name__)
METHODS = ("fp8",)
FAST_ACCUM = {"on": True}
# The routed experts' grouped FP8 GEMM: torch's `_scaled_grouped_mm` or quack's varlen GEMM with the row
# gather in its loads (`fp8_quack.py`, 1.2-1.35x faster on the H200). 'auto': quack where it can run
# (sm90, quack-kernels importable, fast accumulation on), else torch. Process-wide, like FAST_ACCUM.
GROUPED = {"impl": "auto"}
# Products of at most this many token rows (AR decode) run the Triton GEMV (`fp8_gemv.py`), the routed
# experts without the sort by expert; 0: off (A/B: `ditkv bench ar --fp8-gemv-rows`). Process-wide.
GEMV = {"rows": 2}


class QuantizedTokens(NamedTuple):
    """Tokens already quantized for an FP8 projection (`q` [N, K] e4m3, `scale` [N, 1] fp32), and the
    dtype its output takes: what a fused producer (`fp8_kernels.add_rms_norm_quant`) hands the
    projections that accept it (QKV, SwiGLU) instead of bf16 tokens they would quantize again."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    def matmul(self, linear) -> torch.Tensor:
        """These tokens through an FP8 linear (its e4m3 `weight` and per-row `weight_scale`)."""
        return scaled_mm(self.q, self.scale, linear.weight, linear.weight_scale, self.dtype)


def set_gemv_rows(n: int) -> None:
    """Up to `n` token rows, FP8 products on CUDA run the GEMV pass (`fp8_gemv.py`); 0 turns it off."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"fp8 GEMV rows must be an integer >= 0, got {n!r}")
    GEMV["rows"] = n


def gemv_applies(q: torch.Tensor) -> bool:
    """Whether a product over q's rows (tokens) runs the GEMV pass: CUDA, Triton, at most GEMV rows."""
    return q.is_cuda and 0 < q.shape[0] <= GEMV["rows"] and _triton_importable()


def set_fast_accum(on: bool) -> None:
    """Turn `use_fast_accum` of the CUDA FP8 GEMMs on or off (process-wide; the CPU reference is
    unaffected). On by default, as vLLM runs FP8 on Hopper; it trades accuracy for speed (module docstring)."""
    FAST_ACCUM["on"] = bool(on)


def set_grouped_gemm(impl: str | None) -> None:
    """Which kernel runs the routed experts' FP8 GEMMs: 'auto' (None), 'torch' or 'quack'."""
    impl = impl or "auto"
    if impl not in FP8_GROUPED_GEMMS:
        raise ValueError(f"fp8_grouped_gemm must be one of {', '.join(FP8_GROUPED_GEMMS)}, got {impl!r}")
    GROUPED["impl"] = impl


def grouped_gemm_impl(device: torch.device | str) -> str:
    """The kernel the routed experts' FP8 GEMMs take on `device` now: 'quack' or 'torch'. An explicit
    'quack' that cannot run is a BackendError naming why (and the extra), never a silent switch."""
    return _grouped_impl(str(device), GROUPED["impl"], FAST_ACCUM["on"])


@functools.lru_cache(maxsize=None)
def _grouped_impl(device: str, impl: str, fast_accum: bool) -> str:
    if impl == "torch" or torch.device(device).type != "cuda":
        return "torch"
    from . import fp8_quack

    why = fp8_quack.unusable(device)
    if why is None and not fast_accum:
        why = ("quack's grouped FP8 GEMM runs with fast accumulation only "
               "(fp8_fast_accum: false asks for fp32 promotion)")
    if why is None:
        return "quack"
    if impl == "quack":
        from ..errors import BackendError

        raise BackendError(f"fp8_grouped_gemm='quack': {why}; use fp8_grouped_gemm='torch' or 'auto'")
    # auto: said once per device (cached); loud where quack is installed but does not load
    (log.warning if "failed to load" in why else log.info)("routed FP8 expert GEMMs on %s: torch (%s)", device, why)
    return "torch"


def is_fp8(t: torch.Tensor | None) -> bool:
    return t is not None and t.dtype == FP8


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [..., K] e4m3, scale [..., 1] fp32) with x ~ q * scale, one scale per row (last dim)."""
    if x.is_cuda and _triton_ok(x):
        from . import fp8_kernels

        return fp8_kernels.quantize_rows(x)
    return quantize_rows_ref(x)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear weight [out, in] (or stacked [E, out, in]) -> (e4m3 weight, fp32 scale [out] / [E, out])."""
    q, s = quantize_rows_ref(w)
    return q, s.squeeze(-1)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 q * scale, a per-row scale [rows] broadcast over the last dim."""
    return q.float() * scale.float().unsqueeze(-1)


def reference_linear(x: torch.Tensor, w8: torch.Tensor, ws: torch.Tensor, matmul=F.linear) -> torch.Tensor:
    """CPU reference of `linear` on x [..., K]: quantize and dequantize the tokens exactly as the GPU
    path quantizes them, dequantize the weight, fp32 `matmul(x, weight)`; result in x's dtype."""
    q, s = quantize_rows_ref(x)
    return matmul(q.float() * s, dequantize(w8, ws)).to(x.dtype)


def linear(x: torch.Tensor, w8: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ dequant(w8 [N, K], ws [N]).T on CUDA: quantize the tokens, `torch._scaled_mm`."""
    lead, k = x.shape[:-1], x.shape[-1]
    q, s = quantize_rows(x.reshape(-1, k))
    return scaled_mm(q, s, w8, ws, x.dtype).view(*lead, w8.shape[0])


def scaled_mm(q: torch.Tensor, s: torch.Tensor, w8: torch.Tensor, ws: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """Pre-quantized tokens (q [M, K], s [M, 1]) times the weight: rowwise-scaled FP8 GEMM."""
    if q.shape[0] == 0:  # a shape test, not a sync
        return torch.empty(0, w8.shape[0], dtype=out_dtype, device=q.device)
    if gemv_applies(q):
        from . import fp8_gemv

        return fp8_gemv.gemv(q, s, w8, ws, out_dtype)
    return torch._scaled_mm(q, w8.t(), scale_a=s, scale_b=ws.view(1, -1), out_dtype=out_dtype,
                            use_fast_accum=FAST_ACCUM["on"])


def scaled_grouped_mm(q: torch.Tensor, s: torch.Tensor, ends: torch.Tensor, w8: torch.Tensor,
                      ws: torch.Tensor, out_dtype: torch.dtype, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Rows [ends[e-1], ends[e]) of q [M, K] times expert e's weight (w8 [E, N, K], ws [E, N]),
    for every e: one rowwise-scaled grouped FP8 GEMM (`ends` int32 on the device). With `rows`, slot i
    is row rows[i] of (q, s): quack gathers it in the kernel, torch's path gathers first."""
    if grouped_gemm_impl(q.device) == "quack":
        from . import fp8_quack

        return fp8_quack.grouped_mm(q, s, ends, w8, ws, out_dtype, rows)
    if rows is not None:
        q, s = q.index_select(0, rows), s.index_select(0, rows)
    return torch._scaled_grouped_mm(q, w8.transpose(1, 2), s.view(-1), ws, offs=ends, out_dtype=out_dtype,
                                    use_fast_accum=FAST_ACCUM["on"])


def silu_mul_quant(x12: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The SwiGLU gate x1 * silu(x2) of x12 [M, 2I], quantized per row: (q [M, I], s [M, 1]).
    CUDA: one Triton pass (gate and quantization fused); elsewhere the torch ops."""
    if x12.is_cuda and _triton_ok(x12):
        from . import fp8_kernels

        return fp8_kernels.silu_mul_quant(x12)
    x1, x2 = x12.chunk(2, dim=-1)
    return quantize_rows_ref(x1 * F.silu(x2))


@functools.lru_cache(maxsize=None)
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _triton_ok(x: torch.Tensor) -> bool:
    return _triton_importable() and x.is_contiguous() and x.dim() == 2


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def unusable(device: torch.device) -> str | None:
    """Why FP8 W8A8 cannot run on `device`, or None. CPU: the reference path always runs."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    if torch.version.hip:
        return "FP8 W8A8 runs on NVIDIA GPUs (sm89+) here; ROCm is not supported"
    cap = _capability(torch.cuda.current_device() if device.index is None else device.index)
    if cap < (8, 9):
        return f"FP8 GEMMs need compute capability >= 8.9 (Ada, Hopper, Blackwell); this GPU is sm{cap[0]}{cap[1]}"
    if not _triton_importable():
        return "quantization=fp8 on CUDA needs triton for the activation quantization (pip install 'ditkv[triton]')"
    return None


def grouped_fused(device: torch.device) -> bool:
    """Whether `torch._scaled_grouped_mm` runs here without a host sync: CUDA sm90 / sm100."""
    device = torch.device(device)
    if device.type != "cuda" or torch.version.hip or not hasattr(torch, "_scaled_grouped_mm"):
        return False
    return _capability(torch.cuda.current_device() if device.index is None else device.index)[0] in (9, 10)
