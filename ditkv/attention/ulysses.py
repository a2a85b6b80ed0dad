"""Strict Ulysses sequence parallel around any `attn(layer, q, k, v)` callback.

Each of the `sp` ranks holds a contiguous shard of the packed query tokens (the packed sequence
padded to a multiple of sp). Before attention one all-to-all over heads gives every rank the
whole sequence for 1/sp of the heads (query heads and KV heads split alike, so GQA groups stay
on one rank); the padding is dropped, the inner callback runs exactly as on one rank (paged:
writes and reads the rank-local KV heads in the rank's own pool), the padding is restored, and
a second all-to-all returns the rank's token shard with all heads.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _a2a(t: torch.Tensor, group) -> torch.Tensor:
    t = t.contiguous()  # first: empty_like keeps a transposed input's strides
    out = torch.empty_like(t)
    dist.all_to_all_single(out, t, group=group)
    return out


class UlyssesAttention:
    def __init__(self, inner, group, sp: int, num_tokens: int):
        self.inner, self.group, self.sp = inner, group, sp
        self.num_tokens = num_tokens  # real packed tokens; the rest up to shard * sp is padding

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        sp, n = self.sp, q.shape[0]  # n = this rank's shard length
        hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
        hq_l, hkv_l = hq // sp, hkv // sp
        # [n, sp, heads/sp, D] per tensor -> one buffer whose chunk j (dim 0) goes to rank j
        qkv = torch.cat([q.reshape(n, sp, hq_l, d), k.reshape(n, sp, hkv_l, d),
                         v.reshape(n, sp, hkv_l, d)], dim=2).transpose(0, 1)
        full = _a2a(qkv, self.group).reshape(sp * n, hq_l + 2 * hkv_l, d)[: self.num_tokens]
        qf, kf, vf = full.split([hq_l, hkv_l, hkv_l], dim=1)
        o = self.inner(layer, qf.contiguous(), kf.contiguous(), vf.contiguous())  # [N, hq_l, D]
        if o.shape[0] < sp * n:
            o = torch.cat([o, o.new_zeros(sp * n - o.shape[0], hq_l, d)])
        back = _a2a(o.reshape(sp, n, hq_l, d), self.group)  # chunk i: my tokens, head chunk i
        return back.transpose(0, 1).reshape(n, hq, d)
