"""Batch-invariant mode (`EngineConfig.batch_invariant`): a token's result does not depend on the
other tokens of the backbone pass (step-level batching packs several requests into one).

cuBLAS and `torch._grouped_mm` choose their tiling and split-K by shape (M = the batch's tokens,
or a MoE expert's tokens), so on a GPU a request's image alone and batched differ. With the mode
on, every op of the packed pass whose arithmetic could depend on M runs a fixed-tiling Triton
kernel (`invariant_kernels.py`): the dense projections (QKV, o_proj, shared expert, the timestep /
guidance embedders that a batched CUDA graph runs over every request's rows), the fp32 router
logits, the routed experts' grouped GEMM (or the loop's per-expert GEMMs), and the RMSNorms (with
RoPE for q/k). The router's top-k renormalisation and the MoE combine are written as sums in a
fixed order. What stays as it was is row-invariant already: embeddings, RoPE tables, elementwise
ops, the router softmax (one warp per row for <= 1024 experts), top-k, sort, gathers, and the
Triton paged attention (tiles of one row only; config from head_dim, dtype, page, GQA).

The CPU path is invariant without this (every GEMM one product per row: `cpu_rows`): there the
mode changes nothing. Process-wide, like `fused.FUSE`: every process that runs a model sets it from
its config (`worker/threads.apply_process_settings`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import fp8
from ...alignment import aligned, aligned_rows
from .fused import fused

STATE = {"on": False, "cpu": False}


def set_batch_invariant(on: bool, cpu: bool = False) -> None:
    """Turn the mode on or off. `cpu=True` (tests only, under TRITON_INTERPRET=1) also routes CPU
    tensors through the kernels, to check the wiring without a GPU."""
    STATE["on"], STATE["cpu"] = bool(on), bool(on and cpu)


def active(x: torch.Tensor) -> bool:
    return STATE["on"] and (x.is_cuda or STATE["cpu"])


def unusable(device: torch.device) -> str | None:
    """Why the mode cannot run its kernels on `device`, or None (CPU: nothing to run)."""
    if torch.device(device).type != "cuda":
        return None
    try:
        import triton  # noqa: F401
    except ImportError:
        return "batch_invariant needs triton on CUDA (pip install 'ditkv[triton]')"
    return None


def _kernels():
    from . import invariant_kernels

    return invariant_kernels


# CPU GEMMs run as one matrix-vector product per row: a bmm over M = 1 matrices (the weight is a
# stride-0 view, not copied). CPU BLAS picks its kernel, and so its rounding, by shape and
# instruction set: at M = 5 a row gets other bits than at M = 400, and even inside one fixed shape
# the rows past the last full micro-kernel block take an edge kernel (MKL on AVX2 computes rows 30
# and 31 of a 32-row GEMM differently from rows 0..29; measured on a Sapphire Rapids host with the
# AVX2 paths forced). An M = 1 product has one shape for every row wherever the row sits, so a
# token's products do not depend on the call it is in: an AR prefill or decode gives the K/V of a DiT
# prefill bit for bit, a request alone or batched. Cost: ~1.4x a GEMM's time on AVX2, ~2.8x on AVX-512.
# The kernel also depends on the operands' alignment (models/alignment.py): every row of x and the
# weight reach the product 64-byte aligned (loaded weights are aligned once, at load).
def cpu_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x [..., K] on the CPU, each row by the same M = 1 product."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2, weight = aligned_rows(x.reshape(-1, k)), aligned(weight)
    n, out = x2.shape[0], weight.shape[0]
    y = torch.bmm(x2.unsqueeze(1), weight.t().unsqueeze(0).expand(n, k, out)).squeeze(1)
    if bias is not None:
        y = y + bias
    return y.view(*lead, out)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           scale: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`: through the fixed-tiling kernel when the mode is on for x's device; on the CPU
    one product per row (`cpu_rows`). An e4m3 `weight` with its per-channel `scale` runs W8A8
    (`models/fp8.py`): `torch._scaled_mm` on CUDA, the quantize-dequantize reference on the CPU."""
    if scale is not None:
        if bias is not None:
            raise ValueError("the FP8 linear is bias-free (every quantized projection of the model is)")
        if x.device.type == "cpu":
            return fp8.reference_linear(x, weight, scale, cpu_rows)
        return fp8.linear(x, weight, scale)
    if active(x):
        return _kernels().matmul(x, weight, bias)
    if x.device.type == "cpu" and x.dim() >= 2:
        return cpu_rows(x, weight, bias)
    return F.linear(x, weight, bias)


def run(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)`; a plain `nn.Linear` goes through `linear` (subclasses keep their forward), and so
    does one quantized to FP8 (its `weight_scale` beside the e4m3 weight)."""
    if type(module) is nn.Linear:
        scale = module._parameters.get("weight_scale")
        if scale is not None or active(x) or x.device.type == "cpu":
            return linear(x, module.weight, module.bias, scale)
    return module(x)


def dispatch(default, invariant):
    """`default(x, *args)`, or `invariant(x, *args)` when the mode is on for x's device."""
    def call(x: torch.Tensor, *args):
        return invariant(x, *args) if active(x) else default(x, *args)
    call.__doc__ = default.__doc__
    return call


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _kernels().rms_norm(x, weight, eps)


def rope_rms_norm(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> torch.Tensor:
    return _kernels().rms_norm(x, weight, eps, cos, sin)


def route(x: torch.Tensor, wg: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`Router.forward`: fp32 logits by the kernel (IEEE fp32 unless torch allows TF32), softmax,
    top-k, and the renormalising sum of the k weights in a fixed order."""
    probs = linear(x.float(), wg.float()).softmax(dim=-1)
    weights, experts = probs.topk(topk, dim=-1)
    total = weights[:, 0]
    for j in range(1, topk):
        total = total + weights[:, j]
    return weights / total.clamp_min(1e-20).unsqueeze(-1), experts


def _combine_slots(weights: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`layers.combine_slots` as k elementwise products summed in slot order (fp32)."""
    n, k = weights.shape
    s = slots.view(n, k, slots.shape[-1])
    acc = s[:, 0].float() * weights[:, 0:1]
    for j in range(1, k):
        acc = acc + s[:, j].float() * weights[:, j:j + 1]
    return acc.to(dtype)


combine_slots = fused(_combine_slots)  # elementwise: compiled or not, each output is one fixed expression


def grouped_swiglu(xs: torch.Tensor, ends: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   act) -> torch.Tensor:
    """`layers.grouped_swiglu` with the fixed-tiling grouped GEMM; `act` is the SwiGLU gate."""
    kern = _kernels()
    tiles = kern.grouped_tiles(ends, xs.shape[0], w13)  # the same row tiles for both projections
    x12 = kern.grouped_matmul(xs, ends, w13, tiles)
    return kern.grouped_matmul(act(x12), ends, w2, tiles)
