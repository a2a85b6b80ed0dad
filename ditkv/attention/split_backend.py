"""A paged backend that serves the plain (denoise) calls with its own kernel and the rest with Triton.

cuDNN and flash-attn-4 both run plain attention over a row's keys through the page table; the
prefill phase's mixed causal/full mask, AR calls and rows with unequal query counts go to the Triton
per-query-limit kernel by design (not a fallback: what each serves is documented and counted), and K/V
writes always use the Triton scatter kernel. `last_path` says which kernel served the last call and
`calls` counts each.

A real denoise row is not one full span: its first query is the timestep token, which attends
causally (`lead_queries`). A backend with `serves_lead` (fa4) runs the plain call over every query and
then redoes those few leading queries with their own key limits; one without it (cudnn) leaves such
rows to Triton.
"""

from __future__ import annotations

import torch

from .metadata import PagedAttentionMetadata


MAX_LEAD = 4  # leading queries a backend serves one small call each (the timestep and guidance tokens)


def lead_queries(meta: PagedAttentionMetadata) -> int | None:
    """The denoise phase's shape (host-side check): n such that in every row the queries after the
    first n see all `kv_len` keys (they lie in the full-attention span that ends there) and the first
    n do not. HunyuanImage's timestep token (and a distilled model's guidance token) sits just before
    the image span and attends causally, so a real denoise row has n = 1 (2); n = 0 is a row that is
    one full span. Every row needs the same q_len and n, packed at i * q_len. None otherwise (the
    prefill's mixed mask, AR, unequal rows), or when n > MAX_LEAD."""
    q_len = meta.rows[0].q_len
    lead = None
    for i, r in enumerate(meta.rows):
        if r.q_len != q_len or r.q_len == 0 or r.q_offset != i * q_len:
            return None
        n = _row_lead(r)
        if n is None or (lead is not None and n != lead):
            return None
        lead = n
    return lead


def _row_lead(r) -> int | None:
    lo, hi = r.q_start, r.q_start + r.q_len
    for a, b in r.spans:
        if b == r.kv_len and a < hi:  # the span that ends at kv_len holds the row's last queries
            n = max(0, a - lo)
            return n if n <= MAX_LEAD and n < r.q_len else None
    return None


def plain_rows(meta: PagedAttentionMetadata) -> bool:
    """True when every query of every row sees all `kv_len` keys of its row (no leading queries)."""
    return lead_queries(meta) == 0


class PlainRowsSplit:
    """Base of such a backend: subclasses set `name` and implement `plain(q, kv_layer, meta, scale)`;
    `extra(...)` may claim further calls (returns None to decline)."""

    supports_paged = True
    paged_mode = "limits"  # one call per layer, like TritonBackend
    graph_safe = True
    serves_lead = False  # whether `lead` exists: rows with leading causal queries (`lead_queries` > 0)

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
        lead = lead_queries(meta) if half and meta.rows[0].q_len >= self.min_q_len else None
        if lead == 0 or (lead and self.serves_lead):
            self._count(self.name)
            out = self.plain(q, kv_layer, meta, scale)
            if lead:  # the plain call gave the leading queries all keys: redo them with their own limits
                self.lead(out, q, kv_layer, meta, scale, lead)
            return out
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

    def lead(self, out, q, kv_layer, meta: PagedAttentionMetadata, scale: float, n: int) -> None:
        """Overwrite the first `n` queries of every row in `out` (each sees keys [0, key_limit)); only
        where `serves_lead` is set."""
        raise NotImplementedError

    def extra(self, q, kv_layer, meta: PagedAttentionMetadata, scale: float) -> torch.Tensor | None:
        return None
