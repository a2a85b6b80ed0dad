"""`RankReceiver`: the KV consumer that a stage replica's rank hosts for its own pool."""

from __future__ import annotations

import torch

from .messages import Received, Registered, SendKV, Unregister


class RankReceiver:
    """A rank's KV consumer (stage replicas): its pool registered with the transport; receives are
    registered by the replica and every completion notice is forwarded to it as `Received`."""

    def __init__(self, transfer, worker, parallel, rank: int):
        from ..transfer.connector import KVConsumer, transfer_pool
        from ..transfer.transport import make_transport

        if worker.pool is not None:
            transfer_pool(worker.pool, transfer.kv_connector)  # the pool moves into registrable memory
        self.transport = make_transport(transfer.kv_connector, transfer.kv_ip, transfer.protocol,
                                        transfer.max_descriptors_per_batch)
        par = parallel
        shard = 0 if par is None else par.tp_rank * par.sp_size + par.sp_rank  # TP first, then Ulysses
        lo = shard * worker.num_kv_heads
        # legacy (dense cache, no pool): receive slots sized for the whole producer's tokens (every head)
        mc = worker.model.config
        token_bytes = (mc.num_hidden_layers * 2 * mc.num_key_value_heads * mc.attention_head_dim
                       * torch.empty((), dtype=worker.dtype).element_size())
        self.consumer = KVConsumer(transfer, self.transport, rank, worker.pool, lo, lo + worker.num_kv_heads,
                                   token_bytes=token_bytes, device=worker.device)
        self.rank, self.dtype = rank, worker.dtype

    def dense_import(self, li):
        """The rank's KV-head range of receive slot `li.slot` (a `LegacyImport`) as a `DenseImport`."""
        from ..transfer.descriptors import legacy_heads
        from ..worker.denoising import DenseImport

        c = self.consumer
        kv = legacy_heads(c.slots.buffer[li.slot], li.src_heads, li.num_layers, max(li.tokens_per_row),
                          li.head_dim, self.dtype, c.head_lo, c.head_hi)
        return DenseImport(kv, list(li.tokens_per_row))

    @property
    def busy(self) -> bool:
        return self.consumer.expecting

    def rank_dest(self):
        return self.consumer.rank_dest()

    def handle(self, msg) -> Registered | None:
        from ..transfer.connector import BadBlockIdsError, RegistrationError

        if isinstance(msg, SendKV):
            return None
        if isinstance(msg, Unregister):
            self.consumer.unregister(msg.ticket_id)
            return None
        try:
            self.consumer.register_rows(msg.ticket_id, [ids for _, _, ids in msg.rows])
            return Registered(rank=self.rank, ticket_id=msg.ticket_id)
        except RegistrationError as e:
            return Registered(rank=self.rank, ticket_id=msg.ticket_id, error=str(e),
                              bad_block_ids=isinstance(e, BadBlockIdsError))

    def forward(self, send) -> None:
        for tid, notice_rank, rows, src in self.consumer.poll():
            send(Received(rank=self.rank, ticket_id=tid, notice_rank=notice_rank, rows=rows, src_rank=src))

    def close(self) -> None:
        self.transport.close()  # unlinks this rank's pool segment

