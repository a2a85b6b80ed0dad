"""Reading safetensors files: `open_safetensors` (a broken file is a ConfigError naming it), and the
keys kept in fp32 whatever dtype the model is cast to. Shared by the checkpoint loaders."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ditkv.errors import ConfigError

# Kept in fp32 whatever dtype the rest of the model is cast to (fp32 routing, as released).
_FP32_SUFFIXES = (".mlp.gate.wg.weight",)


@contextmanager
def open_safetensors(path: Path, device: str = "cpu") -> Iterator:
    """`safe_open(path)`: a garbage, truncated or unreadable file is a `ConfigError` naming it
    (safetensors checks the header and that the file covers every tensor when it opens)."""
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(str(path), framework="pt", device=device)
    except (SafetensorError, OSError) as e:
        raise ConfigError("checkpoint", str(path), f"not a readable safetensors file ({e}); re-download "
                                                   "or re-save this shard") from e
    with handle as f:
        yield f
