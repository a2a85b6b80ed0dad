import msgspec
import pytest
import torch
from worker_helpers import no_rows_bound

from ditkv.core.kv_manager import DiffusionKVCacheManager
from ditkv.core.layout import RowLayout
from ditkv.core.metadata import DiffusionKVMetadata, RowMetadata
from ditkv.errors import MetadataError
from ditkv.worker.rows import DENOISE, PREFILL, WorkerRows


def make(n_rows=2, seq=40, prefix=10, target=20, blocks=20, bs=16):
    m = DiffusionKVCacheManager(blocks, bs, 2)
    rows = [RowLayout(i, prefix, target, seq, ((prefix + 1, prefix + target),)) for i in range(n_rows)]
    return m, m.reserve_request("a", rows), WorkerRows(blocks, bs, max_rows=2)


def replace_row(meta, **kw):
    return msgspec.structs.replace(meta, rows=(msgspec.structs.replace(meta.rows[0], **kw),) + meta.rows[1:])


def test_install_same_noop_higher_updates_lower_stale():
    _, meta, w = make()
    assert w.install(meta) is True
    assert w.install(meta) is False  # same generation + snapshot: no-op
    newer = msgspec.structs.replace(meta, generation=meta.generation + 5)
    assert w.install(newer) is True and w.get("a").generation == newer.generation
    with pytest.raises(MetadataError, match="stale"):
        w.install(meta)


def test_conflicting_snapshot_rejected_without_change():
    _, meta, w = make()
    w.install(meta)
    other = replace_row(msgspec.structs.replace(meta, generation=meta.generation + 1),
                        block_ids=(7, 8, 9))
    with pytest.raises(MetadataError, match="conflicting"):
        w.install(other)
    assert w.get("a") == meta


@pytest.mark.parametrize("kw, match", [
    (dict(block_ids=(0, 1)), "expected 3"),
    (dict(block_ids=(0, 1, 20)), "outside"),
    (dict(block_ids=(0, -1, 2)), "outside"),
    (dict(num_computed_tokens=11), "num_computed_tokens"),
])
def test_invalid_rows_leave_no_state(kw, match):
    _, meta, w = make()
    with pytest.raises(MetadataError, match=match):
        w.install(replace_row(meta, **kw))
    assert no_rows_bound(w)


def test_row_capacity_and_block_size_checks():
    _, meta, w = make()
    w1 = WorkerRows(20, 16, max_rows=1)
    with pytest.raises(MetadataError, match="free of 1"):
        w1.install(meta)
    with pytest.raises(MetadataError, match="block_size"):
        WorkerRows(20, 32, 2).install(meta)
    with pytest.raises(MetadataError, match="dense_legacy"):
        WorkerRows(20, 16, 2, paged=False).install(meta)
    with pytest.raises(MetadataError, match="no installed paged metadata"):
        w.get("a")


def test_remove_respects_generation_and_never_frees_blocks():
    m, meta, w = make()
    w.install(meta)
    free = m.pool.num_free
    assert w.remove("a", generation=meta.generation + 1) is False
    assert w.remove("a", generation=meta.generation) is True
    assert m.pool.num_free == free and m.num_requests == 1  # scheduler blocks untouched
    assert w.remove("a") is False and no_rows_bound(w)


def test_phase_metadata_and_slot_mapping():
    bs = 16
    meta = DiffusionKVMetadata("r", 1, bs, (
        RowMetadata(0, 10, 20, 33, ((11, 30),), (5, 2, 9), 0),
        RowMetadata(1, 10, 20, 33, ((11, 30),), (0, 7, 3), 4),
    ))
    w = WorkerRows(10, bs, 2)
    w.install(meta)
    pre = w.phase_metadata("r", PREFILL)
    assert [(r.q_start, r.q_len, r.kv_len) for r in pre.rows] == [(0, 33, 33), (4, 29, 33)]
    assert pre.cu_q.tolist() == [0, 33, 62]
    table = [(5, 2, 9), (0, 7, 3)]
    expect = [table[0][p // bs] * bs + p % bs for p in range(0, 33)] + \
             [table[1][p // bs] * bs + p % bs for p in range(4, 33)]
    assert pre.slot_mapping.tolist() == expect
    lim = pre.key_limit[:33].tolist()
    assert lim[:11] == list(range(1, 12)) and lim[11:30] == [30] * 19 and lim[30:] == [31, 32, 33]
    den = w.phase_metadata("r", DENOISE)
    assert [(r.q_start, r.q_len, r.kv_len) for r in den.rows] == [(10, 20, 30), (10, 20, 30)]
    assert den.homogeneous and not pre.homogeneous
    assert den.key_limit.tolist()[:2] == [11, 30]
    assert den.block_table.dtype == torch.int32 and den.block_table.tolist() == [[5, 2, 9], [0, 7, 3]]
    full = w.phase_metadata("r", PREFILL, from_zero=True)
    assert [r.q_start for r in full.rows] == [0, 0]
