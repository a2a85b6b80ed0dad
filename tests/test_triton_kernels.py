"""Triton paged-attention kernels against the torch reference backend.

CPU: the kernels run under the Triton interpreter (`TRITON_INTERPRET=1`, set before triton is
imported) at tiny shapes, fp32. GPU (`-m gpu`): bf16 at HunyuanImage-3 shapes.
"""

from __future__ import annotations

import os
import random

import torch  # noqa: E402 - torch's import does not import triton

if not os.environ.get("DITKV_TRITON_GPU_TESTS") and not torch.cuda.is_available():
    # Interpret on a CPU-only machine; must precede triton's import. The variable is process-wide:
    # set on a GPU machine it would turn every later test's kernels into interpreted ones.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from ditkv.attention.metadata import RowPhase, build_paged_metadata  # noqa: E402
from ditkv.attention.torch_backend import TorchBackend  # noqa: E402
from ditkv.attention.triton_backend import AttnConfig, TritonBackend, paged_attention  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
cpu_only = pytest.mark.skipif(not INTERPRET, reason="interpreter tests (TRITON_INTERPRET=1) are CPU-only")


def _row_layout(rng: random.Random, seq_len: int, prefix_len: int, phase: str):
    """Random full-attention spans inside [0, seq_len); the target is one span in denoise rows."""
    spans = []
    cut = sorted(rng.sample(range(1, seq_len), k=min(seq_len - 1, rng.choice([0, 2, 4]))))
    for a, b in zip(cut[::2], cut[1::2]):
        spans.append((a, b))
    if phase == "denoise" and rng.random() < 0.7:
        # target = [prefix, seq): keep prefix spans, the target is (mostly) one full span
        spans = [(a, min(b, prefix_len)) for a, b in spans if a < prefix_len and min(b, prefix_len) > a]
        spans.append((prefix_len + rng.choice([0, 1]), seq_len))
        spans = [(a, b) for a, b in spans if b > a]
    return tuple(spans)


