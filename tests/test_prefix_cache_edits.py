"""Edits of one input image through the prefix cache (issue 36, docs/prefix-cache.md): a hit may end
inside the image's full-attention block. Every key of a page touching the image names the whole image
(and the seed), so a cached page was computed against the same whole block; the row's first step
computes the block's rest against the cached keys and its own. CPU fp32, tiny-edit model: images with
the cache on equal the cache off bit for bit, for CFG and one-row requests, one after another and
joining a running batch, and at every page boundary inside the block."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from ditkv.attention.metadata import RowPhase, key_limits
from ditkv.attention.planner import plan_row
from ditkv.config import EngineConfig
from ditkv.engine.engine import Engine
from ditkv.engine.types import GenerationRequest
from ditkv.models.loader import load_model
from test_stage_images import image

# the tiny-edit row: <bos> <boi> <img_size> <img_ratio> <timestep> [8x8 latent block (5, 69)] <eoi> prompt
# <boi> <img_size> <img_ratio> | target. Prompts that differ within their first few characters leave the hit
# inside the block (16-token pages: the page [64, 80) holds the block's end and the prompt's start)
PROMPTS = ["make it blue", "make it red and bigger", "move it to the top left", "make it a square",
           "paint it green", "make it much smaller"]


@pytest.fixture(scope="module")
def bundle():
    return load_model("tiny-edit", torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def block(bundle):
    """The input image's full-attention block (start, end) in an edit's rows (both rows, any prompt)."""
    eng = engine(bundle, False)
    try:
        (a, b), = eng.processor.process(edit(0, PROMPTS[0], 2.0))[1].images[0].spans()
    finally:
        eng.shutdown()
    assert (a, b) == (5, 69)  # <bos> <boi> <img_size> <img_ratio> <timestep>, then the 8x8 latent tokens
    return a, b


def edit(i: int, prompt: str, guidance: float) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, request_id=f"e{i}", height=32, width=32, steps=2,
                             guidance_scale=guidance, seed=5, images=[image(3)])


def engine(bundle, cache: bool, block_size: int = 16, seqs: int = 1) -> Engine:
    return Engine(EngineConfig(model="tiny-edit", device="cpu", dtype="float32", block_size=block_size,
                               num_kv_blocks=1024, diffusion_kv_max_rows_per_request=2, max_num_seqs=seqs,
                               enable_prefix_caching=cache), model_bundle=bundle)


def recording(eng: Engine) -> dict:
    """Per request, each row's cache-hit tokens at its reservation (wraps the engine's manager; not the
    pages a row takes from its own row 0: tests/test_prefix_cache_cfg.py)."""
    seen, reserve = {}, eng.manager.reserve_request

    def wrapped(rid, rows, *a, **k):
        meta = reserve(rid, rows, *a, **k)
        if meta is not None:
            seen[rid] = [r.num_cached_tokens - r.num_row0_tokens for r in meta.rows]
        return meta

    eng.manager.reserve_request = wrapped
    return seen


def counting_encodes(eng: Engine) -> list:
    calls, condition = [], eng.worker.runner.condition
    eng.worker.runner.condition = lambda *a, **k: (calls.append(1), condition(*a, **k))[1]
    return calls


def run_edits(bundle, cache: bool, guidance: float, together: bool):
    eng = engine(bundle, cache, seqs=4 if together else 1)
    hits, encodes = recording(eng), counting_encodes(eng)
    todo = [edit(i, p, guidance) for i, p in enumerate(PROMPTS)]
    try:
        if together:  # the first alone; the rest join after its first step, while it still runs
            eng.add_request(todo[0])
            outs = {o.request_id: o for o in eng.step()}
            for r in todo[1:]:
                eng.add_request(r)
            outs.update({o.request_id: o for o in eng.run_until_complete()})
        else:
            outs = {r.request_id: eng.generate(r) for r in todo}
        pool = eng.manager.pool
        assert pool.num_free == pool.num_blocks and int(pool.ref_count.sum()) == 0
        return outs, hits, len(encodes)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("guidance", [2.0, 1.0], ids=["cfg", "one-row"])
@pytest.mark.parametrize("together", [False, True], ids=["one-after-another", "joining"])
def test_edits_of_one_image_hit_inside_its_block_and_equal_the_cache_off(bundle, block, guidance, together):
    ref, _, ref_encodes = run_edits(bundle, False, guidance, together)
    outs, hits, encodes = run_edits(bundle, True, guidance, together)
    a, b = block
    for rid, o in outs.items():
        assert o.ok and ref[rid].ok and np.array_equal(o.image, ref[rid].image), rid  # bit for bit
        assert o.stats.prefix_cache_hit_tokens == sum(hits[rid])
        assert o.stats.tokens_computed == (ref[rid].stats.tokens_computed - o.stats.prefix_cache_hit_tokens
                                           - o.stats.prefix_shared_rows_tokens)
    assert hits["e0"] == [0] * len(hits["e0"])
    later = [hits[f"e{i}"] for i in range(1, len(PROMPTS))]
    assert all(a < row[0] < b for row in later)  # every later cond row's hit ends inside the image block
    # the image is only partly cached: each request still encodes it (its rest is computed)
    assert encodes == ref_encodes == len(PROMPTS)


def test_a_hit_past_the_block_skips_the_encoders_and_one_inside_does_not(bundle, block):
    eng = engine(bundle, True)
    hits, encodes = recording(eng), counting_encodes(eng)
    try:
        outs = [eng.generate(edit(i, p, 2.0)) for i, p in enumerate(["make it blue", "make it blue", "paint it"])]
    finally:
        eng.shutdown()
    assert all(o.ok for o in outs)
    assert hits["e0"] == [0, 0] and hits["e1"][0] >= block[1] and block[0] < hits["e2"][0] < block[1]
    assert len(encodes) == 2  # e1's hit covers the whole image in both rows; e2's ends inside it


@pytest.fixture(scope="module")
def whole(bundle):
    """The cache-off image of the probe edit, per (block size, guidance): the row computed whole."""
    out = {}
    for bs in (16, 32):
        for g in (2.0, 1.0):
            eng = engine(bundle, False, block_size=bs)
            try:
                out[bs, g] = eng.generate(edit(1, PROMPTS[1], g)).image
            finally:
                eng.shutdown()
    return out


@pytest.mark.parametrize("guidance", [2.0, 1.0], ids=["cfg", "one-row"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_every_hit_boundary_inside_the_block_equals_the_row_computed_whole(bundle, whole, block_size, guidance):
    """The cache is warmed by one edit; a second edit of the same image with another prompt then takes
    its hits cut to k pages (row 0) and n - k (row 1), for every k up to its natural hit n: its image
    equals the whole computation. Rows then start at different places inside the block."""
    eng = engine(bundle, True, block_size=block_size)
    hits = recording(eng)
    pool, bounds = eng.manager.pool, set()
    lookup = pool.lookup
    try:
        assert eng.generate(edit(0, PROMPTS[0], guidance)).ok
        layout = eng.processor.process(edit(1, PROMPTS[1], guidance))[1]
        (a, b), = layout.images[0].spans()
        keys = eng.processor.family.prefix_block_keys(eng.executor.model_config, layout, 5, block_size)
        n = min(len(lookup(k)) for k in keys)
        assert n * block_size > a  # the hit reaches into the block
        for k in range(n + 1):
            cuts = iter([k, n - k][:len(keys)])
            pool.lookup = lambda keys, cuts=cuts: lookup(keys)[:next(cuts)]
            r = edit(1, PROMPTS[1], guidance)
            r.request_id = rid = f"k{k}"
            o = eng.generate(r)
            assert o.ok and np.array_equal(o.image, whole[block_size, guidance]), k
            assert hits[rid] == [k * block_size, (n - k) * block_size][:len(keys)]
            bounds |= {h for h in hits[rid] if a < h < b}
    finally:
        eng.shutdown()
    assert len(bounds) == (b - 1) // block_size  # every page boundary inside the block was a hit's end


@st.composite
def row_and_start(draw):
    """A row's sorted, disjoint spans and a first query anywhere in it (often inside a span)."""
    seq = draw(st.integers(4, 200))
    cuts = sorted(draw(st.sets(st.integers(0, seq), max_size=6)))
    spans = tuple((a, b) for a, b in zip(cuts[::2], cuts[1::2]) if b > a)
    start = draw(st.integers(0, seq - 1))
    return seq, spans, start


