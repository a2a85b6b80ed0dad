"""Issue 34 items 1-2: AR phases in the single engine's step loop (one weight copy, one pool).

A request with AR text runs its AR phase (head prefill, text, tail) as steps of the engine, batched
with other requests' AR work and denoise steps, then its DiT phase over the same pool, row 0
adopting the AR row's agreeing pages. On CPU fp32 the text and image of a request are the same:
alone or batched, preempted or not, and as a stage graph (separate AR stage, KV transfer) draws them.
"""

import numpy as np
import pytest

from stage_helpers import tiny_bundle
from ditkv.config import EngineConfig
from ditkv.engine.engine import Engine
from ditkv.engine.types import GenerationRequest
from ditkv.errors import AdmissionError, DitkvError, LayoutError
from ditkv.stages.graph import load_stage_graph
from ditkv.stages.orchestrator import Orchestrator

TIGHT = 332  # max_num_batched_tokens: the largest DiT prefill of these engines (32x32, 96 prompt tokens)
PROMPTS = ["a large red circle", "blue", "a small green square on grey"]


def req(i=0, max_new=6, **kw):
    kw = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, **kw}
    return GenerationRequest(prompt=PROMPTS[i % len(PROMPTS)], height=32, width=32, steps=2, guidance_scale=2.0,
                             seed=10 + i, max_new_tokens=max_new, **kw)


@pytest.fixture(scope="module")
def bundle():
    return tiny_bundle()


def engine(bundle, **kw):
    cfg = {"device": "cpu", "block_size": 16, "num_kv_blocks": 256, "max_num_seqs": 4, "max_image_height": 32,
           "max_image_width": 32, "max_prompt_tokens": 96, **kw}
    return Engine(EngineConfig(**cfg), model_bundle=bundle)


def run(eng, reqs):
    ids = [eng.add_request(r) for r in reqs]
    outs = {o.request_id: o for o in eng.run_until_complete()}
    return [outs[i] for i in ids]


def pool_full(eng):
    m = eng.manager
    return m.pool.num_free == m.pool.num_blocks and m.num_requests == 0 and m.num_ar_rows == 0


def same(a, b, stats=True):
    assert a.status == b.status == "ok", (a.error, b.error)
    assert a.revised_prompt == b.revised_prompt
    if stats:  # a stage graph's outputs carry no AR stats
        assert a.stats.ar_generated_tokens == b.stats.ar_generated_tokens
    assert np.array_equal(a.image, b.image)


@pytest.fixture(scope="module")
def solo(bundle):
    """Each request alone in a fresh engine: the reference."""
    outs = []
    for i in range(3):
        eng = engine(bundle)
        try:
            outs.append(run(eng, [req(i)])[0])
        finally:
            eng.shutdown()
    return outs


def test_a_request_writes_text_then_draws_its_image_over_one_pool(bundle, solo):
    out = solo[0]
    assert out.ok and out.stats.ar_generated_tokens > 0 and out.revised_prompt.startswith(PROMPTS[0])
    s = out.stats
    # time to first token counts from arrival (queueing included), the AR phase from its admission
    assert s.ar_prompt_tokens > 0 and s.ar_seconds > 0
    assert 0 < s.ar_time_to_first_token_s <= s.queue_time_s + s.ar_seconds
    assert s.imported_tokens > 0  # row 0 adopted the AR row's pages: the DiT did not recompute them


def test_batched_equals_solo_text_and_image(bundle, solo):
    """Three requests with different prompts and text lengths, batched (AR chunks, decode tokens and
    denoise steps in shared steps), give each its solo text and image, bit for bit."""
    eng = engine(bundle, max_num_batched_tokens=TIGHT)
    try:
        outs = run(eng, [req(0), req(1), req(2)])
        assert pool_full(eng)
        assert max(eng.batch_sizes) > 1 or eng.stats()["ar_running"] == 0
    finally:
        eng.shutdown()
    for a, b in zip(outs, solo):
        same(a, b)


