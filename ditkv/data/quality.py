"""Automatic "does the picture match the caption?" checker for shapes images.

Pipeline (all plain image statistics, no learned weights beyond 4 templates):
  1. colour   - majority nearest-palette vote over the strongest foreground
                pixels (edge pixels are darkened by anti-aliasing, so skipped);
  2. alpha    - per-pixel coverage = projection of (pixel - background) onto
                (colour - background); the shape is the largest 4-connected
                component with alpha > 0.5, which ignores stray specks;
  3. size     - longest side of that component's bounding box, bucketed at the
                geometric midpoints between SIZE_EXTENT values;
  4. position - bounding-box centre: "center" if within 11% of the side from
                the image centre, otherwise the quadrant it lies in;
  5. shape    - the alpha crop resized to 8x8 and matched to the nearest of
                four centroids, fitted (lazily, deterministically) on renders.
"""

from __future__ import annotations

from collections import deque
from functools import lru_cache

import numpy as np
import torch
from PIL import Image

from .shapes import (BACKGROUND, COLORS, SHAPES, SIZE_EXTENT, SIZES, ShapeSpec,
                     render, tensor_to_image)

_FIELDS = ("shape", "color", "size", "position")
_PALETTE = np.asarray(list(COLORS.values()), np.float32)
_PALETTE_NAMES = tuple(COLORS)
_BG = np.asarray(BACKGROUND, np.float32)

_FG_MIN = 60.0        # RGB distance from background that counts as "something drawn"
_MIN_PIXELS = 6       # fewer foreground pixels than this = blank image
_CENTER_TOL = 0.11    # fraction of the side; corners sit ~0.22 away, centre jitter ~0.03
_DESC = 8             # shape descriptor resolution (8x8 alpha thumbnail)


def as_uint8_image(image) -> np.ndarray:
    """Accept uint8 HWC arrays, PIL images, or float tensors/arrays in [-1, 1] (CHW or HWC)."""
    if isinstance(image, Image.Image):
        return np.asarray(image.convert("RGB"))
    if isinstance(image, torch.Tensor):
        if image.dtype == torch.uint8:
            image = image.cpu().numpy()
        else:
            chw = image if image.shape[0] == 3 else image.permute(2, 0, 1)
            return tensor_to_image(chw)
    arr = np.asarray(image)
    if arr.dtype != np.uint8:  # float array in model space
        chw = arr if arr.shape[0] == 3 and arr.shape[-1] != 3 else arr.transpose(2, 0, 1)
        return tensor_to_image(torch.from_numpy(np.ascontiguousarray(chw)))
    if arr.ndim == 3 and arr.shape[0] == 3 and arr.shape[-1] != 3:
        arr = arr.transpose(1, 2, 0)
    return arr


def _largest_component(mask: np.ndarray) -> np.ndarray:
    """Largest 4-connected component of a boolean mask (BFS; masks are tiny)."""
    h, w = mask.shape
    seen = np.zeros_like(mask)
    best: list[tuple[int, int]] = []
    for y0, x0 in zip(*np.nonzero(mask)):
        if seen[y0, x0]:
            continue
        seen[y0, x0] = True
        comp, queue = [], deque([(y0, x0)])
        while queue:
            y, x = queue.popleft()
            comp.append((y, x))
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    queue.append((ny, nx))
        if len(comp) > len(best):
            best = comp
    out = np.zeros_like(mask)
    if best:
        ys, xs = zip(*best)
        out[list(ys), list(xs)] = True
    return out


def _descriptor(alpha: np.ndarray, y0: int, y1: int, x0: int, x1: int) -> np.ndarray:
    """Scale-normalised shape thumbnail: the bbox alpha crop box-resized to 8x8."""
    crop = np.ascontiguousarray(alpha[y0:y1 + 1, x0:x1 + 1], dtype=np.float32)
    thumb = Image.fromarray(crop).resize((_DESC, _DESC), Image.Resampling.BOX)
    return np.asarray(thumb, np.float32).ravel()


