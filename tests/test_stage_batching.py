"""Step-level batching in a stage graph (issue 15 item 2): the DiT stage is an `Engine` with a
KV-import hook, so with max_num_seqs > 1 requests whose prefix KV arrived by transfer run in one
batch; each image is bit-identical to the same request run alone (CPU fp32); a cancel mid-transfer
still quarantines the pages until the write settles; every page returns."""

import threading

import numpy as np
import pytest
import torch
from stage_helpers import full, no_segments, rank_opts, wait_for

from ditkv.engine.types import GenerationRequest
from ditkv.models.loader import load_model
from ditkv.stages.graph import load_stage_graph
from ditkv.stages.orchestrator import Orchestrator

PROMPTS = ["a large blue square", "a small red circle in the top left", "a green triangle", "a yellow circle",
           "a white cross"]


@pytest.fixture(scope="module")
def bundle():
    return load_model("tiny", torch.device("cpu"), torch.float32)


def graph(max_num_seqs=1, **dit_extra):
    dit = {"model": "tiny", "device": "cpu", "dtype": "float32", "block_size": 16,
           "diffusion_kv_mode": "paged_scheduler", "diffusion_kv_max_rows_per_request": 2, "num_kv_blocks": 256,
           "max_num_seqs": max_num_seqs, **dit_extra}
    return load_stage_graph({"stages": [
        {"stage_id": 0, "kind": "ar",
         "engine": {"model": "tiny", "device": "cpu", "dtype": "float32", "block_size": 16, "num_kv_blocks": 64},
         "kv_transfer_config": {"kv_connector": "shm", "engine_id": "ar", "kv_role": "kv_producer"}},
        {"stage_id": 1, "kind": "dit", "inputs": [0], "engine": dit,
         "kv_transfer_config": {"kv_connector": "shm", "engine_id": "dit", "kv_role": "kv_consumer",
                                "transfer_timeout": 30.0}}]})


def req(i, steps=4):
    return GenerationRequest(prompt=PROMPTS[i % len(PROMPTS)], request_id=f"r{i}", height=32, width=32,
                             steps=steps, guidance_scale=2.0 + i % 2, seed=i)


def run_all(orch, n):
    """Submit every request first, then drive the stages on this thread (deterministic)."""
    rids = [orch.submit(req(i)) for i in range(n)]
    return [orch.take(r, timeout=120) for r in rids]


@pytest.fixture(scope="module")
def solo(bundle):
    orch = Orchestrator(graph(1), bundle)
    try:
        outs = run_all(orch, 5)
        assert full(orch)
    finally:
        orch.shutdown()
    assert all(o.ok for o in outs), [o.error for o in outs]
    assert set(orch.dit[0].batch_sizes) == {1}  # max_num_seqs=1: every step a batch of one
    assert orch.stats()["batch_sizes"] == orch.dit[0].batch_sizes
    return {o.request_id: o.image for o in outs}


def test_dit_stage_batches_imported_requests_bit_identical(bundle, solo):
    orch = Orchestrator(graph(3), bundle)
    try:
        outs = run_all(orch, 5)
        assert all(o.ok for o in outs), [o.error for o in outs]
        sizes = orch.dit[0].batch_sizes
        assert max(sizes) > 1 and max(sizes) <= 3, sizes  # batched, within max_num_seqs
        assert orch.stats()["batch_sizes"] == sizes  # what /health and the /metrics histogram show
        for o in outs:
            assert np.array_equal(o.image, solo[o.request_id]), o.request_id
            assert o.stats.imported_tokens > 0  # the prefix came from the AR stage
        t = orch.transfers.snapshot()
        assert (t["transfers"], t["ok"], t["failures"], t["cancelled"]) == (5, 5, 0, 0)
        assert full(orch)
    finally:
        orch.shutdown()
    assert full(orch)


def test_threaded_stage_graph_batches_and_matches_solo(bundle, solo):
    orch = Orchestrator(graph(3), bundle).start()
    try:
        outs = orch.run([req(i) for i in range(5)], concurrency=5)
        assert all(o.ok for o in outs), [o.error for o in outs]
        for o in outs:
            assert np.array_equal(o.image, solo[o.request_id]), o.request_id
        assert wait_for(lambda: full(orch))
    finally:
        orch.shutdown()


def test_cancel_mid_transfer_quarantines_and_settles_while_others_batch(bundle, solo):
    gate = threading.Event()
    orch = Orchestrator(graph(3), bundle).start()
    tp = orch.ar[0].transport
    orig = tp.write
    held = []

    def write(src, dst, descs, notify=None):  # the first transfer's write waits for the gate
        if not held:
            held.append(notify)
        if notify == held[0]:
            gate.wait()
        return orig(src, dst, descs, notify=notify)
    tp.write = write
    try:
        first = orch.submit(req(0))
        d = orch.dit[0]
        assert wait_for(lambda: d.scheduler.num_waiting_for_kv == 1)
        assert orch.cancel(first)
        out = orch.take(first, timeout=20)
        assert out.status == "cancelled"
        assert d.num_quarantined == 1 and d.manager.num_quarantined_blocks > 0  # the write may still land
        assert orch.ar[0].num_leases == 1  # the producer still reads its pages
        others = orch.run([req(i) for i in range(1, 4)], concurrency=3)  # the stage keeps batching
        assert all(o.ok for o in others), [o.error for o in others]
        for o in others:
            assert np.array_equal(o.image, solo[o.request_id]), o.request_id
        assert d.num_quarantined == 1  # still held: nothing settled it
        gate.set()
        assert wait_for(lambda: full(orch))  # settled: the pages and the lease return
        t = orch.transfers.snapshot()
        assert t["cancelled"] == 1 and t["ok"] == 3 and t["failures"] == 0
    finally:
        gate.set()
        orch.shutdown()
    assert full(orch)


def test_abort_of_a_running_batched_request_frees_its_pages(bundle):
    orch = Orchestrator(graph(3), bundle)
    try:
        rids = [orch.submit(req(i, steps=6)) for i in range(3)]
        d = orch.dit[0]
        for _ in range(200):  # drive until the batch runs
            orch.step()
            if d.scheduler.num_running >= 2:
                break
        assert d.scheduler.num_running >= 2
        orch.cancel(rids[1])
        outs = {r: orch.take(r, timeout=60) for r in rids}
        assert outs[rids[1]].status == "cancelled"
        assert outs[rids[0]].ok and outs[rids[2]].ok
        assert full(orch)
    finally:
        orch.shutdown()


def test_multirank_dit_stage_batches(bundle):
    """TP=2 DiT ranks (rank processes, a KV consumer in each) batch imported requests; every image
    within one level of the same request run alone on the same ranks (a split sums in another order)."""
    opts = rank_opts()
    imgs = {}
    for seqs in (1, 3):
        orch = Orchestrator(graph(seqs, tensor_parallel_size=2), bundle, executor_options=opts)
        try:
            assert [c.head_lo for c in orch.dit[0].consumers] == [0, 1]
            outs = run_all(orch, 3)
            assert all(o.ok for o in outs), [o.error for o in outs]
            imgs[seqs] = {o.request_id: o.image for o in outs}
            if seqs > 1:
                assert max(orch.dit[0].batch_sizes) > 1, orch.dit[0].batch_sizes
            assert wait_for(lambda o=orch: full(o))
        finally:
            orch.shutdown()
        assert full(orch) and no_segments(orch)
    for rid, img in imgs[3].items():
        assert np.abs(img.astype(int) - imgs[1][rid].astype(int)).max() <= 1, rid
