"""Synthetic shapes dataset and its automatic caption/image quality checker."""

from .quality import accuracy, analyze, as_uint8_image, check
from .shapes import (BACKGROUND, COLORS, DEFAULTS, DROP_PROBS, POSITIONS, SHAPES, SIZE_EXTENT,
                     SIZES, ShapeSpec, ShapesDataset, all_specs, heldout_specs, image_to_tensor,
                     parse_caption, render, tensor_to_image, train_specs, vocabulary_text)

__all__ = [
    "BACKGROUND", "COLORS", "DEFAULTS", "DROP_PROBS", "POSITIONS", "SHAPES", "SIZE_EXTENT",
    "SIZES", "ShapeSpec", "ShapesDataset", "accuracy", "all_specs", "analyze", "as_uint8_image",
    "check", "heldout_specs", "image_to_tensor", "parse_caption", "render", "tensor_to_image",
    "train_specs", "vocabulary_text",
]
