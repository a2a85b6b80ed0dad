"""Triton backend: native paged attention with per-query key limits (one launch per layer call).

Same interface as `TorchBackend` (`torch_backend.py`); the kernels live in `triton_kernels.py`.
Tile sizes come from a small heuristic table (`pick_config`), tuned on an H200 (sm_90) with
`ditkv bench attention --sweep`; callers (the benchmark) may pass an explicit `AttnConfig`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from .metadata import PagedAttentionMetadata


@dataclass(frozen=True)
class AttnConfig:
    block_m: int  # query rows per program (query tokens x packed heads)
    block_n: int  # keys per KV tile
    group: int  # query heads of one GQA group packed into the M dimension
    num_warps: int
    num_stages: int
    tma: bool = False  # K/V tiles through a tensor descriptor (needs block_n <= block_size)
    warp_spec: bool = False  # Triton's automatic warp specialisation on the unmasked loop


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@lru_cache(maxsize=None)
def _tma_supported() -> bool:
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def pick_config(head_dim: int, dtype: torch.dtype, block_size: int, gqa: int, max_q_len: int,
                on_gpu: bool) -> AttnConfig:
    """Tile sizes for one call (heuristic; see docs/bench-attention.md for the measurements)."""
    group = gqa & -gqa  # largest power-of-two divisor of the GQA ratio
    if not on_gpu:  # interpreter: tiny tiles keep the numpy emulation quick
        bm = 16 * group if group <= 4 else group
        return AttnConfig(block_m=bm, block_n=16, group=group, num_warps=4, num_stages=1)
    group = min(group, 8)  # keep >= 16 query tokens per tile
    if head_dim <= 128 and dtype in (torch.float16, torch.bfloat16):
        if block_size >= 64 and _tma_supported():  # H200: ~500 TFLOP/s at P=4096, T=4097
            return AttnConfig(block_m=128, block_n=64, group=group, num_warps=4, num_stages=3, tma=True)
        # small pages: pointer loads, a 32-key tile may span pages (one lookup per key row)
        return AttnConfig(block_m=128, block_n=32, group=group, num_warps=4, num_stages=3)
    return AttnConfig(block_m=64, block_n=32, group=min(group, 4), num_warps=4, num_stages=2)


# one-query rows (AR decode) take the split-KV kernel (`triton_decode.py`); an explicit `AttnConfig`
# (the attention benchmark's sweeps) keeps the general kernel. Module-level for A/B runs only.
SPLIT_DECODE = True


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter `k`, `v` `[N, Hkv, D]` into the pool layer at `slot_mapping` (int64 slots); a token whose
    slot is negative is not written (the padded rows of a decode graph)."""
    from .triton_kernels import _write_kv_kernel

    n, hkv, d = k.shape
    if n == 0:
        return
    if kv_layer.stride(-1) != 1:
        raise ValueError("kv_layer's last dimension must be contiguous")
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if d & (d - 1):
        raise ValueError(f"head_dim={d} must be a power of two for the triton backend")
    slots = slot_mapping.to(device=kv_layer.device, dtype=torch.int64)
    block_t = 16 if _interpreting() else max(1, min(64, 8192 // d))
    grid = (triton_cdiv(n, block_t), hkv)
    _write_kv_kernel[grid](k, v, kv_layer, slots, n,
                           k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                           kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
                           PAGE=kv_layer.shape[3], D=d, BLOCK_T=block_t, num_warps=4)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _kv_descriptor(kv_layer: torch.Tensor, block_n: int):
    """The layer's storage from its first element on, as `[rows, head_dim]`; tiles `[block_n, head_dim]`."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    d = kv_layer.shape[-1]
    s_blk, s_kv, s_h, s_t = (kv_layer.stride(i) for i in range(4))
    if s_t != d or s_blk % d or s_kv % d or s_h % d:
        raise ValueError("tma needs token rows of head_dim contiguous elements in the pool")
    elems = kv_layer.untyped_storage().nbytes() // kv_layer.element_size() - kv_layer.storage_offset()
    rows = elems // d
    if rows >= 2**31:
        raise ValueError("tma row coordinates overflow int32 for this pool")
    if kv_layer.data_ptr() % 16 or (d * kv_layer.element_size()) % 16:
        raise ValueError("tma needs a 16-byte aligned layer base and 16-byte token rows")
    return TensorDescriptor(kv_layer, [rows, d], [d, 1], [block_n, d])


def paged_attention(q: torch.Tensor, kv_layer: torch.Tensor, meta: PagedAttentionMetadata, scale: float,
                    config: AttnConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """q `[Nq, Hq, D]` packed rows -> `[Nq, Hq, D]`; query i sees keys `j < meta.key_limit[i]` of its row."""
    from .triton_kernels import _paged_attn_kernel

    nq, hq, d = q.shape
    nb, two, hkv, bs, d2 = kv_layer.shape
    if two != 2 or d2 != d:
        raise ValueError(f"kv_layer shape {tuple(kv_layer.shape)} does not match q {tuple(q.shape)}")
    if hq % hkv:
        raise ValueError(f"num_heads={hq} is not a multiple of num_kv_heads={hkv}")
    if d & (d - 1) or d < 16:
        raise ValueError(f"head_dim={d} must be a power of two >= 16 for the triton backend")
    if bs & (bs - 1) or bs != meta.block_size:
        raise ValueError(f"block_size={bs} must be a power of two equal to meta.block_size={meta.block_size}")
    if out is None:
        out = torch.empty_like(q)
    if nq == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if kv_layer.stride(-1) != 1:
        raise ValueError("kv_layer's last dimension must be contiguous")
    gqa = hq // hkv
    cfg = config or pick_config(d, q.dtype, bs, gqa, meta.max_q_len, q.is_cuda and not _interpreting())
    if gqa % cfg.group or cfg.block_m % cfg.group:
        raise ValueError(f"config {cfg} does not fit a GQA ratio of {gqa}")
    if cfg.tma and cfg.block_n > bs:
        raise ValueError(f"config {cfg}: tma needs block_n <= block_size={bs}")
    block_q = cfg.block_m // cfg.group
    tiles = sum(triton_cdiv(r.q_len, block_q) for r in meta.rows)
    grid = (hkv * (gqa // cfg.group), tiles)
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"
    decode = SPLIT_DECODE and config is None and any(r.q_len == 1 for r in meta.rows)
    if decode:
        from .triton_decode import paged_decode

        n, chunk = (16, 32) if _interpreting() or not q.is_cuda else (64, 128)
        paged_decode(q, kv_layer, meta, float(scale) * math.log2(math.e), out, min(n, bs), chunk, dot_prec)
        if meta.max_q_len == 1:
            return out
    s_blk, s_kv, s_h, s_t = (kv_layer.stride(i) for i in range(4))
    desc = None
    if cfg.tma:
        try:
            desc = _kv_descriptor(kv_layer, cfg.block_n)
        except ValueError:
            if config is not None:  # asked for explicitly: say why it cannot run
                raise
            cfg = replace(cfg, tma=False)  # heuristic choice: pointer loads work for any pool
    _paged_attn_kernel[grid](
        q, kv_layer, desc, out, meta.block_table, meta.cu_q, meta.kv_lens, meta.key_limit,
        meta.num_rows, float(scale) * math.log2(math.e),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), meta.block_table.stride(0),
        s_blk, s_kv, s_h, s_t, s_blk // d, s_kv // d, s_h // d,
        G=gqa, GROUP=cfg.group, D=d, PAGE=bs, BLOCK_Q=block_q, BLOCK_N=cfg.block_n, DOT_PREC=dot_prec,
        USE_TMA=cfg.tma, WARP_SPEC=cfg.warp_spec, SKIP_DECODE=decode, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out


class TritonBackend:
    """Native paged backend: `paged_mode="limits"` (the adapter makes one call per layer)."""

    name = "triton"
    supports_paged = True
    paged_mode = "limits"
    # launch grid from query counts only, key lengths read on the device: one CUDA graph serves
    # every request of a shape bucket (worker/cuda_graph.py)
    graph_safe = True

    def __init__(self, config: AttnConfig | None = None):
        self.config = config

    def write_kv(self, kv_layer, k, v, slot_mapping):
        write_kv(kv_layer, k, v, slot_mapping)

    def paged_attention(self, q, kv_layer, meta: PagedAttentionMetadata, scale: float):
        return paged_attention(q, kv_layer, meta, scale, config=self.config)
