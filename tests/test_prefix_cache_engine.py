"""The prefix cache through the engine on CPU fp32 (docs/prefix-cache.md): images with the cache on
equal the cache off bit for bit (requests one after another, several at once, CFG rows and one-row
requests, an edit whose hit covers its input image), a hit really skips prefill work and the image
encoders, the worker refuses a page in two rows unless shared and read-only, and the pool returns to
free + evictable == initial."""

import msgspec
import numpy as np
import pytest
import torch

from ditkv.config import EngineConfig
from ditkv.core.metadata import DiffusionKVMetadata, RowMetadata
from ditkv.engine.engine import Engine
from ditkv.engine.types import GenerationRequest
from ditkv.errors import ConfigError, MetadataError
from ditkv.models.loader import load_model
from ditkv.worker.rows import WorkerRows

BASE = dict(device="cpu", dtype="float32", block_size=16, num_kv_blocks=256, diffusion_kv_max_rows_per_request=2,
            max_prompt_tokens=200)
LONG = ("a large blue square on a plain grey background, drawn with thick straight lines, centred in the frame, "
        "flat colours, no shadows, in the style of a children's book")


@pytest.fixture(scope="module")
def bundle():
    return load_model("tiny", torch.device("cpu"), torch.float32)


def reqs():
    return [GenerationRequest(prompt=LONG, request_id="a", seed=0, height=32, width=32, steps=3, guidance_scale=2.0),
            GenerationRequest(prompt=LONG, request_id="b", seed=1, height=32, width=32, steps=3, guidance_scale=2.0),
            GenerationRequest(prompt=LONG, request_id="c", seed=0, height=32, width=32, steps=3, guidance_scale=2.0),
            GenerationRequest(prompt=LONG + " again", request_id="d", seed=2, height=32, width=32, steps=2,
                              guidance_scale=1.0)]


def run(bundle, cache: bool, together: bool, seqs: int = 1):
    eng = Engine(EngineConfig(**BASE, enable_prefix_caching=cache, max_num_seqs=seqs), model_bundle=bundle)
    try:
        if together:  # a and b start together; c and d join after their first step, while they run
            todo = reqs()
            for r in todo[:2]:
                eng.add_request(r)
            outs = {o.request_id: o for o in eng.step()}
            for r in todo[2:]:
                eng.add_request(r)
            outs.update({o.request_id: o for o in eng.run_until_complete()})
        else:
            outs = {r.request_id: eng.generate(r) for r in reqs()}
        pool = eng.manager.pool
        assert pool.num_free == pool.num_blocks and pool.num_used == 0  # free + evictable == initial
        assert int(pool.ref_count.sum()) == 0
        return outs, pool.num_evictable, eng.stats()
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def off(bundle):
    return run(bundle, False, together=False)


def test_config_setting():
    assert EngineConfig().prefix_caching and not EngineConfig(enable_prefix_caching=False).prefix_caching
    assert not EngineConfig(diffusion_kv_mode="dense_legacy").prefix_caching
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        EngineConfig(diffusion_kv_mode="dense_legacy", enable_prefix_caching=True)


def test_one_after_another_equals_the_cache_off_and_skips_the_hit(bundle, off):
    outs, evictable, stats = run(bundle, True, together=False)
    ref, ref_evictable, _ = off
    assert ref_evictable == 0 and evictable > 0
    for rid, o in outs.items():
        assert o.ok and ref[rid].ok
        assert np.array_equal(o.image, ref[rid].image), rid  # bit for bit, CPU fp32
        s, r = o.stats, ref[rid].stats
        assert r.prefix_cache_hit_tokens == 0 and s.imported_tokens == 0
        assert s.tokens_computed == r.tokens_computed - s.prefix_cache_hit_tokens  # the hit was not computed
        assert s.prefix_tokens_reused == r.prefix_tokens_reused
    hits = {rid: o.stats.prefix_cache_hit_tokens for rid, o in outs.items()}
    assert hits["a"] == 0 and hits["b"] > 0 and hits["c"] == hits["b"]  # the text pages do not depend on the seed
    assert hits["d"] > 0  # one row (no CFG) of a longer prompt: its cond row's pages are cached
    assert stats["prefix_cache_hit_tokens"] == sum(hits.values()) and 0 < stats["prefix_cache_hit_ratio"] < 1


