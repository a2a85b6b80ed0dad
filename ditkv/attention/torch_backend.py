"""Torch reference backend: runs on any device; the correctness reference for native kernels.

Pool layer view: `kv_layer[num_blocks, 2, num_kv_heads, block_size, head_dim]` (index 0 = K, 1 = V).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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


def limit_attention(q, k, v, key_limit: torch.Tensor, scale: float):
    """Dense attention with per-query key limits: q `[B, Lq, ...]`, key_limit `[B, Lq]` (absolute, keys start at 0)."""
    lk = k.shape[1]
    allowed = torch.arange(lk, device=q.device)[None, None, :] < key_limit[:, :, None].to(q.device)
    return masked_attention(q, k, v, allowed, scale)


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
            out.view_as(qb).copy_(limit_attention(qb, k, v, lim, scale))
            return out
        for r, row in enumerate(meta.rows):
            sl = slice(row.q_offset, row.q_offset + row.q_len)
            k, v = self.gather_row(kv_layer, meta, r)
            res = limit_attention(q[None, sl], k[None].to(q.dtype), v[None].to(q.dtype),
                                  meta.key_limit[None, sl], scale)
            out[sl] = res[0]
        return out
