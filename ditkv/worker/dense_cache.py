"""Dense legacy KV: a model-owned contiguous cache per request, the baseline for the paged path.

Same mask semantics as the paged path (per-query key limits), different KV representation:
`[rows, seq_len, Hkv, D]` per layer, allocated for the whole request. It never receives paged
metadata.
"""

from __future__ import annotations

import torch

from ..attention.metadata import RowPhase, key_limits
from ..attention.torch_backend import limit_attention


class DenseKVCache:
    def __init__(self, num_layers: int, num_rows: int, seq_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device):
        shape = (num_rows, seq_len, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_rows, self.seq_len = num_rows, seq_len

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class DenseAttention:
    """`attn(layer, q, k, v)` callback over a `DenseKVCache` for one phase (rows share the phase)."""

    def __init__(self, cache: DenseKVCache, rows: list[RowPhase], scale: float):
        r0 = rows[0]
        if any((r.q_start, r.q_len, r.kv_len) != (r0.q_start, r0.q_len, r0.kv_len) for r in rows):
            raise ValueError("dense rows of one request must share their phase geometry")
        self.cache, self.rows, self.scale = cache, rows, scale
        self.lo, self.hi, self.kv_len = r0.q_start, r0.q_start + r0.q_len, r0.kv_len
        self.limits = torch.stack([key_limits(r.q_start, r.q_len, r.spans) for r in rows]).to(cache.k[0].device)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n, lq = len(self.rows), self.hi - self.lo
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        kc[:, self.lo:self.hi] = k.view(n, lq, *k.shape[1:]).to(kc.dtype)
        vc[:, self.lo:self.hi] = v.view(n, lq, *v.shape[1:]).to(vc.dtype)
        out = limit_attention(q.view(n, lq, *q.shape[1:]), kc[:, : self.kv_len].to(q.dtype),
                              vc[:, : self.kv_len].to(q.dtype), self.limits, self.scale)
        return out.reshape(q.shape)
