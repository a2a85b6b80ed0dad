"""argparse types for numeric and output-path flags: a bad value is a one-line usage error naming the
flag, never a traceback from deep inside the command."""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path


def _number(kind, text: str):
    try:
        v = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return v


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a count, a size), so a bad value is a one-line usage error."""
    v = _number(int, text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be >= 1")
    return v


def nonneg_int(text: str) -> int:
    v = _number(int, text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"{v} must be >= 0")
    return v


def positive_float(text: str) -> float:
    v = _number(float, text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{v} must be > 0")
    return v


def finite_float(text: str) -> float:
    return _number(float, text)


def true_false(text: str) -> bool:
    """argparse type: `true` or `false` (a flag whose absence means "the default", not false)."""
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"{text!r} is not true or false")
    return text.lower() == "true"


def positive_int_list(text: str) -> list[int]:
    """argparse type: a comma-separated list of integers >= 1, at least one."""
    vals = [positive_int(x.strip()) for x in text.split(",") if x.strip()]
    if not vals:
        raise argparse.ArgumentTypeError(f"{text!r} names no value; give e.g. 1,2,4")
    return vals


def nonneg_int_list(text: str) -> list[int]:
    """argparse type: a comma-separated list of integers >= 0, at least one."""
    vals = [nonneg_int(x.strip()) for x in text.split(",") if x.strip()]
    if not vals:
        raise argparse.ArgumentTypeError(f"{text!r} names no value; give e.g. 0,4")
    return vals


# ---- output paths: probed at parse time, so a folder nothing can be written in fails before the
# command loads a model or runs for minutes. os.access is no proof: root passes it on /proc and on
# read-only mounts, so the probe creates (and removes) a real file there.
WRITE_FIX = "pick a folder you can write to"


def cannot_write_in(folder: Path) -> str | None:
    """None when a file can be created and removed in the existing folder `folder`, else why not."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".ditkv-write-probe-"):
            pass
    except OSError as e:
        return f"cannot create a file in {folder} ({e.strerror or e})"
    return None


def nearest_folder(path: Path) -> Path:
    """The folder a new `path` would be created in: its nearest existing ancestor (a missing
    output folder is created with its parents)."""
    folder = path.absolute().parent
    while not folder.exists():
        folder = folder.parent
    return folder


def writable_file(text: str) -> str:
    """argparse type: a file path that can be written (its folder exists and takes new files).
    The empty string (an unset optional output) passes."""
    if not text:
        return text
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file name")
    folder = path.absolute().parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"folder {folder} does not exist; create it or write elsewhere")
    why = cannot_write_in(folder)
    if why is not None:
        raise argparse.ArgumentTypeError(f"{why}; {WRITE_FIX}")
    return text


def writable_dir(text: str) -> str:
    """argparse type: a folder that exists and takes new files, or can be created (with its parents)."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} exists and is not a folder; give a folder path")
    folder = path if path.is_dir() else nearest_folder(path)
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{folder} is not a folder, so {text} cannot be created there; "
                                         "give another path")
    why = cannot_write_in(folder)
    if why is not None:
        raise argparse.ArgumentTypeError(f"{why}; {WRITE_FIX}")
    return text
