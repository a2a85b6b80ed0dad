"""The fused QKV projection and its two row layouts.

Release checkpoints group the rows of `qkv_proj.weight` per KV head:
    for each KV head g: [q heads of group g (num_kv_groups * D rows), K_g (D rows), V_g (D rows)]
At run time we want all-Q / all-K / all-V ("split" layout) so one matmul output can be
sliced into contiguous q, k, v. `QKVProjection` stores the split layout and converts in
`state_dict()` / `load_state_dict()`, so checkpoints always carry the release layout.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import fp8
from .invariant import linear


def grouped_to_split(w: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Release grouped rows -> [all Q; all K; all V] rows (any trailing dims kept)."""
    groups = num_heads // num_kv_heads
    g = w.reshape(num_kv_heads, groups + 2, head_dim, *w.shape[1:])
    q = g[:, :groups].reshape(num_heads * head_dim, *w.shape[1:])
    k = g[:, groups].reshape(num_kv_heads * head_dim, *w.shape[1:])
    v = g[:, groups + 1].reshape(num_kv_heads * head_dim, *w.shape[1:])
    return torch.cat([q, k, v], dim=0)


def split_to_grouped(w: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Inverse of `grouped_to_split`."""
    groups = num_heads // num_kv_heads
    rest = w.shape[1:]
    q, k, v = w.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=0)
    q = q.reshape(num_kv_heads, groups, head_dim, *rest)
    k = k.reshape(num_kv_heads, 1, head_dim, *rest)
    v = v.reshape(num_kv_heads, 1, head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(w.shape)


class QKVProjection(nn.Module):
    """Bias-free fused projection hidden -> (Hq + 2*Hkv) * D, stored in split layout."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        rows = (num_heads + 2 * num_kv_heads) * head_dim
        self.weight = nn.Parameter(torch.empty(rows, hidden))

    def forward(self, x: torch.Tensor | fp8.QuantizedTokens) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, hidden] (or those tokens already quantized, for FP8 weights) -> q [N, Hq, D], k [N, Hkv, D],
        v [N, Hkv, D]."""
        if isinstance(x, fp8.QuantizedTokens):
            return self.split(x.matmul(self))
        # batch-invariant mode: fixed-tiling kernel; quantized (FP8): W8A8 with the per-row weight_scale
        return self.split(linear(x, self.weight, scale=self._parameters.get("weight_scale")))

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projection's output [N, (Hq + 2*Hkv) * D] -> q, k, v views."""
        n, d = qkv.shape[0], self.head_dim
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        return q.view(n, self.num_heads, d), k.view(n, self.num_kv_heads, d), v.view(n, self.num_kv_heads, d)

    # Checkpoint I/O always speaks the release grouped layout (an FP8 weight's per-row scale too).
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name, p in self._parameters.items():
            t = p if keep_vars else p.detach()
            destination[prefix + name] = split_to_grouped(t, self.num_heads, self.num_kv_heads,
                                                          self.head_dim).contiguous()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        for name, p in self._parameters.items():
            key = prefix + name
            w = state_dict.get(key)
            if w is not None and tuple(w.shape) == tuple(p.shape):
                state_dict[key] = grouped_to_split(w, self.num_heads, self.num_kv_heads, self.head_dim).contiguous()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
