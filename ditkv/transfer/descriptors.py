"""Byte descriptors for moving KV pages between two block-major pools.

Pool layout (`worker/page_pool.py`, BLOCK_MAJOR): `[num_blocks, num_layers, 2, Hkv, block_size, D]`.
One page of all layers is contiguous, so a full-head transfer is one descriptor per page and a
run of pages adjacent on both sides is one descriptor. A consumer rank that holds a KV-head range
`[h0, h1)` (tensor / sequence parallel) gets `2 * num_layers` descriptors per page: inside a
page the head range is contiguous for each (layer, K/V) slab.

A descriptor is `(src_offset, dst_offset, nbytes)` relative to each pool's base address.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch

Desc = tuple[int, int, int]


class PoolGeometry(msgspec.Struct, frozen=True):
    """What a peer must know about a pool to address its pages (sent in the ticket)."""

    num_blocks: int
    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    elem_size: int
    dtype: str

    @property
    def slab_bytes(self) -> int:  # one (layer, K or V) slab of one page
        return self.num_kv_heads * self.block_size * self.head_dim * self.elem_size

    @property
    def page_bytes(self) -> int:
        return self.num_layers * 2 * self.slab_bytes

    @property
    def token_bytes(self) -> int:  # one token of every layer, K and V
        return self.page_bytes // self.block_size


def geometry_of(pool) -> PoolGeometry:
    if getattr(pool, "layout", "block_major") != "block_major":
        raise ValueError("page transfer needs the block-major pool layout")
    return PoolGeometry(pool.num_blocks, pool.num_layers, pool.num_kv_heads, pool.block_size, pool.head_dim,
                        pool.kv.element_size(), str(pool.dtype).removeprefix("torch."))


def check_pages(src: PoolGeometry, dst: PoolGeometry) -> str | None:
    """None when both pools address pages the same way (heads aside), else the reason."""
    for name in ("num_layers", "block_size", "head_dim", "elem_size", "dtype"):
        if getattr(src, name) != getattr(dst, name):
            return f"{name} differs: producer {getattr(src, name)} vs consumer {getattr(dst, name)}"
    return None


def check_compatible(src: PoolGeometry, dst: PoolGeometry, head_lo: int, head_hi: int) -> str | None:
    """None when pages of `src` heads [head_lo, head_hi) fit `dst` pages, else the reason."""
    why = check_pages(src, dst)
    if why:
        return why
    if not 0 <= head_lo < head_hi <= src.num_kv_heads:
        return f"head range [{head_lo}, {head_hi}) outside the producer's {src.num_kv_heads} KV heads"
    if head_hi - head_lo != dst.num_kv_heads:
        return f"head range [{head_lo}, {head_hi}) does not match the consumer's {dst.num_kv_heads} KV heads"
    return None


def coalesce(descs: list[Desc]) -> list[Desc]:
    """Merge neighbours that are contiguous on both sides (input order kept)."""
    out: list[list[int]] = []
    for s, d, n in descs:
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1][2] += n
        else:
            out.append([s, d, n])
    return [tuple(x) for x in out]


def page_descriptors(src: PoolGeometry, dst: PoolGeometry, src_blocks, dst_blocks,
                     head_lo: int = 0, head_hi: int | None = None) -> list[Desc]:
    """Descriptors moving pages `src_blocks[i]` -> `dst_blocks[i]` (heads [head_lo, head_hi))."""
    head_hi = src.num_kv_heads if head_hi is None else head_hi
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source pages for {len(dst_blocks)} destination pages")
    why = check_compatible(src, dst, head_lo, head_hi)
    if why:
        raise ValueError(f"incompatible pools: {why}")
    descs: list[Desc] = []
    if head_hi - head_lo == src.num_kv_heads:  # whole pages
        for s, d in zip(src_blocks, dst_blocks):
            descs.append((int(s) * src.page_bytes, int(d) * dst.page_bytes, src.page_bytes))
        return coalesce(descs)
    head_bytes = src.block_size * src.head_dim * src.elem_size
    n = (head_hi - head_lo) * head_bytes
    for s, d in zip(src_blocks, dst_blocks):
        for slab in range(src.num_layers * 2):
            so = int(s) * src.page_bytes + slab * src.slab_bytes + head_lo * head_bytes
            descs.append((so, int(d) * dst.page_bytes + slab * dst.slab_bytes, n))
    return coalesce(descs)


def overlap_descriptors(src: PoolGeometry, dst: PoolGeometry, src_blocks, dst_blocks,
                        src_lo: int, dst_lo: int) -> list[Desc]:
    """Descriptors moving the KV heads two pools share, page `src_blocks[i]` -> `dst_blocks[i]`.
    The source pool holds global heads [src_lo, src_lo + src.num_kv_heads), the destination
    [dst_lo, dst_lo + dst.num_kv_heads) (tensor-parallel ranks on either side); empty when the
    ranges do not overlap."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source pages for {len(dst_blocks)} destination pages")
    why = check_pages(src, dst)
    if why:
        raise ValueError(f"incompatible pools: {why}")
    lo, hi = max(src_lo, dst_lo), min(src_lo + src.num_kv_heads, dst_lo + dst.num_kv_heads)
    if lo >= hi:
        return []
    if hi - lo == src.num_kv_heads == dst.num_kv_heads:  # whole pages
        return coalesce([(int(s) * src.page_bytes, int(d) * dst.page_bytes, src.page_bytes)
                         for s, d in zip(src_blocks, dst_blocks)])
    head_bytes = src.block_size * src.head_dim * src.elem_size
    n, s_off, d_off = (hi - lo) * head_bytes, (lo - src_lo) * head_bytes, (lo - dst_lo) * head_bytes
    descs: list[Desc] = []
    for s, d in zip(src_blocks, dst_blocks):
        for slab in range(src.num_layers * 2):
            descs.append((int(s) * src.page_bytes + slab * src.slab_bytes + s_off,
                          int(d) * dst.page_bytes + slab * dst.slab_bytes + d_off, n))
    return coalesce(descs)


