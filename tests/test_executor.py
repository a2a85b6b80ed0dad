"""Executors: in-process and multi-process (spawned ranks, ZeroMQ + msgspec control messages).

Covers: results equal across executors, queueing + backpressure + cancellation, an abort leaving
the batch on every rank at the same step, a rank exception failing only its request, a killed or frozen rank failing
the engine closed within a bounded time with every page back in the pool, cancellation storms,
startup errors, and real tensor parallelism through the executor. Two-rank tests without model
parallelism use `replicate_ranks=2` (a rank hook, tests/rank_hooks.py): both ranks run the full model
in one gloo group.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import numpy as np
import pytest
import torch
from rank_hooks import hooked_options

from ditkv.engine.options import ExecutorOptions
from worker_helpers import no_rows_bound

from ditkv.config import EngineConfig
from ditkv.engine.engine import Engine
from ditkv.engine.executor import ExecutorError, combine
from ditkv.engine.messages import BatchDone, BatchStep, NewRequest, RankEnd, SamplingParams, decode, encode
from ditkv.engine.types import GenerationRequest
from ditkv.errors import ConfigError, DitkvError, LayoutError
from ditkv.models.hunyuan import HunyuanImage3Config, HunyuanImage3Model, PixelCodec
from ditkv.models.hunyuan.tokenizer import ByteTokenizer

NUM_BLOCKS = 32  # one CFG request at 32x32 with 16-token blocks takes 12: two fit, the third waits
FAULT = (1, "boom", 1)  # rank 1 raises before step 1 of the request with id "boom"


def opts(**kw) -> ExecutorOptions:
    base = dict(heartbeat_interval_s=0.1, heartbeat_timeout_s=10.0, startup_timeout_s=120.0,
                drain_timeout_s=20.0)
    return hooked_options(**{**base, **kw})


def config(**kw) -> EngineConfig:
    base = dict(device="cpu", diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2,
                block_size=16, num_kv_blocks=NUM_BLOCKS, attention_backend="torch")
    return EngineConfig(**{**base, **kw})


def req(prompt="a blue circle", steps=2, **kw) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, height=32, width=32, steps=steps, guidance_scale=kw.pop("g", 2.0),
                             seed=kw.pop("seed", 1), **kw)


def pool_full(e: Engine) -> bool:
    return e.manager.pool.num_free == e.manager.pool.num_blocks and e.manager.num_requests == 0


@pytest.fixture(scope="module")
def bundle():
    cfg = HunyuanImage3Config.tiny()
    model = HunyuanImage3Model.from_config(cfg, seed=1, zero_init_resblocks=False).eval()
    return model, ByteTokenizer(), PixelCodec(cfg.image_token_downsample)


@pytest.fixture(scope="module")
def inproc(bundle):
    return Engine(config(), model_bundle=bundle)


@pytest.fixture(scope="module")
def mp1(bundle):
    e = Engine(config(), model_bundle=bundle, executor="mp", executor_options=opts())
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def mp2(bundle):
    e = Engine(config(), model_bundle=bundle, executor="mp",
               executor_options=opts(replicate_ranks=2, inject_fault=FAULT))
    yield e
    e.shutdown()


def test_messages_roundtrip_with_metadata(inproc):
    rid = inproc.add_request(req())
    meta = inproc.scheduler.schedule().admitted[0].metadata
    layout = inproc.processor.layout("p", 32, 32, 2.0)
    fam = inproc.processor.family
    m = NewRequest(request_id=rid, metadata=meta, layout=fam.layout_to_wire(layout),
                   params=SamplingParams(steps=2, guidance=2.0, seed=1))
    step = BatchStep(request_id="batch-0", starts=[m], drops=["other"])
    assert decode(encode(step)) == step
    back = fam.layout_from_wire(decode(encode(step)).starts[0].layout)  # the rank's layout is the engine's, bit for bit
    for a, b in zip(back.rows, layout.rows):
        assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("token_ids", "pos_y", "pos_x"))
        assert (a.prefix_len, a.target_len, a.seq_len, a.full_attn_spans, a.guidance_index, a.role) == \
               (b.prefix_len, b.target_len, b.seq_len, b.full_attn_spans, b.guidance_index, b.role)
    assert (back.h, back.w, back.cfg_factor, back.prompt_tokens) == (layout.h, layout.w, 2, layout.prompt_tokens)
    d = BatchDone(request_id="batch-0", rank=1, ended=[RankEnd(request_id=rid, rank=1, status="ok", image=b"\x00\x01",
                                                                image_shape=(1, 2))])
    assert decode(encode(d)) == d
    inproc.scheduler.cancel(rid)
    inproc.step()
    assert pool_full(inproc)


def test_combine_reports_the_failing_rank_and_refuses_a_split():
    stop = lambda r: RankEnd(request_id="x", rank=r, status="stopped", error="stopped: a peer rank failed")  # noqa: E731
    ok = lambda r: RankEnd(request_id="x", rank=r, status="ok", image=b"\x00" * 3, image_shape=(1, 1, 3))  # noqa: E731
    err = RankEnd(request_id="x", rank=1, status="error", error="boom")
    assert combine({0: stop(0), 1: err}, 2).error == "rank 1: boom"  # the failing rank's own error wins
    out = combine({0: ok(0), 1: stop(1)}, 2)
    assert out.status == "error" and "did not agree" in out.error
    good = combine({0: ok(0), 1: ok(1)}, 2)
    assert good.status == "ok" and good.image.shape == (1, 1, 3)


def test_executor_choice(bundle, inproc):
    assert inproc.executor.kind == "inproc" and inproc.stats()["executor"] == "inproc"
    with pytest.raises(ConfigError, match="executor"):
        Engine(config(), model_bundle=bundle, executor="threads")
    with pytest.raises(ConfigError, match="multi-process"):
        Engine(config(), model_bundle=bundle, executor="inproc", executor_options=opts(replicate_ranks=2))


@pytest.mark.parametrize("which", ["mp1", "mp2"])
def test_multiprocess_image_equals_inproc(request, inproc, which):
    e = request.getfixturevalue(which)
    ref = inproc.generate(req("a red square", seed=3))
    steps = []
    e.on_step = lambda rid, i, n: steps.append((i, n))
    try:
        out = e.generate(req("a red square", seed=3))
    finally:
        e.on_step = None
    assert out.ok, out.error
    assert np.array_equal(out.image, ref.image) and out.image.dtype == np.uint8
    assert out.stats.blocks == ref.stats.blocks > 0 and out.stats.prefix_tokens_reused == ref.stats.prefix_tokens_reused
    assert steps == [(0, 2), (1, 2)]  # progress relayed from the output rank
    assert pool_full(e) and e.stats()["world_size"] == (2 if which == "mp2" else 1)
    with pytest.raises(AttributeError, match="other processes"):
        e.worker


@pytest.mark.parametrize("which", ["inproc", "mp1"])
def test_queue_fifo_and_cancel_waiting_and_running(request, which):
    e = request.getfixturevalue(which)
    ids = [e.add_request(req(f"a square {i}", steps=20 if i == 0 else 2)) for i in range(5)]
    seen = []

    def on_step(rid, i, n):
        seen.append((rid, e.scheduler.num_running, e.scheduler.num_waiting, e.manager.pool.num_used))
        if rid == ids[0] and i == 0:
            e.abort(rid)  # running: stops at the next step boundary

    assert e.abort(ids[3])  # waiting: cancelled at once
    e.on_step = on_step
    try:
        outs = e.run_until_complete()
    finally:
        e.on_step = None
    by_id = {o.request_id: o for o in outs}
    assert len(outs) == 5 and set(by_id) == set(ids)
    assert by_id[ids[0]].status == "cancelled" and by_id[ids[3]].status == "cancelled"
    assert [o.request_id for o in outs if o.ok] == [ids[1], ids[2], ids[4]]  # FIFO
    assert seen[0][:3] == (ids[0], 1, 3) and seen[0][3] > 0  # one running with its blocks, three queued
    assert pool_full(e) and not e.abort(ids[0])


def test_abort_leaves_the_batch_on_every_rank(mp2):
    """An abort is a drop in the next BatchStep, which every rank applies before that step: both ranks
    clear the request's rows at the same step and keep serving."""
    seen = []

    def abort_at_1(rid, i, n):
        seen.append(i)
        if i == 1:
            mp2.abort(rid)

    mp2.on_step = abort_at_1
    try:
        out = mp2.generate(req("a green cross", steps=30))
    finally:
        mp2.on_step = None
    assert out.status == "cancelled", out.error
    assert seen == [0, 1]  # no step ran after the abort
    assert pool_full(mp2)
    assert mp2.generate(req()).ok  # rows were cleared on both ranks