def test_several_at_once_equal_the_cache_off(bundle, off):
    outs, _, stats = run(bundle, True, together=True, seqs=4)
    ref = off[0]
    assert len(outs) == 4 and max(stats["batch_sizes"]) == 4  # c and d shared pages a and b still held
    for rid, o in outs.items():
        assert o.ok and np.array_equal(o.image, ref[rid].image), rid
    # a and b start together (nothing is cached before a's first step), c and d after: they hit
    assert outs["a"].stats.prefix_cache_hit_tokens == outs["b"].stats.prefix_cache_hit_tokens == 0
    assert outs["c"].stats.prefix_cache_hit_tokens > 0 and outs["d"].stats.prefix_cache_hit_tokens > 0


def test_an_edit_hit_covers_the_image_and_skips_its_encoding():
    from test_stage_images import image

    def edit(rid, prompt, steps=2):
        return GenerationRequest(prompt=prompt, request_id=rid, height=32, width=32, steps=steps, guidance_scale=2.0,
                                 seed=5, images=[image(3)])

    todo = [("e1", "make it blue", 2), ("e2", "make it blue", 2), ("e3", "make it blue", 3), ("e4", "make it red", 2)]
    outs, encodes = {}, {}
    for cache in (False, True):
        eng = Engine(EngineConfig(model="tiny-edit", device="cpu", block_size=16, num_kv_blocks=256,
                                  diffusion_kv_max_rows_per_request=2, enable_prefix_caching=cache))
        runner, calls = eng.worker.runner, []
        encode = runner.condition
        runner.condition = lambda *a, **k: (calls.append(1), encode(*a, **k))[1]
        try:
            outs[cache] = [eng.generate(edit(*t)) for t in todo]
            encodes[cache] = len(calls)
        finally:
            eng.shutdown()
    for a, b in zip(outs[True], outs[False]):
        assert a.ok and b.ok and np.array_equal(a.image, b.image), a.request_id
    hits = [o.stats.prefix_cache_hit_tokens for o in outs[True]]
    assert hits[0] == 0 and hits[1] == hits[2] > hits[3] > 0
    # e2 and e3 hit past the image: not encoded again. e4's prompt differs inside the page that holds the
    # image block's end: its hit ends inside the block, whose rest is computed, so the image is encoded
    assert encodes[False] == 4 and encodes[True] == 2


def _meta(rid, rows):
    return DiffusionKVMetadata(rid, 1, 16, tuple(RowMetadata(i, 40, 10, 50, (), ids, cached, cached)
                                                 for i, (ids, cached) in enumerate(rows)))


def test_worker_refuses_a_page_in_two_rows_unless_shared_and_read_only():
    w = WorkerRows(20, 16, max_rows=6)
    w.install(_meta("a", [((0, 1, 2, 3), 0)]))
    with pytest.raises(MetadataError, match="already in use"):  # a private page of another request
        w.install(_meta("b", [((0, 5, 6, 7), 0)]))
    with pytest.raises(MetadataError, match="already in use"):  # two rows of one request
        w.install(_meta("b", [((5, 6, 7, 8), 0), ((5, 9, 10, 11), 0)]))
    with pytest.raises(MetadataError, match="still written"):  # shared, but a's first step has not run
        w.install(_meta("b", [((0, 5, 6, 7), 16)]))
    w.seal("a")
    with pytest.raises(MetadataError, match="still written"):  # a's page 2 holds target slots: never read-only
        w.install(_meta("b", [((2, 5, 6, 7), 16)]))
    w.install(_meta("b", [((0, 1, 5, 6), 32), ((0, 7, 8, 9), 16)]))  # a's prefix pages, shared by both rows
    with pytest.raises(MetadataError, match="already in use"):  # a shared page is never private elsewhere
        w.install(_meta("c", [((1, 10, 11, 12), 0)]))
    bad = _meta("c", [((12, 13, 14, 15), 0)])
    bad = msgspec.structs.replace(bad, rows=(msgspec.structs.replace(bad.rows[0], num_cached_tokens=8),))
    with pytest.raises(MetadataError, match="num_cached_tokens"):
        w.install(bad)
    assert w.remove("a") and w.remove("b")
    w.install(_meta("c", [((0, 1, 2, 3), 0)]))  # every page is free again on this rank


