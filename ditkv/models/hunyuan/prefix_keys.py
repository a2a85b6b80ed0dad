"""Block identities for the cross-request prefix cache (docs/prefix-cache.md).

One key per full page of a row strictly before its `prefix_len` (the boundary page holds target
slots, rewritten every step). Keys are chained: page i's key hashes page i-1's key, so a key names
the whole row up to the page's end, and a lookup stops at the first miss. Each page hashes:

- the previous key (the first page: the model id, a digest of the config dict);
- the page's token ids and its RoPE positions (pos_y, pos_x);
- for a page touching an input image's slots (its `<timestep>` through its last latent/vision token):
  that image's content digest (pixels, vision patches, grid) with the request's seed and the image's
  index, since the VAE sample drawn for it comes from the request generator.

Image content is hashed once per image (`content_digest`, kept on it as `CondImage.digest`), never per
page. blake2b with a 16-byte digest: stable across processes (Python's `hash()` is salted per process).
"""

from __future__ import annotations

import hashlib
import json

import torch

DIGEST = 16


def _h() -> "hashlib._Hash":
    return hashlib.blake2b(digest_size=DIGEST)


def model_id(cfg) -> bytes:
    """A digest of the model config (every field, extras included): keys never match across models."""
    h = _h()
    h.update(json.dumps(cfg.to_dict(), sort_keys=True, default=str).encode())
    return h.digest()


def _tensor_bytes(t: torch.Tensor | None) -> bytes:
    if t is None:
        return b"-"
    t = t.detach().to("cpu").contiguous()
    return str((t.dtype, tuple(t.shape))).encode() + t.numpy().tobytes()


def content_digest(image) -> bytes:
    """What an input image's encoders read: its VAE pixels, vision patches and mask. Hashed once per image
    and kept on it (`CondImage.digest`, which its wire form carries), so only a key asks for it: with the
    prefix cache off nothing is hashed."""
    if not image.digest:
        h = _h()
        for t in (image.vae_pixels, image.vit_patches, image.vit_mask):
            h.update(_tensor_bytes(t))
        object.__setattr__(image, "digest", h.digest())  # frozen, and equal whoever computes it first
    return image.digest


def image_digest(image, index: int, seed: int) -> bytes:
    """One input image's identity in a row: its content (`CondImage.digest`), its slots' geometry, its
    place among the request's images and the seed its VAE sample is drawn from."""
    h = _h()
    h.update(content_digest(image))
    h.update(repr((image.h, image.w, image.vit_shape, image.joint, index, int(seed))).encode())
    return h.digest()


def _image_ranges(images, digests) -> list[tuple[int, int, bytes]]:
    """(first slot, end, digest) per image: from its `<timestep>` slot through its last span token."""
    return [(min(im.timestep_index, *(a for a, _ in im.spans())), max(b for _, b in im.spans()), d)
            for im, d in zip(images, digests)]


def row_keys(row, block_size: int, root: bytes, ranges) -> tuple[bytes, ...]:
    """The chained keys of one row's full pages before its `prefix_len`."""
    ids, py, px = (t.to("cpu", torch.int64).numpy() for t in (row.token_ids, row.pos_y, row.pos_x))
    keys, prev = [], root
    for i in range(row.prefix_len // block_size):
        a, b = i * block_size, (i + 1) * block_size
        h = _h()
        h.update(prev)
        h.update(ids[a:b].tobytes())
        h.update(py[a:b].tobytes())
        h.update(px[a:b].tobytes())
        for lo, hi, d in ranges:
            if lo < b and a < hi:
                h.update(d)
        prev = h.digest()
        keys.append(prev)
    return tuple(keys)


def prefix_block_keys(cfg, layout, seed: int, block_size: int) -> list[tuple[bytes, ...]]:
    """Per row of `layout`, the keys of its cacheable pages (see the module docstring)."""
    root = model_id(cfg)
    digests = [image_digest(im, i, seed) for i, im in enumerate(layout.images)]
    ranges = _image_ranges(layout.images, digests)
    return [row_keys(row, block_size, root, ranges) for row in layout.rows]


class _TextHead:
    """An AR row's text head as `row_keys` reads a row: its ids at 1D positions (y = x = index)."""

    def __init__(self, ids):
        self.token_ids = torch.as_tensor(list(ids), dtype=torch.int64)
        self.pos_y = self.pos_x = torch.arange(len(self.token_ids), dtype=torch.int64)
        self.prefix_len = len(self.token_ids)


def text_head_keys(cfg, head_ids, block_size: int) -> tuple[bytes, ...]:
    """The keys of an AR row's full pages of a text head (no input image): the same function and root
    as a DiT row's keys, on purpose. A DiT row's text prefix sits at 1D positions too and attends
    causally, and both phases run the same backbone over the same embeddings with per-query results
    that do not depend on what else the pass holds (CPU: `invariant.cpu_rows` and the fixed attention
    tiles; GPU: `batch_invariant`), so a page of equal tokens at equal positions holds equal bytes
    whichever phase wrote it: the premise the AR->DiT handover's zero-copy adoption already rests on
    (docs/prefix-cache-ar.md). Only pages wholly inside the head: decoding writes from its end on."""
    return row_keys(_TextHead(head_ids), block_size, model_id(cfg), ())


class _ImageHead:
    """An AR head with input images (`ARHead`) as `row_keys` reads a row: its ids at its own positions
    (2D inside each image's blocks, as in the image row), the whole head cacheable."""

    def __init__(self, head):
        self.token_ids = torch.as_tensor(list(head.token_ids), dtype=torch.int64)
        self.pos_y, self.pos_x = head.pos_y, head.pos_x
        self.prefix_len = len(self.token_ids)


def image_head_keys(cfg, head, seed: int, block_size: int) -> tuple[bytes, ...]:
    """The keys of an AR row's full pages of a head with input images (`ARHead`): `row_keys` over its ids
    and positions, every page touching an image's slots mixing in that image's digest with `seed`, the
    seed the AR draws the images' VAE samples from. The same function, root and digests as a DiT row's
    keys: the AR writes an image page with the DiT's own embeddings (`conditioning.encode_images`, CPU
    generator seeded by the seed, images in order), at the image row's 2D positions, attending the block
    in full as the DiT row does, so a page of equal keys holds equal bytes in either phase (the premise
    the handover's adoption of an image head's pages already rests on; docs/prefix-cache-ar.md)."""
    digests = [image_digest(im, i, seed) for i, im in enumerate(head.images)]
    return row_keys(_ImageHead(head), block_size, model_id(cfg), _image_ranges(head.images, digests))
