"""The prefix cache's index over the block pool: key <-> block, and the LRU of evictable pages.

A cached page has a key (a model family's block identity, docs/prefix-cache.md). While requests
reference it, it is shared and read-only; when the last reference goes it is *evictable*: it
keeps its contents and its key, counts as free (`BlockPool.num_free` = free queue + evictable),
and a later request with the same key takes it back without computing it. An allocation that
finds the free queue short evicts the least recently released evictable pages (their keys are
forgotten, their contents overwritten by the new owner).

The index never touches ref counts; `BlockPool` keeps the two in step. Pages of a transfer in
flight or quarantined are never cached (the manager never registers them) nor evicted (they are
referenced).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixIndex:
    def __init__(self):
        self._block_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest release first
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._key_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def is_cached(self, block: int) -> bool:
        return block in self._key_of

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The blocks of the longest run of `keys` from the first that are cached (chained keys:
        a miss ends the run, later keys cannot match a row that differs earlier)."""
        out = []
        for k in keys:
            b = self._block_of.get(k)
            if b is None:
                break
            out.append(b)
        return out

    def add(self, block: int, key: bytes) -> bool:
        """Name a referenced, fully written page. False (nothing changes) when the key already names
        another page (two requests computed the same page at once) or the page already has a key."""
        if key in self._block_of or block in self._key_of:
            return False
        self._block_of[key] = block
        self._key_of[block] = key
        return True

    def park(self, block: int) -> None:
        """The page's last reference went: it becomes the most recently released evictable page."""
        self._evictable[block] = None

    def unpark(self, block: int) -> None:
        """A request took the evictable page back (a hit): it is referenced again."""
        del self._evictable[block]

    def evict(self, n: int) -> list[int]:
        """Forget the `n` least recently released evictable pages; their ids, for a new owner."""
        out = []
        for _ in range(n):
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
            out.append(block)
        self.evictions += n
        return out

    def drop_all_evictable(self) -> list[int]:
        """Forget every evictable page (shutdown); their ids."""
        return self.evict(len(self._evictable))
