"""Worker-side checks by public behaviour, shared by the worker, engine and executor tests."""

from ditkv.core.metadata import DiffusionKVMetadata, RowMetadata
from ditkv.errors import MetadataError

PROBE = "free-rows-probe"


def free_rows(rows) -> int:
    """Row slots `rows` (a paged `WorkerRows`) can still bind: the most rows of a fresh, valid
    one-block-per-row snapshot it accepts (installed, then removed again)."""
    unused = sorted(set(range(rows.num_blocks)) - rows.blocks_in_use())  # a block id is in one row only
    for n in range(min(rows.max_rows, len(unused)), 0, -1):
        meta = DiffusionKVMetadata(PROBE, 1, rows.block_size, tuple(RowMetadata(i, 0, 1, 1, (), (unused[i],))
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


def record_requests(stepper, got: dict | None = None) -> dict:
    """What `stepper` (an in-process `BatchStepper`) ran, by request id, into `got`: {"layout": the
    layout it started with, "x": the final latents once the request finished}. Wraps the instance only."""
    got = {} if got is None else got
    start, end = stepper.start, stepper._end

    def recording_start(request_id, layout, *a, **kw):
        got[request_id] = {"layout": layout}
        return start(request_id, layout, *a, **kw)

    def recording_end(request_id, outcome):
        st = stepper.running.get(request_id)
        if st is not None and st.done:
            got.setdefault(request_id, {})["x"] = st.x.clone()
        return end(request_id, outcome)

    stepper.start, stepper._end = recording_start, recording_end
    return got
