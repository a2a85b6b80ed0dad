"""Worker metadata validation (DESIGN invariant 5): a malformed snapshot is refused with an
explicit error and leaves no rows bound — the row count, row ids, stamp types, and the identity
of the request it is installed for."""

import msgspec
import pytest
from hypothesis import given, settings, strategies as st
from worker_helpers import free_rows, no_rows_bound

from ditkv.core.kv_manager import DiffusionKVCacheManager
from ditkv.core.layout import RowLayout
from ditkv.core.metadata import DiffusionKVMetadata
from ditkv.errors import MetadataError
from ditkv.worker.batch import BatchStepper
from ditkv.worker.parallel import ParallelContext
from ditkv.worker.rows import WorkerRows
from ditkv.worker.worker import DiTWorker
from ditkv.engine.messages import SamplingParams

BS, BLOCKS = 16, 20


def reserve(request_id="a", n_rows=2, m=None):
    m = m or DiffusionKVCacheManager(BLOCKS, BS, 3)
    rows = [RowLayout(i, 10, 20, 40, ((11, 30),)) for i in range(n_rows)]
    return m.reserve_request(request_id, rows)


def assert_untouched(w: WorkerRows):
    assert no_rows_bound(w)


def with_row(meta, i, **kw):
    rows = list(meta.rows)
    rows[i] = msgspec.structs.replace(rows[i], **kw)
    return msgspec.structs.replace(meta, rows=tuple(rows))


def test_zero_rows_refused():
    w = WorkerRows(BLOCKS, BS, max_rows=2)
    with pytest.raises(MetadataError, match="no rows"):
        w.install(msgspec.structs.replace(reserve(), rows=()))
    assert_untouched(w)


def test_duplicate_row_ids_refused():
    w = WorkerRows(BLOCKS, BS, max_rows=2)
    meta = reserve()
    with pytest.raises(MetadataError, match="row id 0 appears 2 times"):
        w.install(with_row(meta, 1, row_id=0))
    assert_untouched(w)


@pytest.mark.parametrize("field, value, match", [
    ("generation", -1, "generation"),
    ("generation", 0, "generation"),
    ("generation", True, "generation"),
    ("generation", 1.0, "generation"),
    ("request_id", "", "request id"),
    ("request_id", 7, "request id"),
])
def test_bad_stamps_refused(field, value, match):
    w = WorkerRows(BLOCKS, BS, max_rows=2)
    with pytest.raises(MetadataError, match=match):
        w.install(msgspec.structs.replace(reserve(), **{field: value}))
    assert_untouched(w)


@pytest.mark.parametrize("bad", [True, False, 1.0, "1", None])
def test_non_int_block_ids_refused(bad):
    """A bool is an int in Python (`True == 1` passes a range check): refuse it by type."""
    w = WorkerRows(BLOCKS, BS, max_rows=2)
    meta = reserve()
    ids = (bad,) + meta.rows[0].block_ids[1:]
    with pytest.raises(MetadataError, match="block ids must be ints"):
        w.install(with_row(meta, 0, block_ids=ids))
    assert_untouched(w)


@settings(max_examples=60, deadline=None)
@given(n_rows=st.integers(0, 3), row_ids=st.lists(st.integers(0, 3), min_size=3, max_size=3),
       generation=st.one_of(st.integers(-3, 3), st.booleans()), request_id=st.sampled_from(["", "a", "b"]),
       block=st.one_of(st.integers(-2, BLOCKS + 1), st.booleans()))
def test_install_accepts_exactly_the_valid_snapshots(n_rows, row_ids, generation, request_id, block):
    """Property: install succeeds iff the snapshot is well-formed; a refusal changes nothing."""
    meta = reserve(n_rows=max(n_rows, 1))
    rows = tuple(msgspec.structs.replace(r, row_id=row_ids[i]) for i, r in enumerate(meta.rows[:n_rows]))
    if rows:
        rows = (msgspec.structs.replace(rows[0], block_ids=(block,) + rows[0].block_ids[1:]),) + rows[1:]
    meta = DiffusionKVMetadata(request_id, generation, BS, rows)
    ids = [b for r in rows for b in r.block_ids]
    valid = (n_rows > 0 and len(set(row_ids[:n_rows])) == n_rows
             and type(generation) is int and generation >= 1 and request_id != ""
             and type(block) is int and 0 <= block < BLOCKS
             and len(ids) == len(set(ids)))  # a block id in one place only (unless shared: prefix cache)
    w = WorkerRows(BLOCKS, BS, max_rows=3)
    if valid:
        assert w.install(meta) is True and free_rows(w) == w.max_rows - n_rows
    else:
        with pytest.raises(MetadataError):
            w.install(meta)
        assert_untouched(w)


def test_identity_mismatch_refused_by_rows():
    w = WorkerRows(BLOCKS, BS, max_rows=2)
    with pytest.raises(MetadataError, match="snapshot of request 'b'"):
        w.install(reserve("b"), request_id="a")
    assert_untouched(w)


def bare_worker() -> DiTWorker:
    """A DiTWorker's install/remove/check_rows over real WorkerRows, without a model."""
    w = DiTWorker.__new__(DiTWorker)
    w.parallel, w.rows = ParallelContext.single(), WorkerRows(BLOCKS, BS, max_rows=4)
    return w


def test_identity_mismatch_refused_by_worker():
    w = bare_worker()
    with pytest.raises(MetadataError, match="snapshot of request 'b'"):
        w.install(reserve("b"), request_id="a")
    assert_untouched(w.rows)


def test_batch_start_with_another_requests_metadata_leaves_no_rows():
    """Starting request 'a' with 'b''s snapshot fails and binds nothing (before: 'b''s rows stayed)."""
    stepper = BatchStepper(bare_worker())
    with pytest.raises(MetadataError) as err:
        stepper.start("a", None, SamplingParams(steps=3, guidance=1.0, seed=0), metadata=reserve("b"))
    assert_untouched(stepper.worker.rows)
    assert "snapshot of request 'b'" in str(err.value)
    assert stepper.batch_size == 0
