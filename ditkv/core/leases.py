"""AR-stage page ownership: leases over a `BlockPool`, the AR side's counterpart of the DiT side's
`DiffusionKVCacheManager`, so both stages allocate and free pages through core/, with generations.

An AR request takes a lease on the pages it prefills and generates into (`acquire`). When its prefix
is ready for transfer, the ticket takes over the pages the prefix fills and the unused tail returns
at once (`hand_over`); the ticket's lease lives until the DiT side released it (`release`). Every
lease carries a generation: a release that names an older generation of the same key is stale and
frees nothing (a late release can never free pages a newer lease of that key holds).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from .block_pool import BlockPool


@dataclass(frozen=True)
class Lease:
    key: str  # "job:<request id>" while the AR runs, then the ticket id
    block_ids: tuple[int, ...]
    generation: int


class LeaseManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.pool = BlockPool(num_blocks, block_size)
        self._leases: dict[str, Lease] = {}
        self._generations = itertools.count(1)

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    def get(self, key: str) -> Lease | None:
        return self._leases.get(key)

    def acquire(self, key: str, n: int) -> Lease:
        """`n` pages for `key`. Raises ValueError when `key` holds a lease or fewer than `n` are free."""
        if key in self._leases:
            raise ValueError(f"lease {key!r} is already held; release it first")
        gen = next(self._generations)
        ids = self.pool.allocate(n, owner=gen)
        lease = Lease(key, tuple(int(i) for i in ids), gen)
        self._leases[key] = lease
        return lease

    def hand_over(self, lease: Lease, key: str, keep: int) -> Lease:
        """The first `keep` pages of `lease` pass to a new lease `key` (e.g. the transfer ticket); the
        rest return to the pool now. `lease` ends."""
        if self._leases.get(lease.key) != lease:
            raise ValueError(f"lease {lease.key!r} (generation {lease.generation}) is not held")
        if not 0 <= keep <= len(lease.block_ids):
            raise ValueError(f"keep={keep} outside 0..{len(lease.block_ids)}")
        if key in self._leases:
            raise ValueError(f"lease {key!r} is already held; release it first")
        kept = np.asarray(lease.block_ids[:keep], dtype=np.int64)
        self.pool.incref(kept)  # the new lease's reference, before the old one's references drop
        self.pool.free(np.asarray(lease.block_ids, dtype=np.int64))
        del self._leases[lease.key]
        new = Lease(key, lease.block_ids[:keep], next(self._generations))
        self._leases[key] = new
        return new

    def release(self, key: str, generation: int | None = None) -> bool:
        """End lease `key` (only its `generation`, when given); False if none such is held."""
        lease = self._leases.get(key)
        if lease is None or (generation is not None and lease.generation != generation):
            return False
        del self._leases[key]
        self.pool.free(np.asarray(lease.block_ids, dtype=np.int64))
        return True

    def release_all(self) -> int:
        """End every lease (fail-closed, shutdown); returns how many there were."""
        n = len(self._leases)
        for key in list(self._leases):
            self.release(key)
        return n