def test_exception_on_one_rank_fails_only_that_request(mp2):
    a, b, c = (mp2.add_request(req(p, steps=3, request_id=p)) for p in ("first", FAULT[1], "third"))
    outs = {o.request_id: o for o in mp2.run_until_complete()}
    assert outs[a].ok and outs[c].ok
    assert outs[b].status == "error" and "rank 1" in outs[b].error and "injected fault" in outs[b].error
    assert mp2.failed is None and pool_full(mp2)


@pytest.mark.parametrize("which", ["inproc", "mp1", "mp2"])
def test_cancellation_storm(request, which):
    """Many requests; aborts at random from another thread and from the step callback."""
    e = request.getfixturevalue(which)
    rng = random.Random(7)
    ids = [e.add_request(req(f"storm {i}", steps=rng.choice([2, 4]), seed=i)) for i in range(16)]
    stop = threading.Event()

    def storm():
        r = random.Random(11)
        while not stop.is_set():
            e.abort(r.choice(ids))
            time.sleep(r.uniform(0.0, 0.02))

    t = threading.Thread(target=storm)
    e.on_step = lambda rid, i, n: e.abort(rid) if rng.random() < 0.2 else None
    t.start()
    try:
        outs = e.run_until_complete()
    finally:
        stop.set()
        t.join()
        e.on_step = None
    assert sorted(o.request_id for o in outs) == sorted(ids)  # exactly one output each
    assert {o.status for o in outs} <= {"ok", "cancelled"} and any(o.status == "cancelled" for o in outs)
    assert pool_full(e) and not e.scheduler.has_work()
    if which == "inproc":
        assert no_rows_bound(e.worker.rows)
    assert e.generate(req()).ok  # no rows leaked on any rank


