"""The engine process's side of the model when the weights live in rank processes: its config and
tokenizer without loading weights, and the layout call's input-image argument."""

from __future__ import annotations

from ..errors import ConfigError


def images_kw(images) -> dict:
    """`images=` for the model's layout, only when the request has input images: a text-to-image
    request calls the layout exactly as before image inputs existed."""
    return {"images": list(images)} if images else {}


def load_frontend(config, bundle):
    """(model config, tokenizer) without loading weights, mirroring `models.loader.load_model`."""
    from ..models.hunyuan import ByteTokenizer, HunyuanImage3Config, load_tokenizer
    from ..models.hunyuan.checkpoint import load_model_config
    from ..models.loader import MODEL_FIX, bundled_or_path

    if bundle is not None:
        return bundle[0].config, bundle[1]
    folder = bundled_or_path(config.model)
    if config.model == "tiny" and not (folder / "config.json").is_file():
        return HunyuanImage3Config.tiny(), ByteTokenizer()
    if not (folder / "config.json").is_file():
        raise ConfigError("model", config.model, MODEL_FIX)
    return load_model_config(folder), load_tokenizer(folder)
