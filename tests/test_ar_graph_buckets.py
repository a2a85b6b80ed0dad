"""The host side of the AR decode graphs (`worker/ar_graph.py`): what a replay of a padded bucket reads. The
real rows get exactly the metadata the eager pass builds for one-token decodes (`build_paged_metadata`);
the padding rows read key 0 of page 0 and write nowhere (slot -1). The replay itself needs CUDA
(tools/gpu_ar_smoke.py)."""

import pytest
import torch

from ditkv.attention.metadata import RowPhase, build_paged_metadata
from ditkv.worker.ar_graph import _pow2, bucket_inputs


def test_real_rows_get_the_eager_metadata_and_padding_writes_nowhere():
    bs, tables, positions, ids = 16, [[7, 3, 9], [2], [5, 8]], [40, 3, 17], [11, 12, 13]
    host, meta = bucket_inputs(ids, positions, tables, rows=4, width=4, block_size=bs)
    eager = build_paged_metadata([RowPhase(i, p, 1, p + 1, ()) for i, p in enumerate(positions)], tables, bs)
    for k in ("q_start", "kv_lens", "key_limit", "slot_mapping"):
        assert getattr(eager, k).tolist() == meta[k][:3].tolist(), k
    for i, t in enumerate(tables):
        assert meta["block_table"][i, :len(t)].tolist() == t and not meta["block_table"][i, len(t):].any()
    assert host["ids"].tolist() == ids + [0] and host["py"].tolist() == positions + [0]
    assert torch.equal(host["py"], host["px"])
    # the padding row: position 0, one key (key 0 of page 0), no write
    assert meta["slot_mapping"][3] == -1 and meta["kv_lens"][3] == 1 and not meta["block_table"][3].any()


def test_a_batch_that_does_not_fit_its_bucket_is_refused():
    with pytest.raises(ValueError, match="do not fit a bucket"):
        bucket_inputs([1, 2, 3], [0, 0, 0], [[1], [2], [3]], rows=2, width=4, block_size=16)
    with pytest.raises(ValueError, match="do not fit a bucket"):
        bucket_inputs([1], [0], [[1, 2, 3]], rows=1, width=2, block_size=16)


def test_row_counts_round_up_to_powers_of_two():
    assert [_pow2(n) for n in (1, 2, 3, 4, 5, 16, 17, 64)] == [1, 2, 4, 4, 8, 16, 32, 64]
