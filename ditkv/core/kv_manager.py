"""`DiffusionKVCacheManager`: request-facing facade over the block pool.

Groups the rows of one request and reserves all of them atomically, stamps a manager-wide
generation on each success, and releases everything on free/close. It never touches tensors.
AR-phase and exported rows are `kv_ar_rows.ARRowsMixin`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import AdmissionError, LayoutError
from .block_pool import BlockPool
from .kv_ar_rows import ARRow, ARRowsMixin, ExportedRow  # noqa: F401 (ARRow, ExportedRow: re-exported)
from .layout import RowLayout, validate_rows
from .metadata import DiffusionKVMetadata, RowMetadata


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class ImportKeys(tuple):
    """An import's prefix keys per row (`reserve_request(..., num_computed_tokens, prefix_keys=)`) that
    it may look up: its transfer skips the pages a row finds cached (native: `RowDest.skip_pages`).
    Plain keys on an import look nothing up (a legacy staging slot is copied whole). The engine decides
    (`Engine.add_import`); this type carries the decision through the scheduler."""


@dataclass
class _Reservation:
    handle: int
    metadata: DiffusionKVMetadata
    block_arrays: list[np.ndarray]
    tokens: int
    row_tokens: list[int] | None = None  # token slots each row accounts for (None: its seq_len)
    keys: list[tuple[bytes, ...]] | None = None  # prefix-cache keys per row (None: never cached)
    hits: list[int] | None = None  # leading shared pages per row: cache hits, then row 0's (never committed by it)
    counted: tuple[int, int, int] = (0, 0, 0)  # what it added to the query, hit and shared-row counters


class DiffusionKVCacheManager(ARRowsMixin):
    def __init__(self, num_blocks: int, block_size: int, max_rows_per_request: int,
                 max_model_len: int | None = None, prefix_caching: bool = False, share_rows: bool = True):
        if max_rows_per_request <= 0:
            raise ValueError(f"max_rows_per_request={max_rows_per_request} must be > 0")
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.max_rows_per_request = max_rows_per_request
        self.max_model_len = max_model_len if (max_model_len and max_model_len > 0) else None
        self._reserved: dict[str, _Reservation] = {}
        # Terminated requests whose pages may still be written by an in-flight transfer: kept
        # allocated (never reused) until the connector reports every rank settled.
        self._quarantined: dict[str, _Reservation] = {}
        self._ar: dict[str, ARRow] = {}  # AR-phase rows (engine.ar_phase): grown, then handed to row 0
        self._exported: dict[str, ExportedRow] = {}  # AR rows' prefixes held for a KV export, by key
        self._generation = 0  # last generation handed out; the first reservation gets 1
        self._next_handle = 0
        self._closed = False
        # cross-request prefix cache (docs/prefix-cache.md): off = keys are ignored, nothing is cached
        self.prefix_caching = prefix_caching
        self.cache_query_tokens = 0  # prefix tokens looked up (cacheable pages x block size)
        self.cache_hit_tokens = 0  # of which found in the cache and reused
        # a request's row r > 0 begins with row 0's pages where their keys agree (`_row_shares`); off
        # under CFG parallel, where row 0 is computed on another rank's pool
        self.share_rows = prefix_caching and share_rows
        self.shared_row_tokens = 0  # prefix tokens a row took from row 0 of its request (not computed)

    # ---- admission ----------------------------------------------------------------------
    def required_blocks(self, rows: Sequence[RowLayout]) -> int:
        return sum(blocks_for(r.seq_len, self.block_size) for r in rows)

    def check_admissible(self, rows: Sequence[RowLayout]) -> None:
        """Raise `AdmissionError` if the request can never fit (client-safe message)."""
        if len(rows) > self.max_rows_per_request:
            raise AdmissionError(
                f"request has {len(rows)} rows but diffusion_kv_max_rows_per_request="
                f"{self.max_rows_per_request}; raise the limit or disable CFG", field="guidance_scale")
        if self.max_model_len is not None:
            for r in rows:
                if r.seq_len > self.max_model_len:
                    raise AdmissionError(
                        f"row {r.row_id} has seq_len={r.seq_len} > max_model_len={self.max_model_len}; "
                        "shorten the prompt, lower the image size or raise max_model_len", field="size")
        need = self.required_blocks(rows)
        if need > self.pool.num_blocks:
            raise AdmissionError(
                f"request can never fit the KV pool: required_blocks={need}, "
                f"available_blocks={self.pool.num_blocks} (empty pool); lower the image size or "
                "prompt length, or give the pool more memory (kv_cache_memory_bytes)", field="size")

    def reserve_request(self, request_id: str, rows: Sequence[RowLayout],
                        num_computed_tokens: Sequence[int] | None = None,
                        adopt: int = 0, prefix_keys: Sequence[Sequence[bytes]] | None = None,
                        handover: bool = False) -> DiffusionKVMetadata | None:
        """All rows get blocks or none do. None = temporary shortage (retry later).

        `adopt`: row 0 begins with the first `adopt` pages of the request's AR row (the AR phase
        wrote them: a zero-copy handover); the AR row's other pages return once the rows hold
        theirs. `prefix_keys` (prefix caching on, no import, no adoption): per row, the keys of its
        cacheable pages; each row begins with the cached pages of its longest cached prefix (it may
        end inside a full-attention span: `_hits`) and only the rest is allocated. Nothing changes on
        None or on an error."""
        if self._closed:
            raise RuntimeError("DiffusionKVCacheManager is closed")
        if not isinstance(request_id, str) or not request_id:
            raise LayoutError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._reserved:
            raise LayoutError(f"request {request_id!r} already holds a reservation; free it first")
        if request_id in self._quarantined:
            raise LayoutError(f"request {request_id!r} still has quarantined pages (transfer in flight); "
                              "use a new request id")
        validate_rows(rows)
        self.check_admissible(rows)
        computed = list(num_computed_tokens) if num_computed_tokens is not None else [0] * len(rows)
        if len(computed) != len(rows) or any(not 0 <= c <= r.prefix_len for c, r in zip(computed, rows)):
            raise LayoutError(f"num_computed_tokens={computed} must give one value per row within [0, prefix_len]")
        plain = num_computed_tokens is None and not adopt
        imported = isinstance(prefix_keys, ImportKeys) and not (plain or handover or adopt)
        # `handover` (the AR->DiT handover, `num_computed_tokens` its tokens per row): the rows' keys are
        # committed after the first step; row 0's adopted pages that the cache holds are its shared pages,
        # and only the rows with nothing in the pages look up. An import (`num_computed_tokens` without
        # `handover`) looks up only with `ImportKeys` (its transfer then skips the hits); it commits its
        # pages after its first step, which runs only once every rank received them (`kv_ready`).
        keys = self._keys(rows, prefix_keys) if handover or not adopt else None
        looked = [plain or imported or (handover and i > 0 and c == 0) for i, c in enumerate(computed)]
        hits = self._hits(rows, [k if ok else () for k, ok in zip(keys, looked)] if keys else None)
        sib = self._row_shares(keys if plain else None, hits)  # row 0's pages: plain requests only
        per_row = [blocks_for(r.seq_len, self.block_size) - len(h) - s for r, h, s in zip(rows, hits, sib)]
        ar = self._check_adopt(request_id, adopt, per_row[0])
        shared0 = self._adopted_cached(request_id, ar, adopt, computed[0]) if keys is not None else 0
        per_row[0] -= adopt
        shared = [b for h in hits for b in h]
        if sum(per_row) + self.pool.evictable_among(shared) > self.pool.num_free:
            return None  # admission counts only the pages it must allocate (and the hits it revives)
        lead = [len(h) + s for h, s in zip(hits, sib)]  # shared leading pages per row: cache hits, then row 0's
        row_tokens = [r.seq_len - n * self.block_size for r, n in zip(rows, lead)]
        handle = ar.handle if ar is not None else self._new_handle()
        fresh, held = self._take(handle, per_row, row_tokens, hits, shared, sib)
        try:  # a failure before registration returns every page; the generation is stamped after
            arrays = [np.concatenate((np.asarray(h, dtype=np.int64), f)) for h, f in zip(held, fresh)]
            if adopt:
                arrays[0] = np.concatenate((np.asarray(ar.block_ids[:adopt], dtype=np.int64), fresh[0]))
            cached = [n * self.block_size for n in lead]
            cached[0] += shared0 * self.block_size  # row 0's adopted cached pages: shared, never written
            meta = self._snapshot(request_id, self._generation + 1, rows, arrays,
                                  [max(c, k) for c, k in zip(computed, cached)], cached,
                                  [s * self.block_size for s in sib])
        except BaseException:
            self._roll_back(fresh, row_tokens, held)
            raise
        if ar is not None:  # the adopted pages are row 0's now; the rest of the AR row returns
            del self._ar[request_id]
            self.pool.free(np.asarray(ar.block_ids[adopt:], dtype=np.int64), self._accounted(ar))
        self._generation += 1
        counted = (0, 0, 0) if keys is None else (sum(len(k) for k, ok in zip(keys, looked) if ok) * self.block_size,
                                                  sum(len(h) for h in hits) * self.block_size,
                                                  sum(sib) * self.block_size)
        self._reserved[request_id] = _Reservation(handle, meta, arrays,
                                                  sum(r.seq_len for r in rows), row_tokens, keys,
                                                  [n + (shared0 if i == 0 else 0) for i, n in enumerate(lead)],
                                                  counted)
        self._count(counted, 1)
        return meta

    def _count(self, counted: tuple[int, int, int], sign: int) -> None:
        self.cache_query_tokens += sign * counted[0]
        self.cache_hit_tokens += sign * counted[1]
        self.shared_row_tokens += sign * counted[2]

    def expected_hit_tokens(self, rows: Sequence[RowLayout], prefix_keys,
                            handover: Sequence[int] | None = None) -> list[int]:
        """Per row, the prefix tokens a plain `reserve_request(rows, prefix_keys=prefix_keys)` made now
        would begin with in shared pages: its cache hit, then row 0's pages (`_row_shares`). With
        `handover` (an AR->DiT handover's tokens per row), the hits its reservation would take: only the
        rows > 0 with nothing handed over look up, and no row takes row 0's pages. A query only: no
        reference, LRU position, key or counter changes. The scheduler credits them in a step's token
        budget before it reserves (`Scheduler._first_step_tokens`)."""
        keys = self._keys(rows, prefix_keys)
        if keys is not None and handover is not None:
            keys = [k if i > 0 and c == 0 else () for i, (k, c) in enumerate(zip(keys, handover))]
        hits = self._hits(rows, keys)
        sib = self._row_shares(keys if handover is None else None, hits)
        return [(len(h) + s) * self.block_size for h, s in zip(hits, sib)]

    def unreserve(self, request_id: str) -> None:
        """Take back a reservation no worker has seen (the scheduler's budget re-check after it): its
        pages return as on `free_request` and the cache counters drop what it added. Its pages' cache
        state is not restored (a revived page is parked again as the newest, a page its allocation
        evicted stays forgotten) and its generation stays used: both only cost a later hit."""
        res = self._reserved.get(request_id)
        if res is None:
            raise LayoutError(f"request {request_id!r} holds no reservation to take back")
        self.free_request(request_id)
        self._count(res.counted, -1)

    def _keys(self, rows, prefix_keys) -> list[tuple[bytes, ...]] | None:
        if not self.prefix_caching or prefix_keys is None:
            return None
        keys = [tuple(k) for k in prefix_keys]
        if len(keys) != len(rows) or any(len(k) > r.prefix_len // self.block_size for k, r in zip(keys, rows)):
            raise LayoutError(f"prefix_keys must give one tuple per row, at most prefix_len // block_size "
                              f"keys each (full pages before the prefix end); got {[len(k) for k in keys]}")
        return keys

    def _hits(self, rows, keys) -> list[list[int]]:
        """Per row, the cached pages it begins with: its longest cached run of keys. The run may end
        inside a full-attention span (an input image's block): the key of every page touching a span
        names the span's whole content (the family's contract, docs/prefix-cache.md), so a cached page
        was computed against the same whole block, and the row's first step computes the span's rest
        against the cached keys and its own (a query in a span sees the whole span)."""
        if keys is None:
            return [[] for _ in rows]
        return [self.pool.lookup(k) for k in keys]

    def _row_shares(self, keys, hits) -> list[int]:
        """Per row, how many pages after its cache hit it takes from row 0 of the same request: the
        leading keys equal to row 0's at the same index (a chained key names the whole row up to its
        page's end, so an equal key means an equal prefix and equal K/V). Row 0's first step writes them
        and row r's reads them in the same pass: the adapter writes every packed token's K/V of a layer
        before any read (docs/prefix-cache.md). Only pages row 0 allocates now (past its own hit)."""
        if keys is None or not self.share_rows:
            return [0] * len(hits)
        out = [0]
        for k, h in zip(keys[1:], hits[1:]):
            j, n = len(h), 0
            if j >= len(hits[0]):  # below row 0's hit, equal keys are cache hits of row r already
                while j + n < min(len(k), len(keys[0])) and k[j + n] == keys[0][j + n]:
                    n += 1
            out.append(n)
        return out

    def _take(self, handle: int, per_row: list[int], row_tokens: list[int], hits: list[list[int]],
              shared: list[int], sib: list[int]) -> tuple[list[np.ndarray], list[list[int]]]:
        """Share the cached hits, allocate each row's fresh pages, then give row r > 0 one reference
        on each of the `sib[r]` pages of row 0 that follow its hit -> (fresh pages, shared leading
        pages) per row. All or nothing: on an error whatever was taken returns (the hits are taken
        first, so an allocation cannot evict them)."""
        fresh: list[np.ndarray] = []
        if shared:
            self.pool.share(shared)
        try:
            for n, t in zip(per_row, row_tokens):
                fresh.append(self.pool.allocate(n, handle, t))
        except BaseException:
            self._roll_back(fresh, row_tokens, hits)
            raise
        held = [list(h) for h in hits]
        for r in range(1, len(hits)):
            if sib[r]:  # row 0's fresh pages at row r's indices (row 0 adopts nothing when there are keys)
                lo = len(hits[r]) - len(hits[0])
                ids = fresh[0][lo:lo + sib[r]]
                self.pool.share_row(ids)
                held[r] += ids.tolist()
        return fresh, held

    def _roll_back(self, fresh: list[np.ndarray], row_tokens: list[int], hits: list[list[int]]) -> None:
        for ids, t in zip(fresh, row_tokens):
            self.pool.free(ids, t)
        for h in hits:
            self.pool.free(np.asarray(h, dtype=np.int64))

    def _new_handle(self) -> int:
        self._next_handle += 1
        return self._next_handle - 1

    def _check_adopt(self, request_id: str, adopt: int, row0_blocks: int) -> "ARRow | None":
        ar = self._ar.get(request_id)
        if adopt and (ar is None or not 0 < adopt <= min(len(ar.block_ids), row0_blocks)):
            have = 0 if ar is None else len(ar.block_ids)
            raise LayoutError(f"request {request_id!r} adopts {adopt} AR pages but its AR row holds {have} "
                              f"and row 0 needs {row0_blocks}")
        return ar

    def _snapshot(self, request_id: str, generation: int, rows: Sequence[RowLayout], arrays: list[np.ndarray],
                  computed: list[int], cached: list[int] | None = None,
                  from_row0: list[int] | None = None) -> DiffusionKVMetadata:
        return DiffusionKVMetadata(
            request_id=request_id,
            generation=generation,
            block_size=self.block_size,
            rows=tuple(
                RowMetadata(r.row_id, r.prefix_len, r.target_len, r.seq_len, r.full_attn_spans,
                            tuple(ids.tolist()), c, k, s)
                for r, ids, c, k, s in zip(rows, arrays, computed, cached or [0] * len(rows),
                                           from_row0 or [0] * len(rows))
            ),
        )

    # ---- release ------------------------------------------------------------------------
    def free_request(self, request_id: str, quarantine: bool = False) -> bool:
        """Return the request's blocks. Idempotent: False when it held nothing.

        `quarantine=True` ends the reservation but keeps its blocks allocated until
        `release_quarantine` (a transfer may still write into them). An AR row is always freed:
        no transfer writes into it."""
        freed_ar = self.free_ar(request_id)
        res = self._reserved.pop(request_id, None)
        if res is None:
            return freed_ar
        if quarantine:  # cached pages are never written by a transfer: their references go now
            self._quarantined[request_id] = self._drop_cached(res)
            return True
        self._free(res)
        return True

    def _drop_cached(self, res: _Reservation) -> _Reservation:
        """`res` without its references to cached pages (they return now); what stays quarantined."""
        if not len(self.pool.cache):
            return res
        keep = []
        for ids in res.block_arrays:
            cached = np.fromiter((self.pool.cache.is_cached(int(b)) for b in ids), dtype=bool, count=ids.size)
            self.pool.free(ids[cached])
            keep.append(ids[~cached])
        return _Reservation(res.handle, res.metadata, keep, res.tokens, res.row_tokens)

    def commit_prefix(self, request_id: str) -> int:
        """The request's first step ran on every rank: its cacheable prefix pages are written, and
        enter the cache under their keys (shared and read-only from now on); how many did. Pages it
        took from the cache are cached already; a request that never reached a worker, or holds no
        keys, commits nothing."""
        res = self._reserved.get(request_id)
        if res is None or res.keys is None:
            return 0
        added = 0
        for ids, keys, hit in zip(res.block_arrays, res.keys, res.hits):
            added += self.pool.cache_pages(ids[hit:len(keys)], keys[hit:])
        res.keys = None  # once
        return added

    def release_quarantine(self, request_id: str) -> bool:
        """Every rank settled: the quarantined blocks go back to the pool. Idempotent."""
        res = self._quarantined.pop(request_id, None)
        if res is None:
            return False
        self._free(res)
        return True

    def _free(self, res: _Reservation) -> None:
        tokens = res.row_tokens or [row.seq_len for row in res.metadata.rows]
        for ids, t in zip(res.block_arrays, tokens):
            self.pool.free(ids, t)

    def close(self) -> None:
        """Free everything, quarantined and exported pages included (shutdown: no transfer outlives it)."""
        for rid in list(self._reserved) + list(self._ar):
            self.free_request(rid)
        self.release_exports()
        for rid in list(self._quarantined):
            self.release_quarantine(rid)
        self.pool.drop_cache()
        self._closed = True

    # ---- queries ------------------------------------------------------------------------
    def quarantined_requests(self) -> list[str]:
        return list(self._quarantined)

    def prefix_cache_stats(self) -> dict:
        q = self.cache_query_tokens
        return {"prefix_cache_query_tokens": q, "prefix_cache_hit_tokens": self.cache_hit_tokens,
                "prefix_cache_hit_ratio": self.cache_hit_tokens / q if q else 0.0,
                "prefix_shared_rows_tokens": self.shared_row_tokens}

    @property
    def num_quarantined_blocks(self) -> int:
        return sum(len(ids) for res in self._quarantined.values() for ids in res.block_arrays)

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def num_requests(self) -> int:
        return len(self._reserved)

    @property
    def num_ar_rows(self) -> int:
        return len(self._ar)

    def stats(self) -> dict:
        return {**self.pool.stats(), "requests": len(self._reserved), "ar_rows": len(self._ar),
                "exports": len(self._exported), "generation": self._generation,
                "quarantined_blocks": self.num_quarantined_blocks, **self.prefix_cache_stats()}
