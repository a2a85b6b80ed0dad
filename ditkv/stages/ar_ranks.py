"""A tensor-parallel AR stage replica's ranks: the AR stage's engine runs over the multi-process
executor (each rank runs the AR pass on its shard, the TP collectives inside the model), each rank
holding its KV-head range of every page in its own pool and writing only that range.

Rank side (`ARSide`, hosted by `engine/proc.py` as `ExecutorOptions.rank_service`, beside the
rank's step loop): the rank's pool moved into registrable memory and a `KVProducer` for its head
range. `SendKV` -> one `Sent` per destination rank whose heads overlap (the write runs on the
producer's threads; `Sent` goes out from the main loop, the only thread that may use the control
socket).

Replica side (`ARRankGroup`): what `ARReplica` needs from the ranks besides the engine's steps: the
source endpoint over every rank, and `start_send` / `poll_sent` that turn the ranks' `Sent`
messages into the ticket's per-(source, destination) reports.
"""

from __future__ import annotations

import queue
from dataclasses import replace

import msgspec

from ..engine.messages import Registered, RegisterReceive, SendKV, Sent
from ..transfer.config import NATIVE
from ..transfer.descriptors import overlap_descriptors
from .remote_ranks import remove_rank_files
from ..transfer.ticket import RankDest, SourceEndpoint, TransferTicket


# ---- rank side ------------------------------------------------------------------------------
class ARSide:
    def __init__(self, transfer, worker, parallel, rank: int):
        from ..transfer.connector import KVProducer, transfer_pool
        from ..transfer.transport import make_transport

        transfer_pool(worker.pool, transfer.kv_connector)
        self.transport = make_transport(transfer.kv_connector, transfer.kv_ip, transfer.protocol,
                                        transfer.max_descriptors_per_batch)
        self.transfer, self.rank = transfer, rank
        self.head_lo = (0 if parallel is None else parallel.tp_rank) * worker.num_kv_heads
        self.producer = KVProducer(transfer, self.transport, worker.pool, rank=rank, head_lo=self.head_lo)
        self._done: queue.Queue = queue.Queue()
        self._inflight = 0

    def rank_dest(self) -> RankDest:
        g = self.producer.geometry
        return RankDest(self.rank, self.transfer.engine_id, self.transfer.kv_role, self.producer.region, g,
                        self.head_lo, self.head_lo + g.num_kv_heads)

    @property
    def busy(self) -> bool:
        return self._inflight > 0

    def handle(self, msg):
        if isinstance(msg, SendKV):
            t = TransferTicket(msg.ticket_id, msg.mode)
            t.ticket_id = msg.ticket_id  # the replica's ticket: notices must name it
            t.bind_source(self.producer.source(msg.src_blocks, msg.num_tokens))
            t.bind_dest(msg.dest)
            t.mark_dispatched(float("inf"))
            self._inflight += 1
            self.producer.dispatch(t, on_done=self._done.put)
            return None
        if isinstance(msg, RegisterReceive):
            return Registered(rank=self.rank, ticket_id=msg.ticket_id, error=f"AR rank {self.rank} hosts no KV consumer")
        return None  # Unregister: nothing registered here

    def forward(self, send) -> None:
        """One `Sent` per destination rank of every write that returned since the last call."""
        while True:
            try:
                t = self._done.get_nowait()
            except queue.Empty:
                return
            self._inflight -= 1
            sent = {d: e for (s, d), e in t._sent.items() if s == self.rank}  # noqa: SLF001 - own ticket copy
            for d in t.dest.ranks:
                if d.rank in sent:
                    nbytes = 0 if sent[d.rank] is not None else self._bytes(t, d)
                    send(Sent(rank=self.rank, ticket_id=t.ticket_id, dest_rank=d.rank, nbytes=nbytes,
                              error=sent[d.rank]))

    def _bytes(self, t: TransferTicket, d: RankDest) -> int:
        if t.mode != NATIVE:  # legacy: this rank's whole chunk of the contiguous tensor
            return max(r.num_tokens for r in t.dest.rows) * self.producer.geometry.token_bytes
        src = t.source.block_ids
        return sum(n for row in t.dest.rows for _, _, n in overlap_descriptors(
            self.producer.geometry, d.geometry, src[:len(row.block_ids)], row.block_ids, self.head_lo, d.head_lo))

    def close(self) -> None:
        self.producer.close(wait=True)
        self.transport.close()


# ---- replica side ---------------------------------------------------------------------------
def rank_options(options, transfer):
    """The executor options of an AR replica's ranks: each rank hosts an `ARSide` (pool in registrable
    memory, a `KVProducer` for its head range) beside the engine's step loop."""
    from ..engine.executor import ExecutorOptions

    return replace(options or ExecutorOptions(), transfer=transfer, rank_service=ARSide)


class ARRankGroup:
    """The AR replica's ranks, used only from the replica thread (the control socket is not
    thread-safe): `ExecutorError` from any call means the replica must fail closed."""

    def __init__(self, executor, transfer, replica: int = 0, stats=None):
        """`executor`: the AR stage engine's multi-process executor, started with `rank_options`."""
        self.executor = executor
        self.sources = tuple(self.executor.rank_dests)
        self.transfer, self.replica, self.stats = transfer, replica, stats
        self._sending: dict[str, tuple[TransferTicket, object]] = {}
        self._stopped: str | None = None
        g = self.sources[0].geometry
        # the whole producer as the DiT sees it: every head, tiled by the ranks' ranges
        self.geometry = msgspec.structs.replace(g, num_kv_heads=sum(s.head_hi - s.head_lo for s in self.sources))
        self.region = self.sources[0].region  # the transport address the DiT validates

    def source(self, block_ids, num_tokens: int) -> SourceEndpoint:
        t = self.transfer
        return SourceEndpoint(t.engine_id, t.kv_role, self.replica, self.region, self.geometry,
                              tuple(int(b) for b in block_ids), num_tokens, ranks=self.sources)

    @property
    def sending(self) -> bool:
        return bool(self._sending)

    def start_send(self, ticket: TransferTicket, on_done) -> None:
        self._sending[ticket.ticket_id] = (ticket, on_done)
        if self._stopped:  # the ranks are gone: nothing can be written
            return self.fail(self._stopped)
        src = ticket.source
        self.executor.broadcast(SendKV(ticket_id=ticket.ticket_id, mode=ticket.mode, src_blocks=list(src.block_ids),
                                       num_tokens=src.num_tokens, dest=ticket.dest))

    def poll_sent(self) -> None:
        """Turn the ranks' `Sent` into ticket reports; `on_done` once every pair reported."""
        for m in self.executor.take_sent():  # also detects a dead or silent rank
            entry = self._sending.get(m.ticket_id)
            if entry is None:
                continue
            if m.error is None and self.stats is not None:
                self.stats.add_bytes(m.nbytes)
            entry[0].report_sent(m.dest_rank, m.error, src=m.rank)
        self._finish_sent()

    def _finish_sent(self) -> None:
        for tid, (t, on_done) in list(self._sending.items()):
            if t.all_sent():
                del self._sending[tid]
                on_done(t)

    def fail(self, reason: str) -> None:
        """The ranks are gone (killed): no write of theirs can still land; settle every pair."""
        for t, _ in self._sending.values():
            for s, d in t.pairs():
                if not t.was_sent(d, s):
                    t.report_sent(d, f"AR replica failed closed: {reason}", src=s)
        self._finish_sent()

    def stop(self, reason: str = "AR ranks shut down") -> None:
        self._stopped = self._stopped or self.executor.failed or reason
        self.executor.shutdown()
        remove_rank_files(self.sources)
