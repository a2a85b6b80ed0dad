"""The MoE router for a few tokens (AR decode) as one Triton pass, on CUDA.

`Router.forward` is seven kernels at decode (the fp32 casts of the tokens and of the gate weight, the
gate GEMV, softmax, top-k, the sum and the division), each a launch for 64 numbers per token. Here two:
the logits (programs of BLOCK_E experts per token read the token's row and their gate rows, bf16
converted in registers: one program for all 64 would read the 512 KB gate alone, ~65 us on an H100),
then one program per token for the softmax, the top-k ids and the renormalised weights:

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

TILE = {"block_e": 2, "block_k": 1024, "num_warps": 4}  # the logits pass; tools/gpu_gemv_tune.py: best on an H100


@triton.jit
def _logits_kernel(x_ptr, w_ptr, logits_ptr, E, K, stride_x, stride_w,
                   BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < E
    k0 = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_E, BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        kk = k + k0
        k_ok = kk < K
        x = tl.load(x_ptr + t * stride_x + kk, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + e[:, None] * stride_w + kk[None, :], mask=e_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        acc += w * x[None, :]
    tl.store(logits_ptr + t * E + e, tl.sum(acc, axis=1), mask=e_ok)


@triton.jit
def _topk_kernel(logits_ptr, weights_ptr, ids_ptr, E: tl.constexpr, TOPK: tl.constexpr, BLOCK_E: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    logits = tl.load(logits_ptr + t * E + e, mask=e_ok, other=float("-inf"))
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


def route(x: torch.Tensor, wg: torch.Tensor, topk: int, tile: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, K], the gate weight wg [E, K] -> (weights [N, topk] fp32, ids [N, topk] int64)."""
    n, k = x.shape
    e = wg.shape[0]
    if topk > e or x.stride(-1) != 1 or wg.stride(-1) != 1:
        raise ValueError(f"route: topk {topk} of {e} experts, rows contiguous along the hidden size")
    weights = torch.empty(n, topk, dtype=torch.float32, device=x.device)
    ids = torch.empty(n, topk, dtype=torch.int64, device=x.device)
    if n:
        t = TILE if tile is None else tile
        logits = torch.empty(n, e, dtype=torch.float32, device=x.device)
        _logits_kernel[(n, triton.cdiv(e, t["block_e"]))](x, wg, logits, e, k, x.stride(0), wg.stride(0),
                                                           BLOCK_E=t["block_e"], BLOCK_K=t["block_k"],
                                                           num_warps=t["num_warps"])
        _topk_kernel[(n,)](logits, weights, ids, E=e, TOPK=topk, BLOCK_E=triton.next_power_of_2(e), num_warps=1)
    return weights, ids
