"""Synthetic "one coloured shape on black" dataset for the toy text-to-image model.

Every image holds exactly one shape, described by four attributes. Captions
follow one fixed grammar (see `ShapeSpec.caption`) so a tiny text encoder can
learn them; underspecified captions render with fixed defaults, which keeps
each caption a deterministic description of its image (and checkable).
"""

from __future__ import annotations

import itertools
import re
import zlib
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np
import torch

# --- vocabulary -------------------------------------------------------------

SHAPES = ("circle", "square", "triangle", "cross")

# Saturated colours picked to be >= ~100 apart in RGB from each other, so a
# nearest-palette vote stays unambiguous even on blurry generated images.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "orange": (245, 130, 20),
    "yellow": (235, 230, 40),
    "green": (30, 190, 50),
    "cyan": (30, 215, 225),
    "blue": (40, 80, 235),
    "purple": (175, 50, 220),
    "white": (240, 240, 240),
}
# Black contrasts with every palette colour (the darkest, blue/red, are still
# > 200 away), and maps to -1 in model space, an easy target for "empty".
BACKGROUND = (0, 0, 0)

SIZES = ("small", "medium", "large")
# Bounding-box side as a fraction of the image side, the same for every shape.
SIZE_EXTENT = {"small": 0.22, "medium": 0.34, "large": 0.50}

POSITIONS = ("top left", "top right", "bottom left", "bottom right", "center")
# Corner shapes sit at 28% / 72% of the side (clamped so large ones fit).
_CORNER_FRAC = 0.28

# Used when a caption leaves an attribute out. The dataset renders dropped
# attributes with exactly these values, so the model learns the same defaults.
DEFAULTS = {"color": "white", "size": "medium", "position": "center"}

# Accepted alternative spellings; captions we emit only use canonical words.
SYNONYMS = {"centre": "center", "middle": "center", "magenta": "purple",
            "violet": "purple", "upper": "top", "lower": "bottom"}
_FILLER = {"a", "an", "the", "in", "at", "on", "of"}
_POS_WORDS = {"top", "bottom", "left", "right", "center"}

_FIELDS = ("shape", "color", "size", "position")
_VOCAB = {"shape": SHAPES, "color": tuple(COLORS), "size": SIZES, "position": POSITIONS}


def vocabulary_text() -> str:
    """Human-readable vocabulary, quoted in every parse error."""
    return ("shapes: " + ", ".join(SHAPES) + "; colors: " + ", ".join(COLORS)
            + "; sizes: " + ", ".join(SIZES) + "; positions: " + ", ".join(POSITIONS)
            + "; fillers: " + ", ".join(sorted(_FILLER)))


# --- spec / captions --------------------------------------------------------

@dataclass(frozen=True)
class ShapeSpec:
    """One shape's attributes; None means "not specified" (see DEFAULTS)."""

    shape: str | None = None
    color: str | None = None
    size: str | None = None
    position: str | None = None

    def __post_init__(self):
        for name in _FIELDS:
            value = getattr(self, name)
            if value is not None and value not in _VOCAB[name]:
                raise ValueError(f"unknown {name} {value!r}; {vocabulary_text()}")

    def resolved(self) -> "ShapeSpec":
        """Fill unspecified colour/size/position with DEFAULTS (shape is required)."""
        if self.shape is None:
            raise ValueError("a shape is required to render; " + vocabulary_text())
        return replace(self, **{k: v for k, v in DEFAULTS.items() if getattr(self, k) is None})

    def caption(self) -> str:
        """'a [size] [color] <shape>[ in the <position>]', e.g. 'a small red circle in the top left'."""
        if self.shape is None:
            raise ValueError("cannot caption a spec without a shape")
        words = [w for w in (self.size, self.color, self.shape) if w is not None]
        article = "an" if words[0][0] in "aeiou" else "a"
        text = " ".join([article, *words])
        if self.position is not None:
            text += f" in the {self.position}"
        return text


