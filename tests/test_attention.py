import math
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ditkv.attention.adapter import PagedAttentionAdapter
from ditkv.attention.backend import select_backend
from ditkv.attention.metadata import RowPhase, build_paged_metadata, key_limits
from ditkv.attention.planner import Segment, plan_row
from ditkv.attention.torch_backend import TorchBackend
from ditkv.errors import BackendError
from ditkv.worker.page_pool import LAYER_MAJOR, PagePool


def test_planner_reference_example():
    # queries 3..8, seq_len 9, span (5, 8): causal [3,5) sees K[:5], full [5,8) sees K[:8], causal [8,9) K[:9]
    segs = plan_row(RowPhase(0, 3, 6, 9, ((5, 8),)))
    assert segs == [Segment(3, 5, 5, True), Segment(5, 8, 8, False), Segment(8, 9, 9, True)]


def test_planner_span_partially_before_queries():
    # denoise: queries = target [10, 30); the span (11, 30) -> causal [10,11), full [11,30)
    assert plan_row(RowPhase(0, 10, 20, 30, ((11, 30),))) == [Segment(10, 11, 11, True), Segment(11, 30, 30, False)]
    # queries inside a span that began earlier still see up to the span end
    assert plan_row(RowPhase(0, 12, 4, 30, ((11, 30),))) == [Segment(12, 16, 30, False)]


def naive(q_rows, k_rows, v_rows, rows, scale):
    """Reference with explicit softmax (no SDPA): query at position i sees keys j < limit(i)."""
    outs = []
    for q, k, v, r in zip(q_rows, k_rows, v_rows, rows):
        lim = key_limits(r.q_start, r.q_len, r.spans)
        g = q.shape[1] // k.shape[1]
        kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)  # [L, Hq, D]
        s = torch.einsum("thd,lhd->htl", q, kk) * scale
        s = s.masked_fill(torch.arange(k.shape[0])[None, None, :] >= lim[None, :, None], float("-inf"))
        outs.append(torch.einsum("htl,lhd->thd", torch.softmax(s, -1), vv))
    return torch.cat(outs)


def random_case(rng, n_rows, same, bs, hq, hkv, d, num_blocks=64, layout="block_major", phase=None):
    torch.manual_seed(rng.randrange(1 << 30))
    pool = PagePool(num_blocks, 2, hkv, bs, d, torch.float32, "cpu", layout=layout)
    perm = list(range(num_blocks))
    rng.shuffle(perm)
    rows, tables, k_rows, v_rows = [], [], [], []
    base = None
    off = 0
    for _ in range(n_rows):
        if same and base is not None:
            seq, prefix, target, spans, ph = base
        else:
            prefix = rng.randrange(0, 40)
            target = rng.randrange(1, 40)
            seq = prefix + target + rng.randrange(0, 3)
            a = rng.randrange(prefix, prefix + target)
            spans = ((a, prefix + target),) if rng.random() < 0.8 else ()
            ph = phase or rng.choice(["prefill", "denoise"])
            base = (seq, prefix, target, spans, ph)
        nb = -(-seq // bs)
        ids = [perm.pop() for _ in range(nb)]
        if ph == "prefill":
            r = RowPhase(off, 0, seq, seq, spans)
        else:
            r = RowPhase(off, prefix, target, prefix + target, spans)
        rows.append(r)
        tables.append(ids)
        k_rows.append(torch.randn(seq, hkv, d))
        v_rows.append(torch.randn(seq, hkv, d))
        off += r.q_len
    meta = build_paged_metadata(rows, tables, bs)
    # pre-fill each row's pages with its full K/V (the retained prefix), then the phase writes its span
    be = TorchBackend()
    for layer in range(2):
        for r, ids, k, v in zip(rows, tables, k_rows, v_rows):
            pos = torch.arange(k.shape[0])
            slots = torch.tensor(ids)[pos // bs] * bs + pos % bs
            be.write_kv(pool.layer(layer), k, v, slots)
    q = torch.randn(meta.num_tokens, hq, d)
    kq = torch.cat([k[r.q_start:r.q_start + r.q_len] for k, r in zip(k_rows, rows)])
    vq = torch.cat([v[r.q_start:r.q_start + r.q_len] for v, r in zip(v_rows, rows)])
    q_rows = [q[r.q_offset:r.q_offset + r.q_len] for r in rows]
    return pool, meta, q, kq, vq, q_rows, k_rows, v_rows, rows


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), n_rows=st.integers(1, 3), same=st.booleans(),
       bs=st.sampled_from([16, 32, 64]), g=st.sampled_from([1, 2, 4]),
       mode=st.sampled_from(["torch", "torch-segments"]), layout=st.sampled_from(["block_major", LAYER_MAJOR]))
def test_paged_adapter_matches_naive(seed, n_rows, same, bs, g, mode, layout):
    rng = random.Random(seed)
    hkv, d = 2, 8
    pool, meta, q, kq, vq, q_rows, k_rows, v_rows, rows = random_case(rng, n_rows, same, bs, hkv * g, hkv, d,
                                                                       layout=layout)
    scale = 1 / math.sqrt(d)
    adapter = PagedAttentionAdapter(select_backend(mode, "cpu", paged=True), pool, meta, scale)
    out = adapter(1, q, kq, vq)
    ref = naive(q_rows, k_rows, v_rows, rows, scale)
    assert meta.homogeneous == (same or n_rows == 1) or not same
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_heterogeneous_segments_path_is_exercised_directly():
    """Rows of different lengths in one adapter call: gather/scatter path equals limits path."""
    rng = random.Random(3)
    pool, meta, q, kq, vq, q_rows, k_rows, v_rows, rows = random_case(rng, 3, False, 16, 4, 2, 8)
    assert not meta.homogeneous
    seg = PagedAttentionAdapter(TorchBackend("segments"), pool, meta, 0.3)(0, q, kq, vq)
    lim = PagedAttentionAdapter(TorchBackend("limits"), pool, meta, 0.3)(0, q, kq, vq)
    torch.testing.assert_close(seg, lim, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(seg, naive(q_rows, k_rows, v_rows, rows, 0.3), atol=1e-5, rtol=1e-5)


def test_denoise_writes_only_the_target_pages():
    rng = random.Random(5)
    pool, meta, q, kq, vq, *_ = random_case(rng, 2, True, 16, 4, 2, 8, phase="denoise")
    before = pool.kv.clone()
    PagedAttentionAdapter(TorchBackend(), pool, meta, 0.3)(0, q, kq * 2, vq * 2)
    changed = (pool.kv != before).any(dim=(1, 2, 3, 5)) if pool.layout == "block_major" else None
    written = torch.zeros_like(changed)
    bs = meta.block_size
    for s in meta.slot_mapping.tolist():
        written[s // bs, s % bs] = True
    assert changed.any() and not (changed & ~written).any()  # nothing outside the target slots changed
    assert not (pool.kv[:, 1] != before[:, 1]).any()  # other layers untouched


def test_backend_selection_is_explicit():
    assert select_backend("auto", "cpu", paged=True).name == "torch"
    with pytest.raises(BackendError, match="CUDA"):
        select_backend("triton", "cpu", paged=True)
    with pytest.raises(BackendError, match="unknown"):
        select_backend("flash", "cpu", paged=True)

    class NoPaged:
        name, supports_paged, paged_mode = "x", False, "limits"

    with pytest.raises(RuntimeError, match="no paged support"):
        PagedAttentionAdapter(NoPaged(), None, None, 1.0)
