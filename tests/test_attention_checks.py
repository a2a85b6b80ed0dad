"""Attention metadata and adapter refuse malformed input before writing a page: a query range
that is empty or runs past the readable keys, and K/V or Q whose shapes do not match the phase."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ditkv.attention.adapter import PagedAttentionAdapter
from ditkv.attention.metadata import RowPhase, build_paged_metadata
from ditkv.attention.torch_backend import TorchBackend
from ditkv.worker.page_pool import PagePool

BS, HKV, D = 16, 2, 8


@pytest.mark.parametrize("row, match", [
    (RowPhase(0, 0, 0, 16, ()), "q_len=0"),  # zero-length query
    (RowPhase(0, 10, 10, 16, ()), "past kv_len=16"),  # queries [10, 20) but only 16 keys readable
    (RowPhase(0, -1, 4, 16, ()), "q_start=-1"),
    (RowPhase(0, 0, 8, 8, ((4, 12),)), "key limit 12"),  # a full span reaches past the readable keys
    (RowPhase(0, 0, 20, 20, ()), "1 blocks"),  # 20 keys need 2 pages of 16
])
def test_malformed_rows_refused(row, match):
    with pytest.raises(ValueError, match=match):
        build_paged_metadata([row], [[0]], BS)


def test_table_count_must_match_rows():
    with pytest.raises(ValueError, match="2 block tables for 1 rows"):
        build_paged_metadata([RowPhase(0, 0, 4, 4, ())], [[0], [1]], BS)


@settings(max_examples=120, deadline=None)
@given(q_start=st.integers(-2, 40), q_len=st.integers(0, 40), kv_len=st.integers(1, 48),
       span=st.one_of(st.none(), st.tuples(st.integers(0, 40), st.integers(1, 60))), pages=st.integers(1, 3))
def test_build_accepts_exactly_the_well_formed_rows(q_start, q_len, kv_len, span, pages):
    """Property: metadata builds iff every query exists, lies inside the readable keys and sees
    only readable keys on pages the table holds; then its key limits never pass kv_len."""
    spans = () if span is None or span[0] >= span[1] else (span,)
    row = RowPhase(0, q_start, q_len, kv_len, spans)
    lim = [next((b for a, b in spans if a <= i < b), i + 1) for i in range(q_start, q_start + q_len)]
    valid = (q_len > 0 and q_start >= 0 and q_start + q_len <= kv_len and max(lim, default=0) <= kv_len
             and kv_len <= pages * BS)
    if not valid:
        with pytest.raises(ValueError):
            build_paged_metadata([row], [list(range(pages))], BS)
        return
    meta = build_paged_metadata([row], [list(range(pages))], BS)
    assert meta.key_limit.tolist() == lim and max(lim) <= kv_len


def case(q_len=20, q_start=0, kv_len=20):
    pool = PagePool(4, 1, HKV, BS, D)
    meta = build_paged_metadata([RowPhase(0, q_start, q_len, kv_len, ())], [[2, 0]], BS)
    return pool, meta


@pytest.mark.parametrize("mode", ["limits", "segments"])
@pytest.mark.parametrize("shape_q, shape_k, shape_v, match", [
    ((20, 4, D), (1, HKV, D), (1, HKV, D), "k has shape"),  # 1-token K/V: would broadcast to every slot
    ((20, 4, D), (20, HKV, D), (1, HKV, D), "v has shape"),
    ((1, 4, D), (20, HKV, D), (20, HKV, D), "q has shape"),
    ((20, 4, D), (20, 1, D), (20, 1, D), "k has shape"),  # wrong KV head count for the pool
    ((20, 4, D), (20, HKV, 4), (20, HKV, 4), "k has shape"),
    ((20, 3, D), (20, HKV, D), (20, HKV, D), "query heads"),  # GQA: Hq must be a multiple of Hkv
])
def test_adapter_checks_shapes_before_writing(mode, shape_q, shape_k, shape_v, match):
    pool, meta = case()
    before = pool.kv.clone()
    adapter = PagedAttentionAdapter(TorchBackend(mode), pool, meta, 0.3)
    with pytest.raises(ValueError, match=match):
        adapter(0, torch.randn(shape_q), torch.randn(shape_k), torch.randn(shape_v))
    assert torch.equal(pool.kv, before), "a page was written before the shape error"


def test_adapter_accepts_matching_shapes():
    pool, meta = case()
    out = PagedAttentionAdapter(TorchBackend(), pool, meta, 0.3)(0, torch.randn(20, 4, D), torch.randn(20, HKV, D),
                                                                torch.randn(20, HKV, D))
    assert out.shape == (20, 4, D) and pool.kv.abs().sum() > 0
