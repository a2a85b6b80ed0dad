"""Step caching across the ranks of one replica (two spawned CPU ranks, gloo): under CFG parallel each
rank holds one row and the per-row sums of the decision are all-reduced, under Ulysses every part of
the pass gathers the whole hidden, so every rank takes the same branch and the request caches the
steps one rank holding everything caches."""

from __future__ import annotations

import numpy as np
import pytest
from rank_hooks import hooked_options

from ditkv.config import EngineConfig
from ditkv.engine.engine import Engine
from ditkv.engine.types import GenerationRequest
from ditkv.models.hunyuan import HunyuanImage3Config, HunyuanImage3Model, PixelCodec
from ditkv.models.hunyuan.tokenizer import ByteTokenizer

CACHES = [
    {"type": "fbcache", "residual_threshold": 0.06, "warmup_steps": 1, "taylorseer": 1},  # the metric decides
    {"type": "dbcache", "Fn": 2, "Bn": 1, "residual_threshold": float("inf"), "warmup_steps": 1,
     "steps_mask": [3]},
]


def tiny_bundle():
    cfg = HunyuanImage3Config.tiny()
    model = HunyuanImage3Model.from_config(cfg, seed=1, zero_init_resblocks=False).eval()
    return model, ByteTokenizer(), PixelCodec(cfg.image_token_downsample)


def config(**kw) -> EngineConfig:
    base = dict(device="cpu", dtype="float32", block_size=16, num_kv_blocks=96, attention_backend="torch",
                max_num_seqs=2)
    return EngineConfig(**{**base, **kw})


def req(i: int) -> GenerationRequest:
    return GenerationRequest(prompt=["a large blue square", "a green triangle"][i], request_id=f"r{i}", seed=i,
                             height=32, width=32, steps=6, guidance_scale=3.0, cache_config=CACHES[i])


def run(eng):
    ids = [eng.add_request(req(i)) for i in range(2)]
    outs = {o.request_id: o for o in eng.run_until_complete()}
    return [outs[i] for i in ids]


@pytest.fixture(scope="module")
def one_rank():
    return run(Engine(config(), model_bundle=tiny_bundle()))


@pytest.mark.slow
@pytest.mark.parametrize("par", [dict(cfg_parallel_size=2), dict(ulysses_degree=2)], ids=["cfg2", "ulysses2"])
def test_ranks_decide_together(one_rank, par):
    opts = hooked_options(heartbeat_interval_s=0.1, heartbeat_timeout_s=20.0, startup_timeout_s=120.0,
                          drain_timeout_s=20.0)
    eng = Engine(config(**par), model_bundle=tiny_bundle, executor="mp", executor_options=opts)
    try:
        outs = run(eng)
        for out, ref in zip(outs, one_rank):
            assert out.ok, out.error
            assert (out.stats.cached_steps, out.stats.computed_steps) == \
                (ref.stats.cached_steps, ref.stats.computed_steps), (par, out.request_id)
            assert np.abs(out.image.astype(int) - ref.image.astype(int)).max() <= 1  # a split sums in another order
        assert outs[1].stats.cached_steps == 4 and 0 < outs[0].stats.cached_steps < 5
        assert eng.manager.pool.num_free == eng.manager.pool.num_blocks
    finally:
        eng.shutdown()


def system_bundle():
    """The tiny model behind a shared system text: the cond and uncond rows begin with the same pages."""
    from ditkv.bench.prefix import _system_text, _with_system

    model, tok, codec = tiny_bundle()
    model.config = _with_system(_system_text(96))(model.config)
    return model, tok, codec


@pytest.mark.slow
def test_cfg_parallel_runs_without_the_prefix_cache_and_equals_one_rank():
    """Under CFG parallel row r's pages are in rank r's pool only, so a cached cond-row page must never
    serve an uncond row: the prefix cache is off there unless asked (and asking is refused)."""
    def sequential(eng):
        outs = []
        for i in range(2):
            eng.add_request(GenerationRequest(prompt=["red", "blue"][i], request_id=f"s{i}", seed=i, height=32,
                                              width=32, steps=3, guidance_scale=3.0))
            outs += eng.run_until_complete()
        return outs

    one = Engine(config(num_kv_blocks=128), model_bundle=system_bundle())
    try:
        want = sequential(one)
        assert want[1].stats.prefix_cache_hit_tokens > 0  # one rank: the second request hits
    finally:
        one.shutdown()
    assert not config(cfg_parallel_size=2).prefix_caching
    with pytest.raises(Exception, match="enable_prefix_caching"):
        config(cfg_parallel_size=2, enable_prefix_caching=True)
    opts = hooked_options(heartbeat_interval_s=0.1, heartbeat_timeout_s=20.0, startup_timeout_s=120.0,
                          drain_timeout_s=20.0)
    eng = Engine(config(cfg_parallel_size=2, num_kv_blocks=128), model_bundle=system_bundle, executor="mp",
                 executor_options=opts)
    try:
        got = sequential(eng)
    finally:
        eng.shutdown()
    for a, b in zip(want, got):
        assert a.ok and b.ok, (a.error, b.error)
        assert b.stats.prefix_cache_hit_tokens == 0 and np.array_equal(a.image, b.image)