@pytest.mark.slow
def test_killed_rank_fails_engine_closed(bundle):
    e = Engine(config(), model_bundle=bundle, executor="mp", executor_options=opts(replicate_ranks=2))
    victim = e.executor.procs[1].pid
    e.on_step = lambda rid, i, n: os.kill(victim, signal.SIGKILL) if i == 0 else None
    ids = [e.add_request(req(f"victim {i}", steps=30)) for i in range(3)]
    t0 = time.monotonic()
    outs = {o.request_id: o for o in e.run_until_complete()}
    assert time.monotonic() - t0 < 15
    assert set(outs) == set(ids) and all(o.status == "error" for o in outs.values())
    assert all("rank 1" in o.error and "SIGKILL" in o.error for o in outs.values()), outs[ids[0]].error
    assert pool_full(e) and e.failed is not None
    assert all(p.exitcode is not None for p in e.executor.procs)  # the survivor was stopped too
    with pytest.raises(DitkvError, match="engine failed"):
        e.add_request(req())
    assert e.shutdown() == []


@pytest.mark.slow
@pytest.mark.parametrize("limit, why", [
    (dict(heartbeat_timeout_s=1.5), "stopped answering: no heartbeat"),
    (dict(heartbeat_timeout_s=60.0, step_timeout_s=1.5), "no step progress"),
], ids=["heartbeat", "step-timeout"])
def test_frozen_rank_fails_engine_closed(bundle, limit, why):
    e = Engine(config(), model_bundle=bundle, executor="mp", executor_options=opts(**limit))
    pid = e.executor.procs[0].pid
    e.on_step = lambda rid, i, n: os.kill(pid, signal.SIGSTOP) if i == 0 else None
    a, b = e.add_request(req(steps=30)), e.add_request(req())
    t0 = time.monotonic()
    outs = {o.request_id: o for o in e.run_until_complete()}
    assert time.monotonic() - t0 < 10
    assert outs[a].status == outs[b].status == "error" and why in outs[a].error, outs[a].error
    assert pool_full(e) and e.executor.procs[0].exitcode is not None  # killed, not left stopped
    e.shutdown()


