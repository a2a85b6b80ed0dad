"""CPU products in fixed shapes (`invariant.cpu_rows`, `torch_backend.tiled_limit_attention`).

CPU BLAS and SDPA pick their kernels, and so their rounding, by shape and instruction set: on an
AVX2 CPU a row of a 5-row GEMM and of a 400-row GEMM get other bits, and so does a query of an
82-key and of a 151-key SDPA; inside one GEMM shape the rows past the last full micro-kernel block
take an edge kernel (MKL on AVX2: rows 30 and 31 of a 32-row GEMM). Every bit-identity claim on the CPU (AR prefix K/V = DiT prefix K/V,
a request alone = batched, dense = paged torch) rests on the properties below, which hold whatever
the CPU: run the suite with ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2 OPENBLAS_CORETYPE=Haswell to force the AVX2 paths on an AVX-512 host.
"""

import pytest
import torch
import torch.nn.functional as F

from ditkv.attention.metadata import key_limits
from ditkv.attention.torch_backend import KV_TILE, Q_TILE, tiled_limit_attention
from ditkv.models.hunyuan import invariant


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("k, n", [(128, 384), (64, 48), (256, 128)])
def test_cpu_linear_rows_do_not_depend_on_the_batch(k, n):
    w, x = _rand(n, k, seed=1) / k ** 0.5, _rand(200, k, seed=2)
    full = invariant.linear(x, w)
    torch.testing.assert_close(full.double(), x.double() @ w.double().T, atol=1e-5, rtol=1e-5)
    for m in (1, 2, 3, 5, 7, 11, 31, 33, 150):  # prefixes of every size
        assert torch.equal(invariant.linear(x[:m], w), full[:m]), m
    for shift in (*range(1, 34), 61):  # the same rows after others: every place in a GEMM's row blocks
        assert torch.equal(invariant.linear(torch.cat([_rand(shift, k, seed=3), x]), w)[shift:], full), shift
    assert torch.equal(invariant.linear(x.view(10, 20, k), w), full.view(10, 20, n))  # leading dims kept
    assert invariant.linear(x[:0], w).shape == (0, n)  # no rows


def _limits(q_start, q_len, spans, b=1):
    return key_limits(q_start, q_len, spans).to(torch.int64)[None].expand(b, -1)


def _reference(q, k, v, lim, scale):
    allowed = torch.arange(k.shape[1])[None, None, :] < lim[:, :, None]
    g = q.shape[2] // k.shape[2]
    qt, kt, vt = (t.transpose(1, 2).double() for t in (q, k, v))
    kt, vt = kt.repeat_interleave(g, 1), vt.repeat_interleave(g, 1)
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=allowed[:, None], scale=scale)
    return out.transpose(1, 2)


S, P = 2 * KV_TILE + 37, Q_TILE + 30
SPANS = ((10, 40), (P + 5, S))  # a span in the prefix, and the image block after it


@pytest.fixture(scope="module")
def qkv():
    return _rand(2, S, 4, 32, seed=4), _rand(2, S, 2, 32, seed=5), _rand(2, S, 2, 32, seed=6)


def test_tiled_attention_is_masked_attention(qkv):
    q, k, v = qkv
    lim = _limits(0, S, SPANS, 2)
    got = tiled_limit_attention(q, k, v, lim, 0.17, 0)
    torch.testing.assert_close(got.double(), _reference(q, k, v, lim, 0.17), atol=1e-5, rtol=1e-5)


def test_a_prefix_computed_alone_has_the_bits_of_the_whole_row(qkv):
    """AR prefill of the prefix (queries and keys [0, P)) vs DiT prefill of the row ([0, S)): the
    prefix queries' outputs are bit-identical (the prefix ends outside every span)."""
    q, k, v = qkv
    whole = tiled_limit_attention(q, k, v, _limits(0, S, SPANS, 2), 0.17, 0)
    prefix = tiled_limit_attention(q[:, :P], k[:, :P], v[:, :P], _limits(0, P, SPANS[:1], 2), 0.17, 0)
    assert torch.equal(prefix, whole[:, :P])


def test_queries_from_an_offset_and_one_row_of_a_batch_keep_their_bits(qkv):
    """An imported prefix (queries start at P), a decode step (one query), one row of two."""
    q, k, v = qkv
    lim = _limits(0, S, SPANS, 2)
    whole = tiled_limit_attention(q, k, v, lim, 0.17, 0)
    assert torch.equal(tiled_limit_attention(q[:, P:], k, v, lim[:, P:], 0.17, P), whole[:, P:])
    assert torch.equal(tiled_limit_attention(q[:, 50:51], k[:, :51], v[:, :51], lim[:, 50:51], 0.17, 50),
                       whole[:, 50:51])
    assert torch.equal(tiled_limit_attention(q[1:], k[1:], v[1:], lim[1:], 0.17, 0), whole[1:])


@pytest.mark.parametrize("starts", [(0, 16), (16, 0), (5, 40), (64, 100)])
def test_rows_starting_inside_the_same_tiles_share_a_call_with_their_own_bits(starts):
    """`TorchBackend` runs rows of one key length whose queries start at different places of the same
    query tiles (a cache hit of a few tokens in one CFG row) as one padded call; each row's output must
    equal that row run alone, bit for bit."""
    from ditkv.attention.metadata import RowPhase, build_paged_metadata
    from ditkv.attention.torch_backend import TorchBackend, _same_tiles

    bs, kv_len, hq, hkv, d = 16, 200, 4, 2, 16
    pages = -(-kv_len // bs)
    pool = _rand(2 * pages, 2, hkv, bs, d, seed=3)
    tables = [list(range(pages)), list(range(pages, 2 * pages))]
    spans = ((120, 150),)
    rows, off = [], 0
    for s in starts:
        rows.append(RowPhase(off, s, kv_len - s, kv_len, spans))
        off += kv_len - s
    q = _rand(off, hq, d, seed=4)
    meta = build_paged_metadata(rows, tables, bs)
    assert _same_tiles(meta) and not meta.homogeneous
    backend = TorchBackend()
    both = backend.paged_attention(q, pool, meta, 0.25)
    for r, row in enumerate(rows):
        alone = build_paged_metadata([RowPhase(0, row.q_start, row.q_len, kv_len, spans)], [tables[r]], bs)
        sl = slice(row.q_offset, row.q_offset + row.q_len)
        assert torch.equal(both[sl], backend.paged_attention(q[sl], pool, alone, 0.25)), r
