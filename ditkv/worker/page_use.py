"""Which installed row writes or reads each page of a rank's pool: the check that a block id is never
in two places unless the page is shared and read-only (the prefix cache, docs/prefix-cache.md).

A row's leading `num_cached_tokens // block_size` pages are *shared*: the scheduler took them from
the prefix cache, the row reads them and never writes them. Every other page of a row is *private*:
it appears in no other row of any installed request. A shared page may also be another request's
private page, only where that request will never write it again: a page wholly before its row's
`prefix_len` (denoise steps write the target only, DESIGN invariant 8) once its first step ran
(`sealed`), which is when the scheduler commits such pages to the cache.
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
        """(private (block, in stable prefix), shared blocks) of a snapshot's rows."""
        bs, private, shared = self.block_size, [], []
        for row in meta.rows:
            n = row.num_cached_tokens // bs
            shared += row.block_ids[:n]
            private += [(b, (j + 1) * bs <= row.prefix_len) for j, b in enumerate(row.block_ids[n:], n)]
        return private, shared

    def check(self, meta) -> None:
        """Raise `MetadataError` before anything is bound if `meta` would put a page in two places."""
        rid = meta.request_id
        private, shared = self._split(meta)
        mine: set[int] = set()
        for b, _ in private:
            if b in mine or b in self._private or b in self._shared:
                who = ("another row of this request" if b in mine else
                       f"request {self._private[b][0]!r}" if b in self._private else "a prefix-cache reader")
                raise MetadataError(f"request {rid!r}: block {b} is already in use ({who}) and is not marked shared "
                                    "and read-only; a block id may be in two rows only as a prefix-cache page "
                                    "(num_cached_tokens)")
            mine.add(b)
        for b in shared:
            holder = self._private.get(b)
            if b in mine or (holder is not None and not (holder[1] and holder[0] in self._sealed)):
                raise MetadataError(f"request {rid!r}: shared page {b} is still written by "
                                    f"{(holder or (rid,))[0]!r}; a page enters the prefix cache only after the "
                                    "first step of the request that writes it, and only below its prefix_len")

    def bind(self, meta) -> None:
        private, shared = self._split(meta)
        for b, stable in private:
            self._private[b] = (meta.request_id, stable)
        for b in shared:
            self._shared[b] = self._shared.get(b, 0) + 1

    def unbind(self, meta) -> None:
        private, shared = self._split(meta)
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
