"""Multi-rank DiT replicas in the AR(0) -> DiT(1) graph: AR TP=1 -> DiT TP=2 over native shm
transfer (each DiT rank is a process with its own pool holding half the KV heads and its own
consumer). Image vs the single-rank graph; a rank killed mid-transfer fails the replica closed;
cancel during transfer keeps the pages quarantined until every rank settled. Both pools (AR and
DiT) return to full after each scenario, and no rank's shm segment is left behind."""

import os
import signal
import threading
import time

from types import SimpleNamespace

import numpy as np
import pytest

from ditkv.transfer.connector import RegistrationError

from ditkv.stages.orchestrator import Orchestrator
from ditkv.stages.graph import load_stage_graph
from ditkv.errors import ConfigError, LayoutError
from stage_helpers import full, gate_writes, no_segments, rank_opts, req, tiny_bundle, wait_for


@pytest.fixture(scope="module")
def bundle():
    return tiny_bundle()


OPTS = rank_opts()


def graph(tp=1, timeout=30.0, kind="shm", mode="native", **dit):
    key = "kv_transfer_config" if mode == "native" else "legacy_kv_transfer"
    return load_stage_graph({"stages": [
        {"stage_id": 0, "kind": "ar",
         "engine": {"model": "tiny", "device": "cpu", "block_size": 16, "num_kv_blocks": 64},
         key: {"kv_connector": kind, "engine_id": "ar", "kv_role": "kv_producer"}},
        {"stage_id": 1, "kind": "dit", "inputs": [0],
         "engine": {"model": "tiny", "device": "cpu", "block_size": 16, "diffusion_kv_mode": "paged_scheduler",
                    "diffusion_kv_max_rows_per_request": 2, "num_kv_blocks": 64, "tensor_parallel_size": tp,
                    **dit},
         key: {"kv_connector": kind, "engine_id": "dit", "kv_role": "kv_consumer", "transfer_timeout": timeout}}]})


@pytest.mark.parametrize("kind", ["shm", pytest.param("mooncake", marks=pytest.mark.slow)])
def test_ar_tp1_to_dit_tp2_native_matches_single_rank(bundle, kind):
    reqs = [req(0), req(1, "a small blue square in the top left corner", 3.0), req(2, "x", 1.0)]
    # the prefix cache off: with it, an import's hits (and so its computed tokens) depend on which
    # concurrent request committed first; tests/test_prefix_cache_imports.py covers hits on TP ranks
    one = Orchestrator(graph(1, enable_prefix_caching=False), bundle)
    try:
        ref = [one.generate(r) for r in reqs]
    finally:
        one.shutdown()
    two = Orchestrator(graph(2, kind=kind, enable_prefix_caching=False), bundle, executor_options=OPTS).start()
    try:
        d = two.dit[0]
        assert [c.head_lo for c in d.consumers] == [0, 1] and d.num_ranks == 2
        outs = two.run(reqs, concurrency=3)
        assert all(o.ok for o in outs), [o.error for o in outs]
        for o, r in zip(outs, ref):
            # TP sums partial products in another order: the image may differ by one level at most
            assert np.abs(o.image.astype(int) - r.image.astype(int)).max() <= 1
            assert o.stats.imported_tokens == r.stats.imported_tokens > 0
            assert o.stats.tokens_computed == r.stats.tokens_computed
        t = two.transfers.snapshot()
        assert t["transfers"] == 3 and t["failures"] == 0
        assert wait_for(lambda: full(two))
    finally:
        two.shutdown()
    assert full(two) and (kind != "shm" or no_segments(two))


