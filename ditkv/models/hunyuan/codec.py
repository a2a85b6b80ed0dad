"""Image codecs: pixels <-> latents.

`PixelCodec` is a lossless space-to-depth packing (each p x p RGB patch becomes 3*p*p channels),
so the tiny model's "latents" decode to a viewable picture without any learned weights.
`VAECodec` wraps the release VAE (32 channels, 16x; `vae.py`, loaded from the checkpoint's
`vae.*` weights), or user-supplied encode/decode callables.
"""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from ditkv.errors import BackendError, ConfigError
from ditkv.models.hunyuan.config import HunyuanImage3Config


@runtime_checkable
class ImageCodec(Protocol):
    latent_channels: int
    downsample: int  # pixels per latent cell, per side

    def encode(self, img: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] in [-1, 1] -> latents [B, C, H/downsample, W/downsample]."""
        ...

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents [B, C, h, w] -> [B, 3, h*downsample, w*downsample] (roughly [-1, 1])."""
        ...


class PixelCodec:
    def __init__(self, patch: int = 4) -> None:
        if patch < 1:
            raise ConfigError("patch", patch, "must be >= 1")
        self.downsample = patch
        self.latent_channels = 3 * patch * patch

    def encode(self, img: torch.Tensor) -> torch.Tensor:
        if img.dim() != 4 or img.shape[1] != 3:
            raise ValueError(f"PixelCodec.encode wants [B, 3, H, W], got {tuple(img.shape)}")
        if img.shape[2] % self.downsample or img.shape[3] % self.downsample:
            raise ValueError(f"image size {tuple(img.shape[2:])} is not a multiple of {self.downsample}")
        return F.pixel_unshuffle(img, self.downsample)

    def encode_sample(self, img: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Input images (image-conditioned generation): the packing is exact, nothing to sample."""
        return self.encode(img)

    def skip_sample(self, img: torch.Tensor, generator: torch.Generator) -> bool:
        """`encode_sample` draws nothing: skipping it leaves `generator` as it would."""
        return True

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        if latents.dim() != 4 or latents.shape[1] != self.latent_channels:
            raise ValueError(
                f"PixelCodec.decode wants [B, {self.latent_channels}, h, w], got {tuple(latents.shape)}"
            )
        return F.pixel_shuffle(latents, self.downsample)


class VAECodec:
    """Interface slot for the release VAE. Supply `encode_fn` / `decode_fn` (e.g. a diffusers
    AutoencoderKL wrapped to include the scaling factor); without them every call raises."""

    def __init__(self, latent_channels: int = 32, downsample: int = 16,
                 scaling_factor: float = 0.562679178327931,
                 encode_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 decode_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 sample_fn: Callable[..., torch.Tensor] | None = None,
                 skip_fn: Callable[..., None] | None = None) -> None:
        self.latent_channels = latent_channels
        self.downsample = downsample
        self.scaling_factor = scaling_factor
        self._encode, self._decode, self._sample, self._skip = encode_fn, decode_fn, sample_fn, skip_fn

    def _missing(self, what: str) -> BackendError:
        return BackendError(
            f"VAECodec.{what}: no VAE was supplied: the checkpoint has no vae.* weights. Use a checkpoint "
            f"with the release VAE, pass VAECodec(encode_fn=..., decode_fn=...), or a pixel-codec model"
        )

    def encode(self, img: torch.Tensor) -> torch.Tensor:
        if self._encode is None:
            raise self._missing("encode")
        return self._encode(img)

    def encode_sample(self, img: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Input images: latents from a posterior sample drawn with `generator` (the release's encoding of
        input images); `sample_fn(img, generator)`, supplied with the release VAE (`ReleaseVAE.encode_sample`)."""
        if self._sample is None:
            if self._encode is None:
                raise self._missing("encode_sample")
            raise BackendError("VAECodec.encode_sample: this codec has an encode_fn but no sample_fn; input images "
                               "are encoded from a posterior sample as the release does: pass sample_fn")
        return self._sample(img, generator)

    def skip_sample(self, img: torch.Tensor, generator: torch.Generator) -> bool:
        """Advance `generator` exactly as `encode_sample(img, generator)` would, without encoding (an input
        image whose prefix K/V were imported); False when this codec cannot (no `skip_fn`): encode then."""
        if self._skip is None:
            return False
        self._skip(img, generator)
        return True

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        if self._decode is None:
            raise self._missing("decode")
        return self._decode(latents)


def make_codec(cfg: HunyuanImage3Config, vae=None, **vae_kwargs) -> ImageCodec:
    """The codec a config asks for. For "vae": the loaded release VAE (`vae`, its own latent scale and
    shift), or explicit kwargs for `VAECodec` (e.g. encode_fn/decode_fn)."""
    if cfg.codec == "pixel":
        return PixelCodec(cfg.image_token_downsample)
    if vae is not None:
        vae_kwargs = {"encode_fn": vae.encode, "decode_fn": vae.decode, "sample_fn": vae.encode_sample,
                      "skip_fn": vae.skip_sample, **vae_kwargs}
    return VAECodec(cfg.latent_channels, cfg.image_token_downsample, cfg.vae_scaling_factor, **vae_kwargs)


# ------------------------------------------------------------------- PIL helpers


def to_pil(img: torch.Tensor):
    """[3, H, W] or [1, 3, H, W] float in [-1, 1] -> uint8 RGB PIL.Image (values clamped)."""
    from PIL import Image

    if img.dim() == 4:
        if img.shape[0] != 1:
            raise ValueError(f"to_pil converts one image, got a batch of {img.shape[0]}")
        img = img[0]
    if img.dim() != 3 or img.shape[0] != 3:
        raise ValueError(f"to_pil wants [3, H, W], got {tuple(img.shape)}")
    u8 = ((img.detach().float().cpu() + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8)
    return Image.fromarray(u8.permute(1, 2, 0).contiguous().numpy())


def from_pil(image) -> torch.Tensor:
    """PIL.Image -> [1, 3, H, W] fp32 in [-1, 1]; exact inverse of `to_pil` on uint8 values."""
    import numpy as np

    arr = np.asarray(image.convert("RGB"), dtype=np.uint8)
    t = torch.from_numpy(arr.copy()).permute(2, 0, 1).float()
    return (t / 127.5 - 1.0).unsqueeze(0)
