"""Edit pairs for the tiny model: (source shape, instruction) -> target shape.

An edit changes exactly one attribute of a fully specified source shape; the instruction follows
one fixed template per attribute (the whole grammar):

    attribute  template              values                                   per source
    color      "make it <color>"     red orange yellow green cyan blue        7 (every colour but
                                     purple white                               the source's)
    size       "make it <size>"      small medium large                       2
    shape      "make it a <shape>"   circle square triangle cross             3
    position   "move it to the <position>"  top left, top right, bottom left,  4
                                     bottom right, center

so 20 instructions, 16 per source and 480 x 16 = 7,680 (source, instruction) pairs. The target
keeps every other attribute of the source. Source and target are drawn with the same jitter
(one rng seed renders both), so an edit also keeps the shape's exact offset and extent.

Split (`heldout_edits(seed)`, `train_edits(seed)`): a pair is held out when
crc32(f"{seed}|{source caption}|{instruction}") % 16 == 0 (480 of 7,680 at seed 0); the rest is
the training pool, minus every pair whose source or target is a text-to-image held-out combination
(`heldout_specs()`), so the text-to-image held-out set stays unseen as an image too. Held-out pairs
are unseen (source, instruction) combinations: every source and every instruction also occurs in
training, never together. Both splits are deterministic in the seed and never overlap.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from .shapes import COLORS, POSITIONS, SHAPES, SIZES, ShapeSpec, all_specs, heldout_specs, render

EDIT_ATTRIBUTES = ("color", "position", "shape", "size")
EDIT_TEMPLATES = {
    "color": "make it {}",
    "size": "make it {}",
    "shape": "make it a {}",
    "position": "move it to the {}",
}
_VALUES = {"color": tuple(COLORS), "size": SIZES, "shape": SHAPES, "position": POSITIONS}
HELDOUT_MOD = 16  # 1 in 16 (source, instruction) pairs is held out


@dataclass(frozen=True)
class Edit:
    """Set one attribute to a value."""

    attribute: str
    value: str

    def __post_init__(self):
        if self.attribute not in EDIT_TEMPLATES:
            raise ValueError(f"unknown edit attribute {self.attribute!r}; one of {EDIT_ATTRIBUTES}")
        if self.value not in _VALUES[self.attribute]:
            raise ValueError(f"unknown {self.attribute} {self.value!r}; one of {_VALUES[self.attribute]}")

    @property
    def instruction(self) -> str:
        return EDIT_TEMPLATES[self.attribute].format(self.value)

    def apply(self, spec: ShapeSpec) -> ShapeSpec:
        return replace(spec.resolved(), **{self.attribute: self.value})


@dataclass(frozen=True)
class EditPair:
    source: ShapeSpec  # complete
    edit: Edit

    @property
    def instruction(self) -> str:
        return self.edit.instruction

    @property
    def target(self) -> ShapeSpec:
        return self.edit.apply(self.source)

    @property
    def attribute(self) -> str:
        return self.edit.attribute


@lru_cache(maxsize=None)
def all_edits() -> tuple[Edit, ...]:
    """The 20 instructions, in EDIT_ATTRIBUTES order."""
    return tuple(Edit(a, v) for a in EDIT_ATTRIBUTES for v in _VALUES[a])


def instructions() -> tuple[str, ...]:
    return tuple(e.instruction for e in all_edits())


def parse_instruction(text: str) -> Edit:
    """The Edit an instruction of the grammar stands for (exact text; ValueError otherwise)."""
    for e in all_edits():
        if e.instruction == text:
            return e
    raise ValueError(f"not an instruction of the edit grammar: {text!r}; templates: "
                     + ", ".join(repr(t) for t in EDIT_TEMPLATES.values()))


def edits_for(spec: ShapeSpec) -> tuple[Edit, ...]:
    """Every instruction that changes `spec` (its 16 edits)."""
    spec = spec.resolved()
    return tuple(e for e in all_edits() if getattr(spec, e.attribute) != e.value)


@lru_cache(maxsize=None)
def all_edit_pairs() -> tuple[EditPair, ...]:
    return tuple(EditPair(s, e) for s in all_specs() for e in edits_for(s))


def is_heldout_edit(pair: EditPair, seed: int = 0) -> bool:
    key = f"{seed}|{pair.source.caption()}|{pair.instruction}"
    return zlib.crc32(key.encode()) % HELDOUT_MOD == 0


@lru_cache(maxsize=None)
def heldout_edits(seed: int = 0) -> tuple[EditPair, ...]:
    """Held-out (source, instruction) pairs: never trained on (module docstring)."""
    return tuple(p for p in all_edit_pairs() if is_heldout_edit(p, seed))


@lru_cache(maxsize=None)
def train_edits(seed: int = 0) -> tuple[EditPair, ...]:
    """Training pairs: not held out, and neither source nor target a text-to-image held-out combination."""
    t2i_heldout = set(heldout_specs())
    return tuple(p for p in all_edit_pairs() if not is_heldout_edit(p, seed)
                 and p.source not in t2i_heldout and p.target not in t2i_heldout)


def render_pair(pair: EditPair, size: int = 64, jitter_seed=None) -> tuple[np.ndarray, np.ndarray]:
    """(source, target) uint8 [size, size, 3]; with `jitter_seed` both get the same jitter, without it
    both are the canonical jitter-free pictures."""
    if jitter_seed is None:
        return render(pair.source, size), render(pair.target, size)
    return (render(pair.source, size, np.random.default_rng(jitter_seed)),
            render(pair.target, size, np.random.default_rng(jitter_seed)))


class EditDataset:
    """n edit samples, deterministic from (seed, index).

    holdout=False: each sample picks an attribute uniformly, then a training pair of that attribute
    uniformly (so the rarer size/shape edits are seen as often as colour edits), with a fresh jitter.
    holdout=True: the held-out pairs in order (n = their count), each with its own fixed jitter.
    `sample(i)` -> (pair, source uint8 image, target uint8 image)."""

    def __init__(self, seed: int = 0, n: int | None = None, size: int = 64, holdout: bool = False,
                 split_seed: int = 0):
        self.seed, self.size, self.holdout = seed, size, holdout
        if holdout:
            self._pairs = heldout_edits(split_seed)
            self.n = len(self._pairs) if n is None else min(n, len(self._pairs))
        else:
            if n is None:
                raise ValueError("EditDataset(holdout=False) needs n")
            self.n = n
            pool = train_edits(split_seed)
            self._by_attr = {a: tuple(p for p in pool if p.attribute == a) for a in EDIT_ATTRIBUTES}

    def __len__(self) -> int:
        return self.n

    def pair(self, index: int) -> tuple[EditPair, int]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        if self.holdout:
            return self._pairs[index], int(np.random.default_rng([self.seed, index, 3]).integers(2**31))
        rng = np.random.default_rng([self.seed, index, 2])
        pairs = self._by_attr[EDIT_ATTRIBUTES[rng.integers(len(EDIT_ATTRIBUTES))]]
        return pairs[rng.integers(len(pairs))], int(rng.integers(2**31))

    def sample(self, index: int) -> tuple[EditPair, np.ndarray, np.ndarray]:
        pair, jitter = self.pair(index)
        src, tgt = render_pair(pair, self.size, jitter)
        return pair, src, tgt
