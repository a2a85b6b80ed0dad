"""The KV consumers of a DiT stage whose engine runs several ranks: each rank is a process of the
multi-process executor (`engine/mp_executor.py`, `engine/proc.py`) that holds its share of the KV
heads in its own page pool and hosts a `KVConsumer` for it. The stage's KV-import hook
(`kv_import.DiTImporter`) keeps tickets and quarantine; this module only gives it `KVConsumer`'s
interface per rank, backed by control messages (RegisterReceive / Registered / Received / Unregister).
"""

from __future__ import annotations

import os
from multiprocessing import shared_memory

import msgspec

from ..transfer.config import NATIVE
from ..transfer.connector import BadBlockIdsError, RegistrationError


class RankGroup:
    """The engine's rank processes as seen by the KV-import hook: collects every rank's notices
    once per poll and hands each rank's consumer proxy its own."""

    def __init__(self, executor, transfer):
        self.executor = executor  # a `MultiprocExecutor` started with `ExecutorOptions.transfer`
        # legacy: every rank has `legacy_slots` receive slots; one index list serves them all (a
        # request takes slot i on every rank), kept by the hook like a local `LegacySlots`
        slots = SlotIndex(transfer.legacy_slots) if transfer.mode != NATIVE else None
        self.consumers = [RemoteConsumer(self, r, d, slots, transfer.legacy_slots)
                          for r, d in enumerate(executor.rank_dests)]
        self._pending: dict[int, list] = {}
        self._stopped = False

    def notices(self, rank: int) -> list[tuple[str, int, list[int], int]]:
        for m in self.executor.take_received():  # also detects a dead or silent rank
            self._pending.setdefault(m.rank, []).append((m.ticket_id, m.notice_rank, list(m.rows), m.src_rank))
        return self._pending.pop(rank, [])

    def stop(self) -> None:
        """Shut every rank down (killed when it does not exit), then remove what a killed rank could
        not: its shared-memory pool segment and notice socket. Only after this may pages be freed."""
        if self._stopped:
            return
        self._stopped = True
        self.executor.shutdown()
        remove_rank_files(self.executor.rank_dests)


def remove_rank_files(rank_dests) -> None:
    """What a killed rank could not remove: its shared-memory pool segment (shm) and its notice
    socket (every transport whose notices use a ZeroMQ IPC endpoint: shm and cuda)."""
    for d in rank_dests:
        if d is None:
            continue
        if d.region.transport == "shm":
            try:
                seg = shared_memory.SharedMemory(name=d.region.handle)
                seg.close()
                seg.unlink()
            except FileNotFoundError:
                pass  # the rank exited cleanly and unlinked it
        path = d.region.endpoint.removeprefix("ipc://")
        if path != d.region.endpoint and os.path.exists(path):
            os.unlink(path)


class SlotIndex:
    """`LegacySlots`' bookkeeping without the buffer (the buffers live in the rank processes)."""

    def __init__(self, n: int):
        self.free = list(range(n))[::-1]

    def take(self) -> int | None:
        return self.free.pop() if self.free else None

    def give(self, slot: int) -> None:
        self.free.append(slot)


class RemoteConsumer:
    """`KVConsumer`'s interface for one rank in its own process."""

    pool = None

    def __init__(self, group: RankGroup, rank: int, dest, slots: SlotIndex | None = None, num_slots: int = 1):
        self.group, self.rank, self.dest = group, rank, dest
        self.head_lo, self.head_hi = dest.head_lo, dest.head_hi
        self.slots = slots  # legacy only
        self.slot_bytes = dest.region.nbytes // num_slots  # legacy: the rank's region is its slots

    def rank_dest(self, slot=None):
        return self.dest if slot is None else msgspec.structs.replace(self.dest, offset=slot * self.slot_bytes)

    def register(self, ticket) -> None:
        rows = [(r.row_id, r.num_tokens, r.block_ids) for r in ticket.dest.rows]
        answer = self.group.executor.register(self.rank, ticket.ticket_id, rows)
        if answer.error:
            raise (BadBlockIdsError if answer.bad_block_ids else RegistrationError)(answer.error)

    def unregister(self, ticket_id: str) -> None:
        self.group.executor.unregister(self.rank, ticket_id)

    def poll(self):
        return self.group.notices(self.rank)
