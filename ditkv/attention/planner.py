"""Segment planner: mixed causal/full rows -> segments a causal-or-not backend can run.

A row's queries `[q_start, q_start + q_len)` split into maximal segments:
- causal `[s, e)`: query `i` sees keys `j <= i`, i.e. `K[:e]` with bottom-right causal alignment;
- full `[a, b)` (a span clipped to the query range): every query sees `K[:b]`.

Homogeneous rows (the CFG rows of one request) produce identical segments, so the adapter keeps
a batched `[R, q_len]` view and writes each segment's output straight into its slice. Rows that
differ are planned one by one and gathered with `index_select` / scattered with `index_copy_`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .metadata import RowPhase


@dataclass(frozen=True)
class Segment:
    q_lo: int  # absolute row positions of the segment's queries [q_lo, q_hi)
    q_hi: int
    kv_len: int  # keys [0, kv_len) are visible
    causal: bool


def plan_row(row: RowPhase) -> list[Segment]:
    """Segments of one row, in query order, covering its query range exactly once."""
    lo, hi = row.q_start, row.q_start + row.q_len
    segs: list[Segment] = []
    cur = lo
    for a, b in row.spans:
        if b <= cur or a >= hi:
            continue
        a_c = max(a, cur)
        if a_c > cur:
            segs.append(Segment(cur, a_c, a_c, True))
        end = min(b, hi)
        segs.append(Segment(a_c, end, b, False))
        cur = end
    if cur < hi:
        segs.append(Segment(cur, hi, hi, True))
    for s in segs:
        if s.kv_len > row.kv_len:
            raise ValueError(f"segment {s} reads beyond the row's kv_len={row.kv_len}")
    return segs


def plan(rows: tuple[RowPhase, ...]) -> list[list[Segment]]:
    """Per-row segment lists (rows with equal layout yield equal lists)."""
    return [plan_row(r) for r in rows]