def test_chunked_prefill_under_a_small_token_budget_is_the_same(bundle, solo):
    """A head longer than the step's token budget is prefilled in chunks: same text and image. (The
    engine refuses a max_num_batched_tokens below its largest DiT prefill, so the budget is lowered
    on the scheduler for the AR phase only.)"""
    eng = engine(bundle)
    fed: list = []
    queue = eng.executor.queue_ar

    def record(works):
        fed.extend((w.start, len(w.token_ids)) for w in works)
        queue(works)
    eng.executor.queue_ar = record
    try:
        rid = eng.add_request(req(2))
        eng.scheduler.max_batched_tokens = 7
        while eng.scheduler.get(rid).handover is None:
            eng.step()
        eng.scheduler.max_batched_tokens = None
        outs = {o.request_id: o for o in eng.run_until_complete()}
    finally:
        eng.shutdown()
    head = outs[rid].stats.ar_prompt_tokens
    chunks = [n for start, n in fed if start < head]
    assert len(chunks) > 2 and sum(chunks) == head and max(n for _, n in fed) <= 7, fed
    same(outs[rid], solo[2])


def test_the_stage_graph_draws_the_same_text_and_image(bundle, solo):
    """The single engine's AR phase against a stage graph's AR stage (its own weights, serial runner,
    transfer): the same text and the same image, bit for bit (CPU fp32)."""
    t = {"kv_connector": "shm", "kv_role": "kv_producer", "engine_id": "ar"}
    graph = load_stage_graph({"stages": [
        {"stage_id": 0, "kind": "ar", "max_new_tokens": 6,
         "engine": {"model": "tiny", "device": "cpu", "block_size": 16, "num_kv_blocks": 64},
         "kv_transfer_config": t},
        {"stage_id": 1, "kind": "dit", "inputs": [0],
         "engine": {"model": "tiny", "device": "cpu", "block_size": 16, "num_kv_blocks": 256},
         "kv_transfer_config": {**t, "kv_role": "kv_consumer", "engine_id": "dit"}}]})
    orch = Orchestrator(graph, bundle)
    try:
        outs = [orch.generate(req(i)) for i in range(3)]
    finally:
        orch.shutdown()
    for a, b in zip(outs, solo):
        same(a, b, stats=False)


@pytest.mark.parametrize("n, max_new, pool, why", [(4, 40, 23, "handover"), (8, 60, 30, "ar_row")])
def test_a_full_pool_preempts_the_youngest_ar_request_and_recomputes_it(bundle, n, max_new, pool, why):
    """A pool too small for every request's pages at once (the smallest that admits one request):
    the youngest AR requests give their pages back, at a handover or while a row grows in decode,
    and are recomputed from their prompt. Every request still gets the text and image it gets with
    a large pool, and the pool is full afterwards."""
    reqs = [req(i, max_new=max_new, request_id=f"r{i}") for i in range(n)]
    # the pool sizes are tuned to pages without sharing (tests/test_prefix_cache_ar.py preempts with the cache on)
    eng = engine(bundle, num_kv_blocks=pool, max_num_seqs=n, enable_prefix_caching=False)
    try:
        outs = run(eng, reqs)
        assert eng.scheduler.preempted_for.get(why, 0) > 0, eng.scheduler.preempted_for
        assert eng.stats()["ar_preempted"] == eng.scheduler.num_preempted  # /metrics ditkv_ar_preemptions_total
        assert pool_full(eng)
    finally:
        eng.shutdown()
    ref = engine(bundle, max_num_seqs=n)
    try:
        want = run(ref, reqs)
        assert ref.scheduler.num_preempted == 0
    finally:
        ref.shutdown()
    for a, b in zip(outs, want):
        same(a, b)
    assert sum(o.stats.ar_preemptions for o in outs) == eng.scheduler.num_preempted


