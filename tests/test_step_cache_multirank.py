"""Step caching across the ranks of one replica (two spawned CPU ranks, gloo): under CFG parallel each
rank holds one row and the per-row sums of the decision are all-reduced, under Ulysses every part of
the pass gathers the whole hidden, so every rank takes the same branch and the request caches the
steps one rank holding everything caches. The prefix cache under CFG parallel: each row hits only pages
its own rank wrote (DiT keys name the rank), AR heads hit on every rank, cache on == off."""

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


LONG = "a red square with a thin black border, centred on a white ground"  # pages past the system text


def sequential(eng, reqs):
    """`reqs` one after another: each is admitted after the previous one ended (its pages cached)."""
    outs = []
    for r in reqs:
        eng.add_request(r)
        outs += eng.run_until_complete()
    return outs


def mp_engine(bundle, **kw):
    opts = hooked_options(heartbeat_interval_s=0.1, heartbeat_timeout_s=20.0, startup_timeout_s=120.0,
                          drain_timeout_s=20.0)
    return Engine(config(cfg_parallel_size=2, num_kv_blocks=128, **kw), model_bundle=bundle, executor="mp",
                  executor_options=opts)


def mp_run(bundle, reqs, **kw):
    eng = mp_engine(bundle, **kw)
    try:
        return sequential(eng, reqs)
    finally:
        eng.shutdown()


def expected_hits(eng, reqs) -> list[list[int]]:
    """Per request, per row: the pages its keys share with the same row of an earlier request (both rows
    commit their whole prefix; with share_rows off a row takes nothing from row 0)."""
    keys = [eng.prefix_keys(eng.processor.process(r)[1], r.seed) for r in reqs]

    def lead(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n
    return [[max((lead(k[r], e[r]) for e in keys[:i]), default=0) for r in range(2)] for i, k in enumerate(keys)]


@pytest.mark.slow
def test_cfg_parallel_prefix_cache_hits_on_each_rank_and_equals_one_rank():
    """Under CFG parallel row r's pages are in rank r's pool only, and its keys name rank r
    (engine/prefix_ranks.py). Behind a system text the uncond row's untagged keys equal the cond row's,
    so without the rank a later uncond row would read the cond row's pages on a rank that never wrote
    them (wrong images: session 17). With it both rows hit their own rank's pages and the images equal
    the cache off under CFG parallel bit for bit (and one rank within one level: the CFG split itself
    may round one pixel once, the cache on or off)."""
    reqs = [GenerationRequest(prompt=p, request_id=f"s{i}", seed=i, height=32, width=32, steps=3,
                              guidance_scale=3.0) for i, p in enumerate([LONG, "blue", LONG])]
    one = Engine(config(num_kv_blocks=128, enable_prefix_caching=False), model_bundle=system_bundle())
    try:
        want = sequential(one, reqs)
    finally:
        one.shutdown()
    assert config(cfg_parallel_size=2).prefix_caching  # unset: on under CFG parallel too
    assert config(cfg_parallel_size=2, enable_prefix_caching=True).prefix_caching
    off = mp_run(system_bundle, reqs, enable_prefix_caching=False)
    eng = mp_engine(system_bundle)
    try:
        got = sequential(eng, reqs)
        hits = expected_hits(eng, reqs)
        assert eng.manager.pool.num_free == eng.manager.pool.num_blocks  # free + evictable = initial
    finally:
        eng.shutdown()
    assert hits[0] == [0, 0] and all(h > 0 for h in hits[1] + hits[2]) and hits[2][0] > hits[1][0]
    for a, c, b, h in zip(want, off, got, hits):
        assert a.ok and c.ok and b.ok, (a.error, c.error, b.error)
        assert b.stats.prefix_cache_hit_tokens == 16 * sum(h), (b.request_id, h)  # both rows, each on its rank
        assert b.stats.prefix_shared_rows_tokens == 0  # row 0's pages are on the other rank
        assert np.array_equal(b.image, c.image)  # cache on == off under CFG parallel, bit for bit
        assert np.abs(b.image.astype(int) - a.image.astype(int)).max() <= 1  # a split may round once


SYSTEM = "you are a careful painter who draws exactly what is asked, in flat colours, with thick lines. "


@pytest.mark.slow
def test_cfg_parallel_ar_rows_hit_untagged_pages_and_equal_one_rank():
    """AR rows run on every rank, so their text heads' pages are in every pool and keep untagged keys: a
    later AR row hits them on both ranks. The DiT rows' tagged keys never meet them; row 0 adopts the AR
    row's pages at the handover. Texts and images equal the cache off bit for bit (one rank: texts equal,
    images within one level)."""
    reqs = [GenerationRequest(prompt=SYSTEM + t, request_id=f"a{i}", seed=3 + i, height=32, width=32, steps=2,
                              guidance_scale=2.0, max_new_tokens=4, ignore_eos=True, temperature=1.0, top_k=0,
                              top_p=1.0)
            for i, t in enumerate(["a small red", "a big blue", "a small red"])]
    kw = dict(num_kv_blocks=128, max_image_height=32, max_image_width=32, max_prompt_tokens=300)
    one = Engine(config(enable_prefix_caching=False, **kw), model_bundle=tiny_bundle())
    try:
        want = sequential(one, reqs)
    finally:
        one.shutdown()
    kw.pop("num_kv_blocks")
    off = mp_run(tiny_bundle, reqs, enable_prefix_caching=False, **kw)
    eng = mp_engine(tiny_bundle, **kw)
    try:
        got = sequential(eng, reqs)
        assert eng.manager.pool.num_free == eng.manager.pool.num_blocks
    finally:
        eng.shutdown()
    for a, c, b in zip(want, off, got):
        assert a.ok and c.ok and b.ok, (a.error, c.error, b.error)
        assert a.stats.ar_generated_tokens == b.stats.ar_generated_tokens == c.stats.ar_generated_tokens == 4
        assert a.revised_prompt == b.revised_prompt == c.revised_prompt
        assert np.array_equal(b.image, c.image)  # cache on == off under CFG parallel, bit for bit
        assert np.abs(b.image.astype(int) - a.image.astype(int)).max() <= 1  # a split may round once
    assert got[0].stats.prefix_cache_hit_tokens == 0
    assert got[1].stats.prefix_cache_hit_tokens >= 80  # the shared text's AR pages (and the uncond row's)
    assert got[2].stats.prefix_cache_hit_tokens > got[1].stats.prefix_cache_hit_tokens
