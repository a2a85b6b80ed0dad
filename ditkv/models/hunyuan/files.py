"""Reading a checkpoint's JSON files (config.json, generation_config.json, the safetensors index,
tokenizer_config.json) with errors that name the file and the fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ditkv.errors import ConfigError


def read_json(path: str | Path, fix: str) -> Any:
    """The parsed content of a checkpoint's JSON file; an unreadable or malformed file is a
    `ConfigError` naming it (`fix`: what to do about it)."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except OSError as e:  # missing, a directory, no permission
        raise ConfigError("checkpoint", str(path), f"cannot read {path.name} ({e.strerror or e}); {fix}") from e
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer past 4300 digits
        raise ConfigError("checkpoint", str(path), f"{path.name} is not valid JSON ({e}); {fix}") from e