def _scenario(seed: int, hq: int, hkv: int, d: int, bs: int, phase: str, nrows: int, max_len: int = 72):
    rng = random.Random(seed)
    rows, lens = [], []
    off = 0
    for _ in range(nrows):
        seq = rng.randint(2, max_len)
        prefix = rng.randint(1, seq - 1)
        spans = _row_layout(rng, seq, prefix, phase)
        if phase == "prefill":
            q_start, q_len = 0, seq
        else:
            q_start, q_len = prefix, seq - prefix
        rows.append(RowPhase(off, q_start, q_len, seq, spans))
        lens.append(seq)
        off += q_len
    nblocks = [(n + bs - 1) // bs for n in lens]
    total = sum(nblocks) + 3
    perm = list(range(total))
    rng.shuffle(perm)
    ids, at = [], 0
    for n in nblocks:
        ids.append(perm[at:at + n])
        at += n
    meta = build_paged_metadata(rows, ids, bs)
    g = torch.Generator().manual_seed(seed)
    # block-major pool with 3 layers: the layer view is strided, never contiguous
    pool = torch.randn(total, 3, 2, hkv, bs, d, generator=g)
    nq = off
    q = torch.randn(nq, hq, d, generator=g)
    k = torch.randn(nq, hkv, d, generator=g)
    v = torch.randn(nq, hkv, d, generator=g)
    return meta, pool, q, k, v


def _run_both(meta, pool, q, k, v, scale, config=None):
    ref_pool, our_pool = pool.clone(), pool.clone()
    ref_b, our_b = TorchBackend(), TritonBackend(config)
    ref_b.write_kv(ref_pool[:, 1], k, v, meta.slot_mapping)
    our_b.write_kv(our_pool[:, 1], k, v, meta.slot_mapping)
    assert torch.equal(ref_pool, our_pool), "write_kv differs from the torch backend"
    ref = ref_b.paged_attention(q, ref_pool[:, 1], meta, scale)
    out = our_b.paged_attention(q, our_pool[:, 1], meta, scale)
    return out, ref


CASES = [
    # seed, hq, hkv, d, bs, phase, rows
    (1, 4, 4, 16, 16, "prefill", 1),
    (2, 4, 2, 32, 32, "denoise", 2),
    (3, 8, 2, 16, 16, "denoise", 3),
    (4, 4, 1, 16, 64, "prefill", 2),
    (5, 2, 2, 32, 16, "denoise", 1),
    (6, 8, 4, 16, 32, "prefill", 3),
]


@cpu_only
@pytest.mark.parametrize("seed,hq,hkv,d,bs,phase,nrows", CASES)
def test_paged_attention_matches_torch(seed, hq, hkv, d, bs, phase, nrows):
    meta, pool, q, k, v = _scenario(seed, hq, hkv, d, bs, phase, nrows)
    out, ref = _run_both(meta, pool, q, k, v, scale=d ** -0.5)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@cpu_only
@pytest.mark.parametrize("cfg", [
    AttnConfig(block_m=16, block_n=32, group=1, num_warps=4, num_stages=1),  # tile spans 2 pages
    AttnConfig(block_m=32, block_n=16, group=2, num_warps=4, num_stages=1),  # packed heads, split group
    AttnConfig(block_m=16, block_n=16, group=4, num_warps=4, num_stages=1),  # 4 tokens x 4 heads
    AttnConfig(block_m=16, block_n=16, group=1, num_warps=4, num_stages=1, tma=True),  # descriptor loads
])
def test_tile_shapes(cfg):
    meta, pool, q, k, v = _scenario(11, 8, 2, 16, 16, "prefill", 2, max_len=60)
    out, ref = _run_both(meta, pool, q, k, v, scale=0.2, config=cfg)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@cpu_only
@pytest.mark.parametrize("cfg", [None, AttnConfig(block_m=32, block_n=16, group=2, num_warps=4, num_stages=1, tma=True)])
def test_homogeneous_cfg_rows_and_denoise_of_same_pool(cfg):
    """CFG rows (equal layouts), prefill then a denoise step over the same pages."""
    bs, hq, hkv, d = 16, 4, 2, 16
    seq, prefix = 50, 21
    spans = ((prefix + 1, seq),)
    ids = [[5, 0, 7, 2], [1, 6, 3, 4]]
    pre = build_paged_metadata([RowPhase(0, 0, seq, seq, spans), RowPhase(seq, 0, seq, seq, spans)], ids, bs)
    den = build_paged_metadata([RowPhase(0, prefix, seq - prefix, seq, spans),
                                RowPhase(seq - prefix, prefix, seq - prefix, seq, spans)], ids, bs)
    g = torch.Generator().manual_seed(3)
    pool = torch.full((8, 2, 2, hkv, bs, d), float("nan"))  # unwritten slots are NaN: must never leak
    ref_pool = pool.clone()
    ours, ref = TritonBackend(cfg), TorchBackend()
    for meta in (pre, den):
        n = meta.num_tokens
        q, k, v = (torch.randn(n, h, d, generator=g) for h in (hq, hkv, hkv))
        ours.write_kv(pool[:, 0], k, v, meta.slot_mapping)
        ref.write_kv(ref_pool[:, 0], k, v, meta.slot_mapping)
        out = ours.paged_attention(q, pool[:, 0], meta, 0.25)
        exp = ref.paged_attention(q, ref_pool[:, 0], meta, 0.25)
        assert not out.isnan().any()
        torch.testing.assert_close(out, exp, atol=2e-5, rtol=2e-5)


@cpu_only
def test_a_negative_slot_writes_nothing():
    """A decode graph's padded rows carry slot -1: their K/V go nowhere, the real rows' land as usual."""
    from ditkv.attention import triton_backend

    g = torch.Generator().manual_seed(5)
    pool = torch.randn(4, 1, 2, 2, 16, 16, generator=g)  # [blocks, layers, K/V, heads, page, dim]
    before = pool.clone()
    k, v = torch.randn(3, 2, 16, generator=g), torch.randn(3, 2, 16, generator=g)
    triton_backend.write_kv(pool[:, 0], k, v, torch.tensor([17, -1, 40]))
    want = before.clone()
    TorchBackend().write_kv(want[:, 0], k[[0, 2]], v[[0, 2]], torch.tensor([17, 40]))
    assert torch.equal(pool, want)


@cpu_only
def test_interface():
    b = TritonBackend()
    assert (b.name, b.supports_paged, b.paged_mode) == ("triton", True, "limits")


# --------------------------------------------------------------------------------------------
# GPU: compiled kernels, bf16, real shapes. Run with DITKV_TRITON_GPU_TESTS=1 pytest -m gpu.

gpu = pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(),
                         reason="needs CUDA and compiled triton (TRITON_INTERPRET unset)")