@pytest.mark.parametrize("layout, heads", [({"ulysses_degree": 2}, [0, 1]), ({"cfg_parallel_size": 2}, [0, 0])])
def test_ulysses_and_cfg_parallel_replicas(bundle, layout, heads):
    """Ulysses ranks hold a KV-head range like TP ranks; CFG ranks hold every head and each runs
    its own row (both rows are written to both ranks: the unused one is never read)."""
    r = req(1, "a small blue square in the top left corner", 3.0)
    one = Orchestrator(graph(1), bundle)
    try:
        ref = one.generate(r)
    finally:
        one.shutdown()
    steps = []  # progress from the rank processes
    orch = Orchestrator(graph(1, **layout), bundle, executor_options=OPTS,
                        on_step=lambda rid, i, total: steps.append((i, total))).start()
    try:
        assert [c.head_lo for c in orch.dit[0].consumers] == heads
        out = orch.generate(r, timeout=60)
        assert out.ok, out.error
        assert steps == [(0, 2), (1, 2)]
        assert np.abs(out.image.astype(int) - ref.image.astype(int)).max() <= 1
        if "cfg_parallel_size" in layout:  # a one-row request is refused at intake, before the AR runs
            with pytest.raises(LayoutError, match="guidance_scale > 1"):
                orch.submit(req(2, "x", 1.0))
        assert wait_for(lambda: full(orch))
    finally:
        orch.shutdown()
    assert full(orch) and no_segments(orch)


def test_rank_killed_mid_transfer_fails_replica_closed(bundle):
    gates = [threading.Event(), threading.Event()]
    orch = Orchestrator(graph(2), bundle, executor_options=OPTS).start()
    gate_writes(orch, gates)
    try:
        d = orch.dit[0]
        seen = []  # were all ranks gone when the scheduler freed the pages?
        orig_fail_all = d.scheduler.fail_all
        d.scheduler.fail_all = lambda *a, **k: (
            seen.append(all(p.exitcode is not None for p in d.ranks.executor.procs)), orig_fail_all(*a, **k))[1]
        rid = orch.submit(req(0))
        assert wait_for(lambda: d.scheduler.num_waiting_for_kv == 1 and d.manager.pool.num_free < 64)
        gates[0].set()  # rank 0 receives; rank 1's write is still held back
        os.kill(d.ranks.executor.procs[1].pid, signal.SIGKILL)
        out = orch.take(rid, timeout=30)
        assert out.status == "error" and "failed closed" in out.error and "rank 1" in out.error
        assert wait_for(lambda: d.manager.pool.num_free == 64)
        assert d.dead and seen == [True]  # pages were freed only after both ranks were shut down
        gates[1].set()  # the producer's late write to the dead rank returns; its lease goes back
        assert wait_for(lambda: full(orch))
        late = orch.generate(req(1), timeout=30)
        assert late.status == "error" and "no live DiT replica" in late.error
    finally:
        for g in gates:
            g.set()
        orch.shutdown()
    assert full(orch) and no_segments(orch)


def test_cancel_during_transfer_quarantine_until_every_rank_settled(bundle):
    gates = [threading.Event(), threading.Event()]
    orch = Orchestrator(graph(2), bundle, executor_options=OPTS).start()
    gate_writes(orch, gates)
    try:
        d = orch.dit[0]
        rid = orch.submit(req(0))
        assert wait_for(lambda: d.scheduler.num_waiting_for_kv == 1)
        assert orch.cancel(rid)
        out = orch.take(rid, timeout=30)
        assert out.status == "cancelled"
        held = d.manager.num_quarantined_blocks
        assert d.num_quarantined == 1 and held > 0
        gates[0].set()  # rank 0 settles; rank 1's write may still land
        t = next(iter(d._quarantine.values()))  # noqa: SLF001
        assert wait_for(lambda: 0 in t.sent)
        time.sleep(0.2)
        assert d.num_quarantined == 1 and d.manager.num_quarantined_blocks == held
        gates[1].set()
        assert wait_for(lambda: full(orch))
        assert orch.generate(req(1), timeout=60).ok  # the replica keeps serving
        assert wait_for(lambda: full(orch))
    finally:
        for g in gates:
            g.set()
        orch.shutdown()
    assert full(orch) and no_segments(orch)


