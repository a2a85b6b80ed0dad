"""Triton kernels for the paged DiT KV cache: slot-mapped K/V writes and limit-masked attention.

Pool layer view (see `torch_backend.py`): `kv_layer[num_blocks, 2, num_kv_heads, block_size, head_dim]`,
a strided slice of the block-major pool; only the last dimension must be contiguous.

Attention (`paged_attention_fwd`): one launch per layer call. The grid is
`(kv_heads * head_splits, query tiles of all rows)`; a program owns one query tile of one row and
`GROUP` query heads of one GQA group, packed into the M dimension (`BLOCK_M = BLOCK_Q * GROUP`,
row `m` is token `m // GROUP`, head `m % GROUP`), so each K/V tile it loads serves the whole group.
Per tile the program reads the per-query exclusive key limits, walks KV tiles up to the largest
limit (tiles past it are never loaded) and applies the mask only on the tiles that cross the
smallest limit. KV tiles are loaded page-wise: when `BLOCK_N <= block_size` a tile lies inside one
page (one block-table lookup per tile), otherwise each key row looks its page up. With `USE_TMA`
(sm_90+, `BLOCK_N <= block_size`) the layer is described to the bulk tensor copy engine as rows of
`head_dim` elements and each page tile is one descriptor load.

Both kernels run under `TRITON_INTERPRET=1` on CPU tensors (used by the unit tests).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kv_ptr, slot_ptr, n_tokens,
                     s_kt, s_kh, s_vt, s_vh,
                     s_blk, s_kv, s_h, s_t,
                     PAGE: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_ptr + t, mask=t < n_tokens, other=-1).to(tl.int64)
    tmask = slot >= 0  # a negative slot writes nothing: a padded row of a decode graph (`worker/ar_graph.py`)
    blk = slot // PAGE
    off = slot % PAGE
    d = tl.arange(0, D)
    m2 = tmask[:, None]
    t64 = t.to(tl.int64)
    k = tl.load(k_ptr + t64[:, None] * s_kt + h * s_kh + d[None, :], mask=m2, other=0.0)
    v = tl.load(v_ptr + t64[:, None] * s_vt + h * s_vh + d[None, :], mask=m2, other=0.0)
    dst = kv_ptr + blk[:, None] * s_blk + h * s_h + off[:, None] * s_t + d[None, :]
    tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=m2)
    tl.store(dst + s_kv, v.to(kv_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _kv_tile_offsets(tab_row_ptr, start_n, n_bound, s_blk, s_t, head_off,
                     PAGE: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, BOUNDED: tl.constexpr):
    """Element offsets `[BLOCK_N, D]` of keys `[start_n, start_n + BLOCK_N)` of one row and head."""
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    if BLOCK_N <= PAGE:
        # the tile lies inside one page: one table lookup, one contiguous [BLOCK_N, D] tile
        page = tl.load(tab_row_ptr + start_n // PAGE).to(tl.int64)
        base = page * s_blk + head_off + (start_n % PAGE) * s_t
        offs = base + n[:, None] * s_t + d[None, :]
    else:
        pos = start_n + n
        if BOUNDED:
            page = tl.load(tab_row_ptr + pos // PAGE, mask=pos < n_bound, other=0).to(tl.int64)
        else:
            page = tl.load(tab_row_ptr + pos // PAGE).to(tl.int64)
        offs = (page * s_blk + head_off + (pos % PAGE) * s_t)[:, None] + d[None, :]
    return offs


@triton.jit
def _attn_tile(acc, l_i, m_i, q, kv_ptr, kv_desc, tab_row_ptr, start_n, max_lim, lim, s_blk, s_kv, s_t, head_off,
               r_blk, r_kv, head_row, scale_log2,
               PAGE: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, MASKED: tl.constexpr,
               DOT_PREC: tl.constexpr, USE_TMA: tl.constexpr):
    if MASKED:
        cols = start_n + tl.arange(0, BLOCK_N)
        inb = (cols < max_lim)[:, None]
    if USE_TMA:
        # the pool layer as rows of D elements; a [BLOCK_N, D] tile is one bulk tensor copy
        page = tl.load(tab_row_ptr + start_n // PAGE)
        r0 = page * r_blk + head_row + start_n % PAGE
        k = kv_desc.load([r0, 0])
        v = kv_desc.load([r0 + r_kv, 0])
        if MASKED:  # rows past the last limit may be unwritten slots (NaN): P = 0 must not meet them
            v = tl.where(inb, v, 0.0)
    else:
        offs = _kv_tile_offsets(tab_row_ptr, start_n, max_lim, s_blk, s_t, head_off, PAGE, BLOCK_N, D, MASKED)
        if MASKED:
            k = tl.load(kv_ptr + offs, mask=inb, other=0.0)
            v = tl.load(kv_ptr + offs + s_kv, mask=inb, other=0.0)
        else:
            k = tl.load(kv_ptr + offs)
            v = tl.load(kv_ptr + offs + s_kv)
    qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC)
    if MASKED:
        qk = tl.where(cols[None, :] < lim[:, None], qk, float("-inf"))
    # one expression for both paths (the compiler fuses it into one FMA): whether a key tile runs masked
    # depends on the other queries of the query tile, so a query's bits must not (a prefix-cache hit
    # shifts a row's query tiles; docs/prefix-cache.md "Bit identity")
    m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)
    qk = qk * scale_log2 - m_new[:, None]
    p = tl.math.exp2(qk)
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc, input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def _paged_attn_kernel(q_ptr, kv_ptr, kv_desc, out_ptr, tab_ptr, cu_q_ptr, kv_lens_ptr, limit_ptr,
                       n_rows, scale_log2,
                       s_qt, s_qh, s_ot, s_oh, s_tab,
                       s_blk, s_kv, s_h, s_t, r_blk, r_kv, r_h,
                       G: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                       BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
                       USE_TMA: tl.constexpr, WARP_SPEC: tl.constexpr, SKIP_DECODE: tl.constexpr = False):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP
    SPLITS: tl.constexpr = G // GROUP
    pid_h = tl.program_id(0)
    tile = tl.program_id(1)
    hkv = pid_h // SPLITS
    h0 = hkv * G + (pid_h % SPLITS) * GROUP

    # which row / local query tile does this program own? (rows are few: a scalar scan)
    row = 0
    q_off = 0
    q_len = 0
    local = 0
    base = 0
    for r in range(0, n_rows):
        lo = tl.load(cu_q_ptr + r)
        hi = tl.load(cu_q_ptr + r + 1)
        nt = tl.cdiv(hi - lo, BLOCK_Q)
        hit = (tile >= base) & (tile < base + nt)
        row = tl.where(hit, r, row)
        q_off = tl.where(hit, lo, q_off)
        q_len = tl.where(hit, hi - lo, q_len)
        # last tiles first: in causal rows they hold the most work
        local = tl.where(hit, nt - 1 - (tile - base), local)
        base += nt
    if tile >= base:
        return
    if SKIP_DECODE:  # one-query rows go to the split-KV decode kernel (`triton_decode.py`)
        if q_len == 1:
            return

    m = tl.arange(0, BLOCK_M)
    tok = local * BLOCK_Q + m // GROUP
    head = h0 + m % GROUP
    valid = tok < q_len
    gtok = (q_off + tok).to(tl.int64)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + gtok[:, None] * s_qt + head[:, None] * s_qh + d[None, :], mask=valid[:, None], other=0.0)

    kv_len = tl.load(kv_lens_ptr + row)
    lim = tl.load(limit_ptr + gtok, mask=valid, other=0)
    lim = tl.minimum(lim, kv_len)
    max_lim = tl.max(lim, 0)
    lim = tl.where(valid, lim, max_lim)  # padding rows see what the tile sees: no empty rows
    min_lim = tl.min(lim, 0)
    full_end = (min_lim // BLOCK_N) * BLOCK_N

    tab_row_ptr = tab_ptr + row.to(tl.int64) * s_tab
    head_off = hkv.to(tl.int64) * s_h
    head_row = hkv * r_h
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start_n in tl.range(0, full_end, BLOCK_N, warp_specialize=WARP_SPEC):  # below every limit: no mask
        start_n = tl.multiple_of(start_n, BLOCK_N)
        acc, l_i, m_i = _attn_tile(acc, l_i, m_i, q, kv_ptr, kv_desc, tab_row_ptr, start_n, max_lim, lim,
                                   s_blk, s_kv, s_t, head_off, r_blk, r_kv, head_row, scale_log2,
                                   PAGE, BLOCK_N, D, False, DOT_PREC, USE_TMA)
    for start_n in range(full_end, max_lim, BLOCK_N):  # tiles crossing some limit: masked
        start_n = tl.multiple_of(start_n, BLOCK_N)
        acc, l_i, m_i = _attn_tile(acc, l_i, m_i, q, kv_ptr, kv_desc, tab_row_ptr, start_n, max_lim, lim,
                                   s_blk, s_kv, s_t, head_off, r_blk, r_kv, head_row, scale_log2,
                                   PAGE, BLOCK_N, D, True, DOT_PREC, USE_TMA)
    acc = acc / l_i[:, None]
    tl.store(out_ptr + gtok[:, None] * s_ot + head[:, None] * s_oh + d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=valid[:, None])