def _gpu_case(rows_spec, hq, hkv, d, bs, seed, dtype=torch.bfloat16):
    """rows_spec: list of (q_start, q_len, kv_len, spans). Prefix K/V are random; the phase writes the rest."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    rows, off = [], 0
    for q_start, q_len, kv_len, spans in rows_spec:
        rows.append(RowPhase(off, q_start, q_len, kv_len, spans))
        off += q_len
    nblocks = [(r.kv_len + bs - 1) // bs for r in rows]
    total = sum(nblocks) + 5
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed)).tolist()
    ids, at = [], 0
    for n in nblocks:
        ids.append(perm[at:at + n])
        at += n
    meta = build_paged_metadata(rows, ids, bs, device=dev)
    pool = torch.randn(total, 2, 2, hkv, bs, d, device=dev, dtype=dtype, generator=g)
    q = torch.randn(off, hq, d, device=dev, dtype=dtype, generator=g)
    k = torch.randn(off, hkv, d, device=dev, dtype=dtype, generator=g)
    v = torch.randn(off, hkv, d, device=dev, dtype=dtype, generator=g)
    return meta, pool, q, k, v


def _check_gpu(meta, pool, q, k, v, config=None):
    ours, ref = TritonBackend(config), TorchBackend()
    ref_pool = pool.clone()
    ours.write_kv(pool[:, 1], k, v, meta.slot_mapping)
    ref.write_kv(ref_pool[:, 1], k, v, meta.slot_mapping)
    assert torch.equal(pool, ref_pool)
    scale = q.shape[-1] ** -0.5
    out = ours.paged_attention(q, pool[:, 1], meta, scale)
    exp = ref.paged_attention(q.float(), ref_pool[:, 1].float(), meta, scale)
    err = ((out.float() - exp).norm() / exp.norm()).item()
    assert err < 1e-2, err
    assert not out.isnan().any()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("bs", [16, 64, 256])
def test_gpu_denoise_hunyuan_shape(bs):
    p, t = 1024, 1025
    spans = ((p, p + t),)
    spec = [(p, t, p + t, spans)] * 2
    _check_gpu(*_gpu_case(spec, 32, 8, 128, bs, seed=bs))


@pytest.mark.gpu
@gpu
def test_gpu_prefill_mixed_mask_heterogeneous():
    spec = [(0, 1300, 1300, ((300, 1300),)), (0, 777, 777, ((100, 200), (301, 777))), (0, 64, 64, ())]
    _check_gpu(*_gpu_case(spec, 32, 8, 128, 64, seed=7))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("cfg", [
    AttnConfig(block_m=128, block_n=64, group=4, num_warps=8, num_stages=3),
    AttnConfig(block_m=64, block_n=128, group=1, num_warps=4, num_stages=2),
    AttnConfig(block_m=128, block_n=32, group=1, num_warps=8, num_stages=3, tma=True),
    AttnConfig(block_m=128, block_n=32, group=4, num_warps=4, num_stages=3),
])
def test_gpu_tile_configs(cfg):
    spec = [(200, 333, 533, ((201, 533),)), (0, 600, 600, ((100, 600),))]
    _check_gpu(*_gpu_case(spec, 16, 4, 64, 32, seed=9), config=cfg)


@pytest.mark.gpu
@gpu
def test_gpu_fp16_head64():
    spec = [(512, 1025, 1537, ((512, 1537),))] * 2
    _check_gpu(*_gpu_case(spec, 16, 2, 64, 128, seed=5, dtype=torch.float16))


@cpu_only
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prefill_starting_inside_a_span_matches_the_whole_row(seed):
    """A prefix-cache hit may end inside a full-attention span (docs/prefix-cache.md): the first step's
    queries then start inside it and must see the whole span, the cached keys and the new ones. Rows
    with different starts in one call, against the torch backend and against the row computed whole."""
    rng = random.Random(seed)
    hq, hkv, d, bs = 4, 2, 16, 16
    seq, spans = 90, ((5, 69), (76, 90))
    starts = [rng.choice([16, 32, 48, 64]) for _ in range(2)]
    whole = build_paged_metadata([RowPhase(i * seq, 0, seq, seq, spans) for i in range(2)],
                                 [list(range(i * 6, i * 6 + 6)) for i in range(2)], bs)
    g = torch.Generator().manual_seed(seed)
    pool = torch.zeros(12, 2, hkv, bs, d)
    q, k, v = (torch.randn(2 * seq, h, d, generator=g) for h in (hq, hkv, hkv))
    b = TritonBackend()
    b.write_kv(pool, k, v, whole.slot_mapping)
    ref_whole = TorchBackend().paged_attention(q, pool, whole, d ** -0.5)
    rows, off, take = [], 0, []
    for i, s in enumerate(starts):
        rows.append(RowPhase(off, s, seq - s, seq, spans))
        take.append(torch.arange(i * seq + s, (i + 1) * seq))
        off += seq - s
    part = build_paged_metadata(rows, [list(range(i * 6, i * 6 + 6)) for i in range(2)], bs)
    take = torch.cat(take)
    assert torch.equal(part.key_limit, whole.key_limit[take])
    out = b.paged_attention(q[take], pool, part, d ** -0.5)
    ref = TorchBackend().paged_attention(q[take], pool, part, d ** -0.5)
    assert torch.equal(ref, ref_whole[take])  # the torch tiles sit at absolute positions: the same bits
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_a_query_gives_the_same_bits_wherever_its_range_starts(dtype):
    """A prefix-cache hit starts a row's first step later, which shifts the row's query tiles: whether a key
    tile runs masked then depends on other queries, and the masked and unmasked paths must give the same
    bits (docs/prefix-cache.md "Bit identity"). The same row from 0 and from several starts."""
    seq, spans, bs = 700, ((37, 421),), 64
    meta, pool, q, _, _ = _gpu_case([(0, seq, seq, spans)], 8, 2, 64, bs, seed=3, dtype=dtype)
    b = TritonBackend()
    whole = b.paged_attention(q, pool[:, 1], meta, 64 ** -0.5)
    for start in (64, 128, 192, 320, 448):  # page-aligned hits, inside the span and after it
        part = build_paged_metadata([RowPhase(0, start, seq - start, seq, spans)],
                                    [meta.block_table[0].tolist()], bs, device=q.device)
        out = b.paged_attention(q[start:].contiguous(), pool[:, 1], part, 64 ** -0.5)
        assert torch.equal(out, whole[start:]), start
