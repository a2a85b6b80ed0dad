"""Block pool: a fixed set of KV block ids with a FIFO free queue and per-block ownership.

Allocation takes ids from the head of the free queue; a release appends the freed ids to the
tail sorted by id, so later allocations tend to get runs of adjacent pages (a transfer can then
merge them into one descriptor). The queue is a numpy ring buffer: every operation is O(blocks
touched), independent of the pool size.

Prefix cache (`prefix_cache.py`): a page with a key that no request references is *evictable*,
not queued: it keeps its contents for a later hit, and counts in `num_free` (free + evictable),
since an allocation that finds the queue short evicts it. A cached page may have several owners
(`share` takes one more reference); `owner` then says SHARED.
"""

from __future__ import annotations

import numpy as np

from .prefix_cache import PrefixIndex

FREE = -1
SHARED = -2  # a cached page: any number of requests may hold it


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks} must be > 0")
        if block_size <= 0:
            raise ValueError(f"block_size={block_size} must be > 0")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._queue = np.arange(num_blocks, dtype=np.int64)  # ring buffer of free ids
        self._head = 0  # index of the next id to hand out
        self._num_free = num_blocks  # ids in the queue (evictable pages are not queued)
        self.cache = PrefixIndex()
        self.owner = np.full(num_blocks, FREE, dtype=np.int64)  # owner handle per block
        self.ref_count = np.zeros(num_blocks, dtype=np.int32)
        self.high_water = 0  # most blocks ever in use at once
        self.tokens_in_use = 0  # live token slots (for internal-waste accounting)

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages an allocation can take now: the free queue plus the evictable cached pages."""
        return self._num_free + self.cache.num_evictable

    @property
    def num_evictable(self) -> int:
        return self.cache.num_evictable

    @property
    def num_used(self) -> int:
        """Pages some request (or quarantine, or export) references."""
        return self.num_blocks - self.num_free

    def stats(self) -> dict:
        used_slots = self.num_used * self.block_size
        return {
            "num_blocks": self.num_blocks,
            "free_blocks": self.num_free,
            "used_blocks": self.num_used,
            "evictable_blocks": self.cache.num_evictable,
            "cached_blocks": len(self.cache),
            "evicted_blocks": self.cache.evictions,
            "high_water_blocks": self.high_water,
            "internal_waste": (used_slots - self.tokens_in_use) / used_slots if used_slots else 0.0,
        }

    # ---- mutation ------------------------------------------------------------------------
    def allocate(self, n: int, owner: int, tokens: int = 0) -> np.ndarray:
        """Take `n` blocks for `owner` (an int handle): from the free queue, then by evicting the least
        recently released cached pages. Raises if fewer than `n` are free."""
        if n < 0 or n > self.num_free:
            raise ValueError(f"cannot allocate {n} blocks: {self.num_free} free")
        evicted = self.cache.evict(n - self._num_free) if n > self._num_free else []
        n -= len(evicted)
        end = self._head + n
        if end <= self.num_blocks:
            ids = self._queue[self._head:end].copy()
        else:
            ids = np.concatenate((self._queue[self._head:], self._queue[: end - self.num_blocks]))
        self._head = end % self.num_blocks
        self._num_free -= n
        if evicted:
            ids = np.concatenate((ids, np.asarray(evicted, dtype=np.int64)))
        self.owner[ids] = owner
        self.ref_count[ids] = 1
        self.tokens_in_use += tokens
        self.high_water = max(self.high_water, self.num_used)
        return ids

    def incref(self, ids: np.ndarray) -> None:
        """Share blocks (e.g. a transfer lease): they return to the queue only at ref count 0."""
        if np.any(self.ref_count[ids] <= 0):
            raise ValueError("incref on a free block")
        np.add.at(self.ref_count, ids, 1)

    def free(self, ids: np.ndarray, tokens: int = 0) -> int:
        """Drop one reference of each id; ids that reach 0 go back to the queue sorted (cached ones become
        evictable instead). Returns how many reached 0."""
        ids = np.sort(np.asarray(ids, dtype=np.int64))
        if ids.size == 0:
            return 0
        if np.any(self.ref_count[ids] <= 0) or np.any(ids[1:] == ids[:-1]):
            raise ValueError("double free: a block is already free or listed twice")
        self.ref_count[ids] -= 1
        released = ids[self.ref_count[ids] == 0]
        self.owner[released] = FREE
        self.tokens_in_use -= tokens
        n = int(released.size)
        if len(self.cache):  # cached pages stay (evictable) for a later hit; the rest are queued
            kept = np.fromiter((self.cache.is_cached(int(b)) for b in released), dtype=bool, count=n)
            for b in released[kept]:
                self.cache.park(int(b))
            released = released[~kept]
        self._enqueue(released)
        return n

    def _enqueue(self, released: np.ndarray) -> None:
        tail = (self._head + self._num_free) % self.num_blocks
        end = tail + released.size
        if end <= self.num_blocks:
            self._queue[tail:end] = released
        else:
            split = self.num_blocks - tail
            self._queue[tail:] = released[:split]
            self._queue[: end - self.num_blocks] = released[split:]
        self._num_free += released.size

    # ---- the prefix cache ----------------------------------------------------------------
    def lookup(self, keys) -> list[int]:
        """The cached pages of the longest run of leading `keys` (not referenced yet: `share` them)."""
        return self.cache.lookup(keys)

    def share(self, ids) -> None:
        """One more reference on each cached page of `ids` (an id listed twice gets two): an evictable
        page is taken back from the LRU; a referenced one gains an owner."""
        ids = np.asarray(ids, dtype=np.int64)
        if not all(self.cache.is_cached(int(b)) for b in ids):
            raise ValueError("share of a page the prefix cache does not hold")
        for b in np.unique(ids):
            if self.ref_count[b] == 0:
                self.cache.unpark(int(b))
        np.add.at(self.ref_count, ids, 1)
        self.owner[ids] = SHARED

    def share_row(self, ids) -> None:
        """One more reference on each referenced page of `ids`: a sibling row of the request that
        allocated them reads them (docs/prefix-cache.md); they are SHARED, as cache hits are."""
        ids = np.asarray(ids, dtype=np.int64)
        self.incref(ids)
        self.owner[ids] = SHARED

    def cache_pages(self, ids, keys) -> int:
        """Name referenced, fully written pages by their keys (a request's prefix after its first
        step); how many became cached (a key already cached elsewhere leaves its page private)."""
        added = 0
        for b, k in zip(ids, keys):
            if self.ref_count[int(b)] <= 0:
                raise ValueError(f"cannot cache block {int(b)}: no request holds it")
            added += self.cache.add(int(b), k)
        return added

    def evictable_among(self, ids) -> int:
        """How many distinct pages of `ids` are evictable now (a hit on them leaves the free count)."""
        return sum(self.cache.is_evictable(int(b)) for b in set(int(b) for b in ids))

    def drop_cache(self) -> int:
        """Every evictable page returns to the free queue, its key forgotten (shutdown)."""
        ids = self.cache.drop_all_evictable()
        self._enqueue(np.sort(np.asarray(ids, dtype=np.int64)))
        return len(ids)
