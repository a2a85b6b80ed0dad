"""Worker-side attention metadata for one phase of one request (all rows).

Built by the worker from a `DiffusionKVMetadata` snapshot and the active phase; consumed by the
attention adapter and backends. In both phases the write span equals the query span: prefill
writes and queries `[start, seq_len)`, denoise writes and queries the target
`[prefix_len, prefix_len + target_len)`.

Masking is expressed as one exclusive key limit per query: query at absolute row position `i`
sees keys `j < limit(i)`, where `limit(i) = b` inside a full-attention span `[a, b)` and `i + 1`
otherwise (causal). A native kernel applies the limits directly; causal-or-not backends use the
segment planner (`planner.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowPhase:
    """One row's view of the active phase (python ints, for planning)."""

    q_offset: int  # offset of this row's first query in the packed token dimension
    q_start: int  # absolute row position of the first query (== first written position)
    q_len: int  # queries == written tokens
    kv_len: int  # keys [0, kv_len) are readable this phase
    spans: tuple[tuple[int, int], ...]  # full-attention spans (absolute, sorted, disjoint)


def key_limits(q_start: int, q_len: int, spans, device=None) -> torch.Tensor:
    """Per-query exclusive key limit for absolute positions [q_start, q_start + q_len)."""
    pos = torch.arange(q_start, q_start + q_len, dtype=torch.int32, device=device)
    limit = pos + 1
    for a, b in spans:
        inside = (pos >= a) & (pos < b)
        limit = torch.where(inside, torch.full_like(limit, b), limit)
    return limit


@dataclass
class PagedAttentionMetadata:
    """Everything a paged backend needs for one layer call (shared by all layers of a step)."""

    rows: tuple[RowPhase, ...]
    block_table: torch.Tensor  # int32 [R, max_blocks]; unused entries are 0
    cu_q: torch.Tensor  # int32 [R + 1]; row r's queries are packed at [cu_q[r], cu_q[r+1])
    q_start: torch.Tensor  # int32 [R]
    kv_lens: torch.Tensor  # int32 [R]
    key_limit: torch.Tensor  # int32 [Nq]; absolute exclusive limit per query
    slot_mapping: torch.Tensor  # int64 [Nq]; pool slot (block_id * block_size + offset) per written token
    block_size: int
    max_q_len: int
    max_kv_len: int

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def num_tokens(self) -> int:
        return int(self.key_limit.numel())

    @property
    def homogeneous(self) -> bool:
        """All rows share q range, kv length and spans: a batched view needs no gather."""
        r0 = self.rows[0]
        return all(
            (r.q_start, r.q_len, r.kv_len, r.spans) == (r0.q_start, r0.q_len, r0.kv_len, r0.spans)
            for r in self.rows
        )

    def to(self, device) -> "PagedAttentionMetadata":
        return PagedAttentionMetadata(
            rows=self.rows,
            block_table=self.block_table.to(device),
            cu_q=self.cu_q.to(device),
            q_start=self.q_start.to(device),
            kv_lens=self.kv_lens.to(device),
            key_limit=self.key_limit.to(device),
            slot_mapping=self.slot_mapping.to(device),
            block_size=self.block_size,
            max_q_len=self.max_q_len,
            max_kv_len=self.max_kv_len,
        )


def check_row(r: int, row: RowPhase, num_pages: int, block_size: int) -> None:
    """One row's query range must be non-empty and inside its readable keys, which its pages hold
    (else the limits backend reads a wrong row and the segment planner fails later, per layer)."""
    if row.q_len <= 0:
        raise ValueError(f"row {r}: q_len={row.q_len}; every row of a phase has at least one query "
                         "(leave a row without queries out of the metadata)")
    if row.q_start < 0:
        raise ValueError(f"row {r}: q_start={row.q_start} must be >= 0")
    if row.q_start + row.q_len > row.kv_len:
        raise ValueError(f"row {r}: queries [{row.q_start}, {row.q_start + row.q_len}) run past kv_len={row.kv_len}; "
                         "a query's own key must be readable (kv_len >= q_start + q_len)")
    if row.kv_len > num_pages * block_size:
        raise ValueError(f"row {r}: kv_len={row.kv_len} keys but its table has {num_pages} blocks of "
                         f"{block_size}; give the row enough pages")


def build_paged_metadata(rows: list[RowPhase], block_ids: list[list[int]], block_size: int,
                         device=None) -> PagedAttentionMetadata:
    """Vectorised construction of tables, limits and slot mappings from per-row phases."""
    n = len(rows)
    if n == 0:
        raise ValueError("build_paged_metadata needs at least one row")
    if len(block_ids) != n:
        raise ValueError(f"{len(block_ids)} block tables for {n} rows; give one table per row")
    for r, (row, ids) in enumerate(zip(rows, block_ids)):
        check_row(r, row, len(ids), block_size)
    max_blocks = max(len(b) for b in block_ids)
    table = torch.zeros((n, max_blocks), dtype=torch.int32)
    for r, ids in enumerate(block_ids):
        table[r, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    cu = [0]
    for r in rows:
        cu.append(cu[-1] + r.q_len)
    limits, slots = [], []
    for r, row in enumerate(rows):
        limits.append(key_limits(row.q_start, row.q_len, row.spans))
        # a full span past the readable keys: the limits backend would silently see fewer keys
        top = int(limits[-1].max())
        if top > row.kv_len:
            raise ValueError(f"row {r}: a full-attention span gives key limit {top} past kv_len={row.kv_len}; "
                             "the phase must make every key its queries see readable")
        pos = torch.arange(row.q_start, row.q_start + row.q_len, dtype=torch.int64)
        slots.append(table[r].to(torch.int64)[pos // block_size] * block_size + pos % block_size)
    meta = PagedAttentionMetadata(
        rows=tuple(rows),
        block_table=table,
        cu_q=torch.tensor(cu, dtype=torch.int32),
        q_start=torch.tensor([r.q_start for r in rows], dtype=torch.int32),
        kv_lens=torch.tensor([r.kv_len for r in rows], dtype=torch.int32),
        key_limit=torch.cat(limits),
        slot_mapping=torch.cat(slots),
        block_size=block_size,
        max_q_len=max(r.q_len for r in rows),
        max_kv_len=max(r.kv_len for r in rows),
    )
    return meta.to(device) if device is not None else meta
