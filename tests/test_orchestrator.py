"""AR -> DiT through the orchestrator: legacy vs native bit-identity, prefix import, and the ticket
lifecycle under failures (timeout + late completion, cancel mid-transfer, registration failure, a
peer that never completes, invalid endpoints, fail-closed). Both pools return to full after each."""

import os
import threading
import time

import numpy as np
import pytest
import torch

from ditkv.config import EngineConfig
from ditkv.engine.engine import Engine
from ditkv.stages.orchestrator import Orchestrator
from ditkv.stages.graph import load_stage_graph
from ditkv.engine.types import GenerationRequest
from ditkv.models.hunyuan import HunyuanImage3Config, HunyuanImage3Model, PixelCodec
from ditkv.models.hunyuan.tokenizer import ByteTokenizer
from ditkv.transfer.connector import RegistrationError
from ditkv.transfer.transport import TransferFailed
from worker_helpers import record_requests

os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
os.environ.setdefault("MC_TRANSFER_TIMEOUT", "5")


@pytest.fixture(scope="module")
def bundle():
    cfg = HunyuanImage3Config.tiny()
    model = HunyuanImage3Model.from_config(cfg, seed=1, zero_init_resblocks=False).eval()
    return model, ByteTokenizer(), PixelCodec(cfg.image_token_downsample)


def graph(mode="native", kind="shm", timeout=30.0, max_new=0, dit_blocks=256, **dit_extra):
    key = "kv_transfer_config" if mode == "native" else "legacy_kv_transfer"
    dit_engine = {"model": "tiny", "device": "cpu", "block_size": 16, "diffusion_kv_mode": "dense_legacy",
                  **dit_extra}
    if mode == "native":
        dit_engine.update(diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2,
                          num_kv_blocks=dit_blocks)
    extra = {} if mode == "native" else {"legacy_slots": 4, "legacy_max_tokens": 256}
    return load_stage_graph({"stages": [
        {"stage_id": 0, "kind": "ar", "max_new_tokens": max_new,
         "engine": {"model": "tiny", "device": "cpu", "block_size": 16, "num_kv_blocks": 64},
         key: {"kv_connector": kind, "engine_id": "ar", "kv_role": "kv_producer", **extra}},
        {"stage_id": 1, "kind": "dit", "inputs": [0], "engine": dit_engine,
         key: {"kv_connector": kind, "engine_id": "dit", "kv_role": "kv_consumer", "transfer_timeout": timeout,
               **extra}}]})


def req(i=0, prompt="a large red circle", g=2.0, **kw):
    return GenerationRequest(prompt=prompt, height=32, width=32, steps=2, guidance_scale=g, seed=i, **kw)


def record_latents(orch):
    got = {}
    for d in orch.dit:
        record_requests(d.engine.executor.stepper, got)
    return got


def full(orch):
    return orch.pools_full() and all(not d.num_quarantined for d in orch.dit)


REQS = [req(0), req(1, "a small blue square in the top left corner", 3.0), req(2, "x", 1.0),
        req(3, "a" * 70, 2.0, negative_prompt="blurry")]


@pytest.mark.parametrize("kind", ["shm", pytest.param("mooncake", marks=pytest.mark.slow)])
def test_legacy_and_native_bit_identical_end_to_end(bundle, kind):
    lat, imgs = {}, {}
    for mode in ("legacy", "native"):
        orch = Orchestrator(graph(mode, kind), bundle).start()
        got = record_latents(orch)
        try:
            outs = orch.run([req(r.seed, r.prompt, r.guidance_scale, negative_prompt=r.negative_prompt)
                             for r in REQS], concurrency=4)
        finally:
            orch.shutdown()
        assert [o.status for o in outs] == ["ok"] * len(REQS), [o.error for o in outs]
        assert full(orch)
        t = orch.transfers.snapshot()  # one verdict per ticket, reported by the DiT side
        assert (t["transfers"], t["ok"], t["failures"], t["cancelled"]) == (len(REQS), len(REQS), 0, 0)
        assert t["bytes"] > 0
        lat[mode] = [got[o.request_id]["x"] for o in outs]
        imgs[mode] = [o.image for o in outs]
        if mode == "native":
            s = outs[0].stats  # cond imports its whole prefix; uncond shares only <bos>: under a page, nothing
            assert s.imported_tokens == 1 + len("a large red circle") + 3
    for a, b in zip(lat["legacy"], lat["native"]):
        assert torch.equal(a, b)
    assert all(np.array_equal(a, b) for a, b in zip(imgs["legacy"], imgs["native"]))


