"""Triton split-KV decode attention: rows with one query token (the AR phase's decode).

The general kernel (`triton_kernels._paged_attn_kernel`) gives a program one query tile of one row
and walks all of that row's keys: a decode row of 1000 keys is then 8 programs (one per KV head)
walking 16 tiles each, 34 us per layer on an H100 while the GPU idles. Here a row's keys are cut
into fixed `CHUNK`-key splits, one program per (KV head, row, split), each writing its partial
softmax state (running max, sum, unnormalised output); `_decode_combine_kernel` then folds the
splits of each (row, query head) in order.

Why the splits are fixed-size and chosen per row: a row's result then depends only on its own keys,
never on which other rows share the call, how wide the block table is (empty splits add exact
zeros) or whether the step also prefills another row (that row goes to the general kernel, which
skips decode rows). So the AR phase stays batch-invariant and decode CUDA graphs equal eager runs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_kernels import _attn_tile


@triton.jit
def _decode_split_kernel(q_ptr, kv_ptr, part_ptr, ml_ptr, tab_ptr, cu_q_ptr, kv_lens_ptr, limit_ptr,
                         scale_log2, n_splits, n_heads,
                         s_qt, s_qh, s_tab, s_blk, s_kv, s_h, s_t,
                         G: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                         BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, DOT_PREC: tl.constexpr):
    hkv = tl.program_id(0)
    row = tl.program_id(1)
    split = tl.program_id(2)
    lo = tl.load(cu_q_ptr + row)
    if tl.load(cu_q_ptr + row + 1) - lo != 1:  # not a decode row: the general kernel's
        return
    m = tl.arange(0, BLOCK_M)
    head = hkv * G + m
    valid = m < G  # the GQA group's query heads, padded to a dot's 16 rows
    d = tl.arange(0, D)
    q = tl.load(q_ptr + lo.to(tl.int64) * s_qt + head[:, None] * s_qh + d[None, :], mask=valid[:, None], other=0.0)
    end = tl.minimum(tl.load(limit_ptr + lo), tl.load(kv_lens_ptr + row))
    start = split * CHUNK
    stop = tl.minimum(start + CHUNK, end)
    lim = tl.full([BLOCK_M], 0, tl.int32) + stop
    tab_row_ptr = tab_ptr + row.to(tl.int64) * s_tab
    head_off = hkv.to(tl.int64) * s_h
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start_n in range(start, stop, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        acc, l_i, m_i = _attn_tile(acc, l_i, m_i, q, kv_ptr, None, tab_row_ptr, start_n, stop, lim,
                                   s_blk, s_kv, s_t, head_off, 0, 0, 0, scale_log2,
                                   PAGE, BLOCK_N, D, True, DOT_PREC, False)
    # partials [rows, heads, splits, D] and (max, sum) [rows, heads, splits, 2]
    slot = (row.to(tl.int64) * n_heads + head) * n_splits + split
    tl.store(part_ptr + slot[:, None] * D + d[None, :], acc, mask=valid[:, None])
    tl.store(ml_ptr + slot * 2, m_i, mask=valid)
    tl.store(ml_ptr + slot * 2 + 1, l_i, mask=valid)


@triton.jit
def _decode_combine_kernel(part_ptr, ml_ptr, out_ptr, cu_q_ptr, n_splits, n_heads, s_ot, s_oh,
                           D: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    lo = tl.load(cu_q_ptr + row)
    if tl.load(cu_q_ptr + row + 1) - lo != 1:
        return
    d = tl.arange(0, D)
    base = (row.to(tl.int64) * n_heads + head) * n_splits
    m_i = tl.load(ml_ptr + base * 2)  # split 0 always holds keys (a decode query sees itself)
    l_i = tl.load(ml_ptr + base * 2 + 1)
    acc = tl.load(part_ptr + base * D + d)
    for s in range(1, n_splits):
        m_s = tl.load(ml_ptr + (base + s) * 2)
        l_s = tl.load(ml_ptr + (base + s) * 2 + 1)
        m_new = tl.maximum(m_i, m_s)
        a = tl.math.exp2(m_i - m_new)
        b = tl.math.exp2(m_s - m_new)  # an empty split: exp2(-inf) = 0, its zeros add nothing
        acc = acc * a + tl.load(part_ptr + (base + s) * D + d) * b
        l_i = l_i * a + l_s * b
        m_i = m_new
    out = acc / l_i
    tl.store(out_ptr + lo.to(tl.int64) * s_ot + head * s_oh + d, out.to(out_ptr.dtype.element_ty))


def decode_splits(block_table_width: int, page: int, chunk: int) -> int:
    """Splits per row: from the block table's width (fixed within a decode graph's bucket)."""
    return max(1, -(-block_table_width * page // chunk))


def paged_decode(q, kv_layer, meta, scale_log2: float, out, block_n: int, chunk: int, dot_prec: str) -> None:
    """Attention of the decode rows (one query token) of `meta` into `out`; other rows untouched."""
    import torch

    nq, hq, d = q.shape
    hkv, page = kv_layer.shape[2], kv_layer.shape[3]
    g = hq // hkv
    rows = meta.num_rows
    splits = decode_splits(meta.block_table.shape[1], page, chunk)
    part = torch.empty((rows, hq, splits, d), dtype=torch.float32, device=q.device)
    ml = torch.empty((rows, hq, splits, 2), dtype=torch.float32, device=q.device)
    s_blk, s_kv, s_h, s_t = (kv_layer.stride(i) for i in range(4))
    _decode_split_kernel[(hkv, rows, splits)](
        q, kv_layer, part, ml, meta.block_table, meta.cu_q, meta.kv_lens, meta.key_limit,
        scale_log2, splits, hq, q.stride(0), q.stride(1), meta.block_table.stride(0), s_blk, s_kv, s_h, s_t,
        G=g, BLOCK_M=max(16, triton.next_power_of_2(g)), D=d, PAGE=page, BLOCK_N=block_n, CHUNK=chunk,
        DOT_PREC=dot_prec, num_warps=4, num_stages=2)
    _decode_combine_kernel[(rows, hq)](part, ml, out, meta.cu_q, splits, hq, out.stride(0), out.stride(1), D=d,
                                       num_warps=1)
