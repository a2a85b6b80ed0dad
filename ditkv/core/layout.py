"""Row layout: the token geometry of one logical KV sequence (one CFG branch of a request)."""

from __future__ import annotations

import msgspec

from ..errors import LayoutError


class RowLayout(msgspec.Struct, frozen=True):
    """`prefix_len` stable tokens, then `target_len` rewritten tokens, inside `seq_len` slots.

    `full_attn_spans` are sorted, disjoint, half-open `(start, end)` ranges inside the row where
    attention is bidirectional; elsewhere it is causal. A gap after prefix + target is allowed
    (trailing tokens such as `<eoi>`).
    """

    row_id: int
    prefix_len: int
    target_len: int
    seq_len: int
    full_attn_spans: tuple[tuple[int, int], ...] = ()

    def __post_init__(self):
        validate_row(self)

    @property
    def target_end(self) -> int:
        return self.prefix_len + self.target_len

    @classmethod
    def of(cls, layout) -> list["RowLayout"]:
        """The scheduler's rows of a model's request layout (anything whose `rows` carry
        prefix_len, target_len, seq_len and full_attn_spans), numbered in order."""
        return [cls(i, r.prefix_len, r.target_len, r.seq_len, tuple(tuple(s) for s in r.full_attn_spans))
                for i, r in enumerate(layout.rows)]


def validate_row(row: RowLayout) -> None:
    def bad(msg):
        raise LayoutError(f"row {row.row_id}: {msg}")

    for name in ("row_id", "prefix_len", "target_len", "seq_len"):
        if not isinstance(getattr(row, name), int) or isinstance(getattr(row, name), bool):
            bad(f"{name} must be an int, got {getattr(row, name)!r}")
    if row.row_id < 0:
        bad(f"row_id={row.row_id} must be >= 0")
    if row.prefix_len < 0:
        bad(f"prefix_len={row.prefix_len} must be >= 0")
    if row.target_len <= 0:
        bad(f"target_len={row.target_len} must be > 0 (every row rewrites at least the timestep token)")
    if row.seq_len <= 0:
        bad(f"seq_len={row.seq_len} must be > 0")
    if row.prefix_len + row.target_len > row.seq_len:
        bad(f"prefix_len + target_len = {row.prefix_len + row.target_len} exceeds seq_len={row.seq_len}; "
            "seq_len must cover the prefix and the target")
    prev_end = 0
    for span in row.full_attn_spans:
        if len(span) != 2:
            bad(f"span {span!r} must be a (start, end) pair")
        a, b = span
        if not (0 <= a < b <= row.seq_len):
            bad(f"span {span!r} must satisfy 0 <= start < end <= seq_len={row.seq_len}")
        if a < prev_end:
            bad(f"spans must be sorted and non-overlapping; {span!r} starts before {prev_end}")
        prev_end = b


def validate_rows(rows) -> None:
    """Request-level checks: at least one row, row ids 0..n-1 in order."""
    if not rows:
        raise LayoutError("a request needs at least one row")
    for i, r in enumerate(rows):
        if not isinstance(r, RowLayout):
            raise LayoutError(f"row {i} must be a RowLayout, got {type(r).__name__}")
        if r.row_id != i:
            raise LayoutError(f"row ids must be contiguous 0..{len(rows) - 1}; position {i} has row_id {r.row_id}")
