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


def select_backend(name: str, device: torch.device | str, paged: bool) -> AttentionBackend:
    """Resolve `attention_backend` (`auto` | `torch` | `torch-segments` | `triton` | `cudnn`) for a device.

    `cudnn` (optional extra `ditkv[cudnn]`): cuDNN paged SDPA for the denoise phase, the Triton
    kernel for the mixed-mask prefill phase and AR (`cudnn_backend.py`). `auto` picks it only
    when it is installed and `cudnn_backend.auto_prefers_cudnn` says the measured table favours it
    on this device; otherwise Triton on CUDA, torch elsewhere."""
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
        if name == "triton":
            from .cudnn_backend import AUTO_MIN_Q_LEN, CudnnBackend, auto_prefers_cudnn
            if auto_prefers_cudnn(device):
                cap = torch.cuda.get_device_capability(device)
                backend = CudnnBackend(device, min_q_len=AUTO_MIN_Q_LEN[cap])
                return backend  # paged-capable by construction
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
    else:
        raise BackendError(
            f"unknown attention_backend={name!r}; choose auto, torch, torch-segments, triton or cudnn")
    if paged and not backend.supports_paged:
        raise BackendError(
            f"attention backend {backend.name!r} cannot run diffusion_kv_mode='paged_scheduler'; "
            "pick a paged-capable backend or use diffusion_kv_mode='dense_legacy'")
    return backend
