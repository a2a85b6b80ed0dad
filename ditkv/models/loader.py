"""Resolve `--model tiny|PATH` to (model, tokenizer, codec) on a device."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import ConfigError
from ..alignment import align_module
from .family import DEFAULT_FAMILY, family_for_folder, family_named, family_of

TINY_ASSET = Path(__file__).resolve().parent.parent / "assets" / "tiny"
# bundled checkpoints by name: the text-to-image tiny model (the default), and its editing fine-tune
# (takes one input image; its text-to-image accuracy is a little lower: docs/tiny-model.md "Editing")
BUNDLED = {"tiny": TINY_ASSET, "tiny-edit": TINY_ASSET.parent / "tiny-edit"}
MODEL_FIX = "pass 'tiny', 'tiny-edit' or a checkpoint folder containing config.json"


def bundled_or_path(name: str) -> Path:
    """The folder of `--model NAME`: a bundled checkpoint's, or NAME as a path."""
    return BUNDLED.get(name, Path(name))


DEVICE_FIX = "use auto, cpu, cuda or cuda:N"


def resolve_device(name: str) -> torch.device:
    """`auto|cpu|cuda|cuda:N` -> a torch device that exists here; anything else is a ConfigError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError) as e:  # torch's parse error lists every backend it knows
        raise ConfigError("device", name, f"not a device name; {DEVICE_FIX}") from e
    if dev.type not in ("cpu", "cuda"):  # the engine, its transports and placement know only these
        raise ConfigError("device", name, f"unsupported device type {dev.type!r}; {DEVICE_FIX}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", name, "no CUDA device is visible; use --device cpu (or auto)")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError("device", name, f"only {torch.cuda.device_count()} CUDA device(s) are visible; "
                                          f"use cuda:0..cuda:{torch.cuda.device_count() - 1}")
    return dev


def load_frontend(name: str):
    """(model config, tokenizer) of `--model NAME` without loading weights, as `load_model` reads them."""
    folder = bundled_or_path(name)
    if name == "tiny" and not (folder / "config.json").is_file():
        return family_named(DEFAULT_FAMILY).load_frontend(None)
    if not (folder / "config.json").is_file():
        raise ConfigError("model", name, MODEL_FIX)
    return family_for_folder(folder).load_frontend(folder)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_model(name: str, device: torch.device, dtype: torch.dtype, quantization: str | None = None,
               ignored: tuple = ()):
    """'tiny' = the bundled trained checkpoint if present, else the deterministic tiny preset (of the
    default family). `quantization` "fp8": the decoder layers' linears become W8A8 while loading
    (`ignored`: module patterns kept); a pre-quantized checkpoint folder loads FP8 whatever it says.
    The folder's config.json names the model family that loads it (`family_for_folder`)."""
    if name == "tiny" and not (TINY_ASSET / "config.json").is_file():
        return aligned_bundle(family_named(DEFAULT_FAMILY).load(None, device, dtype, quantization, tuple(ignored)))
    folder = BUNDLED[name] if name in BUNDLED else _checkpoint_dir(name)
    return aligned_bundle(family_for_folder(folder).load(folder, device, dtype, quantization, tuple(ignored)))


def aligned_bundle(bundle):
    """(model, tokenizer, codec) with every CPU tensor of the model 64-byte aligned, in place
    (models/alignment.py): whoever loaded or built it, the CPU kernels then compute the same bits."""
    align_module(bundle[0])
    return bundle


def quantized(model, method: str | None, ignored: tuple = (), copy: bool = False):
    """`model` with `method` applied (None: as it is; already FP8: as it is). `copy`: quantize new
    module objects that share the unquantized tensors, never a caller's model in place."""
    family = family_of(model.config)
    if method is None or family.quantization_of(model) is not None:
        return model
    if copy:
        model = module_copy(model)
    return family.apply_quantization(model, method, tuple(ignored))


def module_copy(model):
    """New module objects, same parameter / buffer tensors (quantizing or sharding the copy leaves
    the caller's model as it is)."""
    import copy

    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return copy.deepcopy(model, memo)


def param_bytes(model) -> int:
    """Bytes of the model's parameters on this rank (a sliced load: its shard only)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _checkpoint_dir(name: str) -> Path:
    """`--model PATH` as a checkpoint folder, or a ConfigError saying what is wrong with it."""
    path = Path(name)
    if not path.is_dir():
        raise ConfigError("model", name, f"no such folder; {MODEL_FIX}")
    if not (path / "config.json").is_file():
        raise ConfigError("model", name, f"the folder has no config.json; {MODEL_FIX}")
    return path


def checkpoint_folder(name: str) -> Path | None:
    """The folder `load_model(name)` reads weights from; None for the generated tiny preset."""
    folder = bundled_or_path(name)
    return folder if (folder / "config.json").is_file() else None


def load_model_shard(name: str, spec, device: torch.device, dtype: torch.dtype, quantization: str | None = None,
                     ignored: tuple = ()):
    """`load_model` for one TP/EP rank: only its shard is read (`load_checkpoint_shard`); None when
    `name` has no checkpoint folder (the generated tiny preset: load it whole and shard it)."""
    folder = checkpoint_folder(name)
    if folder is None:
        if name != "tiny":
            raise ConfigError("model", name, MODEL_FIX)
        return None
    return aligned_bundle(family_for_folder(folder).load_shard(folder, spec, device, dtype, quantization,
                                                               tuple(ignored)))
