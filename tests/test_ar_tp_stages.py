"""Tensor-parallel AR replicas (TP=2, one process per rank, each writing its KV-head range) in
the AR(0) -> DiT(1) graph: AR TP=2 -> DiT TP=1 (the DiT rank gets two writes) and -> DiT TP=2
(head ranges 1:1), images vs the single-rank graph; an AR rank killed mid-transfer fails the AR
replica closed while the DiT keeps the request's pages quarantined until every write settled.
Both pools full and no rank shm segment left after each scenario."""

import os
import signal
import time

import numpy as np
import pytest

from ditkv.stages.orchestrator import Orchestrator
from ditkv.stages.graph import load_stage_graph
from ditkv.errors import ConfigError, DitkvError
from stage_helpers import full, no_segments, rank_opts, req, tiny_bundle, wait_for


@pytest.fixture(scope="module")
def bundle():
    return tiny_bundle()


def graph(ar_tp=2, dit_tp=1, kind="shm", timeout=30.0, ar_replicas=1, mode="native"):
    key = "kv_transfer_config" if mode == "native" else "legacy_kv_transfer"
    dit_mode = "paged_scheduler" if mode == "native" else "dense_legacy"
    return load_stage_graph({"stages": [
        {"stage_id": 0, "kind": "ar", "replicas": ar_replicas,
         "engine": {"model": "tiny", "device": "cpu", "block_size": 16, "num_kv_blocks": 64,
                    "tensor_parallel_size": ar_tp},
         key: {"kv_connector": kind, "engine_id": "ar", "kv_role": "kv_producer"}},
        # the DiT's prefix cache off (paged): an import's hits would depend on which concurrent request
        # committed first, and these tests compare token and byte counts exactly
        {"stage_id": 1, "kind": "dit", "inputs": [0],
         "engine": {"model": "tiny", "device": "cpu", "block_size": 16, "diffusion_kv_mode": dit_mode,
                    "diffusion_kv_max_rows_per_request": 2, "num_kv_blocks": 64, "tensor_parallel_size": dit_tp,
                    **({"enable_prefix_caching": False} if mode == "native" else {})},
         key: {"kv_connector": kind, "engine_id": "dit", "kv_role": "kv_consumer", "transfer_timeout": timeout}}]})


def record_tickets(orch):
    seen = []
    orig = orch._send
    orch._send = lambda t: (seen.append(t), orig(t))[1]
    return seen


@pytest.fixture(scope="module")
def reference(bundle):
    """Single-rank graph: images, token counts and bytes moved."""
    reqs = [req(0), req(1, "a small blue square in the top left corner", 3.0), req(2, "x", 1.0)]
    one = Orchestrator(graph(1, 1), bundle)
    try:
        outs = [one.generate(r) for r in reqs]
        return reqs, outs, one.transfers.snapshot()["bytes"]
    finally:
        one.shutdown()


@pytest.mark.parametrize("dit_tp, kind, pairs", [
    (1, "shm", [(0, 0), (1, 0)]),  # each head range of the DiT rank comes from one AR rank
    (2, "shm", [(0, 0), (1, 1)]),  # head ranges match 1:1
    pytest.param(2, "mooncake", [(0, 0), (1, 1)], marks=pytest.mark.slow),
])
def test_ar_tp2_matches_single_rank(bundle, reference, dit_tp, kind, pairs):
    reqs, ref, ref_bytes = reference
    orch = Orchestrator(graph(2, dit_tp, kind), bundle, executor_options=rank_opts()).start()
    tickets = record_tickets(orch)
    try:
        ar = orch.ar[0]
        assert [(s.head_lo, s.head_hi) for s in ar.ranks.sources] == [(0, 1), (1, 2)]
        outs = orch.run(reqs, concurrency=3)
        assert all(o.ok for o in outs), [o.error for o in outs]
        for o, r in zip(outs, ref):
            # TP sums partial products in another order: one level per pixel at most
            assert np.abs(o.image.astype(int) - r.image.astype(int)).max() <= 1
            assert o.stats.imported_tokens == r.stats.imported_tokens > 0
            assert o.stats.tokens_computed == r.stats.tokens_computed
        assert all(t.pairs() == pairs and t.all_received() and t.all_sent() for t in tickets)
        snap = orch.transfers.snapshot()
        assert snap["transfers"] == 3 and snap["failures"] == 0 and snap["bytes"] == ref_bytes
        assert wait_for(lambda: full(orch))
    finally:
        orch.shutdown()
    assert full(orch) and (kind != "shm" or no_segments(orch))


