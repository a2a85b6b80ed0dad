"""Attention adapter: one K/V write per layer, then backend calls, output in caller order.

The adapter is what the model's `attn(layer, q, k, v)` callback resolves to in paged mode. It
owns no capacity: the worker hands it the phase metadata and the page pool.
"""

from __future__ import annotations

import torch

from .metadata import PagedAttentionMetadata
from .planner import plan, plan_row
from .torch_backend import segment_attention


class PagedAttentionAdapter:
    def __init__(self, backend, pool, meta: PagedAttentionMetadata, scale: float):
        if not backend.supports_paged:  # defensive: select_backend already refuses this
            raise RuntimeError(f"backend {backend.name} has no paged support")
        self.backend, self.pool, self.meta, self.scale = backend, pool, meta, scale

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kv_layer = self.pool.layer(layer)
        check_shapes(q, k, v, kv_layer, self.meta.num_tokens)
        # The write span equals the query span in both phases: write once, before any read.
        self.backend.write_kv(kv_layer, k, v, self.meta.slot_mapping)
        if self.backend.paged_mode == "limits":
            return self.backend.paged_attention(q, kv_layer, self.meta, self.scale)
        return run_segments(self.backend, q, kv_layer, self.meta, self.scale)


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, n: int) -> None:
    """Before any write: a K/V of the wrong length would broadcast into every slot of the row."""
    hkv, d = kv_layer.shape[2], kv_layer.shape[-1]
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != (n, hkv, d):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, the phase writes {(n, hkv, d)} "
                             "([tokens, kv_heads, head_dim] of the metadata and the pool)")
    if q.dim() != 3 or q.shape[0] != n or q.shape[2] != d:
        raise ValueError(f"q has shape {tuple(q.shape)}, the phase queries [{n}, heads, {d}]")
    if q.shape[1] % hkv:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {hkv} KV heads (GQA groups)")


def run_segments(backend, q: torch.Tensor, kv_layer: torch.Tensor, meta: PagedAttentionMetadata,
                 scale: float) -> torch.Tensor:
    """Drive a causal-or-not backend through the planner; returns `[Nq, Hq, D]` in packed order."""
    out = torch.empty_like(q)
    if meta.homogeneous:
        r0, n = meta.rows[0], meta.num_rows
        segs = plan_row(r0)
        ks, vs = zip(*(backend.gather_row(kv_layer, meta, r) for r in range(n)))
        k, v = torch.stack(ks).to(q.dtype), torch.stack(vs).to(q.dtype)
        qb, ob = q.view(n, r0.q_len, *q.shape[1:]), out.view(n, r0.q_len, *q.shape[1:])
        for s in segs:  # contiguous views in, direct writes out: no scatter
            lo, hi = s.q_lo - r0.q_start, s.q_hi - r0.q_start
            ob[:, lo:hi] = segment_attention(qb[:, lo:hi], k[:, : s.kv_len], v[:, : s.kv_len], s.causal, scale)
        return out
    for r, (row, segs) in enumerate(zip(meta.rows, plan(meta.rows))):
        k, v = backend.gather_row(kv_layer, meta, r)
        k, v = k.to(q.dtype)[None], v.to(q.dtype)[None]
        for s in segs:  # heterogeneous rows: gather the segment's tokens, scatter results back
            idx = torch.arange(s.q_lo - row.q_start, s.q_hi - row.q_start, device=q.device) + row.q_offset
            res = segment_attention(q.index_select(0, idx)[None], k[:, : s.kv_len], v[:, : s.kv_len], s.causal, scale)
            out.index_copy_(0, idx, res[0])
    return out
