"""The release's resolution buckets: the image sizes HunyuanImage-3.0 generates, and `<img_ratio_k>`.

Facts (checked against the release code by tests/test_buckets.py and its fixture): around a base
size B (1024 for the release), the buckets step the two sides in opposite directions by B/16 pixels
from the square B×B until one side reaches B/2 and the other 2B: 16 taller and 16 wider sizes plus
the square, 33 in all. They are ordered by height/width; k of `<img_ratio_k>` is a bucket's place
in that order. A requested size maps to the bucket whose height/width ratio is nearest (the first
one on a tie), is generated at that bucket's size (the "snap"), and takes its k.
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=8)
def bucket_table(base: int = 1024) -> tuple[tuple[int, int], ...]:
    """(height, width) of every bucket around `base`, ordered by height / width."""
    if base < 32 or base % 16:
        raise ValueError(f"bucket base size {base} must be a multiple of 16 and >= 32")
    step, lo, hi = base // 16, base // 2, base * 2
    sizes = [(base, base)]
    for taller in (True, False):
        h = w = base
        while (h, w) != ((hi, lo) if taller else (lo, hi)):
            h, w = (min(h + step, hi), max(w - step, lo)) if taller else (max(h - step, lo), min(w + step, hi))
            sizes.append((h, w))
    return tuple(sorted(sizes, key=lambda s: s[0] / s[1]))


def ratio_index(height: int, width: int, base: int = 1024) -> int:
    """k of `<img_ratio_k>`: the bucket with the nearest height / width (the first on a tie)."""
    want = height / width
    table = bucket_table(base)
    return min(range(len(table)), key=lambda i: (abs(table[i][0] / table[i][1] - want), i))


def snap(height: int, width: int, base: int = 1024) -> tuple[int, int]:
    """The (height, width) the release generates for a requested size."""
    return bucket_table(base)[ratio_index(height, width, base)]
