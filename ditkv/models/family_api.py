"""The model-family interface itself (`ModelFamily`, and what the layers above read of a layout);
`family.py` holds the registry and the module docstring that lists the methods."""

from __future__ import annotations

from typing import Protocol

from ..errors import LayoutError


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


def check_input_image_count(n: int, limit: int) -> None:
    """The one refusal of `n` input images for a model that reads at most `limit` (its config's
    `max_input_images`; 0 or absent: none), whichever path finds it: the engine's intake, the
    stage graph's (`engine/request_check.check_image_support`) or a family's layout."""
    if n and limit <= 0:
        raise LayoutError("image: this model takes no input images (its config has no max_input_images, or 0); "
                          "image editing needs a checkpoint that takes input images (e.g. HunyuanImage-3.0-Instruct, "
                          "or the bundled tiny-edit: --model tiny-edit); "
                          "send the request without images for text-to-image", field="image")
    if n > limit:
        raise LayoutError(f"image: {n} input images, but this model reads at most {limit} (max_input_images); "
                          f"send at most {limit}", field="image")
