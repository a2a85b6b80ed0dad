"""Input images in a prefix: their embeddings and where they go, shared by the DiT and the AR runner.

Each input image of a request is encoded once (`encode_images`): VAE latents from a posterior sample
drawn with the caller's CPU generator (seeded by the request's seed; images in order, as the release
does), embedded through the image path at timestep 0, and, with a vision encoder, its vision tokens.
`fill_image_slots` writes them into the hidden states of a token range. Both stages use the same two
functions, so an AR stage that prefills an image-conditioned prefix writes the K/V the DiT would. The
leading images whose slots every row's pages already hold (a prefix-cache hit, an import) may be
skipped (`skip`). With an `EncoderCache` (the DiT runner's, `encoder_cache.py`) an image encoded by an
earlier request under the same key is not encoded again: its stored embeddings are used and the
generator advances past its sample as for a skipped image.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError


class CondEmbeds:
    """The prefix embeddings of one request's input images: per image its `<timestep>` (timestep 0), its
    latent tokens [h*w, hidden] and its vision tokens [N, hidden] (None without a vision encoder).
    The first `skipped` images were not encoded (every row's pages already hold their slots): their
    entries are absent, and `slot` refuses them rather than fill anything."""

    def __init__(self, ts: torch.Tensor, vae: list, vit: list, skipped: int = 0, reused: int = 0,
                 encoded: int = 0):
        self.ts, self.vae, self.vit, self.skipped = ts, vae, vit, skipped
        self.reused, self.encoded = reused, encoded  # images taken from the encoder cache / encoded now

    def slot(self, j: int, kind: str | None) -> torch.Tensor:
        """Image `j`'s embeddings of one slot kind: None = its `<timestep>`, "vae", "vit"."""
        if j < self.skipped:
            raise ValueError(f"input image {j} was not encoded (its slots were cached when the request started), "
                             "yet a step computes one of its slots: the rows' computed prefix is wrong")
        return self.ts[None] if kind is None else getattr(self, kind)[j]


def skip_samples(codec, images, generator: torch.Generator) -> int:
    """Advance `generator` past the VAE samples of `images` exactly as encoding them would, without
    encoding -> how many were skipped: all of them, or 0 (nothing drawn) when the codec cannot skip.
    A codec skips every image or none (`skip_sample` fails only for want of a skip function)."""
    if codec is None:
        return 0
    for i, im in enumerate(images):
        if not codec.skip_sample(im.vae_pixels, generator):
            if i:
                raise AssertionError("a codec skips every image or none")
            return 0
    return len(images)


@torch.inference_mode()
def encode_images(model, codec, images, generator: torch.Generator, skip: int = 0, cache=None,
                  keys=None) -> CondEmbeds:
    """Encode `images` (`CondImage`s, in request order) with `generator` drawing the VAE samples.
    `skip`: the leading images whose slots every row already holds (a prefix-cache hit or an import):
    the generator only advances past their samples (`skip_samples`; all are encoded when the codec
    cannot skip), so the later images' samples and the noise drawn next are the same.
    `cache` (an `EncoderCache`) with `keys` (one per image, `ModelFamily.input_image_keys`): an image
    found there is not encoded (its stored tensors are used, the generator skips its sample); one
    encoded is stored. A codec that cannot skip encodes every image, as without a cache."""
    if codec is None:
        raise ConfigError("codec", None, "input images need the model's image codec; this runner has none")
    if not 0 <= skip <= len(images):
        raise ValueError(f"skip={skip} must be within [0, {len(images)}] (the request's input images)")
    if cache is not None and (keys is None or len(keys) != len(images)):
        raise ValueError("an encoder cache needs one key per input image (ModelFamily.input_image_keys)")
    dev = model.device
    ts = model.timestep_token(torch.zeros(1, device=dev))[0]
    skipped = skip_samples(codec, images[:skip], generator)
    if skipped < skip:  # the codec cannot skip a sample: a cached image could not be reused either
        cache = None
    vae, vit = [None] * skipped, [None] * skipped
    reused = 0
    for j in range(skipped, len(images)):
        im = images[j]
        if cache is not None and keys[j] in cache and codec.skip_sample(im.vae_pixels, generator):
            z_tokens, v_tokens = cache.get(keys[j])
            reused += 1
        else:
            if cache is not None and keys[j] in cache:  # skip_sample refused (nothing drawn): no cache use
                cache = None
            z_tokens, v_tokens = _encode_one(model, codec, im, generator)
            if cache is not None:
                cache.put(keys[j], z_tokens, v_tokens)
        vae.append(z_tokens)
        vit.append(v_tokens)
    return CondEmbeds(ts, vae, vit, skipped, reused, len(images) - skipped - reused)


def _encode_one(model, codec, im, generator: torch.Generator):
    """One image's latent tokens (a VAE posterior sample drawn with `generator`, through the image path)
    and vision tokens (None without a vision encoder)."""
    z = codec.encode_sample(im.vae_pixels.to(device=model.device, dtype=model.dtype), generator)
    vit = None if im.vit_patches is None else model.vision_tokens(im.vit_patches.to(model.dtype), im.vit_mask,
                                                                   im.vit_shape)
    return model.cond_image_tokens(z.float()), vit


def fill_image_slots(h: torch.Tensor, images, lo: int, hi: int, cond: CondEmbeds | None) -> None:
    """Write the images' embeddings into `h`, the hidden states of row tokens [lo, hi): each image's
    `<timestep>`, its latent tokens and its vision tokens, where they fall inside the range. Only those
    are read: an image whose slots all lie before `lo` may be absent from `cond` (`CondEmbeds.skipped`)."""
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
            src = cond.slot(j, kind)
            h[i0 - lo:i1 - lo] = src[i0 - start:i1 - start].to(h.dtype)
