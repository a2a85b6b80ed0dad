"""Physical KV page pool: one allocation per worker rank holding every layer's K and V pages.

Layouts (named constants, measured in `docs/benchmarks.md`):
- `BLOCK_MAJOR` `[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]`: one page of all
  layers is contiguous, so a transfer moves one descriptor per page (adjacent pages coalesce) and
  a KV-head range is contiguous inside a page (TP/SP reshaping). The default.
- `LAYER_MAJOR` `[num_layers, num_blocks, 2, num_kv_heads, block_size, head_dim]`: each layer's
  pages are contiguous (the classic vLLM shape); kept for comparison.
Backends always receive a per-layer view `[num_blocks, 2, num_kv_heads, block_size, head_dim]`.
"""

from __future__ import annotations

import math
import mmap

import torch

BLOCK_MAJOR = "block_major"
LAYER_MAJOR = "layer_major"
KV_POOL_LAYOUT = BLOCK_MAJOR


def bytes_per_block(num_layers: int, num_kv_heads: int, block_size: int, head_dim: int,
                    dtype: torch.dtype) -> int:
    """Bytes of one block across all layers (K and V)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * num_kv_heads * block_size * head_dim * elem


def _zeroed(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On the CPU an anonymous mapping, which the kernel zero-fills page by page on
    first touch: torch.zeros would write the whole pool (the CPU pool is sized to ~230 MB while a
    64x64 request uses 10 blocks of it), costing the paged engine's start time and resident memory.
    Page-aligned, so the 64-byte alignment the CPU kernels want holds (ditkv/alignment.py)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    # private, as torch's own allocations are: a forked child gets copy-on-write pages, never the parent's pool
    buf = mmap.mmap(-1, count * torch.empty((), dtype=dtype).element_size(), flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(buf, dtype=dtype, count=count).view(shape)  # the tensor keeps buf alive


class PagePool:
    def __init__(self, num_blocks: int, num_layers: int, num_kv_heads: int, block_size: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device="cpu",
                 layout: str = KV_POOL_LAYOUT):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks} must be > 0")
        if layout == BLOCK_MAJOR:
            shape = (num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim)
        elif layout == LAYER_MAJOR:
            shape = (num_layers, num_blocks, 2, num_kv_heads, block_size, head_dim)
        else:
            raise ValueError(f"unknown pool layout {layout!r}; use {BLOCK_MAJOR!r} or {LAYER_MAJOR!r}")
        self.layout = layout
        self.num_blocks, self.num_layers, self.num_kv_heads = num_blocks, num_layers, num_kv_heads
        self.block_size, self.head_dim, self.dtype = block_size, head_dim, dtype
        # zeros, not empty: a page read before it is written must not hold NaN garbage
        self.kv = _zeroed(shape, dtype, torch.device(device))

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def layer(self, i: int) -> torch.Tensor:
        """View `[num_blocks, 2, num_kv_heads, block_size, head_dim]` of layer `i`."""
        return self.kv[:, i] if self.layout == BLOCK_MAJOR else self.kv[i]

    def page(self, block_id: int) -> torch.Tensor:
        """All layers of one block `[num_layers, 2, H, bs, D]` (contiguous in block-major)."""
        return self.kv[block_id] if self.layout == BLOCK_MAJOR else self.kv[:, block_id]
