"""Building blocks of HunyuanImage-3.0: norms, 2D RoPE, SwiGLU / MoE, timestep and image blocks.

Attribute names inside each block follow the release checkpoint (`mlp.0`, `in_layers.2`,
`emb_layers.1`, `out_layers.3`, `skip_connection`, `gate.wg`, ...), so state dicts load as is.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# ----------------------------------------------------------------------- norms


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, statistics in fp32 (bf16 mean-of-squares loses digits)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


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


# ---------------------------------------------------------------------- 2D RoPE


def rope_cos_sin(
    pos_y: torch.Tensor, pos_x: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [N, 1, head_dim] (fp32) for 2D RoPE.

    The head_dim/2 inverse frequencies are taken in pairs: the first of each pair turns with
    the y position, the second with x. The half-size angle vector is repeated to head_dim
    (rotate-half layout). With y == x this is exactly ordinary 1D RoPE.
    """
    device = pos_y.device
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim))
    inv_freq = inv_freq.float().view(head_dim // 4, 2)
    pos = torch.stack([pos_y, pos_x], dim=-1).float()  # [N, 2]
    angles = (pos[:, None, :] * inv_freq[None]).reshape(pos.shape[0], head_dim // 2)
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, H, D] with precomputed tables; math in fp32, result in x's dtype."""
    x32 = x.float()
    return (x32 * cos + rotate_half(x32) * sin).to(x.dtype)


def rope_2d(x: torch.Tensor, pos_y: torch.Tensor, pos_x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """2D rotary embedding of x [N, H, D] at positions (pos_y[N], pos_x[N])."""
    cos, sin = rope_cos_sin(pos_y, pos_x, x.shape[-1], theta)
    return apply_rope(x, cos, sin)


# ---------------------------------------------------------------- MLP and MoE


class SwiGLU(nn.Module):
    """Fused `gate_and_up_proj`: first half is x1 ("up"), second half x2 is gated: down(x1*silu(x2))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_and_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = self.gate_and_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(x1 * F.silu(x2))


class Router(nn.Module):
    """`gate.wg`: hidden -> experts logits, always evaluated in fp32."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.wg = nn.Linear(hidden, num_experts, bias=False)

    def forward(self, x: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert ids [N, k] and their weights [N, k] (fp32, renormalised to sum 1)."""
        logits = F.linear(x.float(), self.wg.weight.float())
        probs = logits.softmax(dim=-1)
        weights, experts = probs.topk(topk, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        return weights, experts


class MoE(nn.Module):
    """Routed SwiGLU experts (top-k, no token dropping) plus an always-on shared expert."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, topk: int, num_shared: int = 1) -> None:
        super().__init__()
        self.topk = topk
        self.gate = Router(hidden, num_experts)
        self.experts = nn.ModuleList(SwiGLU(hidden, intermediate) for _ in range(num_experts))
        # The release sizes the shared MLP as num_shared_expert experts fused into one.
        self.shared_mlp = SwiGLU(hidden, intermediate * num_shared) if num_shared > 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, d = x.shape
        weights, experts = self.gate(x, self.topk)
        flat = experts.reshape(-1)  # slot s = token s // k, choice s % k
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        # Each (token, choice) slot is written exactly once -> deterministic, no atomics.
        slots = x.new_empty(n * self.topk, d)
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            sel = order[start:start + c]
            slots[sel] = self.experts[e](x[sel // self.topk])
            start += c
        routed = torch.bmm(weights.unsqueeze(1), slots.view(n, self.topk, d).float()).squeeze(1)
        out = routed.to(x.dtype)
        if self.shared_mlp is not None:
            out = out + self.shared_mlp(x)
        return out


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
        emb = timestep_sinusoid(t.reshape(-1), self.freq_dim)
        return self.mlp(emb.to(self.mlp[0].weight.dtype))


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

    def zero_init_names(self) -> tuple[str, ...]:
        """Parameters the release initialises to zero (the block starts as its skip path)."""
        return ("out_layers.3.weight", "out_layers.3.bias")

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.in_layers(x)
        scale, shift = self.emb_layers(emb).to(h.dtype)[:, :, None, None].chunk(2, dim=1)
        h = self.out_layers[0](h) * (1 + scale) + shift
        h = self.out_layers[3](F.silu(h))
        return self.skip_connection(x) + h
