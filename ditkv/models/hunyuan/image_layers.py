"""Image-path blocks of HunyuanImage-3.0: the timestep embedder and the time-conditioned ResBlock
(with its GroupNorm) that the patch embed and the final layer stack.

Attribute names follow the release checkpoint (`mlp.0`, `in_layers.2`, `emb_layers.1`,
`out_layers.3`, `skip_connection`), so state dicts load as is.

On CUDA without autograd (inference) the blocks run channels-last (`fast_path`): the convs' weights
are stored channels-last once (`channels_last_weights`, the layout cuDNN's NHWC kernels read), the
activations stay channels-last (the DiT's tokens [R, h*w, C] already are: no transposes), and each
GroupNorm with what follows it (SiLU; the time modulation) is one Triton kernel set
(`image_kernels.py`). Elsewhere (CPU, training) the plain modules run, as released.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from . import invariant as _inv


def group_count(channels: int, preferred: int = 32) -> int:
    """GroupNorm groups: 32 like the release, or the largest divisor of `channels` below it."""
    for g in range(min(preferred, channels), 0, -1):
        if channels % g == 0:
            return g
    return 1


FAST = {"on": True}  # process-wide, like fused.FUSE; off only to measure against (`bench step --no-fast-image-path`)


def set_fast_image_path(on: bool) -> None:
    FAST["on"] = bool(on)


def fast_path(x: torch.Tensor) -> bool:
    """The channels-last CUDA path applies: a CUDA tensor and no autograd (the kernels have no backward)."""
    return FAST["on"] and x.is_cuda and not torch.is_grad_enabled()


def channels_last_weights(module: nn.Module, memory_format=torch.channels_last) -> None:
    """Store the conv weights under `module` in `memory_format` (channels_last, or channels_last_3d
    for the VAE's Conv3d), once: the parameter keeps its name and values, its storage is re-laid.
    Not during a CUDA-graph capture (the eager warm-up before it has done it; a weight replaced
    since then runs as it is, correct but slower); state dicts are saved `.contiguous()`."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return
    dims = 5 if memory_format == torch.channels_last_3d else 4
    for m in module.modules():
        if isinstance(m, (nn.Conv2d, nn.Conv3d)):
            w = m.weight
            if w.is_cuda and w.dim() == dims and not w.is_contiguous(memory_format=memory_format):
                with torch.inference_mode(False), torch.no_grad():
                    m.weight.data = w.data.contiguous(memory_format=memory_format)


def norm_act(norm: nn.GroupNorm, x: torch.Tensor, mod: torch.Tensor | None = None, silu: bool = False,
             fp32: bool = False) -> torch.Tensor:
    """`norm(x)`, then `* (1 + scale) + shift` with `mod` = [scale | shift] [N, 2C] (x's dtype), then
    SiLU: one Triton kernel set for a channels-last CUDA x (`image_kernels`), the eager ops otherwise.
    `fp32`: the norm computed on `x.float()` and cast back (GroupNorm32), else on x."""
    if fast_path(x):
        from . import image_kernels

        if image_kernels.supports(x, norm.num_groups):
            if mod is not None and mod.shape[0] == 1 and x.shape[0] > 1:
                mod = mod.expand(x.shape[0], -1)
            return image_kernels.group_norm_cl(x, norm.num_groups, norm.weight, norm.bias, norm.eps, mod, silu)
    if fp32:
        y = F.group_norm(x.float(), norm.num_groups, norm.weight.float(), norm.bias.float(), norm.eps).to(x.dtype)
    else:
        y = F.group_norm(x, norm.num_groups, norm.weight, norm.bias, norm.eps)
    if mod is not None:
        pad = (None,) * (x.dim() - 2)
        scale, shift = mod[(slice(None), slice(None), *pad)].chunk(2, dim=1)
        y = y * (1 + scale) + shift
    return F.silu(y) if silu else y


class GroupNorm32(nn.GroupNorm):
    """GroupNorm computed in fp32 and cast back."""

    def __init__(self, channels: int) -> None:
        super().__init__(group_count(channels), channels, eps=1e-5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return norm_act(self, x, fp32=True)


# --------------------------------------------------------- timestep embedding


def timestep_sinusoid(t: torch.Tensor, dim: int = 256, max_period: float = 10000.0) -> torch.Tensor:
    """[R] -> [R, dim] fp32: cos half first, then sin half."""
    half = dim // 2
    freqs = torch.exp(
        -math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32) / half
    )
    args = t.float()[:, None] * freqs[None]
    return torch.cat([args.cos(), args.sin()], dim=-1)


class TimestepEmbedder(nn.Module):
    """Sinusoid -> Linear -> GELU -> Linear (`mlp.0`, `mlp.2` in the release)."""

    def __init__(self, hidden: int, freq_dim: int = 256, out_dim: int | None = None) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(
            nn.Linear(freq_dim, hidden), nn.GELU(), nn.Linear(hidden, out_dim or hidden)
        )

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        h = timestep_sinusoid(t.reshape(-1), self.freq_dim).to(self.mlp[0].weight.dtype)
        for m in self.mlp:  # a batched CUDA graph embeds every request's rows at once
            h = _inv.run(m, h)
        return h


# ------------------------------------------------------------------ ResBlock


class ResBlock(nn.Module):
    """Time-conditioned residual conv block (adaptive GroupNorm: norm*(1+scale)+shift).

    in:  GroupNorm -> SiLU -> conv3x3 (in->out)
    out: GroupNorm modulated by SiLU->Linear(emb, 2*out) -> SiLU -> conv3x3 (zero-initialised)
    skip: identity, or a 1x1 conv when the channel count changes.
    `out_layers.2` is an Identity standing where training had Dropout, to keep release indices.
    """

    def __init__(self, in_ch: int, emb_ch: int, out_ch: int) -> None:
        super().__init__()
        self.in_layers = nn.Sequential(GroupNorm32(in_ch), nn.SiLU(), nn.Conv2d(in_ch, out_ch, 3, padding=1))
        self.emb_layers = nn.Sequential(nn.SiLU(), nn.Linear(emb_ch, 2 * out_ch))
        self.out_layers = nn.Sequential(
            GroupNorm32(out_ch), nn.SiLU(), nn.Identity(), nn.Conv2d(out_ch, out_ch, 3, padding=1)
        )
        self.skip_connection = nn.Identity() if in_ch == out_ch else nn.Conv2d(in_ch, out_ch, 1)

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """x [R, in, h, w] (channels-last on the fast path), emb [R or 1, emb_ch] -> [R, out, h, w]."""
        h = self.in_layers[2](norm_act(self.in_layers[0], x, silu=True, fp32=True))
        mod = self.emb_layers(emb).to(h.dtype)  # [R, 2 * out] = [scale | shift]
        h = norm_act(self.out_layers[0], h, mod=mod, silu=True, fp32=True)
        return self.skip_connection(x) + self.out_layers[3](h)
