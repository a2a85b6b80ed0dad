"""Attention backend protocol and selection (no silent fallback)."""

from __future__ import annotations

from typing import Protocol

import torch

from ..errors import BackendError
from .metadata import PagedAttentionMetadata


class AttentionBackend(Protocol):
    name: str
    supports_paged: bool
    # "limits": paged_attention applies per-query key limits natively (one call per layer);
    # "segments": the adapter plans causal/full segments and calls segment_attention.
    paged_mode: str

    def write_kv(self, kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None: ...

    def paged_attention(self, q: torch.Tensor, kv_layer: torch.Tensor,
                        meta: PagedAttentionMetadata, scale: float) -> torch.Tensor: ...


def _pow2_pages(block_size: int) -> str | None:
    # the Triton kernels index a page with tl.arange(0, PAGE): a power of two
    if block_size & (block_size - 1):
        return "its Triton kernels need a power of two (16, 32, 64, 128, 256)"
    return None


# Page sizes each backend's kernels can run, checked at startup (config validation only knows
# multiples of 16): backend name -> why a block size is refused, or None. cudnn and fa4 run the
# Triton kernel for prefill and AR.
PAGE_GEOMETRY = {"triton": _pow2_pages, "cudnn": _pow2_pages, "fa4": _pow2_pages}


def check_page_geometry(name: str, block_size: int) -> None:
    why = PAGE_GEOMETRY.get(name, lambda _: None)(block_size)
    if why is not None:
        raise BackendError(f"block_size={block_size} cannot run attention_backend={name!r}: {why}; "
                           "set block_size to one of those, or pick attention_backend='torch'")


def select_backend(name: str, device: torch.device | str, paged: bool,
                   block_size: int | None = None) -> AttentionBackend:
    """Resolve `attention_backend` (`auto` | `torch` | `torch-segments` | `triton` | `cudnn` | `fa4`) for a device.

    `cudnn` (optional extra `ditkv[cudnn]`): cuDNN paged SDPA for the denoise phase, the Triton
    kernel for the mixed-mask prefill phase and AR (`cudnn_backend.py`). `auto` picks it only
    when it is installed and `cudnn_backend.auto_prefers_cudnn` says the measured table favours it
    on this device; `fa4` (optional extra `ditkv[fa4]`) likewise, before cudnn, by
    `fa4_backend.AUTO_MIN_Q_LEN`; otherwise Triton on CUDA, torch elsewhere. `block_size`: the page size, checked
    against the backend's kernels (`PAGE_GEOMETRY`) before anything is built."""
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
        if name == "triton" and block_size is not None:
            check_page_geometry(name, block_size)  # cudnn has the same rule
        if name == "triton":
            from . import fa4_backend
            if fa4_backend.auto_prefers_fa4(device):
                cap = torch.cuda.get_device_capability(device)
                return fa4_backend.Fa4Backend(device, min_q_len=fa4_backend.AUTO_MIN_Q_LEN[cap])
            from .cudnn_backend import AUTO_MIN_Q_LEN, CudnnBackend, auto_prefers_cudnn
            if auto_prefers_cudnn(device):
                cap = torch.cuda.get_device_capability(device)
                backend = CudnnBackend(device, min_q_len=AUTO_MIN_Q_LEN[cap])
                return backend  # paged-capable by construction
    if block_size is not None:
        check_page_geometry(name, block_size)
    if name == "torch":
        from .torch_backend import TorchBackend
        backend = TorchBackend(paged_mode="limits")
    elif name == "torch-segments":
        from .torch_backend import TorchBackend
        backend = TorchBackend(paged_mode="segments")
    elif name == "triton":
        if device.type != "cuda":
            raise BackendError(
                f"attention_backend='triton' needs a CUDA device, got {device}; "
                "use attention_backend='torch' (or 'auto') on CPU")
        from .triton_backend import TritonBackend
        backend = TritonBackend()
    elif name == "cudnn":
        from .cudnn_backend import CudnnBackend
        backend = CudnnBackend(device)  # BackendError without CUDA or without the package
    elif name == "fa4":
        from .fa4_backend import Fa4Backend
        backend = Fa4Backend(device)  # BackendError without CUDA, off sm90/sm100 or without the extra
    else:
        raise BackendError(
            f"unknown attention_backend={name!r}; choose auto, torch, torch-segments, triton, cudnn or fa4")
    if paged and not backend.supports_paged:
        raise BackendError(
            f"attention backend {backend.name!r} cannot run diffusion_kv_mode='paged_scheduler'; "
            "pick a paged-capable backend or use diffusion_kv_mode='dense_legacy'")
    return backend
