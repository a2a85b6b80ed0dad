"""Dense legacy KV: a model-owned contiguous cache per request, the baseline for the paged path.

Same mask semantics as the paged path (per-query key limits), different KV representation:
`[rows, seq_len, Hkv, D]` per layer, allocated for the whole request. It never receives paged
metadata.
"""

from __future__ import annotations

import torch

from ..attention.metadata import RowPhase, key_limits
from ..attention.planner import plan_row
from ..attention.torch_backend import fast_segment_attention, limit_attention


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
    """`attn(layer, q, k, v)` callback over a `DenseKVCache` for one phase (rows share the phase).

    `segments=False`: one masked SDPA with per-query key limits (the torch backend's math, so dense
    and paged torch runs agree bit for bit). `segments=True`: the mask split into causal and full
    segments (`plan_row`), each on SDPA's fused kernels: the fastest dense attention for this mask,
    the fair baseline for the paged path on a GPU. `fa4=True` (with `segments`, CUDA sm90/sm100 and
    the `ditkv[fa4]` extra, else a BackendError): each segment on flash-attn-4's dense forward instead of
    SDPA, the baseline to hold against `attention_backend='fa4'`."""

    def __init__(self, cache: DenseKVCache, rows: list[RowPhase], scale: float, segments: bool = False, *,
                 fa4: bool = False):
        r0 = rows[0]
        if any((r.q_start, r.q_len, r.kv_len) != (r0.q_start, r0.q_len, r0.kv_len) for r in rows):
            raise ValueError("dense rows of one request must share their phase geometry")
        self.cache, self.rows, self.scale = cache, rows, scale
        self.lo, self.hi, self.kv_len = r0.q_start, r0.q_start + r0.q_len, r0.kv_len
        self.segments = plan_row(r0) if segments and all(r.spans == r0.spans for r in rows) else None
        self.limits = None if self.segments else \
            torch.stack([key_limits(r.q_start, r.q_len, r.spans) for r in rows]).to(cache.k[0].device)
        self.fa4 = bool(fa4)
        if self.fa4:
            from ..attention.fa4_backend import fa4_unusable
            from ..errors import BackendError

            why = fa4_unusable(cache.k[0].device)
            if why is not None or self.segments is None:
                raise BackendError(why or "DenseAttention(fa4=True) runs the mask as segments: pass segments=True "
                                          "(rows of one request with equal spans)")

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n, lq = len(self.rows), self.hi - self.lo
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        kc[:, self.lo:self.hi] = k.view(n, lq, *k.shape[1:]).to(kc.dtype)
        vc[:, self.lo:self.hi] = v.view(n, lq, *v.shape[1:]).to(vc.dtype)
        if self.segments is not None:
            qb = q.view(n, lq, *q.shape[1:])
            out = torch.empty_like(qb)
            seg_attention = _fa4_segment if self.fa4 else fast_segment_attention
            for s in self.segments:
                a, b = s.q_lo - self.lo, s.q_hi - self.lo
                out[:, a:b] = seg_attention(qb[:, a:b], kc[:, : s.kv_len].to(q.dtype),
                                            vc[:, : s.kv_len].to(q.dtype), s.causal, self.scale)
            return out.reshape(q.shape)
        out = limit_attention(q.view(n, lq, *q.shape[1:]), kc[:, : self.kv_len].to(q.dtype),
                              vc[:, : self.kv_len].to(q.dtype), self.limits, self.scale, self.lo)
        return out.reshape(q.shape)


def _fa4_segment(q, k, v, causal: bool, scale: float):
    from ..attention.fa4_backend import dense_attention

    return dense_attention(q.contiguous(), k, v, causal, scale)
