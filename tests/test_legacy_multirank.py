"""Legacy transfer with multi-rank stages (issue 9's baseline): AR TP=1/2 -> DiT TP=2 (and AR TP=2
-> DiT TP=1), DiT Ulysses 2 and CFG parallel 2. A tensor-parallel producer sends its chunk `[L, 2, P, h, D]` of the contiguous tensor
to every DiT rank whose heads overlap; each DiT rank slices its heads out of its receive slot into
its dense cache. KV bit-exact at the receive side (unit level), images vs the single-rank legacy
graph and vs native, slots / pools / leases full after; a rank killed mid-transfer fails closed."""

import os
import signal
import threading
import time

import msgspec
import numpy as np
import pytest
import torch

from ditkv.stages.orchestrator import Orchestrator
from ditkv.stages.graph import load_stage_graph
from ditkv.transfer.config import TransferConfig
from ditkv.transfer.connector import KVConsumer, KVProducer, transfer_pool
from ditkv.transfer.descriptors import gather_contiguous, legacy_heads
from ditkv.transfer.ticket import DestEndpoint, RankDest, RowDest, SourceEndpoint, TransferTicket
from ditkv.transfer.transport import make_transport
from ditkv.worker.page_pool import PagePool
from stage_helpers import full, gate_writes, no_segments, rank_opts, req, tiny_bundle, wait_for

os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
os.environ.setdefault("MC_TRANSFER_TIMEOUT", "5")


# ---- unit: chunked slot layout, bit-exact at the receive side -------------------------------
@pytest.mark.parametrize("kind", ["shm", pytest.param("mooncake", marks=pytest.mark.slow)])
@pytest.mark.parametrize("src_tp, dst_heads", [(1, [(0, 2)]), (1, [(0, 1), (1, 2)]), (2, [(0, 2)]),
                                               (2, [(0, 1), (1, 2)])])
def test_legacy_chunks_reassemble_bit_exact(kind, src_tp, dst_heads):
    torch.manual_seed(0)
    full = PagePool(16, 3, 2, 16, 8)
    full.kv.normal_()
    blocks, tokens = [3, 4, 9], 40
    want = gather_contiguous(full, blocks, tokens)  # [L, 2, P, H, D] of the single-rank producer
    pc = TransferConfig("legacy", engine_id="ar", kv_role="kv_producer", kv_connector=kind, legacy_max_tokens=64,
                        legacy_slots=2)
    cc = TransferConfig("legacy", engine_id="dit", kv_role="kv_consumer", kv_connector=kind, legacy_max_tokens=64,
                        legacy_slots=2)
    h = 2 // src_tp
    tps, prods, cons = [], [], []
    try:
        for s in range(src_tp):  # each source rank holds heads [s*h, (s+1)*h) of the same pages
            p = PagePool(16, 3, h, 16, 8)
            transfer_pool(p, kind)
            p.kv.copy_(full.kv[:, :, :, s * h:(s + 1) * h])
            tps.append(make_transport(kind))
            prods.append(KVProducer(pc, tps[-1], p, rank=s, head_lo=s * h))
        for r, (lo, hi) in enumerate(dst_heads):
            tps.append(make_transport(kind))
            cons.append(KVConsumer(cc, tps[-1], r, None, lo, hi, token_bytes=prods[0].geometry.token_bytes * src_tp))
        g0 = prods[0].geometry
        ranks = tuple(RankDest(s, "ar", "kv_producer", p.region, p.geometry, s * h, (s + 1) * h)
                      for s, p in enumerate(prods)) if src_tp > 1 else ()
        src = SourceEndpoint("ar", "kv_producer", 0, prods[0].region, msgspec.structs.replace(g0, num_kv_heads=2),
                             tuple(blocks), tokens, ranks=ranks)
        slot = 1  # a non-zero slot: offsets must add up
        t = TransferTicket("r", "legacy")
        t.bind_source(src)
        t.bind_dest(DestEndpoint("dit", "kv_consumer", 0, tuple(c.rank_dest(slot) for c in cons),
                                 (RowDest(0, tokens), RowDest(1, 1))))
        t.mark_dispatched(10)
        done = threading.Semaphore(0)
        for p in prods:
            p.dispatch(t, lambda _: done.release())
        for _ in prods:
            assert done.acquire(timeout=10)
        assert t.all_sent() and not t.send_errors()
        end = time.monotonic() + 10
        while not t.all_received() and time.monotonic() < end:
            for c in cons:
                for _, rank, rows, s in c.poll():
                    t.report_received(rank, rows, s)
        assert t.all_received()
        src_heads = [(lo, hi) for _, lo, hi, _ in src.source_ranks()]
        for c in cons:
            got = legacy_heads(c.slots.buffer[slot], src_heads, 3, tokens, 8, torch.float32, c.head_lo, c.head_hi)
            assert torch.equal(got, want[:, :, :, c.head_lo:c.head_hi])
    finally:
        for p in prods:
            p.close()
        for x in tps:
            x.close()


