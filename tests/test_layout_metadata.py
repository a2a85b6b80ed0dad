import msgspec
import pytest
from hypothesis import given, strategies as st

from ditkv.core.layout import RowLayout, validate_rows
from ditkv.core.metadata import DiffusionKVMetadata, RowMetadata, encode_metadata
from ditkv.errors import LayoutError


def test_valid_row_with_gap_and_span():
    r = RowLayout(0, prefix_len=10, target_len=17, seq_len=28, full_attn_spans=((11, 27),))
    assert r.target_end == 27


@pytest.mark.parametrize("kw, match", [
    (dict(prefix_len=-1, target_len=4, seq_len=8), "prefix_len"),
    (dict(prefix_len=0, target_len=0, seq_len=8), "target_len"),
    (dict(prefix_len=0, target_len=4, seq_len=0), "seq_len"),
    (dict(prefix_len=5, target_len=4, seq_len=8), "exceeds seq_len"),
    (dict(prefix_len=2, target_len=4, seq_len=8, full_attn_spans=((3, 9),)), "span"),
    (dict(prefix_len=2, target_len=4, seq_len=8, full_attn_spans=((3, 3),)), "span"),
    (dict(prefix_len=2, target_len=4, seq_len=8, full_attn_spans=((4, 6), (1, 3))), "sorted"),
    (dict(prefix_len=2, target_len=4, seq_len=8, full_attn_spans=((2, 5), (4, 6))), "non-overlapping"),
    (dict(prefix_len=2.0, target_len=4, seq_len=8), "int"),
])
def test_invalid_rows(kw, match):
    with pytest.raises(LayoutError, match=match):
        RowLayout(0, **kw)


def test_request_rows_must_be_contiguous():
    r0 = RowLayout(0, 1, 2, 3)
    with pytest.raises(LayoutError, match="at least one row"):
        validate_rows([])
    with pytest.raises(LayoutError, match="contiguous"):
        validate_rows([r0, RowLayout(2, 1, 2, 3)])
    validate_rows([r0, RowLayout(1, 1, 2, 3)])


rows_st = st.lists(
    st.builds(
        lambda rid, ids, nc, spans: RowMetadata(rid, 3, 5, 9, spans, tuple(ids), nc),
        st.integers(0, 3), st.lists(st.integers(0, 2**31 - 1), max_size=300), st.integers(0, 3),
        st.sampled_from([(), ((4, 8),), ((0, 2), (4, 9))])),
    min_size=1, max_size=3)


@given(rid=st.text(min_size=1, max_size=40), gen=st.integers(1, 2**62), bs=st.sampled_from([16, 64, 256]),
       rows=rows_st)
def test_metadata_roundtrips_exactly(rid, gen, bs, rows):
    m = DiffusionKVMetadata(rid, gen, bs, tuple(rows))
    data = encode_metadata(m)
    assert isinstance(data, bytes)
    back = msgspec.msgpack.decode(data, type=DiffusionKVMetadata)  # as the engine messages decode it
    assert back == m and back.rows == m.rows and back.num_blocks == m.num_blocks
    assert encode_metadata(back) == data


def test_metadata_is_immutable():
    m = DiffusionKVMetadata("r", 1, 16, (RowMetadata(0, 1, 2, 3, (), (0,)),))
    with pytest.raises(AttributeError):
        m.generation = 2
    assert m.same_snapshot(msgspec.structs.replace(m, generation=5))
    assert not m.same_snapshot(msgspec.structs.replace(m, request_id="x"))