def test_imported_prefix_is_not_recomputed_and_matches_plain_dit(bundle):
    orch = Orchestrator(graph(), bundle)
    got = record_latents(orch)
    out = orch.generate(req(5))
    orch.shutdown()
    e = Engine(EngineConfig(diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2,
                            block_size=16, num_kv_blocks=256, device="cpu"), model_bundle=bundle)
    ref = e.generate(req(5))
    lay = e.worker.layout("a large red circle", 32, 32, 2.0)
    seq, tgt, pre = lay.rows[0].seq_len, lay.rows[0].target_len, lay.rows[0].prefix_len
    assert out.ok and out.stats.imported_tokens == pre
    assert out.stats.tokens_computed == 2 * seq - pre + 2 * tgt  # step 0 starts at the import
    assert ref.stats.tokens_computed == 2 * seq + 2 * tgt
    assert np.array_equal(out.image, ref.image)  # imported = computed bit for bit (fixed-shape CPU products)
    assert got and full(orch)


def test_ar_generated_text_becomes_part_of_the_prefix(bundle):
    orch = Orchestrator(graph(max_new=4), bundle)
    out = orch.generate(req(1, "ab"))
    orch.shutdown()
    assert out.ok, out.error
    assert out.stats.imported_tokens >= 1 + 2 + 3 + 1 and full(orch)


# ---- failures -----------------------------------------------------------------------------------
def slow_writes(orch, delay=None, gate=None, fail=None):
    tp = orch.ar[0].transport
    orig = tp.write

    def write(*a, **kw):
        if gate is not None:
            gate.wait()
        if delay:
            time.sleep(delay)
        if fail:
            raise TransferFailed(fail)
        return orig(*a, **kw)
    tp.write = write


