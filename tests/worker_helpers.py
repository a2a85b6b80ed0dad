"""Worker-side checks by public behaviour, shared by the worker, engine and executor tests."""

from ditkv.core.metadata import DiffusionKVMetadata, RowMetadata
from ditkv.errors import MetadataError

PROBE = "free-rows-probe"


def free_rows(rows) -> int:
    """Row slots `rows` (a paged `WorkerRows`) can still bind: the most rows of a fresh, valid
    one-block-per-row snapshot it accepts (installed, then removed again)."""
    for n in range(rows.max_rows, 0, -1):
        meta = DiffusionKVMetadata(PROBE, 1, rows.block_size, tuple(RowMetadata(i, 0, 1, 1, (), (0,))
                                                                   for i in range(n)))
        try:
            rows.install(meta)
        except MetadataError:
            continue
        rows.remove(PROBE)
        return n
    return 0


def no_rows_bound(rows) -> bool:
    """Every row slot is free (no request holds rows on this worker)."""
    return free_rows(rows) == rows.max_rows
