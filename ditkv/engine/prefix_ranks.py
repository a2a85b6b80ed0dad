"""The CFG rank in a DiT row's prefix-cache keys (docs/prefix-cache.md, "Under CFG parallel").

A family's keys (`ModelFamily.prefix_block_keys`) name what a page holds, not where. With
`cfg_parallel_size` > 1 row r of a CFG request runs on CFG rank r and its pages are written in that
rank's pool only (every rank's pool has the same block ids), so a page is valid on one rank. Each key
of row r is therefore hashed again with the rank that writes it: a page then only ever hits for a row
on that rank. With one CFG rank the keys pass through untouched (byte for byte today's keys).

AR rows keep untagged keys (`ModelFamily.ar_head_block_keys`): every rank runs every AR work, so an AR
page holds the same bytes in every pool and may serve an AR row anywhere. A tagged key never equals an
untagged one (a different hash input), so under CFG parallel no DiT row hits an AR page and no AR row
hits a DiT page (that one holds garbage on the other ranks). The AR->DiT handover does not look up:
row 0 adopts the AR row's pages by id, on rank 0, which wrote them like every rank.
"""

from __future__ import annotations

import hashlib

_PERSON = b"ditkv.cfg-rank"  # blake2b's personalization: no untagged key hashes with it


def cfg_rank_of_row(row: int, cfg_parallel_size: int) -> int:
    """The CFG rank holding row `row` (CFG-parallel requests have exactly one row per rank)."""
    return row % cfg_parallel_size


def tag_key(key: bytes, rank: int) -> bytes:
    """`key` as a page valid on CFG rank `rank` only. A chained key names the row up to its page's end,
    so hashing each key with the rank keeps the chain's meaning: equal tagged keys, equal prefix and rank."""
    h = hashlib.blake2b(digest_size=len(key), person=_PERSON)
    h.update(rank.to_bytes(2, "little"))
    h.update(key)
    return h.digest()


def rank_keys(keys, cfg_parallel_size: int):
    """Per row, its keys tagged with the CFG rank that holds it; `keys` unchanged with one CFG rank
    (or None: the cache is off)."""
    if keys is None or cfg_parallel_size == 1:
        return keys
    return [tuple(tag_key(k, cfg_rank_of_row(r, cfg_parallel_size)) for k in row)
            for r, row in enumerate(keys)]