# ---- end to end -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bundle():
    return tiny_bundle()


def graph(ar_tp=1, dit_tp=2, mode="legacy", kind="shm", timeout=30.0, **dit):
    key = "kv_transfer_config" if mode == "native" else "legacy_kv_transfer"
    dit_mode = "paged_scheduler" if mode == "native" else "dense_legacy"
    return load_stage_graph({"stages": [
        {"stage_id": 0, "kind": "ar",
         "engine": {"model": "tiny", "device": "cpu", "block_size": 16, "num_kv_blocks": 64,
                    "tensor_parallel_size": ar_tp},
         key: {"kv_connector": kind, "engine_id": "ar", "kv_role": "kv_producer"}},
        {"stage_id": 1, "kind": "dit", "inputs": [0],
         "engine": {"model": "tiny", "device": "cpu", "block_size": 16, "diffusion_kv_mode": dit_mode,
                    "diffusion_kv_max_rows_per_request": 2, "num_kv_blocks": 64, "tensor_parallel_size": dit_tp,
                    **dit},
         key: {"kv_connector": kind, "engine_id": "dit", "kv_role": "kv_consumer", "transfer_timeout": timeout}}]})


REQS = [req(0), req(1, "a small blue square in the top left corner", 3.0), req(2, "x", 1.0)]


def run_graph(g, bundle, reqs=REQS):
    orch = Orchestrator(g, bundle, executor_options=rank_opts()).start()
    try:
        outs = orch.run(reqs, concurrency=3)
        assert all(o.ok for o in outs), [o.error for o in outs]
        snap = orch.transfers.snapshot()
        assert wait_for(lambda: full(orch))
    finally:
        orch.shutdown()
    assert full(orch) and no_segments(orch)
    return outs, snap


@pytest.fixture(scope="module")
def reference(bundle):
    return run_graph(graph(1, 1), bundle)


@pytest.mark.parametrize("ar_tp, dit_tp, byte_factor, kind", [
    (1, 2, 2, "shm"), (2, 2, 1, "shm"), (2, 1, 1, "shm"),
    pytest.param(2, 2, 1, "mooncake", marks=pytest.mark.slow),
])
def test_legacy_multirank_matches_single_rank_and_native(bundle, reference, ar_tp, dit_tp, byte_factor, kind):
    ref, ref_snap = reference
    outs, snap = run_graph(graph(ar_tp, dit_tp, kind=kind), bundle)
    native, _ = run_graph(graph(ar_tp, dit_tp, mode="native", kind=kind), bundle)
    for o, r, n in zip(outs, ref, native):
        # TP sums partial products in another order: one level per pixel at most
        assert np.abs(o.image.astype(int) - r.image.astype(int)).max() <= 1
        assert np.array_equal(o.image, n.image)  # dense vs paged attention: same bits
        assert o.stats.imported_tokens == r.stats.imported_tokens == n.stats.imported_tokens > 0
        assert o.stats.tokens_computed == r.stats.tokens_computed
    # the whole-chunk choice: an AR TP=1 producer sends every head to each DiT rank
    assert snap["transfers"] == 3 and snap["failures"] == 0 and snap["bytes"] == byte_factor * ref_snap["bytes"]


def test_legacy_dit_rank_killed_mid_transfer_fails_closed(bundle):
    gates = [threading.Event(), threading.Event()]
    orch = Orchestrator(graph(1, 2), bundle, executor_options=rank_opts()).start()
    gate_writes(orch, gates)
    try:
        d = orch.dit[0]
        rid = orch.submit(req(0))
        assert wait_for(lambda: d.scheduler.num_waiting_for_kv == 1 and not d.pool_full())
        gates[0].set()
        os.kill(d.ranks.executor.procs[1].pid, signal.SIGKILL)
        out = orch.take(rid, timeout=30)
        assert out.status == "error" and "failed closed" in out.error and "rank 1" in out.error
        assert d.dead and all(p.exitcode is not None for p in d.ranks.executor.procs)
        gates[1].set()  # the late write to the dead rank returns; the AR lease goes back
        assert wait_for(lambda: full(orch))
        late = orch.generate(req(1), timeout=30)
        assert late.status == "error" and "no live DiT replica" in late.error
    finally:
        for g in gates:
            g.set()
        orch.shutdown()
    assert full(orch) and no_segments(orch)