def wait_for(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


@pytest.mark.parametrize("mode, kind", [("native", "shm"), ("legacy", "shm"),
                                        pytest.param("native", "mooncake", marks=pytest.mark.slow)])
def test_timeout_fails_request_and_quarantines_until_late_completion(bundle, mode, kind):
    # the timeout must also let req(1) through on a loaded 2-core CI machine
    orch = Orchestrator(graph(mode, kind, timeout=1.5), bundle).start()
    slow_writes(orch, delay=4.0)  # well past the timeout, even on a loaded machine
    try:
        out = orch.generate(req(0), timeout=30)
        assert out.status == "error" and "timed out receiving KV" in out.error
        d = orch.dit[0]
        assert d.num_quarantined == 1  # the write is still in flight: its pages are not reusable
        if mode == "native":
            assert d.manager.num_quarantined_blocks > 0
        assert wait_for(lambda: d.num_quarantined == 0)  # the late completion releases them
        assert wait_for(lambda: full(orch))
        orch.ar[0].transport.write = type(orch.ar[0].transport).write.__get__(orch.ar[0].transport)
        assert orch.generate(req(1), timeout=30).ok  # the replica keeps serving
    finally:
        orch.shutdown()
    assert full(orch)


def test_cancel_during_transfer_quarantines_then_frees(bundle):
    gate = threading.Event()
    orch = Orchestrator(graph(), bundle).start()
    slow_writes(orch, gate=gate)
    try:
        rid = orch.submit(req(0))
        d = orch.dit[0]
        assert wait_for(lambda: d.scheduler.num_waiting_for_kv == 1)
        assert orch.cancel(rid)
        out = orch.take(rid, timeout=10)
        assert out.status == "cancelled"
        assert d.num_quarantined == 1 and d.manager.num_quarantined_blocks > 0
        t = orch.transfers.snapshot()
        assert (t["cancelled"], t["transfers"], t["bytes"]) == (1, 0, 0)  # a cancel is not a failure
        assert orch.ar[0].num_leases == 1  # the producer still reads its pages
        gate.set()
        assert wait_for(lambda: full(orch) and orch.ar[0].num_leases == 0)
    finally:
        gate.set()
        orch.shutdown()
    assert full(orch)


def test_registration_failure_rolls_back_before_dispatch(bundle):
    orch = Orchestrator(graph(), bundle)
    sent = []
    orig_send = orch._send
    orch._send = lambda t: (sent.append(t), orig_send(t))

    def refuse(ticket):
        raise RegistrationError("rank 0: receive queue full")
    orch.dit[0].consumers[0].register = refuse
    out = orch.generate(req(0))
    assert out.status == "error" and "registration failed" in out.error
    assert not sent  # nothing was dispatched
    assert orch.transfers.snapshot()["failures"] == 1
    for _ in range(3):
        orch.step()  # the producer frees its pages on the abort notice
    assert full(orch) and orch.ar[0].num_leases == 0
    orch.shutdown()


def test_peer_that_never_completes_keeps_pages_until_shutdown(bundle):
    gate = threading.Event()
    orch = Orchestrator(graph(timeout=1.5), bundle).start()  # the others must beat it under load
    tp = orch.ar[0].transport
    orig, calls = tp.write, []

    def write(*a, **kw):
        calls.append(1)
        if len(calls) == 1:
            gate.wait()  # the first write hangs "forever"
        return orig(*a, **kw)
    tp.write = write
    try:
        first = orch.generate(req(0), timeout=30)
        assert first.status == "error" and "timed out" in first.error
        d = orch.dit[0]
        stuck = d.manager.num_quarantined_blocks
        assert stuck > 0
        outs = orch.run([req(i) for i in range(1, 4)], concurrency=2)  # others go on
        assert all(o.ok for o in outs), [o.error for o in outs]
        assert d.manager.num_quarantined_blocks == stuck  # still held
    finally:
        orch.shutdown()
        gate.set()
    assert full(orch)


def test_producer_write_failure_fails_fast_without_quarantine(bundle):
    orch = Orchestrator(graph(timeout=30), bundle).start()
    slow_writes(orch, fail="peer unreachable")
    try:
        t0 = time.monotonic()
        out = orch.generate(req(0), timeout=30)
        assert out.status == "error" and "peer unreachable" in out.error
        assert time.monotonic() - t0 < 10  # not the 30 s timeout
        t = orch.transfers.snapshot()
        assert (t["transfers"], t["failures"], t["bytes"]) == (1, 1, 0)
        assert wait_for(lambda: full(orch))
    finally:
        orch.shutdown()


def test_invalid_endpoint_is_rejected_before_either_request_is_touched(bundle):
    orch = Orchestrator(graph(), bundle)
    orch.ar[0].producer.config.kv_role = "kv_consumer"  # a misconfigured peer reached at run time
    reserved = []
    orig = orch.dit[0].scheduler.add_request
    orch.dit[0].scheduler.add_request = lambda *a, **k: (reserved.append(a), orig(*a, **k))[1]
    out = orch.generate(req(0))
    assert out.status == "error" and "a producer needs" in out.error
    assert not reserved
    orch.step()
    assert full(orch)
    orch.shutdown()


def test_wrong_rank_notice_fails_the_replica_closed(bundle):
    orch = Orchestrator(graph(), bundle)
    d = orch.dit[0]
    orig = d.consumers[0].poll
    d.consumers[0].poll = lambda: [(tid, 1, rows, src) for tid, _, rows, src in orig()]  # a rank we do not have
    outs = orch.run([req(0), req(1)], concurrency=2)
    assert outs[0].status == "error" and "failed closed" in outs[0].error
    # the second one either was on the replica when it failed, or arrived after it died
    assert outs[1].status == "error" and ("failed closed" in outs[1].error or "no live DiT" in outs[1].error)
    assert d.dead and "rank 1" in d.dead
    late = orch.generate(req(2))
    assert late.status == "error" and "no live DiT replica" in late.error
    for _ in range(3):
        orch.step()
    orch.shutdown()
    assert full(orch)


def test_invalid_block_ids_fail_the_replica_closed(bundle):
    orch = Orchestrator(graph(), bundle)
    d = orch.dit[0]
    d.consumers[0].pool = type("P", (), {"num_blocks": 1})()  # pretend the pool shrank under us
    out = orch.generate(req(0))
    assert out.status == "error" and "outside" in out.error and d.dead
    orch.step()
    orch.shutdown()
    assert full(orch)


def test_cli_generate_with_stage_files(tmp_path):
    from ditkv.entrypoints.cli import main

    root = os.path.join(os.path.dirname(__file__), "..", "examples")
    for name in ("stages-native.yaml", "stages-legacy.yaml"):
        out = tmp_path / f"{name}.png"
        assert main(["generate", "--config", os.path.join(root, name), "--prompt", "a red circle",
                     "--steps", "1", "--height", "32", "--width", "32", "--out", str(out),
                     "--no-progress"]) == 0
        assert out.stat().st_size > 0
    a, b = (tmp_path / "stages-native.yaml.png").read_bytes(), (tmp_path / "stages-legacy.yaml.png").read_bytes()
    assert a == b


@pytest.mark.slow
def test_bench_transfer_json_keys(capsys):
    import argparse
    import json

    from ditkv.bench import transfer

    p = argparse.ArgumentParser()
    transfer.add_arguments(p)
    transfer.run(p.parse_args(["--json", "--requests", "4", "--runs", "1", "--concurrency", "2",
                               "--transports", "shm", "--height", "32", "--width", "32", "--pages", "8"]))
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"legacy_rps", "native_rps", "ratio", "bit_exact", "page_bandwidth_ratio"} <= set(out)
    assert out["bit_exact"] is True and out["throughput"][0]["pools_full"]


