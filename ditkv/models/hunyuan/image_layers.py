"""Image-path blocks of HunyuanImage-3.0: the timestep embedder and the time-conditioned ResBlock
(with its GroupNorm) that the patch embed and the final layer stack.

Attribute names follow the release checkpoint (`mlp.0`, `in_layers.2`, `emb_layers.1`,
`out_layers.3`, `skip_connection`), so state dicts load as is.
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


class GroupNorm32(nn.GroupNorm):
    """GroupNorm computed in fp32 and cast back."""

    def __init__(self, channels: int) -> None:
        super().__init__(group_count(channels), channels, eps=1e-5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.group_norm(x.float(), self.num_groups, self.weight.float(), self.bias.float(), self.eps)
        return y.to(x.dtype)


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
        h = self.in_layers(x)
        scale, shift = self.emb_layers(emb).to(h.dtype)[:, :, None, None].chunk(2, dim=1)
        h = self.out_layers[0](h) * (1 + scale) + shift
        h = self.out_layers[3](F.silu(h))
        return self.skip_connection(x) + h