@settings(max_examples=300, deadline=None)
@given(row_and_start())
def test_a_query_range_starting_inside_a_span_sees_what_the_whole_row_sees(case):
    """The limits and the segment planner (every paged backend plans from one of them) give a range
    that starts anywhere, inside a span included, the keys the same queries see in the whole row."""
    seq, spans, start = case
    whole = key_limits(0, seq, spans)
    assert torch.equal(key_limits(start, seq - start, spans), whole[start:])
    seen = torch.zeros(seq - start, dtype=torch.int32)
    segs = plan_row(RowPhase(0, start, seq - start, seq, spans))
    assert segs[0].q_lo == start and segs[-1].q_hi == seq
    for s in segs:
        for i in range(s.q_lo, s.q_hi):  # a causal segment's query i sees keys [0, i]; a full one [0, kv_len)
            seen[i - start] = i + 1 if s.causal else s.kv_len
    assert torch.equal(seen, whole[start:])


def test_with_step_caching_a_hit_inside_the_block_changes_no_bit(bundle, block):
    """Step caching (docs/step-cache.md) computes the first step whole, from wherever it starts: a hit
    that ends inside the image block gives the cache-off image with a dbcache step cache too."""
    step_cache = {"type": "dbcache", "Fn": 1, "Bn": 1, "residual_threshold": 1e9, "warmup_steps": 1}
    outs, hits = {}, None
    for cache in (False, True):
        eng = Engine(EngineConfig(model="tiny-edit", device="cpu", dtype="float32", block_size=16, num_kv_blocks=1024,
                                  diffusion_kv_max_rows_per_request=2, enable_prefix_caching=cache,
                                  cache_config=step_cache), model_bundle=bundle)
        seen = recording(eng)
        try:
            outs[cache] = [eng.generate(edit(i, p, 2.0)) for i, p in enumerate(PROMPTS[:3])]
        finally:
            eng.shutdown()
        hits = seen if cache else hits
    for a, b in zip(outs[True], outs[False]):
        assert a.ok and b.ok and np.array_equal(a.image, b.image), a.request_id
        assert a.stats.cached_steps == b.stats.cached_steps > 0
    assert all(block[0] < hits[f"e{i}"][0] < block[1] for i in (1, 2))
