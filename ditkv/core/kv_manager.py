"""`DiffusionKVCacheManager`: request-facing facade over the block pool.

Groups the rows of one request and reserves all of them atomically, stamps a manager-wide
generation on each success, and releases everything on free/close. It never touches tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import AdmissionError, LayoutError
from .block_pool import BlockPool
from .layout import RowLayout, validate_rows
from .metadata import DiffusionKVMetadata, RowMetadata


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@dataclass
class _Reservation:
    handle: int
    metadata: DiffusionKVMetadata
    block_arrays: list[np.ndarray]
    tokens: int


class DiffusionKVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, max_rows_per_request: int,
                 max_model_len: int | None = None):
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
        self._generation = 0  # last generation handed out; the first reservation gets 1
        self._next_handle = 0
        self._closed = False

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
                        num_computed_tokens: Sequence[int] | None = None) -> DiffusionKVMetadata | None:
        """All rows get blocks or none do. None = temporary shortage (retry later)."""
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
        per_row = [blocks_for(r.seq_len, self.block_size) for r in rows]
        if sum(per_row) > self.pool.num_free:
            return None
        handle = self._next_handle
        self._next_handle += 1
        arrays: list[np.ndarray] = []
        try:  # a failure before registration returns every page; the generation is stamped after
            for r, n in zip(rows, per_row):
                arrays.append(self.pool.allocate(n, handle, r.seq_len))
            meta = self._snapshot(request_id, self._generation + 1, rows, arrays, computed)
        except BaseException:
            for r, ids in zip(rows, arrays):  # roll back whatever was taken, then re-raise
                self.pool.free(ids, r.seq_len)
            raise
        self._generation += 1
        self._reserved[request_id] = _Reservation(handle, meta, arrays, sum(r.seq_len for r in rows))
        return meta

    def _snapshot(self, request_id: str, generation: int, rows: Sequence[RowLayout], arrays: list[np.ndarray],
                  computed: list[int]) -> DiffusionKVMetadata:
        return DiffusionKVMetadata(
            request_id=request_id,
            generation=generation,
            block_size=self.block_size,
            rows=tuple(
                RowMetadata(r.row_id, r.prefix_len, r.target_len, r.seq_len, r.full_attn_spans,
                            tuple(ids.tolist()), c)
                for r, ids, c in zip(rows, arrays, computed)
            ),
        )

    # ---- release ------------------------------------------------------------------------
    def free_request(self, request_id: str, quarantine: bool = False) -> bool:
        """Return the request's blocks. Idempotent: False when it held nothing.

        `quarantine=True` ends the reservation but keeps its blocks allocated until
        `release_quarantine` (a transfer may still write into them)."""
        res = self._reserved.pop(request_id, None)
        if res is None:
            return False
        if quarantine:
            self._quarantined[request_id] = res
            return True
        self._free(res)
        return True

    def release_quarantine(self, request_id: str) -> bool:
        """Every rank settled: the quarantined blocks go back to the pool. Idempotent."""
        res = self._quarantined.pop(request_id, None)
        if res is None:
            return False
        self._free(res)
        return True

    def _free(self, res: _Reservation) -> None:
        for ids, row in zip(res.block_arrays, res.metadata.rows):
            self.pool.free(ids, row.seq_len)

    def close(self) -> None:
        """Free everything, quarantined pages included (shutdown: no transfer outlives it)."""
        for rid in list(self._reserved):
            self.free_request(rid)
        for rid in list(self._quarantined):
            self.release_quarantine(rid)
        self._closed = True

    # ---- queries ------------------------------------------------------------------------
    def quarantined_requests(self) -> list[str]:
        return list(self._quarantined)

    @property
    def num_quarantined_blocks(self) -> int:
        return sum(len(ids) for res in self._quarantined.values() for ids in res.block_arrays)

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def num_requests(self) -> int:
        return len(self._reserved)

    def stats(self) -> dict:
        return {**self.pool.stats(), "requests": len(self._reserved), "generation": self._generation,
                "quarantined_blocks": self.num_quarantined_blocks}
