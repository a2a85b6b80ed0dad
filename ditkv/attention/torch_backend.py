"""Torch reference backend: runs on any device; the correctness reference for native kernels.

Pool layer view: `kv_layer[num_blocks, 2, num_kv_heads, block_size, head_dim]` (index 0 = K, 1 = V).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..alignment import aligned
from .metadata import PagedAttentionMetadata


def _split_slots(slots: torch.Tensor, block_size: int):
    return slots // block_size, slots % block_size


def gather_kv(kv_layer: torch.Tensor, block_row: torch.Tensor, kv_len: int, block_size: int):
    """Contiguous K, V `[kv_len, Hkv, D]` of one row: gather whole pages, then trim."""
    nb = -(-kv_len // block_size)
    pages = kv_layer.index_select(0, block_row[:nb].to(device=kv_layer.device, dtype=torch.long))
    kv = pages.permute(1, 0, 3, 2, 4).reshape(2, nb * block_size, *pages.shape[2:3], pages.shape[-1])
    return kv[0, :kv_len], kv[1, :kv_len]


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None,
                     scale: float) -> torch.Tensor:
    """q `[B, Lq, Hq, D]`, k/v `[B, Lk, Hkv, D]`, allowed `[B, Lq, Lk]` bool (None = all) -> `[B, Lq, Hq, D]`."""
    hq, hkv = q.shape[2], k.shape[2]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if hq != hkv:  # GQA: query head h reads KV head h // (hq / hkv)
        kt = kt.repeat_interleave(hq // hkv, dim=1)
        vt = vt.repeat_interleave(hq // hkv, dim=1)
    mask = None if allowed is None else allowed[:, None]
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


def segment_attention(q, k, v, causal: bool, scale: float):
    """Causal-or-not primitive: causal is bottom-right aligned (last query sees every key)."""
    if not causal:
        return masked_attention(q, k, v, None, scale)
    lq, lk = q.shape[1], k.shape[1]
    qi = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
    allowed = torch.arange(lk, device=q.device)[None, :] <= qi
    return masked_attention(q, k, v, allowed.expand(q.shape[0], lq, lk), scale)


def fast_segment_attention(q, k, v, causal: bool, scale: float):
    """`segment_attention` without an explicit mask, so SDPA may take its fused kernels (flash,
    cuDNN, memory-efficient): no mask at all for a full segment, the built-in causal flag or a
    lower-right `CausalBias` for a causal one. Same math; other summation order."""
    from torch.nn.attention.bias import causal_lower_right

    hq, hkv = q.shape[2], k.shape[2]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if hq != hkv:
        kt = kt.repeat_interleave(hq // hkv, dim=1)
        vt = vt.repeat_interleave(hq // hkv, dim=1)
    lq, lk = q.shape[1], k.shape[1]
    if not causal:
        out = F.scaled_dot_product_attention(qt, kt, vt, scale=scale)
    elif lq == lk:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
    else:
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=causal_lower_right(lq, lk), scale=scale)
    return out.transpose(1, 2)


def limit_attention(q, k, v, key_limit: torch.Tensor, scale: float, q_start: int):
    """Dense attention with per-query key limits: q `[B, Lq, ...]` at absolute row positions
    `[q_start, q_start + Lq)`, key_limit `[B, Lq]` (absolute, keys start at 0). On the CPU in fixed
    tiles (`tiled_limit_attention`), elsewhere one masked SDPA."""
    if q.device.type == "cpu":
        return tiled_limit_attention(q, k, v, key_limit, scale, q_start)
    lk = k.shape[1]
    allowed = torch.arange(lk, device=q.device)[None, None, :] < key_limit[:, :, None].to(q.device)
    return masked_attention(q, k, v, allowed, scale)


# CPU attention tiles: queries by absolute row position, keys from 0. CPU SDPA (and the BLAS under
# it) blocks by sequence length and instruction set, so a query's bits would depend on how many
# other queries and keys the call holds: an AR prefill of the prefix and a DiT prefill of the whole
# row would write different K/V for the same tokens on an AVX2 CPU. Here every product has one shape
# and a query sits at the same place of its tile whatever else is in the call; key tiles past a
# query's limit are exact no-ops of the online softmax (scale 1, weights 0).
Q_TILE, KV_TILE = 64, 128


def tiled_limit_attention(q, k, v, key_limit: torch.Tensor, scale: float, q_start: int):
    """`limit_attention` in fixed tiles; fp32 math, output in q's dtype."""
    b, lq, hq, d = q.shape
    # contiguous, 64-byte aligned fp32 copies: the tile products then see one memory layout whatever
    # buffer (a page gather, a view at any offset) the caller's q/k/v live in (ditkv/alignment.py)
    qt, kt, vt = (aligned(t.transpose(1, 2).float().contiguous()) for t in (q, k, v))
    if hq != k.shape[2]:  # GQA: query head h reads KV head h // (hq / hkv)
        kt = kt.repeat_interleave(hq // k.shape[2], dim=1)
        vt = vt.repeat_interleave(hq // k.shape[2], dim=1)
    pad = -k.shape[1] % KV_TILE
    if pad:
        kt, vt = F.pad(kt, (0, 0, 0, pad)), F.pad(vt, (0, 0, 0, pad))
    lim = key_limit.to(device=q.device, dtype=torch.int64)
    out = qt.new_empty(b, hq, lq, d)
    for a in range(q_start // Q_TILE * Q_TILE, q_start + lq, Q_TILE):
        lo, hi = max(a, q_start), min(a + Q_TILE, q_start + lq)  # this tile's queries, absolute
        tile = qt.new_zeros(b, hq, Q_TILE, d)
        tile[:, :, lo - a:hi - a] = qt[:, :, lo - q_start:hi - q_start]
        tlim = lim.new_ones(b, Q_TILE)  # padding queries see key 0 only: no empty softmax
        tlim[:, lo - a:hi - a] = lim[:, lo - q_start:hi - q_start]
        out[:, :, lo - q_start:hi - q_start] = _tile_attention(tile, kt, vt, tlim, scale)[:, :, lo - a:hi - a]
    return out.transpose(1, 2).to(q.dtype)


def _tile_attention(q, k, v, lim: torch.Tensor, scale: float):
    """q `[B, H, Q_TILE, D]` over k/v `[B, H, n * KV_TILE, D]`, keys `j < lim [B, Q_TILE]`: online
    softmax over the key tiles that any of its queries sees, in order."""
    m = q.new_full((*q.shape[:3], 1), float("-inf"))
    l, acc = q.new_zeros(m.shape), torch.zeros_like(q)
    cols = torch.arange(KV_TILE, device=q.device)
    for j in range(0, int(lim.max()), KV_TILE):
        s = torch.matmul(q, k[:, :, j:j + KV_TILE].transpose(-1, -2)) * scale
        s = s.masked_fill((j + cols)[None, None, None, :] >= lim[:, None, :, None], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        alpha, p = torch.exp(m - m_new), torch.exp(s - m_new)
        l = l * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + torch.matmul(p, v[:, :, j:j + KV_TILE])
        m = m_new
    return acc / l


class TorchBackend:
    name = "torch"
    supports_paged = True

    def __init__(self, paged_mode: str = "limits"):
        if paged_mode not in ("limits", "segments"):
            raise ValueError(f"paged_mode must be 'limits' or 'segments', got {paged_mode!r}")
        self.paged_mode = paged_mode
        if paged_mode == "segments":
            self.name = "torch-segments"

    def write_kv(self, kv_layer, k, v, slot_mapping):
        bs = kv_layer.shape[3]
        blocks, offs = _split_slots(slot_mapping.to(kv_layer.device), bs)
        kv_layer[blocks, 0, :, offs] = k.to(kv_layer.dtype)
        kv_layer[blocks, 1, :, offs] = v.to(kv_layer.dtype)

    def gather_row(self, kv_layer, meta: PagedAttentionMetadata, r: int, kv_len: int | None = None):
        row = meta.rows[r]
        return gather_kv(kv_layer, meta.block_table[r], kv_len or row.kv_len, meta.block_size)

    def paged_attention(self, q, kv_layer, meta: PagedAttentionMetadata, scale: float):
        """q `[Nq, Hq, D]` packed rows -> `[Nq, Hq, D]`, masking by per-query key limits."""
        out = torch.empty_like(q)
        if meta.homogeneous:  # batched view: one gather + one attention call for all rows
            r0 = meta.rows[0]
            ks, vs = zip(*(self.gather_row(kv_layer, meta, r) for r in range(meta.num_rows)))
            k, v = torch.stack(ks).to(q.dtype), torch.stack(vs).to(q.dtype)
            qb = q.view(meta.num_rows, r0.q_len, *q.shape[1:])
            lim = meta.key_limit.view(meta.num_rows, r0.q_len)
            out.view_as(qb).copy_(limit_attention(qb, k, v, lim, scale, r0.q_start))
            return out
        if q.device.type == "cpu" and _same_tiles(meta):
            return self._padded_rows(q, kv_layer, meta, scale, out)
        for r, row in enumerate(meta.rows):
            sl = slice(row.q_offset, row.q_offset + row.q_len)
            k, v = self.gather_row(kv_layer, meta, r)
            res = limit_attention(q[None, sl], k[None].to(q.dtype), v[None].to(q.dtype),
                                  meta.key_limit[None, sl], scale, row.q_start)
            out[sl] = res[0]
        return out

    def _padded_rows(self, q, kv_layer, meta: PagedAttentionMetadata, scale: float, out):
        """Rows of one key length whose queries start at different places of the same query tiles (a
        prefix-cache hit of a few tokens in one CFG row): one batched call over the union of their
        ranges, each row's missing queries padded (zeros, key limit 1, results dropped). A query keeps
        its place in its absolute tile and its own key limits, so its bits are those of its own call;
        the pad costs nothing extra, as the rows cover the same tiles."""
        lo = min(r.q_start for r in meta.rows)
        hi = max(r.q_start + r.q_len for r in meta.rows)
        ks, vs = zip(*(self.gather_row(kv_layer, meta, r) for r in range(meta.num_rows)))
        k, v = torch.stack(ks).to(q.dtype), torch.stack(vs).to(q.dtype)
        qb = q.new_zeros(meta.num_rows, hi - lo, *q.shape[1:])
        lim = meta.key_limit.new_ones(meta.num_rows, hi - lo)
        for r, row in enumerate(meta.rows):
            a, sl = row.q_start - lo, slice(row.q_offset, row.q_offset + row.q_len)
            qb[r, a:a + row.q_len], lim[r, a:a + row.q_len] = q[sl], meta.key_limit[sl]
        res = limit_attention(qb, k, v, lim, scale, lo)
        for r, row in enumerate(meta.rows):
            a = row.q_start - lo
            out[row.q_offset:row.q_offset + row.q_len] = res[r, a:a + row.q_len]
        return out


def _same_tiles(meta: PagedAttentionMetadata) -> bool:
    """Several rows of one key length whose query ranges cover the same CPU query tiles."""
    r0 = meta.rows[0]
    tiles = lambda r: (r.q_start // Q_TILE, -(-(r.q_start + r.q_len) // Q_TILE))  # noqa: E731
    return meta.num_rows > 1 and all(r.kv_len == r0.kv_len and r.q_len > 0 and tiles(r) == tiles(r0)
                                     for r in meta.rows)
