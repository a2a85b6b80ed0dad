"""Image sizes as the served model makes them: which `WIDTHxHEIGHT` a request may ask for, and
what `size=auto` takes from an input image.

A release model (`image_base_size` set) snaps every requested size to its nearest resolution
bucket (`models/hunyuan/buckets.py`, applied by the engine), so any positive size may be asked
for. Any other model (the bundled tiny ones) generates the size as asked, so each side must be a
whole number of latent cells (`image_token_downsample` pixels); 1x1 is a 400 there. The server's
check and the `pattern` that /openapi.json publishes are one regex (`SizeRule.pattern`), so the
schema and the server agree. Whether the model's positions and the KV pool hold that many image
tokens is the engine's verdict (400 naming `size`); for `size=auto` the answer then says that the
size came from the input image and how to choose another.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

DIGITS = 5  # at most 5 digits per side: the bound the schema has always had (--max-image-size is checked too)


@dataclass(frozen=True)
class SizeRule:
    cell: int = 1  # each side a multiple of this many pixels
    snaps: bool = False  # the model snaps requested sizes to its resolution buckets

    def pattern(self, auto: bool = False) -> str:
        side = _multiples(self.cell)
        return f"^({'auto|' if auto else ''}{side}x{side})$"

    def hint(self) -> str:
        """What the pattern means, for the 400 of a size that does not match it."""
        if self.cell == 1:
            return "'WIDTHxHEIGHT' in pixels, e.g. '64x64'"
        return (f"'WIDTHxHEIGHT' in pixels, each side a multiple of {self.cell} (this model's pixels per latent "
                f"cell), e.g. '{self.cell * 16}x{self.cell * 16}'")

    def auto_multiple(self) -> int:
        """`size=auto` rounds to this: whole 16 px (as the release's buckets step) and whole latent cells."""
        return math.lcm(16, self.cell)


def size_rule(service) -> SizeRule:
    """The served model's size rule; a service whose model config cannot be found (a stand-in)
    takes any positive size and leaves the verdict to the engine."""
    cfg = _model_config(service)
    if cfg is None:
        return SizeRule()
    if getattr(cfg, "image_base_size", None) is not None:
        return SizeRule(snaps=True)
    return SizeRule(cell=int(getattr(cfg, "image_token_downsample", 1) or 1))


def _model_config(service):
    # neither service exposes its model config: AsyncEngine keeps it on its engine's executor,
    # AsyncOrchestrator on its orchestrator
    executor = getattr(getattr(service, "_engine", None), "executor", None)
    cfg = getattr(executor, "model_config", None)
    return cfg if cfg is not None else getattr(getattr(service, "orch", None), "model_config", None)


def auto_note(size: tuple[int, int], image: tuple[int, int], rule: SizeRule) -> str:
    """Appended to the engine's 400 on `size` when the size came from `size=auto`."""
    return (f"size=auto (the default) took {size[0]}x{size[1]} from the first input image ({image[0]}x{image[1]} "
            f"pixels, rounded down to {rule.auto_multiple()} px, longest side at most --max-image-size), and this "
            "model cannot make that size: pass size=WIDTHxHEIGHT with a smaller size")


@lru_cache(maxsize=16)
def _multiples(cell: int) -> str:
    """Regex of the positive multiples of `cell` with 1..DIGITS digits and no leading zero."""
    if cell == 1:
        return f"[1-9][0-9]{{0,{DIGITS - 1}}}"
    alts = [p for n in range(1, DIGITS + 1) if (p := _digits(n, 0, cell, True)) is not None]
    return "(?:" + "|".join(alts) + ")"


@lru_cache(maxsize=None)
def _digits(n: int, residue: int, cell: int, lead: bool) -> str | None:
    """Regex of the n-digit strings (first digit 1-9 if `lead`) whose value is `residue` modulo
    `cell`; None if there is none. Digits that leave the same remainder share a class."""
    if n == 0:
        return "" if residue == 0 else None
    rests: dict[str, list[int]] = {}
    for d in range(1 if lead else 0, 10):
        rest = _digits(n - 1, (residue - d * 10 ** (n - 1)) % cell, cell, False)
        if rest is not None:
            rests.setdefault(rest, []).append(d)
    alts = [_char_class(ds) + rest for rest, ds in rests.items()]
    return None if not alts else alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"


def _char_class(ds: list[int]) -> str:
    if len(ds) == 1:
        return str(ds[0])
    if ds == list(range(ds[0], ds[-1] + 1)):
        return f"[{ds[0]}-{ds[-1]}]"
    return "[" + "".join(map(str, ds)) + "]"
