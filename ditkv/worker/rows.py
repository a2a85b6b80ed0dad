"""Worker-side rows and block tables: install / remove metadata snapshots, build phase metadata.

`install` validates the whole snapshot before changing anything; on any error the worker state
is exactly what it was. Removing rows never frees scheduler blocks (the scheduler owns them).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..attention.metadata import PagedAttentionMetadata, RowPhase, build_paged_metadata
from ..core.kv_manager import blocks_for
from ..core.metadata import DiffusionKVMetadata
from ..errors import MetadataError
from .page_use import PageUse

PREFILL, DENOISE = "prefill", "denoise"


@dataclass
class _Active:
    metadata: DiffusionKVMetadata
    row_slots: list[int]  # worker row slots bound to this request


class WorkerRows:
    def __init__(self, num_blocks: int, block_size: int, max_rows: int, paged: bool = True):
        self.num_blocks, self.block_size, self.max_rows, self.paged = num_blocks, block_size, max_rows, paged
        self._active: dict[str, _Active] = {}
        self._free_slots = list(range(max_rows))[::-1]
        self._use = PageUse(block_size)  # a block id in two rows only as a shared, read-only page

    # ---- install / remove ---------------------------------------------------------------
    def install(self, meta: DiffusionKVMetadata, request_id: str | None = None) -> bool:
        """Validate then bind. Returns True when state changed, False for an identical re-send.

        `request_id`: the request the caller installs for; another request's snapshot is refused."""
        if not self.paged:
            raise MetadataError(
                f"request {meta.request_id!r}: paged metadata sent to a worker in dense_legacy mode; "
                "dense requests carry no paged metadata (set diffusion_kv_mode=paged_scheduler)")
        self._validate(meta, request_id)
        cur = self._active.get(meta.request_id)
        if cur is not None:
            old = cur.metadata
            if meta.generation < old.generation:
                raise MetadataError(f"request {meta.request_id!r}: stale generation {meta.generation} < "
                                    f"installed {old.generation}")
            if not meta.same_snapshot(old):
                raise MetadataError(f"request {meta.request_id!r}: conflicting snapshot for an active "
                                    f"request (generation {meta.generation} vs installed {old.generation}); "
                                    "remove the old rows first")
            if meta.generation == old.generation:
                return False
            cur.metadata = meta
            return True
        if len(meta.rows) > len(self._free_slots):
            raise MetadataError(f"request {meta.request_id!r} needs {len(meta.rows)} rows but the worker has "
                                f"{len(self._free_slots)} free of {self.max_rows}; raise "
                                "diffusion_kv_max_rows_per_request")
        self._use.check(meta)
        self._use.bind(meta)
        slots = [self._free_slots.pop() for _ in meta.rows]
        self._active[meta.request_id] = _Active(meta, slots)
        return True

    def _validate(self, meta, request_id: str | None) -> None:
        """Every check of a snapshot, before any state changes (DESIGN invariant 5)."""
        if not isinstance(meta, DiffusionKVMetadata):
            raise MetadataError(f"expected DiffusionKVMetadata, got {type(meta).__name__} "
                                "(a dense KV payload cannot be installed in paged mode)")
        check_stamps(meta)
        if request_id is not None and meta.request_id != request_id:
            raise MetadataError(f"request {request_id!r} was sent the snapshot of request {meta.request_id!r}; "
                                "send each request its own metadata")
        if meta.block_size != self.block_size:
            raise MetadataError(f"request {meta.request_id!r}: block_size={meta.block_size} but the "
                                f"worker pool uses {self.block_size}")
        for row in meta.rows:
            self._validate_row(meta.request_id, row)

    def _validate_row(self, request_id: str, row) -> None:
        need = blocks_for(row.seq_len, self.block_size)
        if len(row.block_ids) != need:
            raise MetadataError(f"request {request_id!r} row {row.row_id}: {len(row.block_ids)} "
                                f"block ids for seq_len={row.seq_len}, expected {need}")
        # a bool is an int in Python (True passes a range check as block 1): refuse it by type
        odd = [b for b in row.block_ids if type(b) is not int]
        if odd:
            raise MetadataError(f"request {request_id!r} row {row.row_id}: block ids must be ints, got "
                                f"{odd[:4]!r}; send the block ids the scheduler reserved")
        bad = [b for b in row.block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise MetadataError(f"request {request_id!r} row {row.row_id}: block ids {bad[:4]} "
                                f"outside [0, {self.num_blocks})")
        if not 0 <= row.num_computed_tokens <= row.prefix_len:
            raise MetadataError(f"request {request_id!r} row {row.row_id}: num_computed_tokens="
                                f"{row.num_computed_tokens} outside [0, prefix_len={row.prefix_len}]")
        k = row.num_cached_tokens
        if type(k) is not int or not 0 <= k <= row.num_computed_tokens or k % self.block_size:
            raise MetadataError(f"request {request_id!r} row {row.row_id}: num_cached_tokens={k!r} must be a "
                                f"multiple of block_size={self.block_size} within [0, num_computed_tokens="
                                f"{row.num_computed_tokens}] (whole shared pages of the computed prefix)")
        m = row.num_row0_tokens
        if type(m) is not int or not 0 <= m <= k or m % self.block_size:
            raise MetadataError(f"request {request_id!r} row {row.row_id}: num_row0_tokens={m!r} must be a "
                                f"multiple of block_size={self.block_size} within [0, num_cached_tokens={k}] "
                                "(the shared pages that row 0 of the request writes)")

    def remove(self, request_id: str, generation: int | None = None) -> bool:
        """Clear the request's rows (only that generation if given). Never frees scheduler blocks."""
        cur = self._active.get(request_id)
        if cur is None or (generation is not None and cur.metadata.generation != generation):
            return False
        del self._active[request_id]
        self._free_slots.extend(reversed(cur.row_slots))
        self._use.unbind(cur.metadata)
        return True

    def seal(self, request_id: str) -> None:
        """The request's first step ran: its prefix pages are read-only from now on (they may be
        shared with a later request through the prefix cache)."""
        if request_id in self._active:
            self._use.seal(request_id)

    def blocks_in_use(self, exclude_request: str | None = None) -> set[int]:
        """The block ids of every installed row (but `exclude_request`'s): pages an AR row must not write."""
        return {b for rid, cur in self._active.items() if rid != exclude_request
                for row in cur.metadata.rows for b in row.block_ids}

    def writable_blocks(self) -> set[int]:
        """The pages an installed row may still write: an AR row may read none of them."""
        return self._use.writable()

    def get(self, request_id: str) -> DiffusionKVMetadata:
        cur = self._active.get(request_id)
        if cur is None:
            raise MetadataError(f"request {request_id!r} has no installed paged metadata; a paged request "
                                "must be admitted by the scheduler first (no dense fallback)")
        return cur.metadata

    # ---- phases -------------------------------------------------------------------------
    def phase_metadata(self, request_id: str, phase: str, device=None,
                       from_zero: bool = False) -> PagedAttentionMetadata:
        """Attention metadata of one phase (see the phase table in DESIGN.md).

        `from_zero` makes prefill start at token 0 even over an imported prefix (the full
        recompute baseline)."""
        return self.batch_metadata([(request_id, phase, from_zero)], device)

    def batch_metadata(self, items, device=None) -> PagedAttentionMetadata:
        """One metadata for a step over several requests: `items` is (request id, phase,
        from_zero) per request, rows packed in that order (step-level batching)."""
        rows, tables, offset = [], [], 0
        for request_id, phase, from_zero in items:
            meta = self.get(request_id)
            for row in meta.rows:
                if phase == PREFILL:
                    start = 0 if from_zero else row.num_computed_tokens
                    rp = RowPhase(offset, start, row.seq_len - start, row.seq_len, row.full_attn_spans)
                elif phase == DENOISE:
                    end = row.prefix_len + row.target_len
                    rp = RowPhase(offset, row.prefix_len, row.target_len, end, row.full_attn_spans)
                else:
                    raise ValueError(f"unknown phase {phase!r}; use {PREFILL!r} or {DENOISE!r}")
                rows.append(rp)
                tables.append(list(row.block_ids))
                offset += rp.q_len
        return build_paged_metadata(rows, tables, self.block_size, device)


def check_stamps(meta: DiffusionKVMetadata) -> None:
    """Request id, generation and row ids: the identity a snapshot is bound and removed by."""
    if not isinstance(meta.request_id, str) or not meta.request_id:
        raise MetadataError(f"snapshot request id must be a non-empty str, got {meta.request_id!r}; "
                            "send the id the scheduler reserved")
    # the manager stamps generations from 1; a bool is an int in Python, so check the exact type
    if type(meta.generation) is not int or meta.generation < 1:
        raise MetadataError(f"request {meta.request_id!r}: generation must be a positive int, got "
                            f"{meta.generation!r}; send the generation the scheduler stamped")
    if not meta.rows:
        raise MetadataError(f"request {meta.request_id!r}: the snapshot has no rows; a request has at "
                            "least one row (one per CFG branch)")
    ids = [r.row_id for r in meta.rows]
    dup = next((i for i in ids if ids.count(i) > 1), None)
    if dup is not None:
        raise MetadataError(f"request {meta.request_id!r}: row id {dup!r} appears {ids.count(dup)} times; "
                            "each row of a snapshot needs its own row id")
