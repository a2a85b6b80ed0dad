"""Which installed row writes or reads each page of a rank's pool: the check that a block id is never
in two places unless the page is shared and read-only (the prefix cache, docs/prefix-cache.md).

A row's leading `num_cached_tokens // block_size` pages are *shared*: the row reads them and never
writes them. Every other page of a row is *private*: it appears in no other row of any installed
request, with two exceptions, both pages its writer will never write again once they are read:

- a shared page taken from the prefix cache may be another request's private page wholly before its
  row's `prefix_len` (denoise steps write the target only, DESIGN invariant 8) once that request's
  first step ran (`sealed`), which is when the scheduler commits such pages to the cache;
- a row's last `num_row0_tokens // block_size` shared pages are row 0's private pages of the same
  request at the same indices, pages row 0's first step writes whole (past its own
  `num_computed_tokens`, before its `prefix_len`): in that step the attention adapter writes every
  packed token's K/V of a layer before any query reads, so the reading row sees them written.
"""

from __future__ import annotations

from ..errors import MetadataError


class PageUse:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self._private: dict[int, tuple[str, bool]] = {}  # block -> (request, wholly before its row's prefix_len)
        self._shared: dict[int, int] = {}  # block -> rows that read it as shared
        self._sealed: set[str] = set()  # requests whose first step ran: their prefix pages are read-only

    def _split(self, meta):
        """(private (block, in stable prefix), shared blocks, (block, index) read from row 0)."""
        bs, private, shared, from_row0 = self.block_size, [], [], []
        for row in meta.rows:
            n, m = row.num_cached_tokens // bs, row.num_row0_tokens // bs
            shared += row.block_ids[:n - m]
            from_row0 += [(b, j) for j, b in enumerate(row.block_ids[n - m:n], n - m)]
            private += [(b, (j + 1) * bs <= row.prefix_len) for j, b in enumerate(row.block_ids[n:], n)]
        return private, shared + [b for b, _ in from_row0], from_row0

    def check(self, meta) -> None:
        """Raise `MetadataError` before anything is bound if `meta` would put a page in two places."""
        rid = meta.request_id
        private, shared, from_row0 = self._split(meta)
        mine: set[int] = set()
        for b, _ in private:
            if b in mine or b in self._private or b in self._shared:
                who = ("another row of this request" if b in mine else
                       f"request {self._private[b][0]!r}" if b in self._private else "a prefix-cache reader")
                raise MetadataError(f"request {rid!r}: block {b} is already in use ({who}) and is not marked shared "
                                    "and read-only; a block id may be in two rows only as a prefix-cache page "
                                    "(num_cached_tokens)")
            mine.add(b)
        row0 = set(from_row0)
        for b in shared[:len(shared) - len(from_row0)]:
            holder = self._private.get(b)
            if b in mine or (holder is not None and not (holder[1] and holder[0] in self._sealed)):
                raise MetadataError(f"request {rid!r}: shared page {b} is still written by "
                                    f"{(holder or (rid,))[0]!r}; a page enters the prefix cache only after the "
                                    "first step of the request that writes it, and only below its prefix_len")
        if row0:
            self._check_row0(meta, row0)

    def _check_row0(self, meta, from_row0: set[tuple[int, int]]) -> None:
        """Pages a row reads from row 0 of its request: row 0's first step must write each one whole."""
        bs, first = self.block_size, meta.rows[0]
        if first.num_row0_tokens:
            raise MetadataError(f"request {meta.request_id!r}: row {first.row_id} is the request's first row and "
                                f"cannot read {first.num_row0_tokens} tokens from row 0 (num_row0_tokens must be 0)")
        lo, hi = -(-first.num_computed_tokens // bs), min(first.prefix_len // bs, len(first.block_ids))
        bad = sorted(from_row0 - {(first.block_ids[j], j) for j in range(lo, hi)})
        if bad:
            raise MetadataError(f"request {meta.request_id!r}: page {bad[0][0]} (index {bad[0][1]}) is read from "
                                "row 0, but row 0's first step does not write it whole at that index before its "
                                "prefix_len; num_row0_tokens may only count row 0's pages past its "
                                "num_computed_tokens")

    def bind(self, meta) -> None:
        private, shared, _ = self._split(meta)
        for b, stable in private:
            self._private[b] = (meta.request_id, stable)
        for b in shared:
            self._shared[b] = self._shared.get(b, 0) + 1

    def unbind(self, meta) -> None:
        private, shared, _ = self._split(meta)
        for b, _ in private:
            self._private.pop(b, None)
        for b in shared:
            left = self._shared.get(b, 0) - 1
            if left > 0:
                self._shared[b] = left
            else:
                self._shared.pop(b, None)
        self._sealed.discard(meta.request_id)

    def writable(self) -> set[int]:
        """The private pages some installed row may still write (not a sealed request's stable prefix)."""
        return {b for b, (rid, stable) in self._private.items() if not (stable and rid in self._sealed)}

    def seal(self, request_id: str) -> None:
        """The request's first step ran: its pages before each row's prefix_len are read-only now."""
        self._sealed.add(request_id)
