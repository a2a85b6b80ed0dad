"""The release VAE (the checkpoint's `vae.*` weights): images <-> 32-channel latents at 16x.

Architecture facts (numbers checked against the release code by tests/test_vae.py):
- 3D convolutions (kernel 3, zero padding in time too) over [B, C, T, H, W]; an image is one frame.
  The encoder repeats it to `ffactor_temporal` frames; the decoder upsamples time as well and the
  image is the last decoded frame.
- Resolution changes are space-to-depth (down) / depth-to-space (up) around a 3x3 conv, with a
  parameter-free shortcut: channel-group means going down, channel repeats going up. The same
  shortcuts join `conv_in` of the decoder and `conv_out` of the encoder.
- ResNet blocks (GroupNorm 32, eps 1e-6, SiLU), one single-head attention block in the middle.
- The DiT's latents are `(z - shift) * scale`: decode divides by `scaling_factor`, then adds
  `shift_factor`; encode the reverse.
Module and parameter names follow the checkpoint's (`encoder.down.0.block.1.conv2.weight`, ...), so
the `vae.` keys load without a map. Decoding large images runs tile by tile with linear blending
(`tile_latent`, as diffusers users know it), so memory stays bounded.

On CUDA at inference the decoder runs channels-last (`channels_last_3d`): its conv weights are
re-laid once, the rearrangements below keep that layout, and each GroupNorm (+ SiLU) is one
Triton kernel set (`image_layers.norm_act`). The encoder and the CPU run the plain NCDHW ops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ditkv.errors import ConfigError
from ditkv.models.hunyuan.image_layers import channels_last_weights, fast_path, norm_act

CL3 = torch.channels_last_3d


@dataclass(frozen=True)
class VAEConfig:
    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 32
    block_out_channels: tuple[int, ...] = (128, 256, 512, 1024, 1024)
    layers_per_block: int = 2
    ffactor_spatial: int = 16
    ffactor_temporal: int = 4
    sample_size: int = 256  # pixels per side of one decode tile
    scaling_factor: float = 1.0
    shift_factor: float = 0.0
    downsample_match_channel: bool = True
    upsample_match_channel: bool = True

    @classmethod
    def from_dict(cls, d: dict) -> "VAEConfig":
        names = {f for f in cls.__dataclass_fields__}
        kw = {k: v for k, v in d.items() if k in names}
        for k in ("scaling_factor", "shift_factor"):
            if kw.get(k) is None:
                kw.pop(k, None)
        try:
            if "block_out_channels" in kw:
                kw["block_out_channels"] = tuple(kw["block_out_channels"])
            cfg = cls(**kw)
            cfg.validate()
        except (TypeError, ValueError) as e:  # a wrong type or a non-positive factor in config.json
            if isinstance(e, ConfigError):
                raise
            raise ConfigError("vae", d, f"is not a valid release VAE config ({e}); use the checkpoint's own "
                              "config.json") from e
        return cfg

    def validate(self) -> None:
        ints = ("in_channels", "out_channels", "latent_channels", "layers_per_block", "ffactor_spatial",
                "ffactor_temporal", "sample_size")
        bad = next((n for n in ints if not isinstance(getattr(self, n), int) or getattr(self, n) < 1), None)
        if bad or not self.block_out_channels or not all(isinstance(c, int) and c > 0 for c in self.block_out_channels):
            raise ConfigError(f"vae.{bad or 'block_out_channels'}", getattr(self, bad or "block_out_channels"),
                              "must be a positive integer (block_out_channels: a non-empty list of them)")
        levels = int(math.log2(self.ffactor_spatial))
        if 2 ** levels != self.ffactor_spatial or levels >= len(self.block_out_channels):
            raise ConfigError("vae.ffactor_spatial", self.ffactor_spatial,
                              f"must be a power of two below 2**{len(self.block_out_channels)}")
        if self.ffactor_temporal < 1 or self.ffactor_temporal & (self.ffactor_temporal - 1) \
                or self.ffactor_temporal > self.ffactor_spatial:
            raise ConfigError("vae.ffactor_temporal", self.ffactor_temporal, "must be a power of two <= ffactor_spatial")
        if any(c % 32 for c in self.block_out_channels):
            raise ConfigError("vae.block_out_channels", self.block_out_channels, "must be multiples of 32 (GroupNorm)")
        if self.block_out_channels[-1] % (2 * self.latent_channels):
            raise ConfigError("vae.latent_channels", self.latent_channels,
                              "2 * latent_channels must divide the last block width")


def _norm(ch: int) -> nn.GroupNorm:
    return nn.GroupNorm(32, ch, eps=1e-6)


def _conv(cin: int, cout: int, k: int = 3) -> nn.Conv3d:
    return nn.Conv3d(cin, cout, k, padding=k // 2)


def _to_depth(x: torch.Tensor, rt: int) -> torch.Tensor:
    """[B, C, T*rt, 2H, 2W] -> [B, rt*2*2*C, T, H, W], channels ordered (time, row, col, c)."""
    b, c, t, h, w = x.shape
    x = x.view(b, c, t // rt, rt, h // 2, 2, w // 2, 2)
    return x.permute(0, 3, 5, 7, 1, 2, 4, 6).reshape(b, rt * 4 * c, t // rt, h // 2, w // 2)


def _channels_last(x: torch.Tensor) -> bool:
    return x.dim() == 5 and x.is_contiguous(memory_format=CL3) and not x.is_contiguous()


def _repeat_channels(x: torch.Tensor, r: int) -> torch.Tensor:
    """`x.repeat_interleave(r, dim=1)`, channels-last in and out when x is."""
    if _channels_last(x):
        return x.permute(0, 2, 3, 4, 1).repeat_interleave(r, dim=-1).permute(0, 4, 1, 2, 3)
    return x.repeat_interleave(r, dim=1)


def _from_depth(x: torch.Tensor, rt: int) -> torch.Tensor:
    """Inverse of `_to_depth` (a channels-last x gives a channels-last result: the same
    rearrangement done on the [B, T, H, W, C] storage)."""
    b, c4, t, h, w = x.shape
    c = c4 // (rt * 4)
    if _channels_last(x):
        xl = x.permute(0, 2, 3, 4, 1).view(b, t, h, w, rt, 2, 2, c).permute(0, 1, 4, 2, 5, 3, 6, 7)
        return xl.reshape(b, t * rt, h * 2, w * 2, c).permute(0, 4, 1, 2, 3)
    x = x.view(b, rt, 2, 2, c, t, h, w)
    return x.permute(0, 4, 5, 1, 6, 2, 7, 3).reshape(b, c, t * rt, h * 2, w * 2)


class ResnetBlock(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.norm1, self.conv1 = _norm(cin), _conv(cin, cout)
        self.norm2, self.conv2 = _norm(cout), _conv(cout, cout)
        if cin != cout:
            self.nin_shortcut = _conv(cin, cout, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(norm_act(self.norm1, x, silu=True))
        h = self.conv2(norm_act(self.norm2, h, silu=True))
        skip = self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x
        return skip + h


class AttnBlock(nn.Module):
    """One head over every (frame, row, column) position, channels as the head dimension."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.norm = _norm(ch)
        self.q, self.k, self.v, self.proj_out = (_conv(ch, ch, 1) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.shape
        n = norm_act(self.norm, x)
        q, k, v = (f(n).reshape(b, 1, c, t * h * w).transpose(2, 3) for f in (self.q, self.k, self.v))
        o = F.scaled_dot_product_attention(q, k, v).transpose(2, 3).reshape(b, c, t, h, w)
        return x + self.proj_out(o)


class Down(nn.Module):
    """Space-to-depth after a conv, plus the channel-group mean of the same rearrangement."""

    def __init__(self, cin: int, cout: int, temporal: bool) -> None:
        super().__init__()
        self.rt = 2 if temporal else 1
        self.conv = _conv(cin, cout // (self.rt * 4))
        self.group = self.rt * 4 * cin // cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _to_depth(self.conv(x), self.rt)
        s = _to_depth(x, self.rt)
        return h + s.view(s.shape[0], h.shape[1], self.group, *s.shape[2:]).mean(2)


class Up(nn.Module):
    """A conv then depth-to-space, plus the input's channels repeated into the same places."""

    def __init__(self, cin: int, cout: int, temporal: bool) -> None:
        super().__init__()
        self.rt = 2 if temporal else 1
        self.conv = _conv(cin, cout * self.rt * 4)
        self.repeats = self.rt * 4 * cout // cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _from_depth(self.conv(x), self.rt) + _from_depth(_repeat_channels(x, self.repeats), self.rt)


def _level(blocks: list[nn.Module], resample: nn.Module | None) -> nn.Module:
    m = nn.Module()
    m.block = nn.ModuleList(blocks)
    if resample is not None:
        if isinstance(resample, Down):
            m.downsample = resample
        else:
            m.upsample = resample
    return m


def _mid(ch: int) -> nn.Module:
    m = nn.Module()
    m.block_1, m.attn_1, m.block_2 = ResnetBlock(ch, ch), AttnBlock(ch), ResnetBlock(ch, ch)
    return m


class Encoder(nn.Module):
    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__()
        chans, n = cfg.block_out_channels, cfg.layers_per_block
        spatial, temporal_from = int(math.log2(cfg.ffactor_spatial)), \
            int(math.log2(cfg.ffactor_spatial // cfg.ffactor_temporal))
        self.conv_in = _conv(cfg.in_channels, chans[0])
        self.down = nn.ModuleList()
        cin = chans[0]
        for i, ch in enumerate(chans):
            blocks = []
            for _ in range(n):
                blocks.append(ResnetBlock(cin, ch))
                cin = ch
            resample = None
            if i < spatial:
                cout = chans[i + 1] if cfg.downsample_match_channel else cin
                resample, cin = Down(cin, cout, temporal=i >= temporal_from), cout
            self.down.append(_level(blocks, resample))
        self.mid = _mid(cin)
        self.norm_out, self.conv_out = _norm(cin), _conv(cin, 2 * cfg.latent_channels)
        self.group = chans[-1] // (2 * cfg.latent_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for level in self.down:
            for block in level.block:
                h = block(h)
            if hasattr(level, "downsample"):
                h = level.downsample(h)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        b, c, t, hh, ww = h.shape
        skip = h.view(b, c // self.group, self.group, t, hh, ww).mean(2)
        return self.conv_out(F.silu(self.norm_out(h))) + skip


class Decoder(nn.Module):
    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__()
        chans, n = tuple(reversed(cfg.block_out_channels)), cfg.layers_per_block
        spatial, temporal = int(math.log2(cfg.ffactor_spatial)), int(math.log2(cfg.ffactor_temporal))
        self.repeats = chans[0] // cfg.latent_channels
        cin = chans[0]
        self.conv_in = _conv(cfg.latent_channels, cin)
        self.mid = _mid(cin)
        self.up = nn.ModuleList()
        for i, ch in enumerate(chans):
            blocks = []
            for _ in range(n + 1):
                blocks.append(ResnetBlock(cin, ch))
                cin = ch
            resample = None
            if i < spatial or i < temporal:
                cout = chans[i + 1] if cfg.upsample_match_channel else cin
                resample, cin = Up(cin, cout, temporal=i < temporal), cout
            self.up.append(_level(blocks, resample))
        self.norm_out, self.conv_out = _norm(cin), _conv(cin, cfg.out_channels)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(z) + _repeat_channels(z, self.repeats)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        for level in self.up:
            for block in level.block:
                h = block(h)
            if hasattr(level, "upsample"):
                h = level.upsample(h)
        return self.conv_out(norm_act(self.norm_out, h, silu=True))


class ReleaseVAE(nn.Module):
    """`encode` / `decode` between [B, 3, H, W] images in [-1, 1] and the DiT's latents [B, C, h, w]."""

    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__()
        cfg.validate()
        self.config = cfg
        self.encoder, self.decoder = Encoder(cfg), Decoder(cfg)
        self.tile_latent: int | None = None  # latent cells per tile side; None = decode whole

    # ---- the networks on [B, C, T, H, W] (one frame: T = 1) ------------------------------------
    def encode_moments(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Image frames [B, 3, 1, H, W] -> (mean, logvar) [B, C, 1, H/f, W/f]."""
        moments = self.encoder(x.expand(-1, -1, self.config.ffactor_temporal, -1, -1))
        mean, logvar = moments.chunk(2, dim=1)
        return mean, logvar.clamp(-30.0, 20.0)

    def decode_frames(self, z: torch.Tensor) -> torch.Tensor:
        """Latent frames [B, C, 1, h, w] -> the image frame [B, 3, 1, h*f, w*f]."""
        t = self.tile_latent
        if t is not None and (z.shape[-1] > t or z.shape[-2] > t):
            out = self._decode_tiled(z, t)
        else:
            out = self.decoder(z)
        return out[:, :, -1:]

    def _decode_tiled(self, z: torch.Tensor, tile: int) -> torch.Tensor:
        f = self.config.ffactor_spatial
        stride = int(tile * 0.75)  # latent cells between tile starts: a quarter overlaps
        blend = int(tile * f * 0.25)  # pixels blended across a seam
        keep = tile * f - blend
        fmt = CL3 if _channels_last(z) else None  # a tile of a channels-last z, re-laid as one
        rows = [[self.decoder(_tile(z[..., i:i + tile, j:j + tile], fmt)) for j in range(0, z.shape[-1], stride)]
                for i in range(0, z.shape[-2], stride)]
        out_rows = []
        for i, row in enumerate(rows):
            parts = []
            for j, tile_out in enumerate(row):
                if i > 0:
                    tile_out = _blend(rows[i - 1][j], tile_out, blend, dim=-2)
                if j > 0:
                    tile_out = _blend(row[j - 1], tile_out, blend, dim=-1)
                parts.append(tile_out[..., :keep, :keep])
            out_rows.append(torch.cat(parts, dim=-1))
        return torch.cat(out_rows, dim=-2)

    # ---- the codec the engine calls ------------------------------------------------------------
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """The DiT's latents [B, C, h, w] -> image [B, 3, h*f, w*f] (about [-1, 1])."""
        c = self.config
        z = (latents.to(self.conv_dtype) / c.scaling_factor + c.shift_factor)[:, :, None]
        if fast_path(z):  # channels-last decoder on CUDA (module docstring)
            channels_last_weights(self.decoder, CL3)
            z = z.contiguous(memory_format=CL3)
        return self.decode_frames(z)[:, :, 0].contiguous()

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] in [-1, 1] -> latents [B, C, H/f, W/f] (the posterior mean)."""
        c = self.config
        mean, _ = self.encode_moments(images.to(self.conv_dtype)[:, :, None])
        return ((mean - c.shift_factor) * c.scaling_factor)[:, :, 0]

    def skip_sample(self, images: torch.Tensor, generator: torch.Generator) -> None:
        """Draw from `generator` exactly what `encode_sample(images, generator)` draws, without encoding."""
        c = self.config
        b, _, h, w = images.shape
        torch.randn((b, c.latent_channels, 1, h // c.ffactor_spatial, w // c.ffactor_spatial), generator=generator,
                    dtype=torch.float32)

    def encode_sample(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """[B, 3, H, W] in [-1, 1] -> latents [B, C, H/f, W/f] from a posterior sample, as the release encodes
        input images (`latent_dist.sample(generator)`: mean + std * N(0, I), the noise drawn with `generator`
        in the shape [B, C, 1, h, w]; here on the CPU in fp32, so a seed gives the same latents everywhere);
        then the latent transform. Without a generator: the posterior mean (`encode`)."""
        c = self.config
        mean, logvar = self.encode_moments(images.to(self.conv_dtype)[:, :, None])
        if generator is not None:
            noise = torch.randn(mean.shape, generator=generator, dtype=torch.float32)
            mean = mean + torch.exp(0.5 * logvar) * noise.to(device=mean.device, dtype=mean.dtype)
        return ((mean - c.shift_factor) * c.scaling_factor)[:, :, 0]

    @property
    def conv_dtype(self) -> torch.dtype:
        return self.decoder.conv_in.weight.dtype


def _tile(z: torch.Tensor, fmt) -> torch.Tensor:
    return z if fmt is None else z.contiguous(memory_format=fmt)


def _blend(prev: torch.Tensor, cur: torch.Tensor, extent: int, dim: int) -> torch.Tensor:
    """Ramp the first `extent` positions of `cur` along `dim` from `prev`'s last ones into its own,
    in place: later seams read the already-blended neighbour, as the release's tiling does."""
    extent = min(prev.shape[dim], cur.shape[dim], extent)
    if extent <= 0:
        return cur
    w = torch.arange(extent, device=cur.device, dtype=cur.dtype) / extent
    shape = [1] * cur.dim()
    shape[dim] = extent
    w = w.view(shape)
    head = cur.narrow(dim, 0, extent)
    head.copy_(prev.narrow(dim, prev.shape[dim] - extent, extent) * (1 - w) + head * w)
    return cur
