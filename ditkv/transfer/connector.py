"""Connectors: the producer side (AR pool -> wire) and the consumer side (one per DiT rank).

Native: `page_descriptors` move only the imported prefix pages, page to page, adjacent pages
merged; a consumer rank holding a KV-head range gets exactly that range. A row's leading pages the
destination already holds (`RowDest.skip_pages`: its prefix-cache hits) are not sent.
Legacy (the baseline): the producer gathers the prefix into one contiguous `[L, 2, P, Hkv, D]`
tensor in a staging buffer, sends it into the consumer rank's receive slot, and the DiT copies it
from there into its dense cache. A tensor-parallel producer rank sends its own heads' chunk, placed
in the slot at its head offset; each consumer rank slices its heads (`descriptors.legacy_heads`).

Connectors move bytes and report; they never free pages (the stages do, after the reports).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from .config import LEGACY, NATIVE, TransferConfig
from .descriptors import LegacyLayout, geometry_of, gather_contiguous, legacy_chunk_offset, overlap_descriptors
from .ticket import RankDest, SourceEndpoint, TransferTicket, parse_notice
from .transport import Transport, alloc_region

log = logging.getLogger("ditkv.transfer")


class RegistrationError(RuntimeError):
    """A consumer rank refused to register a receive (nothing was dispatched)."""


class BadBlockIdsError(RegistrationError):
    """The destination block ids lie outside the rank's pool: the DiT's own reservation is invalid,
    so the replica is corrupt (fail it closed) rather than the request unlucky (roll it back)."""


def transfer_pool(pool, kind: str) -> None:
    """Move a `PagePool`'s storage into memory the transport can register (same shape, zeros). A
    device pool already is such memory: it stays (a second one would double the pool's memory
    until the caching allocator let the first go)."""
    if kind != "shm" and pool.kv.device.type != "cpu":
        return
    shape, dtype, device = tuple(pool.kv.shape), pool.kv.dtype, pool.kv.device
    pool.kv = None  # the old storage goes before the new one comes
    pool.kv = alloc_region(kind, shape, dtype, device)


def buffer_device(kind: str, device) -> torch.device:
    """Where legacy staging / receive slots live: next to the pool for the GPU transport (the
    copies stay device to device); host memory for the others (shm, Mooncake's non-CUDA build)."""
    return torch.device(device) if kind == "cuda" else torch.device("cpu")


class KVProducer:
    """AR side of one replica: the registered source pool and a small pool of send threads."""

    def __init__(self, config: TransferConfig, transport: Transport, pool, replica: int = 0, threads: int = 2,
                 stats=None, rank: int = 0, head_lo: int = 0):
        self.config, self.transport, self.pool, self.replica = config, transport, pool, replica
        self.stats = stats  # `TransferStats` (bytes written), or None
        # a tensor-parallel AR rank holds KV heads [head_lo, head_lo + pool heads) and writes only those
        self.rank, self.head_lo = rank, head_lo
        self.geometry = geometry_of(pool)
        self.region = transport.register("pool", pool.kv, export=False)  # producers write, never get written
        self._staging = None
        self._free_staging: list[int] = []
        self._staging_lock = threading.Condition()
        if config.mode == LEGACY:  # one staging slot per send thread
            slot = config.legacy_max_tokens * self.geometry.token_bytes
            self._staging = alloc_region(transport.kind, (threads, slot), torch.uint8,
                                         buffer_device(transport.kind, pool.kv.device))
            self.staging_region = transport.register("staging", self._staging, export=False)
            self._free_staging = list(range(threads))
            self._slot_bytes = slot
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=f"kv-send-{config.engine_id}")

    def source(self, block_ids, num_tokens: int) -> SourceEndpoint:
        return SourceEndpoint(self.config.engine_id, self.config.kv_role, self.replica, self.region,
                              self.geometry, tuple(int(b) for b in block_ids), num_tokens)

    def dispatch(self, ticket: TransferTicket, on_done: Callable[[TransferTicket], None]) -> None:
        """Send asynchronously; `on_done(ticket)` runs once every rank has a `sent` report."""
        self._pool.submit(self._send, ticket, on_done)

    def _send(self, ticket: TransferTicket, on_done) -> None:
        try:
            if ticket.mode == NATIVE:
                self._send_native(ticket)
            else:
                self._send_legacy(ticket)
        except Exception as e:  # a bug must still settle the ticket, or pages leak
            log.exception("send of %s failed", ticket.ticket_id)
            for r in ticket.dest.ranks:
                if not ticket.was_sent(r.rank, self.rank):
                    ticket.report_sent(r.rank, f"{type(e).__name__}: {e}", self.rank)
        finally:
            on_done(ticket)

    def _send_native(self, ticket: TransferTicket) -> None:
        src = ticket.source
        for rank in ticket.dest.ranks:
            if max(self.head_lo, rank.head_lo) >= min(self.head_lo + self.geometry.num_kv_heads, rank.head_hi):
                continue  # no head in common: no pair, no write, no notice
            self._write(ticket, rank, "pool", native_descriptors(self.geometry, rank, src.block_ids, ticket.dest.rows,
                                                                 self.head_lo))

    def _send_legacy(self, ticket: TransferTicket) -> None:
        src = ticket.source
        tokens = max(r.num_tokens for r in ticket.dest.rows)
        nbytes = tokens * self.geometry.token_bytes
        if nbytes > self._slot_bytes:
            raise ValueError(f"{tokens} prefix tokens exceed legacy_max_tokens={self.config.legacy_max_tokens}")
        with self._staging_lock:
            while not self._free_staging:
                self._staging_lock.wait()
            slot = self._free_staging.pop()
        try:
            g = self.geometry
            shape = LegacyLayout(g.num_layers, tokens, g.num_kv_heads, g.head_dim).shape
            out = self._staging[slot, :nbytes].view(self.pool.kv.dtype).view(shape)
            gather_contiguous(self.pool, src.block_ids, tokens, out=out)
            # this rank's whole chunk (every head it holds) to every destination rank that needs any of
            # them, at the chunk's place in the slot; the receiver slices its own heads (docs/transfer.md)
            off = legacy_chunk_offset(g.num_layers, g.head_dim, self.pool.kv.element_size(), tokens, self.head_lo)
            for rank in ticket.dest.ranks:
                if max(self.head_lo, rank.head_lo) >= min(self.head_lo + g.num_kv_heads, rank.head_hi):
                    continue  # no head in common: no pair, no write
                self._write(ticket, rank, "staging", [(slot * self._slot_bytes, rank.offset + off, nbytes)])
        finally:
            with self._staging_lock:
                self._free_staging.append(slot)
                self._staging_lock.notify()

    def _write(self, ticket: TransferTicket, rank: RankDest, src: str, descs) -> None:
        try:
            self.transport.write(src, rank.region, descs, notify=ticket.notice(rank.rank, self.rank))
        except Exception as e:
            ticket.report_sent(rank.rank, f"{type(e).__name__}: {e}", self.rank)
        else:
            if self.stats is not None:  # before report_sent: a settled ticket's bytes are counted
                self.stats.add_bytes(sum(n for _, _, n in descs))
            ticket.report_sent(rank.rank, None, self.rank)

    def close(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=True)