def test_rank_refusal_rolls_back_then_invalid_block_ids_fail_closed(bundle):
    orch = Orchestrator(graph(2), bundle, executor_options=OPTS)
    d = orch.dit[0]
    sent, unregistered = [], []
    orig_send, orig_unreg = orch._send, d.consumers[0].unregister
    real = d.consumers[1].register
    orch._send = lambda t: (sent.append(t), orig_send(t))
    d.consumers[0].unregister = lambda tid: (unregistered.append(tid), orig_unreg(tid))
    try:
        def refuse(ticket):  # the word "outside" alone must not fail the replica (typed errors decide)
            raise RegistrationError("rank 1: receive queue full (ticket outside the window)")
        d.consumers[1].register = refuse
        out = orch.generate(req(0))
        assert out.status == "error" and "registration failed" in out.error
        assert not sent and len(unregistered) == 1  # rank 0 had registered: rolled back
        for _ in range(3):
            orch.step()
        assert full(orch) and not d.dead

        def bad_ids(ticket):  # the rank process checks the ids against its own pool: BadBlockIdsError
            row = SimpleNamespace(row_id=0, num_tokens=16, block_ids=[10_000])
            real(SimpleNamespace(ticket_id=ticket.ticket_id, dest=SimpleNamespace(rows=[row])))
        d.consumers[1].register = bad_ids
        out = orch.generate(req(1))
        assert out.status == "error" and "outside" in out.error and d.dead
        assert all(p.exitcode is not None for p in d.ranks.executor.procs)
        for _ in range(3):
            orch.step()
        assert not sent and full(orch)
    finally:
        orch.shutdown()
    assert full(orch) and no_segments(orch)


@pytest.mark.parametrize("dit, mode, kind, match", [
    ({"tensor_parallel_size": 1, "enable_expert_parallel": True}, "native", "shm", "expert parallel"),  # one rank
])
def test_unsupported_multirank_configs_fail_at_startup(dit, mode, kind, match):
    d = dict(dit)
    tp = d.pop("tensor_parallel_size")
    if mode == "legacy":
        d["diffusion_kv_mode"] = "dense_legacy"
    with pytest.raises(ConfigError, match=match):
        graph(tp, mode=mode, kind=kind, **d)


def test_parallel_sizes_the_model_cannot_split_fail_before_anything_starts(bundle):
    import ditkv.stages.orchestrator as orch_mod

    built = []
    orig = orch_mod.ARReplica
    orch_mod.ARReplica = lambda *a, **k: built.append(1) or orig(*a, **k)
    try:
        with pytest.raises(ConfigError, match="num_key_value_heads=2 must be divisible"):
            Orchestrator(graph(4), bundle, executor_options=OPTS)  # the tiny model has 2 KV heads
    finally:
        orch_mod.ARReplica = orig
    assert not built  # no pool was allocated, no rank spawned


def test_ar_tensor_parallel_runs_on_the_legacy_path_too():
    """AR TP > 1 is accepted on the legacy path (tests/test_legacy_multirank.py runs it)."""
    g = {"stages": [
        {"stage_id": 0, "kind": "ar", "engine": {"tensor_parallel_size": 2, "block_size": 16},
         "legacy_kv_transfer": {"kv_connector": "shm", "engine_id": "ar", "kv_role": "kv_producer"}},
        {"stage_id": 1, "kind": "dit", "inputs": [0], "engine": {"block_size": 16, "diffusion_kv_mode": "dense_legacy"},
         "legacy_kv_transfer": {"kv_connector": "shm", "engine_id": "dit", "kv_role": "kv_consumer"}}]}
    assert load_stage_graph(g).ar.engine.tensor_parallel_size == 2


def test_cli_generate_with_the_tp2_example(tmp_path):
    from ditkv.entrypoints.cli import main

    root = os.path.join(os.path.dirname(__file__), "..", "examples")
    g = load_stage_graph(os.path.join(root, "stages-native-tp2.yaml"))
    assert g.dit.engine.tensor_parallel_size == 2 and g.mode == "native"
    out = tmp_path / "tp2.png"
    assert main(["generate", "--config", os.path.join(root, "stages-native-tp2.yaml"), "--prompt", "a red circle",
                 "--steps", "1", "--height", "32", "--width", "32", "--out", str(out), "--no-progress"]) == 0
    assert out.stat().st_size > 0