@pytest.mark.parametrize("when", ["queued", "prefill", "decode", "handover"])
def test_abort_in_every_ar_state_returns_every_page(bundle, when):
    eng = engine(bundle, max_num_batched_tokens=TIGHT)
    try:
        victim = eng.add_request(req(0, max_new=30, request_id="victim"))
        other = eng.add_request(req(1, max_new=4, request_id="other"))
        steps = {"queued": 0, "prefill": 1, "decode": 3, "handover": None}[when]
        outs = {}
        for _ in range(200 if steps is None else steps):
            r = eng.scheduler.get(victim)
            if steps is None and r.handover is not None:  # its text ended: it waits for its DiT pages
                break
            outs |= {o.request_id: o for o in eng.step()}
        state = eng.scheduler.get(victim)
        assert state.status.value == ("waiting" if when == "queued" else "ar"), state.status
        assert eng.abort(victim)
        outs |= {o.request_id: o for o in eng.run_until_complete()}
        assert outs[victim].status == "cancelled"
        assert outs[other].ok
        assert pool_full(eng)
        # the rank forgets the victim's AR row with the next step (before any start reuses its pages)
        assert set(eng.executor.stepper.ar.rows) <= set(eng.executor._queue.ar_ends)
    finally:
        eng.shutdown()


def test_bad_ar_requests_get_clear_errors_and_hold_nothing(bundle):
    eng = engine(bundle, num_kv_blocks=20)
    try:
        with pytest.raises(AdmissionError, match="max_new_tokens") as e:
            eng.add_request(req(0, max_new=4000))
        assert e.value.field == "max_new_tokens"
        with pytest.raises(DitkvError, match="top_p"):
            eng.add_request(req(0, top_p=1.5))
        assert eng.scheduler.num_waiting == 0 and pool_full(eng)
    finally:
        eng.shutdown()
    dense = engine(bundle, diffusion_kv_mode="dense_legacy", max_num_seqs=1)
    try:
        with pytest.raises(LayoutError, match="paged_scheduler") as e:
            dense.add_request(req(0))
        assert e.value.field == "max_new_tokens"
    finally:
        dense.shutdown()


def test_no_text_means_no_ar_phase(bundle):
    """max_new_tokens 0 or unset on a bot_task image checkpoint: a plain text-to-image request."""
    eng = engine(bundle)
    try:
        plain = dict(temperature=None, top_k=None, top_p=None)
        a, b = run(eng, [req(0, max_new=0, **plain), req(0, max_new=None, **plain)])
    finally:
        eng.shutdown()
    assert a.ok and b.ok and a.stats.ar_prompt_tokens == 0 and a.revised_prompt is None
    assert np.array_equal(a.image, b.image)


@pytest.mark.slow
@pytest.mark.parametrize("par", [dict(), dict(tensor_parallel_size=2)], ids=["replicated", "tp2"])
def test_ar_phases_run_on_every_rank_of_a_multiprocess_engine(par):
    """Two rank processes (gloo): every rank runs the AR pass with the step and draws the same
    tokens; the text equals the in-process engine's, the image too (replicated: bit for bit; a TP
    split changes the summation order: within one level)."""
    from rank_hooks import hooked_options

    from stage_helpers import tiny_bundle as factory

    reqs = [req(i, temperature=0.0, request_id=f"r{i}") for i in range(2)]
    ref = engine(factory())
    try:
        want = run(ref, reqs)
    finally:
        ref.shutdown()
    o = hooked_options(heartbeat_interval_s=0.1, heartbeat_timeout_s=10.0, startup_timeout_s=120.0,
                       drain_timeout_s=20.0, **({} if par else {"replicate_ranks": 2}))
    eng = Engine(EngineConfig(device="cpu", block_size=16, num_kv_blocks=256, max_num_seqs=4, max_image_height=32,
                              max_image_width=32, max_prompt_tokens=96, **par),
                 model_bundle=factory, executor="mp", executor_options=o)
    try:
        assert eng.executor.world_size == 2
        outs = run(eng, reqs)
        assert pool_full(eng)
    finally:
        eng.shutdown()
    for a, b in zip(outs, want):
        assert a.ok, a.error
        assert a.revised_prompt == b.revised_prompt and a.stats.ar_generated_tokens > 0
        assert np.abs(a.image.astype(int) - b.image.astype(int)).max() <= (1 if par else 0)
