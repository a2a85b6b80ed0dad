"""The engine process's side of the model when the weights live in rank processes: its config and
tokenizer without loading weights, and the layout call's input-image argument."""

from __future__ import annotations


def images_kw(images) -> dict:
    """`images=` for the model's layout, only when the request has input images: a text-to-image
    request calls the layout exactly as before image inputs existed."""
    return {"images": list(images)} if images else {}


def load_frontend(config, bundle):
    """(model config, tokenizer) without loading weights (`models.loader.load_frontend`), or the
    caller's bundle's."""
    from ..models.loader import load_frontend as load

    if bundle is not None:
        return bundle[0].config, bundle[1]
    return load(config.model)
