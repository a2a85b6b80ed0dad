"""A paged backend that serves the plain (denoise) calls with its own kernel and the rest with Triton.

cuDNN and flash-attn-4 both run plain attention over a row's keys through the page table; the
prefill phase's mixed causal/full mask, AR calls and rows with unequal query counts go to the Triton
per-query-limit kernel by design (not a fallback: what each serves is documented and counted), and K/V
writes always use the Triton scatter kernel. `last_path` says which kernel served the last call and
`calls` counts each.
"""

from __future__ import annotations

import torch

from .metadata import PagedAttentionMetadata


def plain_rows(meta: PagedAttentionMetadata) -> bool:
    """True when every query of every row sees all `kv_len` keys of its row (host-side check).

    That holds when the row's query span lies inside one full-attention span that ends at
    `kv_len` (the denoise phase). Equal query counts are also required (one dense Q view)."""
    q_len = meta.rows[0].q_len
    for i, r in enumerate(meta.rows):
        if r.q_len != q_len or r.q_len == 0 or r.q_offset != i * q_len:
            return False
        lo, hi = r.q_start, r.q_start + r.q_len
        if not any(a <= lo and hi <= b == r.kv_len for a, b in r.spans):
            return False
    return True


class PlainRowsSplit:
    """Base of such a backend: subclasses set `name` and implement `plain(q, kv_layer, meta, scale)`;
    `extra(...)` may claim further calls (returns None to decline)."""

    supports_paged = True
    paged_mode = "limits"  # one call per layer, like TritonBackend
    graph_safe = True

    def __init__(self, min_q_len: int = 1):
        """`min_q_len`: plain calls with fewer queries per row go to Triton too (`auto` passes the
        measured crossover; an explicit choice takes every plain call)."""
        from .triton_backend import TritonBackend
        self._triton = TritonBackend()
        self.min_q_len = min_q_len
        self.last_path = ""
        self.calls = {self.name: 0, "triton": 0}

    def write_kv(self, kv_layer, k, v, slot_mapping):
        self._triton.write_kv(kv_layer, k, v, slot_mapping)

    def paged_attention(self, q, kv_layer, meta: PagedAttentionMetadata, scale: float):
        half = q.dtype in (torch.bfloat16, torch.float16) and kv_layer.dtype == q.dtype
        if half and meta.rows[0].q_len >= self.min_q_len and plain_rows(meta):
            self._count(self.name)
            return self.plain(q, kv_layer, meta, scale)
        out = self.extra(q, kv_layer, meta, scale) if half else None
        if out is not None:
            return out
        self._count("triton")  # mixed mask (prefill), AR, unequal query counts, fp32: by design
        return self._triton.paged_attention(q, kv_layer, meta, scale)

    def _count(self, path: str, counter: str | None = None) -> None:
        self.last_path = path
        self.calls[counter or path] += 1

    def plain(self, q, kv_layer, meta: PagedAttentionMetadata, scale: float) -> torch.Tensor:
        raise NotImplementedError

    def extra(self, q, kv_layer, meta: PagedAttentionMetadata, scale: float) -> torch.Tensor | None:
        return None
