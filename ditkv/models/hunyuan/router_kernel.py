"""The MoE router for a few tokens (AR decode) as one Triton pass, on CUDA.

`Router.forward` is seven kernels at decode (the fp32 casts of the tokens and of the gate weight, the
gate GEMV, softmax, top-k, the sum and the division), each a launch for 64 numbers per token. Here one
program per token reads its row and the gate weight (bf16, converted in registers), and writes the
top-k ids and renormalised weights:

    logits = x . wg (fp32),  p = softmax(logits),  top-k of p (largest first; a tie to the lower id),
    weights = p_topk / max(sum(p_topk), 1e-20)

The same arithmetic as `Router.forward` except the order of the fp32 sums (the logit's over the hidden
size, the softmax's), so a weight can differ in its last bits and an exact tie between two experts'
probabilities can go another way. It runs where the FP8 GEMV pass does (`fp8.gemv_applies`: a few
token rows on CUDA), so `fp8.set_gemv_rows(0)` turns both off.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 128


@triton.jit
def _route_kernel(x_ptr, w_ptr, weights_ptr, ids_ptr, K, stride_x, stride_w,
                  E: tl.constexpr, TOPK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    k0 = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_E], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        kk = k + k0
        k_ok = kk < K
        x = tl.load(x_ptr + t * stride_x + kk, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + e[:, None] * stride_w + kk[None, :], mask=e_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    logits = tl.where(e_ok, acc, float("-inf"))
    p = tl.exp(logits - tl.max(logits, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(e_ok, p, -1.0)
    total = 0.0
    for j in tl.static_range(TOPK):  # the largest left, a tie to the lower id
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, e, BLOCK_E), axis=0)
        tl.store(ids_ptr + t * TOPK + j, idx.to(tl.int64))
        tl.store(weights_ptr + t * TOPK + j, best)
        total += best
        p = tl.where(e == idx, -1.0, p)
    total = tl.maximum(total, 1e-20)
    for j in tl.static_range(TOPK):
        tl.store(weights_ptr + t * TOPK + j, tl.load(weights_ptr + t * TOPK + j) / total)


def route(x: torch.Tensor, wg: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, K], the gate weight wg [E, K] -> (weights [N, topk] fp32, ids [N, topk] int64)."""
    n, k = x.shape
    e = wg.shape[0]
    if topk > e or x.stride(-1) != 1 or wg.stride(-1) != 1:
        raise ValueError(f"route: topk {topk} of {e} experts, rows contiguous along the hidden size")
    weights = torch.empty(n, topk, dtype=torch.float32, device=x.device)
    ids = torch.empty(n, topk, dtype=torch.int64, device=x.device)
    if n:
        _route_kernel[(n,)](x, wg, weights, ids, k, x.stride(0), wg.stride(0), E=e, TOPK=topk,
                            BLOCK_E=triton.next_power_of_2(e), BLOCK_K=BLOCK_K, num_warps=4)
    return weights, ids