def test_metrics_gauges():
    from ditkv.entrypoints.metrics import _EngineCollector

    stats = {"alive": True, "num_blocks": 10, "used_blocks": 2, "free_blocks": 8, "evictable_blocks": 3,
             "prefix_cache_hit_ratio": 0.25, "prefix_cache_hit_tokens": 16, "prefix_cache_query_tokens": 64}
    from ditkv.entrypoints.metrics import TRANSFERS

    got = {m.name: m.samples[0].value for m in _EngineCollector(lambda: stats, TRANSFERS).collect() if m.samples}
    assert got["ditkv_kv_blocks_evictable"] == 3 and got["ditkv_prefix_cache_hit_ratio"] == 0.25
    assert got["ditkv_prefix_cache_hit_tokens"] == 16 and got["ditkv_kv_blocks_free"] == 8


def test_fail_closed_and_abort_with_shared_pages_return_every_page(bundle):
    eng = Engine(EngineConfig(**BASE, max_num_seqs=4), model_bundle=bundle)
    try:
        todo, outs = reqs(), {}
        eng.add_request(todo[0])
        eng.step()  # a's first step: its prefix pages are cached and a still holds them
        for r in todo[1:3]:
            eng.add_request(r)
        eng.step()  # b and c share a's pages (a: 2 of 3 steps)
        pool = eng.manager.pool
        shared = [b for b in range(pool.num_blocks) if pool.ref_count[b] > 1]
        assert shared and pool.num_evictable == 0
        assert eng.abort("b")  # cancel while shared: c keeps the pages after a ends
        outs.update({o.request_id: o.status for o in eng.step()})
        assert outs == {"a": "ok", "b": "cancelled"}
        assert all(pool.ref_count[b] >= 1 for b in shared)  # c still holds them
        eng.fail_closed("test: a rank died")
        assert pool.num_free == pool.num_blocks and int(pool.ref_count.sum()) == 0 and pool.num_evictable > 0
        outs.update({o.request_id: o.status for o in eng.step()})
        assert outs == {"a": "ok", "b": "cancelled", "c": "error"}
    finally:
        eng.shutdown()
    assert pool.num_evictable == 0 and pool.num_free == pool.num_blocks  # shutdown empties the cache


def test_with_step_caching_the_prefix_cache_changes_no_bit(bundle):
    """Step caching (issue 35) skips middle layers on later steps; the prefill always computes, so the
    pages the prefix cache shares are whole. Cache on == off with a dbcache step cache."""
    step_cache = {"type": "dbcache", "Fn": 1, "Bn": 1, "residual_threshold": 1e9, "warmup_steps": 1}
    outs = {}
    for cache in (False, True):
        eng = Engine(EngineConfig(**BASE, enable_prefix_caching=cache, max_num_seqs=2, cache_config=step_cache),
                     model_bundle=bundle)
        try:
            outs[cache] = [eng.generate(r) for r in reqs()[:3]]
        finally:
            eng.shutdown()
    for a, b in zip(outs[True], outs[False]):
        assert a.ok and b.ok and np.array_equal(a.image, b.image), a.request_id
        assert a.stats.cached_steps == b.stats.cached_steps > 0
    assert [o.stats.prefix_cache_hit_tokens > 0 for o in outs[True]] == [False, True, True]
