"""Bit-exactness of one transferred prefix, legacy vs native, over a real transport and devices.

The same source pages (AR pool on `src_device`) go once through the native path (page to page
into a paged pool on `dst_device`) and once through the legacy path (gathered, sent into a
receive slot). Checks: the received KV is bit-identical, and the attention of new queries over it
(dense cache filled from the legacy slot vs the paged pool read by the torch backend) is
bit-identical on every layer. `ditkv bench transfer` reports it per transport; the GPU tests call it.
"""

from __future__ import annotations

import time

import torch


def _wait(ticket, consumers, timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while not ticket.all_received() and time.monotonic() < end:
        for c in consumers:
            for _, rank, rows, src in c.poll():
                ticket.report_received(rank, rows, src)
        time.sleep(0.0005)
    return ticket.all_received()


def _transfer(kind, mode, ta, tb, src_pool, dst_device, src_blocks, dst_blocks, prefix, legacy_tokens):
    """Move `prefix` tokens of `src_blocks` once; returns the received `[L, 2, P, H, D]` and the
    consumer's pool (native) for the attention check."""
    from ..transfer.config import TransferConfig
    from ..transfer.connector import KVConsumer, KVProducer, transfer_pool
    from ..transfer.ticket import DestEndpoint, RowDest, TransferTicket
    from ..worker.page_pool import PagePool

    kw = dict(kv_connector=kind, legacy_max_tokens=legacy_tokens, legacy_slots=2)
    pc = TransferConfig(mode, engine_id="ar", kv_role="kv_producer", **kw)
    cc = TransferConfig(mode, engine_id="dit", kv_role="kv_consumer", **kw)
    g = src_pool
    dst = None
    if mode == "native":
        dst = PagePool(g.num_blocks, g.num_layers, g.num_kv_heads, g.block_size, g.head_dim, g.dtype, dst_device)
        transfer_pool(dst, kind)
    prod = KVProducer(pc, ta, src_pool)
    cons = KVConsumer(cc, tb, 0, dst, 0, g.num_kv_heads, token_bytes=prod.geometry.token_bytes, device=dst_device)
    try:
        slot = None if mode == "native" else cons.slots.take()
        row = RowDest(0, prefix, tuple(dst_blocks) if mode == "native" else ())
        t = TransferTicket("exact", mode)
        t.bind_source(prod.source(src_blocks, prefix))
        t.bind_dest(DestEndpoint("dit", "kv_consumer", 0, (cons.rank_dest(slot),), (row,)))
        cons.register(t)
        t.mark_dispatched(30)
        prod.dispatch(t, lambda _: None)
        if not _wait(t, [cons]) or t.send_errors():
            raise RuntimeError(f"{mode} transfer over {kind} did not complete: {t.send_errors()}")
        shape = (g.num_layers, 2, prefix, g.num_kv_heads, g.head_dim)
        if mode == "native":
            pages = dst.kv[list(dst_blocks)]  # [nb, L, 2, H, bs, D] -> [L, 2, P, H, D]
            n = len(dst_blocks) * g.block_size
            kv = pages.permute(1, 2, 0, 4, 3, 5).reshape(g.num_layers, 2, n, g.num_kv_heads, g.head_dim)
            return kv[:, :, :prefix].clone(), dst
        return cons.slots.tensor(slot, shape, g.dtype).clone(), None
    finally:
        prod.close()


@torch.no_grad()  # not inference_mode: the send threads write these tensors outside of it
def kv_attention_exact(kind: str, src_device="cpu", dst_device="cpu", dtype=torch.float32, block_size: int = 64,
                       prefix: int = 100, queries: int = 8, layers: int = 4, heads: int = 2,
                       head_dim: int = 32) -> dict:
    from ..attention.adapter import PagedAttentionAdapter
    from ..attention.metadata import RowPhase, build_paged_metadata
    from ..attention.torch_backend import TorchBackend
    from ..transfer.connector import transfer_pool
    from ..transfer.transport import make_transport
    from ..worker.dense_cache import DenseAttention, DenseKVCache
    from ..worker.denoising import DenseImport
    from ..worker.page_pool import PagePool

    nb = -(-(prefix + queries) // block_size)
    src = PagePool(4 * nb + 4, layers, heads, block_size, head_dim, dtype, src_device)
    transfer_pool(src, kind)
    gen = torch.Generator().manual_seed(0)
    src.kv.copy_(torch.randn(src.kv.shape, generator=gen).to(dtype))
    src_blocks = list(range(1, 2 * nb + 1, 2))  # scattered on both sides: several descriptors
    dst_blocks = list(range(2 * nb + 2, 4 * nb + 2, 2))
    ta, tb = make_transport(kind), make_transport(kind)  # one pair; closing unmaps shm pools: last
    try:
        native, pool = _transfer(kind, "native", ta, tb, src, dst_device, src_blocks, dst_blocks, prefix, prefix)
        legacy, _ = _transfer(kind, "legacy", ta, tb, src, dst_device, src_blocks, dst_blocks, prefix, prefix)
        kv_exact = bool(torch.equal(native, legacy)) and bool(native.abs().sum() > 0)
        # new queries attending over the imported prefix: dense (legacy) vs paged (native)
        q = torch.randn(queries, 2 * heads, head_dim, generator=gen).to(dst_device, dtype)
        k = torch.randn(queries, heads, head_dim, generator=gen).to(dst_device, dtype)
        v = torch.randn(queries, heads, head_dim, generator=gen).to(dst_device, dtype)
        row = RowPhase(0, prefix, queries, prefix + queries, ((prefix + 1, prefix + queries - 1),))
        cache = DenseKVCache(layers, 1, prefix + queries, heads, head_dim, dtype, dst_device)
        DenseImport(legacy, [prefix]).fill(cache)
        dense = DenseAttention(cache, [row], head_dim ** -0.5)
        meta = build_paged_metadata([row], [dst_blocks], block_size, device=dst_device)
        paged = PagedAttentionAdapter(TorchBackend(), pool, meta, head_dim ** -0.5)
        attn_exact = all(torch.equal(dense(i, q, k, v), paged(i, q, k, v)) for i in range(layers))
        devices = str(src.device), str(pool.device)
    finally:
        ta.close()
        tb.close()
    return {"transport": kind, "src_device": devices[0], "dst_device": devices[1],
            "dtype": str(dtype).removeprefix("torch."), "prefix_tokens": prefix, "pages": nb,
            "kv_exact": kv_exact, "attention_exact": bool(attn_exact)}