def native_descriptors(geometry, rank: RankDest, src_blocks, rows, head_lo: int = 0) -> list:
    """Descriptors of one producer rank's write to destination `rank`: each row's pages from its
    `skip_pages` on, source page i to the row's destination page i (cached pages are never written)."""
    descs = []
    for row in rows:
        k, n = row.skip_pages, len(row.block_ids)
        descs += overlap_descriptors(geometry, rank.geometry, src_blocks[k:n], row.block_ids[k:], head_lo,
                                     rank.head_lo)
    return descs


class LegacySlots:
    """Receive slots of one consumer rank (legacy path): the temporary buffers of the baseline."""

    def __init__(self, config: TransferConfig, transport: Transport, token_bytes: int, device="cpu"):
        self.slot_bytes = config.legacy_max_tokens * token_bytes
        self.buffer = alloc_region(transport.kind, (config.legacy_slots, self.slot_bytes), torch.uint8,
                                   buffer_device(transport.kind, device))
        self.free = list(range(config.legacy_slots))[::-1]

    def take(self) -> int | None:
        return self.free.pop() if self.free else None

    def give(self, slot: int) -> None:
        self.free.append(slot)

    def tensor(self, slot: int, shape, dtype: torch.dtype) -> torch.Tensor:
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        return self.buffer[slot, :n].view(dtype).view(shape)


class KVConsumer:
    """One DiT rank's receive side: registered memory, expected tickets, completion notices."""

    def __init__(self, config: TransferConfig, transport: Transport, rank: int, pool=None,
                 head_lo: int = 0, head_hi: int | None = None, token_bytes: int | None = None,
                 device="cpu"):
        self.config, self.transport, self.rank = config, transport, rank
        self.pool = pool
        self.slots = None
        if config.mode == NATIVE:
            if pool is None:
                raise ValueError("a native consumer needs the rank's page pool")
            self.geometry = geometry_of(pool)
            self.region = transport.register("pool", pool.kv, export=config.ipc_export)
            head_hi = head_lo + pool.num_kv_heads if head_hi is None else head_hi
        else:
            if token_bytes is None or head_hi is None:
                raise ValueError("a legacy consumer needs the producer's token_bytes and its head range")
            self.geometry = None
            self.slots = LegacySlots(config, transport, token_bytes, device)
            self.region = transport.register("slots", self.slots.buffer, export=config.ipc_export)
        self.head_lo, self.head_hi = head_lo, head_hi
        self._expected: set[str] = set()

    def rank_dest(self, slot: int | None = None) -> RankDest:
        offset = 0 if slot is None else slot * self.slots.slot_bytes
        return RankDest(self.rank, self.config.engine_id, self.config.kv_role, self.region, self.geometry,
                        self.head_lo, self.head_hi, offset)

    def register(self, ticket: TransferTicket) -> None:
        """Expect this ticket's notices; refuse what this rank cannot receive."""
        self.register_rows(ticket.ticket_id, [tuple(r.block_ids) for r in ticket.dest.rows])

    def register_rows(self, ticket_id: str, rows_block_ids) -> None:
        """`register` by value (a rank process gets the ticket's rows in a control message)."""
        if ticket_id in self._expected:
            raise RegistrationError(f"rank {self.rank}: ticket {ticket_id} is already registered")
        if self.pool is not None:
            for ids in rows_block_ids:
                bad = [b for b in ids if not 0 <= b < self.pool.num_blocks]
                if bad:
                    raise BadBlockIdsError(f"rank {self.rank}: destination block ids {bad[:4]} outside "
                                            f"[0, {self.pool.num_blocks})")
        self._expected.add(ticket_id)

    @property
    def expecting(self) -> bool:
        return bool(self._expected)

    def unregister(self, ticket_id: str) -> None:
        self._expected.discard(ticket_id)

    def poll(self) -> list[tuple[str, int, list[int], int]]:
        """Completion notices that arrived: (ticket id, rank, rows, source rank)."""
        out = []
        for msg in self.transport.poll_notifies():
            try:
                out.append(parse_notice(msg))
            except ValueError:
                log.warning("rank %d: ignoring a malformed completion notice %r", self.rank, msg)
        return out