def split_batches(descs: list[Desc], max_per_batch: int) -> list[list[Desc]]:
    return [descs[i:i + max_per_batch] for i in range(0, len(descs), max_per_batch)] or [[]]


# ---- legacy: one contiguous tensor -----------------------------------------------------------
@dataclass(frozen=True)
class LegacyLayout:
    """The legacy payload `[num_layers, 2, P, Hkv, D]`: the dense cache's per-layer row layout."""

    num_layers: int
    num_tokens: int
    num_kv_heads: int
    head_dim: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_tokens, self.num_kv_heads, self.head_dim)


def gather_contiguous(pool, block_ids, num_tokens: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy the first `num_tokens` of a row's pages into one `[L, 2, P, Hkv, D]` tensor."""
    nb = -(-num_tokens // pool.block_size)
    idx = torch.as_tensor(list(block_ids[:nb]), dtype=torch.long, device=pool.device)
    pages = pool.kv.index_select(0, idx)  # [nb, L, 2, H, bs, D]
    flat = pages.permute(1, 2, 0, 4, 3, 5).reshape(pool.num_layers, 2, nb * pool.block_size,
                                                   pool.num_kv_heads, pool.head_dim)
    if out is None:
        return flat[:, :, :num_tokens].contiguous()
    out.copy_(flat[:, :, :num_tokens])
    return out


# A tensor-parallel producer has only its own KV heads, so a legacy receive slot holds one chunk per
# source rank, in head order: the chunk of heads [a, b) is `[L, 2, P, b - a, D]` at byte offset
# `a * P * L * 2 * D * itemsize`. With one source rank this is exactly the whole `[L, 2, P, H, D]`.
def legacy_chunk_offset(num_layers: int, head_dim: int, itemsize: int, num_tokens: int, head_lo: int) -> int:
    return head_lo * num_tokens * num_layers * 2 * head_dim * itemsize


def legacy_heads(buf: torch.Tensor, src_heads, num_layers: int, num_tokens: int, head_dim: int,
                 dtype: torch.dtype, lo: int, hi: int) -> torch.Tensor:
    """KV heads [lo, hi) of a legacy receive slot (`buf`: its bytes) as `[L, 2, P, hi - lo, D]`:
    a view with one source chunk covering them, else the overlapping chunks concatenated."""
    per_head = legacy_chunk_offset(num_layers, head_dim, torch.empty((), dtype=dtype).element_size(), num_tokens, 1)
    parts, covered = [], lo
    for a, b in sorted(src_heads):
        s, e = max(a, lo), min(b, hi)
        if s >= e:
            continue
        if s != covered:
            raise ValueError(f"source head ranges {list(src_heads)} do not cover [{lo}, {hi})")
        chunk = buf[a * per_head:b * per_head].view(dtype).view(num_layers, 2, num_tokens, b - a, head_dim)
        parts.append(chunk[:, :, :, s - a:e - a])
        covered = e
    if covered != hi:
        raise ValueError(f"source head ranges {list(src_heads)} do not cover [{lo}, {hi})")
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=3)
