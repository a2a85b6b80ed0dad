import msgspec
import pytest

from ditkv.core.kv_manager import DiffusionKVCacheManager
from ditkv.core.layout import RowLayout
from ditkv.core.metadata import DiffusionKVMetadata, encode_metadata
from ditkv.errors import AdmissionError, LayoutError


def rows(n=2, seq=40, prefix=10, target=20):
    return [RowLayout(i, prefix, target, seq, ((prefix + 1, prefix + target),)) for i in range(n)]


def mgr(blocks=10, bs=16, max_rows=2, max_len=None):
    return DiffusionKVCacheManager(blocks, bs, max_rows, max_len)


def test_reserve_all_rows_and_metadata():
    m = mgr()
    meta = m.reserve_request("a", rows())
    assert meta.generation == 1 and meta.request_id == "a" and meta.block_size == 16
    assert [len(r.block_ids) for r in meta.rows] == [3, 3]
    ids = [b for r in meta.rows for b in r.block_ids]
    assert len(set(ids)) == 6 and m.pool.num_free == 4
    assert m.num_requests == 1 and m.stats()["requests"] == 1
    assert all(r.num_computed_tokens == 0 for r in meta.rows)
    assert msgspec.msgpack.decode(encode_metadata(meta), type=DiffusionKVMetadata) == meta


def test_generation_increases_per_success_and_readmission():
    m = mgr(blocks=20)
    g1 = m.reserve_request("a", rows()).generation
    g2 = m.reserve_request("b", rows()).generation
    m.free_request("a")
    g3 = m.reserve_request("a", rows()).generation
    assert (g1, g2, g3) == (1, 2, 3)
    assert m.reserve_request("c", rows(seq=150)) is None  # shortage does not consume a generation
    m.free_request("b")
    assert m.reserve_request("d", rows()).generation == 4


def test_temporary_shortage_returns_none_and_takes_nothing():
    m = mgr(blocks=8)
    assert m.reserve_request("a", rows()) is not None  # 6 blocks
    free = m.pool.num_free
    assert m.reserve_request("b", rows()) is None
    assert m.pool.num_free == free and m.num_requests == 1 and m.free_request("b") is False


@pytest.mark.parametrize("kw, r, match", [
    (dict(max_rows=1), rows(2), "rows"),
    (dict(max_len=32), rows(), "max_model_len"),
    (dict(blocks=5), rows(), "required_blocks=6, available_blocks=5"),
])
def test_never_fits_raises_client_safe_error(kw, r, match):
    m = mgr(**kw)
    with pytest.raises(AdmissionError, match=match):
        m.reserve_request("a", r)
    assert m.pool.num_free == m.pool.num_blocks


def test_structural_errors():
    m = mgr(blocks=20)
    with pytest.raises(LayoutError):
        m.reserve_request("", rows())
    with pytest.raises(LayoutError):
        m.reserve_request("a", [])
    with pytest.raises(LayoutError, match="contiguous"):
        m.reserve_request("a", [rows()[1]])
    m.reserve_request("a", rows())
    with pytest.raises(LayoutError, match="already"):
        m.reserve_request("a", rows())
    with pytest.raises(LayoutError, match="num_computed_tokens"):
        m.reserve_request("b", rows(), num_computed_tokens=[11, 0])
    meta = m.reserve_request("c", rows(), num_computed_tokens=[10, 4])
    assert [r.num_computed_tokens for r in meta.rows] == [10, 4]


def test_exception_mid_allocation_rolls_back(monkeypatch):
    m = mgr(blocks=20)
    real = m.pool.allocate
    calls = {"n": 0}

    def flaky(n, owner, tokens=0):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real(n, owner, tokens)

    monkeypatch.setattr(m.pool, "allocate", flaky)
    with pytest.raises(RuntimeError, match="boom"):
        m.reserve_request("a", rows())
    assert m.pool.num_free == 20 and m.pool.tokens_in_use == 0 and m.num_requests == 0
    assert m.generation == 0


def test_free_idempotent_and_close():
    m = mgr(blocks=20)
    m.reserve_request("a", rows())
    m.reserve_request("b", rows(1))
    assert m.free_request("a") is True and m.free_request("a") is False
    assert m.free_request("never") is False
    m.close()
    assert m.pool.num_free == 20 and m.num_requests == 0
    with pytest.raises(RuntimeError, match="closed"):
        m.reserve_request("c", rows())