@pytest.mark.slow
def test_rank_dying_while_idle_is_noticed_at_the_next_step(bundle):
    e = Engine(config(), model_bundle=bundle, executor="mp", executor_options=opts())
    os.kill(e.executor.procs[0].pid, signal.SIGKILL)
    e.executor.procs[0].join(5)
    rid = e.add_request(req())
    (out,) = e.step()
    assert out.request_id == rid and out.status == "error" and "rank 0" in out.error
    assert pool_full(e) and not e.scheduler.has_work()
    e.shutdown()


def test_startup_error_is_reported_not_hung(bundle):
    t0 = time.monotonic()
    with pytest.raises(ExecutorError, match="rank 0 failed to build its worker: BackendError.*triton"):
        Engine(config(attention_backend="triton"), model_bundle=bundle, executor="mp", executor_options=opts())
    assert time.monotonic() - t0 < 60


def _bundle_that_fails_in_ranks():
    """A model factory: fine in the engine process, raises in a spawned rank."""
    import multiprocessing

    if multiprocessing.parent_process() is not None:
        raise RuntimeError("no weights on this host")
    cfg = HunyuanImage3Config.tiny()
    return HunyuanImage3Model.from_config(cfg, seed=1), ByteTokenizer(), PixelCodec(cfg.image_token_downsample)


def test_rank_startup_failure_names_rank_and_cause():
    t0 = time.monotonic()
    with pytest.raises(ExecutorError, match="rank 0 failed to start: RuntimeError: no weights on this host"):
        Engine(config(), model_bundle=_bundle_that_fails_in_ranks, executor="mp", executor_options=opts())
    assert time.monotonic() - t0 < 60


@pytest.mark.slow
@pytest.mark.parametrize("par", [dict(tensor_parallel_size=2), dict(cfg_parallel_size=2)], ids=["tp2", "cfg2"])
def test_model_parallel_through_the_executor(bundle, inproc, par):
    """Two real parallel ranks (gloo on CPU) return the single-rank image."""
    ref = inproc.generate(req("a yellow circle", seed=5))
    e = Engine(config(**par), model_bundle=bundle, executor_options=opts())
    try:
        assert e.executor.kind == "mp" and e.executor.world_size == 2
        out = e.generate(req("a yellow circle", seed=5))
        assert out.ok, out.error
        assert np.abs(out.image.astype(int) - ref.image.astype(int)).max() <= 1
        if "cfg_parallel_size" in par:
            with pytest.raises(LayoutError, match="cfg_parallel_size=2"):
                e.add_request(req(g=1.0))
        assert pool_full(e)
    finally:
        e.shutdown()


def test_a_bundle_the_ranks_cannot_receive_is_a_clear_error(bundle):
    """spawn pickles the bundle: a local lambda is refused with the fix, and nothing is left running
    (the unstarted rank processes were once killed by the cleanup, an AttributeError)."""
    local = lambda: bundle  # noqa: E731 - the point: a local function does not pickle
    with pytest.raises(ConfigError, match="module-level function"):
        Engine(config(), model_bundle=local, executor="mp", executor_options=opts())
