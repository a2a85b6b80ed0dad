"""The MoE combine on CUDA as one Triton pass: token t's output is the sum over its k routing
choices j of w[t, j] * y[inv[t*k + j]], in fp32, where y holds the expert outputs in expert order
(the grouped GEMM's) and inv maps a slot to its row there.

Reading y through `inv` replaces two passes over the k*N expert outputs (the un-permuting gather,
then the weighted sum) with one, and the reduction over k runs in registers: the torch.compile'd
weighted sum took ~1 ms per release layer (8194 tokens x 8 choices x 4096), this ~0.15 ms.
The k terms are summed in choice order, like `layers.combine_slots`. The FP8 decoder layer
(`fp8_layer.py`) also hands it the shared expert's output and the residual stream: both are added in
fp32 in the same pass (routed, then + shared, then + residual, the unfused order, rounded once at the
end instead of after each add), so neither the MoE output nor its sum with the shared expert goes to
memory on its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_H = 1024


@triton.jit
def _combine_kernel(w_ptr, y_ptr, inv_ptr, out_ptr, shared_ptr, res_ptr, H, stride_y, stride_out,
                    K: tl.constexpr, HAS_INV: tl.constexpr, HAS_SHARED: tl.constexpr, HAS_RES: tl.constexpr,
                    BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(K):
        row = t * K + j
        if HAS_INV:
            row = tl.load(inv_ptr + t * K + j).to(tl.int64)
        w = tl.load(w_ptr + t * K + j)
        y = tl.load(y_ptr + row * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
        acc += y * w
    if HAS_SHARED:  # [N, H] contiguous, like out
        acc += tl.load(shared_ptr + t * stride_out + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        acc += tl.load(res_ptr + t * stride_out + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def combine_gathered(weights: torch.Tensor, y: torch.Tensor, inv: torch.Tensor | None, dtype: torch.dtype,
                     shared: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """weights [N, k] fp32, y [N*k, H] (expert order), inv [N*k] -> [N, H] in `dtype` (inv None: y is in
    slot order, the decode GEMV's); `shared` and `residual` ([N, H], contiguous) are added to every
    token's sum when given."""
    n, k = weights.shape
    h = y.shape[1]
    out = torch.empty(n, h, dtype=dtype, device=y.device)
    for extra in (shared, residual):
        if extra is not None and (extra.shape != out.shape or not extra.is_contiguous()):
            raise ValueError(f"combine addends must be contiguous {tuple(out.shape)}, got {tuple(extra.shape)}")
    if n:
        _combine_kernel[(n, triton.cdiv(h, BLOCK_H))](
            weights.contiguous(), y, y if inv is None else inv, out, out if shared is None else shared,
            out if residual is None else residual, h, y.stride(0), out.stride(0), K=k, HAS_INV=inv is not None,
            HAS_SHARED=shared is not None, HAS_RES=residual is not None,
            BLOCK=BLOCK_H, num_warps=4)
    return out