def test_legacy_ar_rank_killed_mid_transfer_fails_closed(bundle, tmp_path):
    orch = Orchestrator(graph(2, 2, timeout=1.0), bundle, executor_options=rank_opts(str(tmp_path))).start()
    try:
        ar, d = orch.ar[0], orch.dit[0]
        rid = orch.submit(req(0))
        assert wait_for(lambda: d.scheduler.num_waiting_for_kv == 1)
        (tmp_path / "r0").touch()  # AR rank 0 writes its chunk; rank 1 stays held
        out = orch.take(rid, timeout=30)
        assert out.status == "error" and "timed out" in out.error
        assert d.num_quarantined == 1 and not d.pool_full() and ar.num_leases == 1  # slot held
        os.kill(ar.ranks.executor.procs[1].pid, signal.SIGKILL)
        assert wait_for(lambda: ar.dead and "rank 1" in ar.dead)
        assert wait_for(lambda: full(orch)) and not d.dead
    finally:
        (tmp_path / "r0").touch()
        (tmp_path / "r1").touch()
        orch.shutdown()
    assert full(orch) and no_segments(orch)


@pytest.mark.parametrize("dit", [{"ulysses_degree": 2}, {"cfg_parallel_size": 2}])
def test_legacy_ulysses_and_cfg_parallel_match_single_rank_and_native(bundle, dit):
    """Ulysses ranks slice their KV-head range out of the slot like TP ranks; a CFG rank holds every
    head and fills only its own row (cond: the whole prefix, uncond: the part it shares)."""
    reqs = REQS[:2]  # both with CFG (a CFG-parallel replica refuses a one-row request)
    ref, ref_snap = run_graph(graph(1, 1), bundle, reqs)
    outs, snap = run_graph(graph(1, 1, **dit), bundle, reqs)
    native, _ = run_graph(graph(1, 1, mode="native", **dit), bundle, reqs)
    for o, r, n in zip(outs, ref, native, strict=True):
        assert np.abs(o.image.astype(int) - r.image.astype(int)).max() <= 1
        assert np.array_equal(o.image, n.image)  # dense vs paged attention: same bits
        assert o.stats.imported_tokens == r.stats.imported_tokens > 0
    # an AR TP=1 producer sends its whole chunk to each of the 2 DiT ranks
    assert snap["transfers"] == 2 and snap["failures"] == 0 and snap["bytes"] == 2 * ref_snap["bytes"]


def test_dense_import_must_cover_every_row_of_the_request():
    """A legacy import for a CFG request names each row's shared length; a wrong count is refused
    before any cache is filled (it would otherwise fill the wrong CFG rank's row)."""
    import torch

    from ditkv.models.hunyuan import ByteTokenizer, HunyuanImage3Config, HunyuanImage3Model, build_request_layout
    from ditkv.worker.denoising import DenseImport, denoise
    from ditkv.worker.dit_runner import DiTRunner

    cfg = HunyuanImage3Config.tiny()
    model = HunyuanImage3Model.from_config(cfg).eval()
    layout = build_request_layout(cfg, ByteTokenizer(), "a red circle", 32, 32, 3.0)
    p = layout.rows[0].prefix_len
    kv = torch.zeros(cfg.num_hidden_layers, 2, p, cfg.num_key_value_heads, cfg.attention_head_dim)
    with pytest.raises(ValueError, match="covers 1 rows, the request has 2"):
        denoise(DiTRunner(model, paged=False), "r", layout, 1, 3.0, 0, dense_import=DenseImport(kv, [p]))


def test_paged_mode_refuses_a_dense_kv_payload():
    """The pages carry a paged request's prefix: a dense (legacy) KV payload handed to a paged runner,
    or sent where paged metadata belongs, is an error, never installed or run as a dense request."""
    import torch

    from ditkv.config import EngineConfig
    from ditkv.errors import MetadataError
    from ditkv.models.hunyuan import build_request_layout
    from ditkv.worker.denoising import DenseImport, denoise
    from ditkv.worker.worker import DiTWorker

    w = DiTWorker(EngineConfig(model="tiny", device="cpu", dtype="float32", diffusion_kv_mode="paged_scheduler",
                               diffusion_kv_max_rows_per_request=2),
                  num_blocks=64)
    assert w.runner.paged
    cfg = w.model.config
    layout = build_request_layout(cfg, w.tokenizer, "a red circle", 32, 32, 3.0)
    p = layout.rows[0].prefix_len
    payload = DenseImport(torch.zeros(cfg.num_hidden_layers, 2, p, cfg.num_key_value_heads, cfg.attention_head_dim),
                          [p, p])
    with pytest.raises(ValueError, match="dense KV import cannot be used in paged mode"):
        denoise(w.runner, "r", layout, 1, 3.0, 0, dense_import=payload)
    with pytest.raises(MetadataError, match="dense KV payload cannot be installed in paged mode"):
        w.rows.install(payload)
    assert not w.rows._active
