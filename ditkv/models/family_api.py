"""The model-family interface itself (`ModelFamily`, and what the layers above read of a layout);
`family.py` holds the registry and the module docstring that lists the methods."""

from __future__ import annotations

from typing import Protocol


class RequestLayout(Protocol):
    """What the layers above the models read of a family's request layout: `rows` (each with
    token_ids, pos_y, pos_x, prefix_len, target_len, seq_len, timestep_index, image_start,
    full_attn_spans, guidance_index), the latent grid `h` x `w`, `num_image_tokens`, the input
    `images` (each with its `spans()` and `vae_pixels`) and `prompt_tokens`."""

    rows: list
    h: int
    w: int
    images: tuple
    prompt_tokens: int


class ModelFamily:
    """Base class: every method must be implemented by a family (`models/family.py` lists them)."""

    name = ""

    def __getattr__(self, attr):  # a family that misses a method says so by name
        raise NotImplementedError(f"model family {self.name!r} does not implement {attr!r}")
