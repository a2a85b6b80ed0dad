"""The KV manager's AR-phase rows (engine.ar_phase) and exported rows (a stage graph's AR stage), as a mixin
of `DiffusionKVCacheManager`: reserve, grow, hand over, export and free one request's causal AR row, and
its part in the prefix cache (docs/prefix-cache-ar.md): a text head's full pages are looked up when the
row is reserved and committed as its prefill writes them; row 0 keeps adopted cached pages shared.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import LayoutError


def _pages(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@dataclass
class ARRow:
    """A request's AR-phase row: one causal row that grows a page at a time. Each growth is a new
    generation whose block table extends the last one (append-only), which is what workers accept."""
    handle: int
    generation: int
    block_ids: list[int]
    tokens: int  # token slots the row covers (for the pool's waste accounting)
    # prefix cache (docs/prefix-cache-ar.md): the keys of its head's full pages, how many leading pages it
    # took from the cache (never written by it), and how many leading pages are cached now (hits + commits)
    keys: tuple[bytes, ...] = ()
    hit: int = 0
    cached: int = 0


@dataclass(frozen=True)
class ExportedRow:
    """The first pages of a finished AR row, held for a KV export (a stage graph's ticket) until
    `release_export`; a new generation, so a release naming an older one is stale and frees nothing."""
    key: str  # the ticket id
    block_ids: tuple[int, ...]
    generation: int
    tokens: int  # token slots it accounts for in the pool (its AR row's cache hits excluded)


class ARRowsMixin:
    """Needs the manager's `pool`, `block_size`, `prefix_caching`, `_ar`, `_exported`, `_reserved`,
    `_quarantined`, `_generation`, `_closed`, `_new_handle` and its prefix-cache counters."""

    # ---- AR-phase rows -------------------------------------------------------------------
    def ar_hit(self, keys, head_len: int) -> list[int]:
        """The cached pages an AR row of a `head_len`-token head with `keys` may begin with: the longest
        cached run, short of the head's last token (its logits draw the first text token, so at least
        that token is prefilled). Nothing is taken yet (`reserve_ar(..., hit=)`). No hit is cut back for a
        full-attention span: an image head's page keys name each image they touch whole, so a hit may end
        inside an image's block (the rank fills the block's rest and lets it see the whole block)."""
        if not self.prefix_caching or not keys:
            return []
        return self.pool.lookup(tuple(keys)[:(head_len - 1) // self.block_size])

    def reserve_ar(self, request_id: str, tokens: int, keys=(), hit=()) -> ARRow | None:
        """A new AR row covering `tokens` (its head, or what its first chunk needs), or None when the
        pages are not free now. `hit` (from `ar_hit`): its first pages, shared from the prefix cache
        (read-only: its first work starts after them); `keys`: its head's keys, committed as its prefill
        writes them (`commit_ar`). Admission counts only the pages it allocates and the hits it revives."""
        if self._closed:
            raise RuntimeError("DiffusionKVCacheManager is closed")
        if request_id in self._ar or request_id in self._reserved or request_id in self._quarantined:
            raise LayoutError(f"request {request_id!r} already holds pages; free them first")
        hit = [int(b) for b in hit] if self.prefix_caching else []
        keys = tuple(keys) if self.prefix_caching else ()
        if hit != self.pool.lookup(keys[:len(hit)]):
            raise LayoutError(f"request {request_id!r}: the AR hit is not the cache's pages for its keys; "
                              "look it up with ar_hit just before reserve_ar")
        n = max(_pages(tokens, self.block_size) - len(hit), 0)
        if n + self.pool.evictable_among(hit) > self.pool.num_free:
            return None
        handle = self._new_handle()
        if hit:  # shared first: an allocation below cannot evict them
            self.pool.share(hit)
        ids = self.pool.allocate(n, handle, max(tokens - len(hit) * self.block_size, 0))
        self._generation += 1
        row = self._ar[request_id] = ARRow(handle, self._generation, hit + ids.tolist(), tokens, keys,
                                           len(hit), len(hit))
        if keys:
            self.cache_query_tokens += len(keys) * self.block_size
            self.cache_hit_tokens += len(hit) * self.block_size
        return row

    def commit_ar(self, request_id: str, computed: int) -> int:
        """The AR row's first `computed` tokens are written on every rank (a step fed them ok): its head's
        full pages among them enter the cache under their keys (read-only from now on: the row writes
        only past its head). How many did (a key cached meanwhile by another row leaves its page private,
        and the run of cached pages ends there)."""
        row = self._ar.get(request_id)
        if row is None or row.cached >= len(row.keys):
            return 0
        end = min(len(row.keys), computed // self.block_size)
        added = 0
        for j in range(row.cached, end):
            if not self.pool.cache_pages([row.block_ids[j]], [row.keys[j]]):
                row.keys = row.keys[:j]  # a page after a private one is never cached: runs stay leading
                break
            added += 1
            row.cached = j + 1
        return added

    def ar_cached_pages(self, request_id: str) -> int:
        """How many leading pages of the request's AR row the prefix cache holds (shared, read-only)."""
        row = self._ar.get(request_id)
        return 0 if row is None else row.cached

    def grow_ar(self, request_id: str, tokens: int) -> ARRow | None:
        """Make the AR row cover `tokens`: the same row when it does, else a new generation whose
        table appends the pages it needs; None (nothing changed) when they are not free now."""
        row = self._ar.get(request_id)
        if row is None:
            raise LayoutError(f"request {request_id!r} has no AR row")
        if tokens <= row.tokens:
            return row
        n = _pages(tokens, self.block_size) - len(row.block_ids)
        if n > self.pool.num_free:
            return None
        self.pool.tokens_in_use += tokens - row.tokens
        if n > 0:
            row.block_ids = row.block_ids + self.pool.allocate(n, row.handle).tolist()
            self._generation += 1
            row.generation = self._generation
        row.tokens = tokens
        return row

    def free_ar(self, request_id: str) -> bool:
        """Return the request's AR row (finished, preempted or ended). Idempotent."""
        row = self._ar.pop(request_id, None)
        if row is None:
            return False
        self.pool.free(np.asarray(row.block_ids, dtype=np.int64), self._accounted(row))
        return True

    def _accounted(self, row: ARRow) -> int:
        """Token slots the AR row added to the pool's accounting (its cache hits were someone else's)."""
        return row.tokens - row.hit * self.block_size

    def ar_row(self, request_id: str) -> ARRow | None:
        return self._ar.get(request_id)

    # ---- exported rows (a stage graph's AR stage: the mirror of the DiT stage's import) ---------
    def export_ar(self, request_id: str, key: str, keep: int, tokens: int) -> ExportedRow:
        """The AR row's first `keep` pages (holding `tokens` tokens) pass to the export `key`; the rest
        of the row returns now. The pages change holder, never contents (zero copy)."""
        row = self._ar.get(request_id)
        if row is None:
            raise LayoutError(f"request {request_id!r} has no AR row to export")
        if key in self._exported:
            raise LayoutError(f"export {key!r} is already held; release it first")
        if not 0 <= keep <= len(row.block_ids) or tokens > keep * self.block_size:
            raise LayoutError(f"export of {tokens} tokens in {keep} pages: the AR row holds {len(row.block_ids)}")
        del self._ar[request_id]
        kept = max(tokens - row.hit * self.block_size, 0)  # the exported row's share of the accounting
        self.pool.free(np.asarray(row.block_ids[keep:], dtype=np.int64), self._accounted(row) - kept)
        self._generation += 1
        out = self._exported[key] = ExportedRow(key, tuple(row.block_ids[:keep]), self._generation, kept)
        return out

    def release_export(self, key: str, generation: int | None = None) -> bool:
        """End export `key` (only its `generation`, when given): its pages return. False (nothing
        freed) when none such is held: a stale or repeated release."""
        ex = self._exported.get(key)
        if ex is None or (generation is not None and ex.generation != generation):
            return False
        del self._exported[key]
        self.pool.free(np.asarray(ex.block_ids, dtype=np.int64), ex.tokens)
        return True

    def release_exports(self) -> int:
        """End every export (its readers are gone: a failed-closed stage); how many there were."""
        keys = list(self._exported)
        for key in keys:
            self.release_export(key)
        return len(keys)

    def exported(self, key: str) -> ExportedRow | None:
        return self._exported.get(key)

    @property
    def num_exports(self) -> int:
        return len(self._exported)

    def _adopted_cached(self, request_id: str, ar: "ARRow | None", adopt: int, computed0: int) -> int:
        """How many of row 0's adopted pages the prefix cache holds (the AR row's leading cached run). They
        stay shared and read-only, so they must lie wholly inside the tokens already in the pages: the
        DiT writes from `computed0` on (the engine cuts the handover to that, `ar_phase._hand_over`)."""
        n = 0 if ar is None else min(ar.cached, adopt)
        if n * self.block_size > computed0:
            raise LayoutError(f"request {request_id!r}: row 0 adopts {n} cached AR pages but only {computed0} tokens "
                              "are in them; the DiT would write a shared page (cut the handover to whole cached pages)")
        return n
