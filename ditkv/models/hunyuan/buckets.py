"""The release's resolution buckets: the image sizes HunyuanImage-3.0 generates, and `<img_ratio_k>`.

Facts (checked against the release code by tests/test_buckets.py and its fixture): around a base
size B (1024 for the release), the buckets step the two sides in opposite directions by B/16 pixels
from the square B×B until one side reaches B/2 and the other 2B: 16 taller and 16 wider sizes plus
the square, 33 in all. They are ordered by height/width; k of `<img_ratio_k>` is a bucket's place
in that order. A requested size maps to the bucket whose height/width ratio is nearest (the first
one on a tie), is generated at that bucket's size (the "snap"), and takes its k.

The Instruct / Instruct-Distil code (`template.instruct_code`) has 37 (checked by
tests/test_instruct_buckets.py): the 33, then four fixed sizes whatever the base (`INSTRUCT_EXTRA_SIZES`,
k = 33..36, not re-sorted); the nearest ratio among all 37 wins, so 720x1280 is generated as asked
with k 36 where the base code makes 768x1280 with k 12. Its tokenizer keeps `<img_ratio_33..36>`
apart from 0..32 (`ratio_token_id`).
"""

from __future__ import annotations

from functools import lru_cache

from ditkv.errors import LayoutError

BASE_BUCKETS = 33
# (height, width): image_processor.py's `extra_resolutions` of the Instruct code, in its order
INSTRUCT_EXTRA_SIZES = ((1024, 768), (1280, 720), (768, 1024), (720, 1280))


@lru_cache(maxsize=16)
def bucket_table(base: int = 1024, instruct: bool = False) -> tuple[tuple[int, int], ...]:
    """(height, width) of every bucket around `base`, ordered by height / width; `instruct`: the
    Instruct code's table, the extra sizes appended after them."""
    if base < 32 or base % 16:
        raise ValueError(f"bucket base size {base} must be a multiple of 16 and >= 32")
    step, lo, hi = base // 16, base // 2, base * 2
    sizes = [(base, base)]
    for taller in (True, False):
        h = w = base
        while (h, w) != ((hi, lo) if taller else (lo, hi)):
            h, w = (min(h + step, hi), max(w - step, lo)) if taller else (max(h - step, lo), min(w + step, hi))
            sizes.append((h, w))
    table = sorted(sizes, key=lambda s: s[0] / s[1])
    for h, w in INSTRUCT_EXTRA_SIZES if instruct else ():
        if all(h / w != b[0] / b[1] for b in table):  # the release skips a size whose ratio a bucket has
            table.append((h, w))
    return tuple(table)


def ratio_index(height: int, width: int, base: int = 1024, instruct: bool = False) -> int:
    """k of `<img_ratio_k>`: the bucket with the nearest height / width (the first on a tie)."""
    want = height / width
    table = bucket_table(base, instruct)
    return min(range(len(table)), key=lambda i: (abs(table[i][0] / table[i][1] - want), i))


def snap(height: int, width: int, base: int = 1024, instruct: bool = False) -> tuple[int, int]:
    """The (height, width) the release generates for a requested size."""
    return bucket_table(base, instruct)[ratio_index(height, width, base, instruct)]


def output_bucket(cfg, height: int, width: int) -> tuple[int, int, int]:
    """(height, width, k) of the output image a model config makes for a requested size: its code
    family's nearest bucket with `image_base_size` set (the release), else the size as asked with the
    k of its ratio (0 for a model with one ratio token)."""
    from ditkv.models.hunyuan.template import instruct_code

    instruct, base = instruct_code(cfg), cfg.image_base_size
    k = ratio_index(height, width, base or 1024, instruct)
    if base is not None:
        height, width = bucket_table(base, instruct)[k]
    return height, width, 0 if cfg.num_ratio_tokens == 1 else k


def ratio_token_id(k: int, first: int, extra_first: int | None = None) -> int:
    """The id of `<img_ratio_k>`: the release tokenizers number 0..32 consecutively from `first` (the id
    of `<img_ratio_0>`); the Instruct ones put 33..36 elsewhere, consecutively from `extra_first` (the id
    of `<img_ratio_33>`), so `first + k` would be another token there."""
    if k < BASE_BUCKETS:
        return first + k
    if extra_first is None or k >= BASE_BUCKETS + len(INSTRUCT_EXTRA_SIZES):
        raise ValueError(f"<img_ratio_{k}> needs the id of <img_ratio_33> (an Instruct tokenizer's extra ratios)")
    return extra_first + k - BASE_BUCKETS


def auto_sizes(cfg) -> tuple[tuple[int, int, int], ...]:
    """`size=auto`: (height, width, id of `<img_ratio_k>`) of every bucket the model may choose, k in
    order (its code family's table: 33, or the Instruct code's 37). The AR phase draws one of these ids
    after `<boi> <img_size>` (docs/ar-phase.md "size=auto"). A model without a bucket table or without
    ratio tokens cannot choose: a `LayoutError` on `size` says what to do instead."""
    from ditkv.models.hunyuan.template import instruct_code

    if cfg.image_base_size is None:
        raise LayoutError("size: size=auto lets the model pick one of its resolution buckets, and this model has "
                          "none (no image_base_size: it draws any size as asked, e.g. the bundled tiny models); "
                          "pass a size (height and width)", field="size")
    if cfg.num_ratio_tokens == 1:
        raise LayoutError("size: size=auto has the model write an <img_ratio_k> token, and this model has one ratio "
                          "token (num_ratio_tokens 1); pass a size (height and width)", field="size")
    table = bucket_table(cfg.image_base_size, instruct_code(cfg))
    try:
        ids = [ratio_token_id(k, cfg.img_ratio_token_id, cfg.img_ratio_extra_token_id) for k in range(len(table))]
    except ValueError as e:
        raise LayoutError("size: size=auto on an Instruct checkpoint chooses among <img_ratio_0..36>, and the id of "
                          "<img_ratio_33> is unknown: put the checkpoint's tokenizer.json in the folder, or set "
                          f"img_ratio_extra_token_id in config.json ({e})", field="size") from e
    return tuple((h, w, i) for (h, w), i in zip(table, ids))
