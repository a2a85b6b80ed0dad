"""Input images in a prefix: their embeddings and where they go, shared by the DiT and the AR runner.

Each input image of a request is encoded once (`encode_images`): VAE latents from a posterior sample
drawn with the caller's CPU generator (seeded by the request's seed; images in order, as the release
does), embedded through the image path at timestep 0, and, with a vision encoder, its vision tokens.
`fill_image_slots` writes them into the hidden states of a token range. Both stages use the same two
functions, so an AR stage that prefills an image-conditioned prefix writes the K/V the DiT would.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError


class CondEmbeds:
    """The prefix embeddings of one request's input images: per image its `<timestep>` (timestep 0), its
    latent tokens [h*w, hidden] and its vision tokens [N, hidden] (None without a vision encoder)."""

    def __init__(self, ts: torch.Tensor, vae: list[torch.Tensor], vit: list[torch.Tensor | None]):
        self.ts, self.vae, self.vit = ts, vae, vit


@torch.inference_mode()
def encode_images(model, codec, images, generator: torch.Generator) -> CondEmbeds:
    """Encode `images` (`CondImage`s, in request order) with `generator` drawing the VAE samples."""
    if codec is None:
        raise ConfigError("codec", None, "input images need the model's image codec; this runner has none")
    dev = model.device
    ts = model.timestep_token(torch.zeros(1, device=dev))[0]
    vae, vit = [], []
    for im in images:
        z = codec.encode_sample(im.vae_pixels.to(device=dev, dtype=model.dtype), generator)
        vae.append(model.cond_image_tokens(z.float()))
        vit.append(None if im.vit_patches is None
                   else model.vision_tokens(im.vit_patches.to(model.dtype), im.vit_mask, im.vit_shape))
    return CondEmbeds(ts, vae, vit)


def fill_image_slots(h: torch.Tensor, images, lo: int, hi: int, cond: CondEmbeds | None) -> None:
    """Write the images' embeddings into `h`, the hidden states of row tokens [lo, hi): each image's
    `<timestep>`, its latent tokens and its vision tokens, where they fall inside the range."""
    for j, im in enumerate(images):
        slots = [(im.timestep_index, None), (im.vae_start, "vae")]
        if im.vit_start is not None:
            slots.append((im.vit_start, "vit"))
        for start, kind in slots:
            n_src = 1 if kind is None else (im.h * im.w if kind == "vae" else im.vit_len)
            i0, i1 = max(start, lo), min(start + n_src, hi)
            if i0 >= i1:
                continue
            if cond is None:
                raise ValueError(f"input image {j}'s prefix slots need its embeddings (encode_images)")
            src = cond.ts[None] if kind is None else getattr(cond, kind)[j]
            h[i0 - lo:i1 - lo] = src[i0 - start:i1 - start].to(h.dtype)
