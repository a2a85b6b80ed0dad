"""Block pool: a fixed set of KV block ids with a FIFO free queue and per-block ownership.

Allocation takes ids from the head of the free queue; a release appends the freed ids to the
tail sorted by id, so later allocations tend to get runs of adjacent pages (a transfer can then
merge them into one descriptor). The queue is a numpy ring buffer: every operation is O(blocks
touched), independent of the pool size.
"""

from __future__ import annotations

import numpy as np

FREE = -1


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks} must be > 0")
        if block_size <= 0:
            raise ValueError(f"block_size={block_size} must be > 0")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._queue = np.arange(num_blocks, dtype=np.int64)  # ring buffer of free ids
        self._head = 0  # index of the next id to hand out
        self._num_free = num_blocks
        self.owner = np.full(num_blocks, FREE, dtype=np.int64)  # owner handle per block
        self.ref_count = np.zeros(num_blocks, dtype=np.int32)
        self.high_water = 0  # most blocks ever in use at once
        self.tokens_in_use = 0  # live token slots (for internal-waste accounting)

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_blocks - self._num_free

    def stats(self) -> dict:
        used_slots = self.num_used * self.block_size
        return {
            "num_blocks": self.num_blocks,
            "free_blocks": self._num_free,
            "used_blocks": self.num_used,
            "high_water_blocks": self.high_water,
            "internal_waste": (used_slots - self.tokens_in_use) / used_slots if used_slots else 0.0,
        }

    # ---- mutation ------------------------------------------------------------------------
    def allocate(self, n: int, owner: int, tokens: int = 0) -> np.ndarray:
        """Take `n` blocks for `owner` (an int handle). Raises if fewer than `n` are free."""
        if n < 0 or n > self._num_free:
            raise ValueError(f"cannot allocate {n} blocks: {self._num_free} free")
        end = self._head + n
        if end <= self.num_blocks:
            ids = self._queue[self._head:end].copy()
        else:
            ids = np.concatenate((self._queue[self._head:], self._queue[: end - self.num_blocks]))
        self._head = end % self.num_blocks
        self._num_free -= n
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
        """Drop one reference of each id; ids that reach 0 go back to the queue sorted. Returns that count."""
        ids = np.sort(np.asarray(ids, dtype=np.int64))
        if ids.size == 0:
            return 0
        if np.any(self.ref_count[ids] <= 0) or np.any(ids[1:] == ids[:-1]):
            raise ValueError("double free: a block is already free or listed twice")
        self.ref_count[ids] -= 1
        released = ids[self.ref_count[ids] == 0]
        self.owner[released] = FREE
        self.tokens_in_use -= tokens
        tail = (self._head + self._num_free) % self.num_blocks
        end = tail + released.size
        if end <= self.num_blocks:
            self._queue[tail:end] = released
        else:
            split = self.num_blocks - tail
            self._queue[tail:] = released[:split]
            self._queue[: end - self.num_blocks] = released[split:]
        self._num_free += released.size
        return int(released.size)
