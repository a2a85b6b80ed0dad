"""Image sizes as the served model makes them: which `WIDTHxHEIGHT` a request may ask for, and
what `size=auto` takes from an input image.

A release model (`image_base_size` set) snaps every requested size to its nearest resolution
bucket (`models/hunyuan/buckets.py`, applied by the engine), so any positive size may be asked
for. Any other model (the bundled tiny ones) generates the size as asked, so each side must be a
whole number of latent cells (`image_token_downsample` pixels); 1x1 is a 400 there. The server's
check and the `pattern` that /openapi.json publishes are one regex (`SizeRule.pattern`), so the
schema and the server agree; it also caps each side at the server's `--max-image-size`
(`SizeRule.max_side`), so a client generating sizes from the schema (schemathesis, SDK codegen)
never proposes one the server refuses. Whether the model's positions and the KV pool hold that many image
tokens is the engine's verdict (400 naming `size`); for `size=auto` the answer then says that the
size came from the input image and how to choose another.

`size=auto` is the model's own choice among its resolution buckets, as the release's image_size="auto"
(an AR phase or a stage graph's AR stage; docs/ar-phase.md "size=auto"), where the served engine can
(`SizeRule.auto`): on /v1/images/generations, and on chat and edits with input images (the images in
the model's context, as the release's img_ratio step). Where it cannot (a model without buckets, a
dense_legacy engine), chat and edits take the first input image's size and generations has no auto.
`SizeRule.auto_default`: a request without a size is auto on generations (the checkpoint's
generation_config.json says `image_size: auto`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

UNCAPPED = 99_999  # a rule without a server behind it (a stand-in, the unit tests): 5 digits per side


@dataclass(frozen=True)
class SizeRule:
    cell: int = 1  # each side a multiple of this many pixels
    snaps: bool = False  # the model snaps requested sizes to its resolution buckets
    max_side: int = UNCAPPED  # the server's --max-image-size: no side above it
    auto: bool = False  # text to image may ask for size=auto: the served engine lets the model pick
    auto_default: bool = False  # ... and a request without a size gets it (the checkpoint's image_size: auto)

    def pattern(self, auto: bool = False) -> str:
        side = _multiples(self.cell, self.max_side)
        return f"^({'auto|' if auto else ''}{side}x{side})$"

    def hint(self) -> str:
        """What the pattern means, for the 400 of a size that does not match it."""
        cap = "" if self.max_side == UNCAPPED else \
            f"at most {self.max_side} (this server's max_image_size, --max-image-size)"
        ex = min(64 if self.cell == 1 else self.cell * 16, self.max_side // self.cell * self.cell) or self.cell
        if self.cell == 1:
            return f"'WIDTHxHEIGHT' in pixels, {'each side ' + cap + ', ' if cap else ''}e.g. '{ex}x{ex}'"
        return (f"'WIDTHxHEIGHT' in pixels, each side a multiple of {self.cell} (this model's pixels per latent "
                f"cell){' and ' + cap if cap else ''}, e.g. '{ex}x{ex}'")

    def auto_multiple(self) -> int:
        """`size=auto` rounds to this: whole 16 px (as the release's buckets step) and whole latent cells."""
        return math.lcm(16, self.cell)


def size_rule(service, max_side: int = UNCAPPED) -> SizeRule:
    """The served model's size rule, each side at most `max_side` (the server's --max-image-size);
    a service whose model config cannot be found (a stand-in) takes any positive size and leaves
    the verdict to the engine."""
    cfg = _model_config(service)
    if cfg is None:
        return SizeRule(max_side=max_side)
    auto = _auto(service)
    if getattr(cfg, "image_base_size", None) is not None:
        return SizeRule(snaps=True, max_side=max_side, **auto)
    return SizeRule(cell=int(getattr(cfg, "image_token_downsample", 1) or 1), max_side=max_side, **auto)


def _auto(service) -> dict:
    """`auto` and `auto_default` of a served engine whose model can pick its size: a single engine's, or
    a stage graph's orchestrator's intake (its AR stage picks)."""
    proc = getattr(getattr(service, "_engine", None), "processor", None) \
        or getattr(getattr(service, "orch", None), "processor", None)
    if proc is None or proc.auto_size_error() is not None:
        return {}
    return {"auto": True, "auto_default": bool(proc.auto_size_default)}


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
def _multiples(cell: int, max_side: int) -> str:
    """Regex of the multiples of `cell` in 1..max_side, written without leading zeros."""
    top = str(max_side)
    alts = [p for n in range(1, len(top) + 1)
            if (p := _digits(n, 0, cell, True, top if n == len(top) else None)) is not None]
    if not alts:  # no side the model makes is within the server's limit: the pattern matches nothing
        return "(?!)"
    return alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"


@lru_cache(maxsize=None)
def _digits(n: int, residue: int, cell: int, lead: bool, bound: str | None) -> str | None:
    """Regex of the n-digit strings (first digit 1-9 if `lead`) whose value is `residue` modulo
    `cell` and, if `bound` (n digits) is given, at most `bound`; None if there is none. Digits
    that leave the same rest share a class; only the digit equal to the bound's keeps a bound."""
    if n == 0:
        return "" if residue == 0 else None
    top = int(bound[0]) if bound else 9
    rests: dict[str, list[int]] = {}
    for d in range(1 if lead else 0, top + 1):
        rest = _digits(n - 1, (residue - d * 10 ** (n - 1)) % cell, cell, False,
                       bound[1:] if bound and d == top else None)
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
