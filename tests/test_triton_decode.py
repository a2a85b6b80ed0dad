"""The split-KV decode kernel (`attention/triton_decode.py`): one-query rows (AR decode) against the
torch backend, mixed with prefill rows in one call, and batch-invariant bit for bit: a decode row's
output does not depend on the other rows, the block table's width, or a prefill row in the call.

CPU: the Triton interpreter (fp32, tiny shapes). GPU (`-m gpu`): bf16 at the release's GQA shape.
"""

from __future__ import annotations

import os

import torch

if not os.environ.get("DITKV_TRITON_GPU_TESTS") and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's import (see test_triton_kernels.py)

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from ditkv.attention import triton_backend  # noqa: E402
from ditkv.attention.metadata import RowPhase, build_paged_metadata  # noqa: E402
from ditkv.attention.torch_backend import TorchBackend  # noqa: E402
from ditkv.attention.triton_backend import TritonBackend  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _case(lens, q_lens, hq, hkv, d, bs, device, dtype, seed=0, width=None):
    """Rows with keys [0, len) whose last q_len tokens are queries (causal: no spans), pages shuffled."""
    g = torch.Generator().manual_seed(seed)
    rows, ids, off = [], [], 0
    need = [-(-n // bs) for n in lens]
    perm = torch.randperm(sum(need) + 2, generator=g).tolist()
    at = 0
    for n, ql, k in zip(lens, q_lens, need):
        rows.append(RowPhase(off, n - ql, ql, n, ()))
        ids.append(perm[at:at + k] + [0] * ((width or k) - k))  # a wider table (a graph bucket) pads with 0
        at += k
        off += ql
    meta = build_paged_metadata(rows, ids, bs, device)
    pool = torch.randn(len(perm), 2, hkv, bs, d, generator=g).to(device, dtype)
    q = torch.randn(off, hq, d, generator=g).to(device, dtype)
    return meta, pool, q


def _attn(meta, pool, q, backend):
    return backend.paged_attention(q, pool, meta, q.shape[-1] ** -0.5)


CPU = pytest.mark.skipif(not INTERPRET, reason="interpreter tests (TRITON_INTERPRET=1) are CPU-only")


@CPU
@pytest.mark.parametrize("lens,q_lens,hq,hkv,bs", [
    ([1], [1], 4, 1, 16),                # a row's very first token
    ([77, 33, 5], [1, 1, 1], 8, 2, 16),  # decode rows of several splits (chunk 32 keys)
    ([50, 40, 70], [1, 12, 1], 4, 2, 16),  # decode rows beside a prefill chunk
    ([100], [1], 4, 4, 32),
])
def test_decode_rows_match_torch(lens, q_lens, hq, hkv, bs):
    meta, pool, q = _case(lens, q_lens, hq, hkv, 16, bs, "cpu", torch.float32)
    torch.testing.assert_close(_attn(meta, pool, q, TritonBackend()), _attn(meta, pool, q, TorchBackend()),
                               atol=2e-5, rtol=2e-5)


def _alone_vs_batched(device, dtype, hq, hkv, d, bs, lens):
    """Row 0 (a decode row) alone with an exact table, then beside others with a wider table and a
    prefill row: bit for bit the same output."""
    meta, pool, q = _case(lens[:1], [1], hq, hkv, d, bs, device, dtype, seed=3)
    alone = _attn(meta, pool, q, TritonBackend())
    more = len(lens) - 1
    q_lens = [1] + [1 + (i % 2) * 9 for i in range(more)]  # decode and prefill rows
    big_meta, big_pool, big_q = _case(lens, q_lens, hq, hkv, d, bs, device, dtype, seed=4,
                                      width=2 * -(-max(lens) // bs))
    # row 0 of the batch has row 0's keys and query: copy them into its pages
    for j, (src, dst) in enumerate(zip(meta.block_table[0].tolist(), big_meta.block_table[0].tolist())):
        if j < -(-lens[0] // bs):
            big_pool[dst] = pool[src]
    big_q[0] = q[0]
    batched = _attn(big_meta, big_pool, big_q, TritonBackend())
    return alone[0], batched[0]


@CPU
def test_decode_row_is_batch_invariant_cpu():
    a, b = _alone_vs_batched("cpu", torch.float32, 8, 2, 16, 16, [70, 20, 90, 33])
    assert torch.equal(a, b)


@CPU
def test_general_kernel_still_serves_decode_rows_when_switched_off(monkeypatch):
    meta, pool, q = _case([70, 30], [1, 1], 8, 2, 16, 16, "cpu", torch.float32)
    monkeypatch.setattr(triton_backend, "SPLIT_DECODE", False)
    torch.testing.assert_close(_attn(meta, pool, q, TritonBackend()), _attn(meta, pool, q, TorchBackend()),
                               atol=2e-5, rtol=2e-5)


gpu = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs a CUDA device")


@gpu
@pytest.mark.gpu
def test_gpu_decode_release_shape():
    """32 query heads over 8 KV heads, head_dim 128, 64-token pages, bf16: the AR decode's shape."""
    lens = [1000, 1500, 17, 3000]
    meta, pool, q = _case(lens, [1, 1, 1, 1], 32, 8, 128, 64, "cuda", torch.bfloat16)
    out = _attn(meta, pool, q, TritonBackend())
    ref = _attn(meta, pool.float(), q.float(), TorchBackend())
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    a, b = _alone_vs_batched("cuda", torch.bfloat16, 32, 8, 128, 64, [1200, 64, 2500, 700])
    assert torch.equal(a, b)
