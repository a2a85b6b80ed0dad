"""The DiT runner's encoder cache: input images' embeddings kept across requests (docs/prefix-cache.md).

A prefix-cache hit that ends inside an input image's slots still needs that image's embeddings for the
slots after the hit's end (editing one image again and again with one seed and new prompts: every hit
ends in the page that holds the image block's end). Encoding it (VAE encode and posterior sample, the
image path, the vision encoder) is the costly part of such a request's start, and its result depends only
on what `ModelFamily.input_image_keys` hashes: the image's content and geometry, its index among the
request's images and the seed its VAE sample is drawn from. So the runner keeps the last few images'
embeddings under that key and reuses the very tensors it computed: a request's image is the same bit for
bit with or without the cache.

Bound: a count of images, least recently used first out. One release image (1024x1024) holds its latent
tokens [4096, hidden 4096] and its vision tokens [1024, 4096] in the model dtype: about 40 MiB in bf16,
so a bound of 8 images is about 320 MiB of device memory beyond the startup memory plan.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    """LRU of per-image embeddings: key (bytes) -> (latent tokens [h*w, hidden], vision tokens or None)."""

    def __init__(self, capacity: int):
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"an encoder cache holds at least 1 image, got capacity={capacity!r}")
        self.capacity = capacity
        self._entries: OrderedDict[bytes, tuple[torch.Tensor, torch.Tensor | None]] = OrderedDict()
        self.hits = self.misses = 0  # images found (`get`) / stored after encoding (`put`)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes):
        """The embeddings stored under `key` (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self.hits += 1
        return entry

    def put(self, key: bytes, vae: torch.Tensor, vit: torch.Tensor | None) -> None:
        """Store one image's embeddings; the least recently used goes when the cache is full."""
        self._entries[key] = (vae, vit)
        self._entries.move_to_end(key)
        self.misses += 1
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