def _measure(image) -> tuple[ShapeSpec, np.ndarray | None]:
    """Predicted attributes (shape left None) plus the shape descriptor, if any."""
    img = as_uint8_image(image).astype(np.float32)
    h, w = img.shape[:2]
    diff = img - _BG
    dist = np.linalg.norm(diff, axis=-1)
    fg = dist > _FG_MIN
    if fg.sum() < _MIN_PIXELS:
        return ShapeSpec(), None

    # 1. colour: vote among pixels close to the brightest foreground level.
    core = dist >= max(_FG_MIN, 0.6 * np.percentile(dist[fg], 90))
    pix = img[core]
    nearest = ((pix[:, None, :] - _PALETTE[None]) ** 2).sum(-1).argmin(1)
    color_idx = int(np.bincount(nearest, minlength=len(_PALETTE)).argmax())
    color = _PALETTE_NAMES[color_idx]

    # 2. coverage and the main blob.
    ref = _PALETTE[color_idx] - _BG
    alpha = np.clip(diff @ ref / float(ref @ ref), 0.0, 1.0)
    blob = _largest_component(alpha > 0.5)
    if blob.sum() < _MIN_PIXELS:
        return ShapeSpec(color=color), None
    ys, xs = np.nonzero(blob)
    y0, y1, x0, x1 = ys.min(), ys.max(), xs.min(), xs.max()

    # 3. size from the bbox's longest side (all shapes share one extent per size).
    extent = max(y1 - y0 + 1, x1 - x0 + 1) / max(h, w)
    fracs = [SIZE_EXTENT[s] for s in SIZES]
    cuts = [np.sqrt(a * b) for a, b in zip(fracs, fracs[1:])]
    size = SIZES[int(np.searchsorted(cuts, extent))]

    # 4. position from the bbox centre (the mass centroid of a triangle sits low).
    dx = ((x0 + x1 + 1) / 2 - w / 2) / w
    dy = ((y0 + y1 + 1) / 2 - h / 2) / h
    if max(abs(dx), abs(dy)) < _CENTER_TOL:
        position = "center"
    else:
        position = ("top" if dy < 0 else "bottom") + " " + ("left" if dx < 0 else "right")

    return ShapeSpec(color=color, size=size, position=position), _descriptor(alpha, y0, y1, x0, x1)


@lru_cache(maxsize=None)
def _templates() -> np.ndarray:
    """Mean descriptor per shape over jittered renders of all sizes/positions (~0.1 s)."""
    rng = np.random.default_rng(1234)
    positions = ("center", "top left", "bottom right")
    rows = []
    for shape in SHAPES:
        descs = [_measure(render(ShapeSpec(shape, "white", size, pos), 64, rng))[1]
                 for size in SIZES for pos in positions for _ in range(2)]
        rows.append(np.mean(descs, axis=0))
    return np.stack(rows)


def analyze(image) -> ShapeSpec:
    """Best-guess ShapeSpec for an image; fields are None where nothing was found."""
    pred, desc = _measure(image)
    if desc is None:
        return pred
    shape = SHAPES[int(((_templates() - desc) ** 2).sum(1).argmin())]
    return ShapeSpec(shape, pred.color, pred.size, pred.position)


def check(image, spec: ShapeSpec, *, use_defaults: bool = True) -> dict:
    """Compare an image to the spec it should show.

    With use_defaults (the default) unspecified attributes are expected to take
    their DEFAULTS values, exactly as the dataset renders them; otherwise they
    pass as long as something was detected. A blank image fails everything.
    """
    want = spec.resolved() if use_defaults else spec
    pred = analyze(image)
    out = {}
    for field in _FIELDS:
        got, exp = getattr(pred, field), getattr(want, field)
        out[f"{field}_ok"] = got is not None and (exp is None or got == exp)
    out["all_ok"] = all(out[f"{f}_ok"] for f in _FIELDS)
    out["predicted"] = pred
    return out


def accuracy(images, specs, *, use_defaults: bool = True) -> dict:
    """Per-attribute accuracy (and all-attribute accuracy) over paired images/specs."""
    images, specs = list(images), list(specs)
    if len(images) != len(specs):
        raise ValueError(f"{len(images)} images but {len(specs)} specs")
    if not images:
        raise ValueError("accuracy() needs at least one image")
    results = [check(im, sp, use_defaults=use_defaults) for im, sp in zip(images, specs)]
    acc = {f: float(np.mean([r[f"{f}_ok"] for r in results])) for f in _FIELDS}
    acc["all"] = float(np.mean([r["all_ok"] for r in results]))
    acc["n"] = len(results)
    return acc
