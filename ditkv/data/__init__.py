"""Synthetic shapes dataset, its edit pairs (`edits.py`) and its automatic caption/image quality checker."""

from .edits import (EDIT_ATTRIBUTES, EDIT_TEMPLATES, Edit, EditDataset, EditPair, all_edit_pairs, all_edits,
                    edits_for, heldout_edits, parse_instruction, render_pair, train_edits)
from .quality import accuracy, analyze, as_uint8_image, check
from .shapes import (BACKGROUND, COLORS, DEFAULTS, DROP_PROBS, POSITIONS, SHAPES, SIZE_EXTENT,
                     SIZES, ShapeSpec, ShapesDataset, all_specs, heldout_specs, image_to_tensor,
                     parse_caption, render, tensor_to_image, train_specs, vocabulary_text)

__all__ = [
    "EDIT_ATTRIBUTES", "EDIT_TEMPLATES", "Edit", "EditDataset", "EditPair", "all_edit_pairs", "all_edits",
    "edits_for", "heldout_edits", "parse_instruction", "render_pair", "train_edits",
    "BACKGROUND", "COLORS", "DEFAULTS", "DROP_PROBS", "POSITIONS", "SHAPES", "SIZE_EXTENT",
    "SIZES", "ShapeSpec", "ShapesDataset", "accuracy", "all_specs", "analyze", "as_uint8_image",
    "check", "heldout_specs", "image_to_tensor", "parse_caption", "render", "tensor_to_image",
    "train_specs", "vocabulary_text",
]