def test_ar_rank_killed_mid_transfer_quarantine_until_settled(bundle, tmp_path):
    """The DiT times out while AR rank 1's write is held: its pages stay quarantined (rank 0's
    write landed, rank 1's may still). Killing AR rank 1 fails the AR replica closed, which
    settles every write; only then do the DiT pages return."""
    orch = Orchestrator(graph(2, 2, timeout=1.0), bundle, executor_options=rank_opts(str(tmp_path))).start()
    tickets = record_tickets(orch)
    try:
        ar, d = orch.ar[0], orch.dit[0]
        rid = orch.submit(req(0))
        assert wait_for(lambda: d.scheduler.num_waiting_for_kv == 1 and tickets)
        t = tickets[0]
        (tmp_path / "r0").touch()  # AR rank 0 writes; rank 1 stays held
        assert wait_for(lambda: t.was_sent(0, 0) and t.received.get(0))
        out = orch.take(rid, timeout=30)
        assert out.status == "error" and "timed out" in out.error
        held = d.manager.num_quarantined_blocks
        assert d.num_quarantined == 1 and held > 0 and ar.num_leases == 1
        time.sleep(0.2)
        assert d.num_quarantined == 1 and not t.settled()
        os.kill(ar.ranks.executor.procs[1].pid, signal.SIGKILL)
        assert wait_for(lambda: ar.dead and "rank 1" in ar.dead)
        assert t.settled() and "failed closed" in t.send_errors()[1]
        assert wait_for(lambda: full(orch))
        assert all(p.exitcode is not None for p in ar.ranks.executor.procs)
        with pytest.raises(DitkvError, match="no live AR replica"):
            orch.submit(req(1))
        assert not d.dead  # the DiT replica is unharmed
    finally:
        (tmp_path / "r0").touch()
        (tmp_path / "r1").touch()
        orch.shutdown()
    assert full(orch) and no_segments(orch)


def test_ar_rank_killed_fails_the_request_and_the_other_replica_serves(bundle, tmp_path):
    """AR TP=2 -> DiT TP=1, two AR replicas: killing a rank of replica 0 while its writes are
    held fails the DiT request at once (every write reported failed); replica 1 keeps serving."""
    orch = Orchestrator(graph(2, 1, ar_replicas=2), bundle, executor_options=rank_opts(str(tmp_path))).start()
    try:
        a0, d = orch.ar[0], orch.dit[0]
        rid = orch.submit(req(0))
        assert wait_for(lambda: d.scheduler.num_waiting_for_kv == 1)
        os.kill(a0.ranks.executor.procs[0].pid, signal.SIGKILL)
        out = orch.take(rid, timeout=30)
        assert out.status == "error" and "failed closed" in out.error and "rank 0" in out.error
        assert wait_for(lambda: full(orch)) and a0.dead and not orch.ar[1].dead
        (tmp_path / "r0").touch()
        (tmp_path / "r1").touch()
        out = orch.generate(req(1), timeout=60)
        assert out.ok, out.error
        assert wait_for(lambda: full(orch))
    finally:
        (tmp_path / "r0").touch()
        (tmp_path / "r1").touch()
        orch.shutdown()
    assert full(orch) and no_segments(orch)


def test_ar_tp_with_cuda_transport_is_rejected():
    with pytest.raises(ConfigError, match="cuda"):
        graph(2, 1, kind="cuda")


def test_ar_tp_the_model_cannot_split_fails_before_anything_starts(bundle):
    with pytest.raises(ConfigError, match="num_key_value_heads=2 must be divisible"):
        Orchestrator(graph(4, 1), bundle, executor_options=rank_opts())  # the tiny model has 2 KV heads