def test_on_step_reports_every_denoising_step(bundle):
    seen = []
    orch = Orchestrator(graph(), bundle, on_step=lambda rid, i, total: seen.append((rid, i, total)))
    outs = orch.run([req(0), req(1)], concurrency=2)
    orch.shutdown()
    assert all(o.ok for o in outs)
    for o in outs:
        assert [(i, n) for rid, i, n in seen if rid == o.request_id] == [(0, 2), (1, 2)]


@pytest.mark.parametrize("mode, extra, names", [
    ("native", {"dit_blocks": 4}, "num_kv_blocks=4"),  # the pool's size, not max_model_len
    ("legacy", {"max_model_len": 64}, "max_model_len=64"),  # honoured in dense mode too
])
def test_a_request_that_can_never_fit_the_dit_stage_names_the_setting(bundle, mode, extra, names):
    """The stage graph refuses what its DiT stage can never run with the engine's own message, at
    submit, before the AR stage is asked for anything; the pools stay full and a request that fits
    still runs."""
    from ditkv.errors import AdmissionError

    orch = Orchestrator(graph(mode, **extra), bundle)
    try:
        with pytest.raises(AdmissionError, match=names):
            orch.generate(req(0))
        assert full(orch)
        assert orch.generate(GenerationRequest(prompt="x", height=16, width=16, steps=2, guidance_scale=1.0)).status == "ok"
        assert wait_for(lambda: (orch.step(), full(orch))[1])  # the AR side lets go just after delivery
    finally:
        orch.shutdown()
