import copy

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ditkv.core.block_pool import FREE, BlockPool


def test_allocate_free_counts_and_owner():
    p = BlockPool(8, 16)
    a = p.allocate(3, owner=7, tokens=40)
    assert a.tolist() == [0, 1, 2] and p.num_free == 5 and p.num_used == 3
    assert (p.owner[a] == 7).all() and (p.ref_count[a] == 1).all()
    st_ = p.stats()
    assert st_["high_water_blocks"] == 3 and st_["internal_waste"] == pytest.approx((48 - 40) / 48)
    assert p.free(a, tokens=40) == 3 and p.num_free == 8 and (p.owner == FREE).all()
    assert p.stats()["internal_waste"] == 0.0 and p.stats()["high_water_blocks"] == 3


def test_freed_blocks_return_sorted_to_the_tail():
    p = BlockPool(6, 16)
    a = p.allocate(4, 1)
    p.free(np.array([3, 0, 2]))  # unsorted release
    assert p.allocate(3, 2).tolist() == [4, 5, 0]  # hand-out order: the old tail, then the freed ids sorted
    assert p.allocate(2, 2).tolist() == [2, 3] and p.num_free == 0
    del a


def test_shortage_and_double_free_raise():
    p = BlockPool(4, 16)
    with pytest.raises(ValueError, match="cannot allocate"):
        p.allocate(5, 1)
    a = p.allocate(2, 1)
    p.free(a)
    with pytest.raises(ValueError, match="double free"):
        p.free(a)
    b = p.allocate(2, 1)
    with pytest.raises(ValueError, match="double free"):
        p.free(np.array([b[0], b[0]]))
    assert p.num_free == 2  # the failed free changed nothing


def test_refcount_sharing():
    p = BlockPool(4, 16)
    a = p.allocate(2, 1)
    p.incref(a)
    assert p.free(a) == 0 and p.num_free == 2  # still leased
    assert p.free(a) == 2 and p.num_free == 4
    with pytest.raises(ValueError):
        p.incref(a)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 9)), max_size=60), st.integers(1, 23))
def test_ring_buffer_never_loses_or_duplicates(ops, n):
    p = BlockPool(n, 16)
    held = []
    for alloc, k in ops:
        if alloc and k <= p.num_free:
            held.append(p.allocate(k, 1))
        elif held:
            p.free(held.pop(k % len(held)))
        ids = copy.deepcopy(p).allocate(p.num_free, 2)  # the whole free queue, as a copy would hand it out
        used = np.concatenate(held) if held else np.zeros(0, np.int64)
        assert np.unique(ids).size == ids.size == p.num_free
        assert (p.owner[ids] == FREE).all() and (p.owner[used] != FREE).all()
        assert sorted(ids.tolist() + used.tolist()) == list(range(n))
        assert p.num_free + p.num_used == n