def parse_caption(text: str) -> ShapeSpec:
    """Parse a caption into a (possibly partial) ShapeSpec.

    Word order is free, case and punctuation are ignored, hyphens count as
    spaces and SYNONYMS are mapped. Omitted attributes come back as None.
    Raises ValueError (quoting the vocabulary) on unknown words, on a missing
    shape, on conflicting words, or on a lone 'top'/'left'-style position.
    """
    tokens = re.sub(r"[-_/]", " ", text.lower())
    tokens = re.sub(r"[.,!?;:'\"()]", " ", tokens).split()
    found: dict[str, str] = {}
    pos_words: list[str] = []
    unknown: list[str] = []
    for tok in tokens:
        tok = SYNONYMS.get(tok, tok)
        if tok in _FILLER:
            continue
        if tok in _POS_WORDS:
            pos_words.append(tok)
            continue
        field = next((f for f in ("shape", "color", "size") if tok in _VOCAB[f]), None)
        if field is None:
            unknown.append(tok)
        elif field in found and found[field] != tok:
            raise ValueError(f"caption {text!r} names two {field}s ({found[field]}, {tok}); "
                             + vocabulary_text())
        else:
            found[field] = tok
    if unknown:
        raise ValueError(f"unknown word(s) {unknown} in caption {text!r}; " + vocabulary_text())
    if pos_words:
        found["position"] = _parse_position(pos_words, text)
    if "shape" not in found:
        raise ValueError(f"caption {text!r} names no shape; " + vocabulary_text())
    return ShapeSpec(**found)


def _parse_position(words: list[str], text: str) -> str:
    vert = {w for w in words if w in ("top", "bottom")}
    horiz = {w for w in words if w in ("left", "right")}
    center = "center" in words
    if center and not vert and not horiz:
        return "center"
    if len(vert) == 1 and len(horiz) == 1 and not center:
        return f"{vert.pop()} {horiz.pop()}"
    raise ValueError(f"cannot read a position from {' '.join(words)!r} in {text!r}; "
                     + vocabulary_text())


# --- rendering --------------------------------------------------------------

_SUPERSAMPLE = 4


def _inside(shape: str, dx: np.ndarray, dy: np.ndarray, half: float) -> np.ndarray:
    """Boolean coverage of a shape whose bounding box is 2*half on each side."""
    ax, ay = np.abs(dx), np.abs(dy)
    if shape == "circle":
        return dx * dx + dy * dy <= half * half
    if shape == "square":
        return (ax <= half) & (ay <= half)
    if shape == "triangle":  # apex up, base at the bottom: width grows linearly
        t = (dy + half) / (2 * half)
        return (t >= 0) & (t <= 1) & (ax <= half * t)
    if shape == "cross":  # arms one third of the box wide
        arm = half / 3
        return ((ax <= arm) & (ay <= half)) | ((ay <= arm) & (ax <= half))
    raise ValueError(f"unknown shape {shape!r}")


def _anchor(position: str, size: int) -> tuple[float, float]:
    if position == "center":
        return size / 2, size / 2
    vert, horiz = position.split()
    cx = size * (_CORNER_FRAC if horiz == "left" else 1 - _CORNER_FRAC)
    cy = size * (_CORNER_FRAC if vert == "top" else 1 - _CORNER_FRAC)
    return cx, cy


def render(spec: ShapeSpec, size: int = 64, rng: np.random.Generator | None = None) -> np.ndarray:
    """Draw `spec` (defaults filled in) as a uint8 [size, size, 3] image.

    With an rng, centre (+-2 px at 64) and extent (+-6%) are jittered; without
    one the output is the canonical, jitter-free picture.
    """
    spec = spec.resolved()
    extent = SIZE_EXTENT[spec.size] * size
    cx, cy = _anchor(spec.position, size)
    if rng is not None:
        extent *= rng.uniform(0.94, 1.06)
        cx += rng.uniform(-2, 2) * size / 64
        cy += rng.uniform(-2, 2) * size / 64
    half = extent / 2
    # Keep a 1 px margin so large corner shapes are never clipped.
    cx = float(np.clip(cx, half + 1, size - half - 1))
    cy = float(np.clip(cy, half + 1, size - half - 1))

    # Supersample then box-average: cheap anti-aliasing with exact coverage.
    n = size * _SUPERSAMPLE
    coords = (np.arange(n, dtype=np.float32) + 0.5) / _SUPERSAMPLE
    inside = _inside(spec.shape, coords[None, :] - cx, coords[:, None] - cy, half)
    alpha = inside.reshape(size, _SUPERSAMPLE, size, _SUPERSAMPLE).mean(axis=(1, 3))

    bg = np.asarray(BACKGROUND, np.float32)
    fg = np.asarray(COLORS[spec.color], np.float32)
    img = bg + alpha[..., None] * (fg - bg)
    return np.rint(img).astype(np.uint8)


