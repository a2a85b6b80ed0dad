"""Step-level continuous batching (issue 15 item 3): requests join and leave the running batch
between denoising steps; a request's image is bit-identical alone or in any batch on CPU fp32
(the CPU expert GEMMs run in fixed tiles, models/hunyuan/layers.py); a cancel or an error ends
only its own request and frees its blocks."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ditkv.config import EngineConfig
from ditkv.engine.engine import Engine
from ditkv.engine.types import GenerationRequest
from ditkv.errors import AdmissionError, ConfigError
from ditkv.models.loader import load_model

import torch

PROMPTS = ["a large blue square", "a small red circle in the top left", "a green triangle", "a yellow circle"]
BASE = dict(diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2, num_kv_blocks=64,
            device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def bundle():
    return load_model("tiny", torch.device("cpu"), torch.float32)


def _req(i, steps=3):
    return GenerationRequest(prompt=PROMPTS[i % len(PROMPTS)], request_id=f"r{i}", seed=i, height=32, width=32,
                             steps=steps)


@pytest.fixture(scope="module")
def solo(bundle):
    eng = Engine(EngineConfig(**BASE), model_bundle=bundle)
    return {i: eng.generate(_req(i)).image for i in range(6)}


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arrivals=st.lists(st.integers(0, 4), min_size=2, max_size=6), seqs=st.integers(2, 4),
       cancel=st.one_of(st.none(), st.tuples(st.integers(0, 5), st.integers(0, 3))))
def test_images_are_bit_identical_alone_or_in_any_batch(bundle, solo, arrivals, seqs, cancel):
    """Hypothesis draws when each request arrives (engine step), max_num_seqs and one cancel."""
    eng = Engine(EngineConfig(**BASE, max_num_seqs=seqs), model_bundle=bundle)
    pending = dict(enumerate(arrivals))
    outs, tick = {}, 0
    while pending or eng.scheduler.has_work():
        for i in [i for i, t in pending.items() if t <= tick]:
            eng.add_request(_req(i))
            del pending[i]
        if cancel is not None and cancel[1] == tick and cancel[0] < len(arrivals):
            eng.abort(f"r{cancel[0]}")
        outs.update({o.request_id: o for o in eng.step()})
        assert eng.scheduler.num_running <= seqs
        tick += 1
    outs.update({o.request_id: o for o in eng.step()})
    assert len(outs) == len(arrivals)
    for i in range(len(arrivals)):
        o = outs[f"r{i}"]
        if o.status == "ok":
            assert np.array_equal(o.image, solo[i]), f"request {i} differs from its solo image"
        else:
            assert cancel is not None and cancel[0] == i and o.status == "cancelled"
    assert eng.manager.pool.num_free == eng.manager.pool.num_blocks  # nothing leaked
    assert max(eng.batch_sizes) <= seqs


def test_requests_run_together_and_a_long_one_does_not_starve_short_ones(bundle):
    eng = Engine(EngineConfig(**BASE, max_num_seqs=4), model_bundle=bundle)
    eng.add_request(_req(0, steps=12))
    order = []
    for tick in range(40):
        if tick == 1:
            eng.add_request(_req(1, steps=2))
            eng.add_request(_req(2, steps=2))
        order += [o.request_id for o in eng.step()]
        if not eng.scheduler.has_work():
            break
    assert order == ["r1", "r2", "r0"] or order == ["r2", "r1", "r0"]
    assert max(eng.batch_sizes) == 3
    assert eng.stats()["batch_sizes"] == eng.batch_sizes


def test_an_error_ends_only_its_request(bundle, solo, monkeypatch):
    eng = Engine(EngineConfig(**BASE, max_num_seqs=3), model_bundle=bundle)
    real = eng.worker.check_rows

    def bad(rid, layout):
        if rid == "r1":
            raise ValueError("injected bad input")
        return real(rid, layout)

    monkeypatch.setattr(eng.worker, "check_rows", bad)
    for i in range(3):
        eng.add_request(_req(i))
    outs = {o.request_id: o for o in eng.run_until_complete()}
    assert outs["r1"].status == "error" and "injected" in outs["r1"].error
    for i in (0, 2):
        assert outs[f"r{i}"].status == "ok" and np.array_equal(outs[f"r{i}"].image, solo[i])
    assert eng.manager.pool.num_free == eng.manager.pool.num_blocks


def test_a_failed_shared_step_ends_that_batch_and_the_engine_keeps_serving(bundle, solo, monkeypatch):
    eng = Engine(EngineConfig(**BASE, max_num_seqs=2), model_bundle=bundle)
    runner = eng.worker.runner
    real, calls = runner.forward_batch, []

    def flaky(items):
        calls.append(len(items))
        if len(calls) == 2:
            raise RuntimeError("injected out of memory")
        return real(items)

    monkeypatch.setattr(runner, "forward_batch", flaky)
    eng.add_request(_req(0))
    eng.add_request(_req(1))
    outs = {o.request_id: o for o in eng.run_until_complete()}
    assert {o.status for o in outs.values()} == {"error"}
    assert eng.manager.pool.num_free == eng.manager.pool.num_blocks
    out = eng.generate(_req(2))
    assert out.status == "ok" and np.array_equal(out.image, solo[2])


def test_batched_tokens_bound_every_step_and_startup(bundle, monkeypatch):
    from ditkv.engine.profiling import max_request_tokens

    cfg = EngineConfig(**BASE, max_num_seqs=4, max_image_height=32, max_image_width=32, max_prompt_tokens=64)
    probe = Engine(cfg, model_bundle=bundle)
    need = max_request_tokens(probe.executor.model_config, probe.executor.tokenizer, probe.envelope)
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        Engine(cfg.replace(max_num_batched_tokens=need - 1), model_bundle=bundle)
    bound = need + 150  # room for running denoise rows beside one new prefill, not for two prefills
    eng = Engine(cfg.replace(max_num_batched_tokens=bound), model_bundle=bundle)
    seen = []
    real = eng.worker.runner.forward_batch

    def spy(items):
        v, tokens = real(items)
        seen.append(sum(tokens))
        return v, tokens

    monkeypatch.setattr(eng.worker.runner, "forward_batch", spy)
    for i in range(4):
        eng.add_request(_req(i))
    outs = eng.run_until_complete()
    assert [o.status for o in outs] == ["ok"] * 4
    assert seen and max(seen) <= bound
    assert max(eng.batch_sizes) >= 2  # denoise rows of one request ride along with another's prefill


def test_scheduler_refuses_a_request_above_the_token_bound_at_once():
    from ditkv.core.kv_manager import DiffusionKVCacheManager
    from ditkv.core.layout import RowLayout
    from ditkv.core.scheduler import Scheduler

    s = Scheduler(DiffusionKVCacheManager(64, 16, 2), max_running=4, max_batched_tokens=100)
    with pytest.raises(AdmissionError, match="max_num_batched_tokens"):
        s.add_request("big", [RowLayout(0, 30, 30, 61, ()), RowLayout(1, 30, 30, 61, ())])
    s.add_request("a", [RowLayout(0, 20, 30, 51, ())])
    s.add_request("b", [RowLayout(0, 20, 30, 51, ())])
    assert [r.request_id for r in s.schedule().admitted] == ["a"]  # 51 + 51 > 100
    assert [r.request_id for r in s.schedule().admitted] == ["b"]  # a's denoise 30 + b's prefill 51