def image_to_tensor(image: np.ndarray) -> torch.Tensor:
    """uint8 [H,W,3] -> float32 [3,H,W] in [-1, 1] (the model's pixel space)."""
    t = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1).float()
    return t / 127.5 - 1.0


def tensor_to_image(t: torch.Tensor) -> np.ndarray:
    """float [3,H,W] in [-1, 1] -> uint8 [H,W,3] (values outside are clipped)."""
    t = ((t.detach().float().cpu() + 1.0) * 127.5).round().clamp(0, 255)
    return t.to(torch.uint8).permute(1, 2, 0).numpy()


# --- splits & dataset -------------------------------------------------------

@lru_cache(maxsize=None)
def all_specs() -> tuple[ShapeSpec, ...]:
    """Every full attribute combination (4*8*3*5 = 480)."""
    return tuple(ShapeSpec(*combo) for combo in itertools.product(SHAPES, COLORS, SIZES, POSITIONS))


def _is_heldout(spec: ShapeSpec) -> bool:
    # crc32 of the caption is stable across runs and Python versions (unlike hash()).
    return zlib.crc32(spec.caption().encode()) % 8 == 0


@lru_cache(maxsize=None)
def heldout_specs() -> tuple[ShapeSpec, ...]:
    """Full combinations never shown in training: a compositional-generalisation test set."""
    return tuple(s for s in all_specs() if _is_heldout(s))


@lru_cache(maxsize=None)
def train_specs() -> tuple[ShapeSpec, ...]:
    return tuple(s for s in all_specs() if not _is_heldout(s))


# Chance that a training caption omits each attribute (rendered with DEFAULTS).
DROP_PROBS = {"position": 0.25, "size": 0.15, "color": 0.05}


class ShapesDataset(torch.utils.data.Dataset):
    """n (caption, image) pairs, deterministic from (seed, index).

    holdout=False samples only train_specs() and sometimes drops attributes
    from the caption (the image then uses DEFAULTS for them, never landing on
    a held-out combination); holdout=True samples only heldout_specs() with
    full captions. Items are float32 [3,size,size] tensors in [-1, 1].
    """

    def __init__(self, seed: int, n: int, size: int = 64, holdout: bool = False,
                 drop_probs: dict[str, float] | None = None):
        self.seed, self.n, self.size, self.holdout = seed, n, size, holdout
        self.drop_probs = {} if holdout else dict(DROP_PROBS if drop_probs is None else drop_probs)
        self._pool = heldout_specs() if holdout else train_specs()
        self._heldout = set(heldout_specs())

    def __len__(self) -> int:
        return self.n

    def sample(self, index: int) -> tuple[str, ShapeSpec, np.ndarray]:
        """(caption, resolved spec actually drawn, uint8 image) for one index."""
        if not 0 <= index < self.n:
            raise IndexError(index)
        rng = np.random.default_rng([self.seed, index, int(self.holdout)])
        full = self._pool[rng.integers(len(self._pool))]
        dropped = {f: None for f, p in self.drop_probs.items() if rng.random() < p}
        spec = replace(full, **dropped)
        if spec.resolved() in self._heldout:
            spec = full  # defaults would recreate a held-out combo: keep it full
        return spec.caption(), spec.resolved(), render(spec, self.size, rng)

    def __getitem__(self, index: int) -> tuple[str, torch.Tensor]:
        caption, _, image = self.sample(index)
        return caption, image_to_tensor(image)
