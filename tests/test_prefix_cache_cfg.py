"""A request's own rows share pages at reservation (issue 36, docs/prefix-cache.md "Rows of one request"):
where the uncond row's keys equal the cond row's (a system prompt, an edit's input image before the
prompt), it begins with the cond row's pages, allocated and computed once. In the first step the cond row
writes them and the uncond row reads them in the same pass (the adapter writes a layer's K/V before any
read). CPU fp32: images with the cache on equal the cache off bit for bit, solo and batched."""

import numpy as np
import pytest
import torch

from ditkv.config import EngineConfig
from ditkv.core.kv_manager import DiffusionKVCacheManager
from ditkv.core.layout import RowLayout
from ditkv.engine.engine import Engine
from ditkv.engine.types import GenerationRequest
from ditkv.models.loader import load_model
from test_prefix_cache import BS, chain
from test_stage_images import image

SYSTEM = ("You draw simple flat pictures: plain background, thick outlines, bright colours, no text at all. " * 3)
PROMPTS = ["make it blue", "make it red and bigger", "move it to the top left", "paint it green"]


def _bundle(model: str, system: str | None):
    bundle = load_model(model, torch.device("cpu"), torch.float32)
    if system is not None:
        cfg = bundle[0].config
        bundle[0].config = cfg.replace(extra={**cfg.extra, "use_system_prompt": "custom", "system_prompt": system})
    return bundle


@pytest.fixture(scope="module")
def edit_bundle():
    return _bundle("tiny-edit", None)


@pytest.fixture(scope="module")
def system_bundle():
    return _bundle("tiny", SYSTEM)


def edits(n: int) -> list[GenerationRequest]:
    return [GenerationRequest(prompt=p, request_id=f"e{i}", height=32, width=32, steps=2, guidance_scale=2.0,
                              seed=5, images=[image(3)]) for i, p in enumerate(PROMPTS[:n])]


def t2i(n: int) -> list[GenerationRequest]:
    return [GenerationRequest(prompt=f"request {i}: {p}", request_id=f"s{i}", height=32, width=32, steps=2,
                              guidance_scale=2.0, seed=i) for i, p in enumerate(PROMPTS[:n])]


def run(model, bundle, todo, cache: bool, together: bool):
    """The requests through one engine: one after another, or all added before the first step (nothing
    is cached then: every shared page is a row's own sibling). -> (outputs, tables per request)."""
    eng = Engine(EngineConfig(model=model, device="cpu", dtype="float32", block_size=16, num_kv_blocks=1024,
                              diffusion_kv_max_rows_per_request=2, max_num_seqs=len(todo) if together else 1,
                              max_prompt_tokens=512, enable_prefix_caching=cache), model_bundle=bundle)
    tables, reserve = {}, eng.manager.reserve_request

    def recording(rid, rows, *a, **k):
        meta = reserve(rid, rows, *a, **k)
        if meta is not None:
            tables[rid] = meta
        return meta

    eng.manager.reserve_request = recording
    try:
        if together:
            for r in todo:
                eng.add_request(r)
            outs = {o.request_id: o for o in eng.run_until_complete()}
            assert max(eng.stats()["batch_sizes"]) == len(todo)
        else:
            outs = {r.request_id: eng.generate(r) for r in todo}
        pool = eng.manager.pool
        assert pool.num_free == pool.num_blocks and int(pool.ref_count.sum()) == 0  # free + evictable == initial
        return outs, tables
    finally:
        eng.shutdown()


CASES = {"edit": ("tiny-edit", "edit_bundle", edits), "system prompt": ("tiny", "system_bundle", t2i)}


@pytest.mark.parametrize("together", [False, True], ids=["solo", "batched"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_uncond_row_shares_the_cond_rows_pages_and_changes_no_bit(request, case, together):
    model, fixture, build = CASES[case]
    bundle = request.getfixturevalue(fixture)
    todo = build(4 if together else 2)
    ref, ref_tables = run(model, bundle, todo, False, together)
    outs, tables = run(model, bundle, todo, True, together)
    for r in todo:
        rid = r.request_id
        o, off = outs[rid], ref[rid]
        assert o.ok and off.ok and np.array_equal(o.image, off.image), rid  # bit for bit, CPU fp32
        cond, uncond = tables[rid].rows
        assert off.stats.prefix_shared_rows_tokens == 0 and cond.num_row0_tokens == 0
        s = o.stats
        if together or rid.endswith("0"):  # nothing cached yet: every shared page is the cond row's
            n = uncond.num_row0_tokens // 16
            assert n > 0 and s.prefix_shared_rows_tokens == n * 16 and s.prefix_cache_hit_tokens == 0
            assert uncond.block_ids[:n] == cond.block_ids[:n]  # the same pages, not copies
            # pages used by the request drop by the shared ones (the off run allocates every row whole)
            used = len(set(cond.block_ids) | set(uncond.block_ids))
            assert used == tables[rid].num_blocks - n == ref_tables[rid].num_blocks - n
        assert s.tokens_computed == off.stats.tokens_computed - s.prefix_cache_hit_tokens - s.prefix_shared_rows_tokens
        assert s.prefix_tokens_reused == off.stats.prefix_tokens_reused


def test_the_edits_uncond_row_takes_the_whole_image_block(edit_bundle):
    """An edit's input image precedes the prompt in both rows: the uncond row's shared pages run up to
    the page where the prompt begins (16-token pages: the block (5, 69) ends inside page 4)."""
    _, tables = run("tiny-edit", edit_bundle, edits(1), True, False)
    cond, uncond = tables["e0"].rows
    assert uncond.num_row0_tokens == uncond.num_cached_tokens == uncond.num_computed_tokens == 4 * 16


def test_off_changes_nothing(edit_bundle):
    _, tables = run("tiny-edit", edit_bundle, edits(1), False, False)
    assert [(r.num_cached_tokens, r.num_row0_tokens) for r in tables["e0"].rows] == [(0, 0), (0, 0)]
    m = DiffusionKVCacheManager(40, BS, 2, prefix_caching=False)
    rows = [RowLayout(0, 3 * BS + 5, 20, 3 * BS + 26), RowLayout(1, 3 * BS + 5, 20, 3 * BS + 26)]
    meta = m.reserve_request("a", rows, prefix_keys=[chain([1, 2, 3])] * 2)
    assert not set(meta.rows[0].block_ids) & set(meta.rows[1].block_ids)


def test_under_cfg_parallel_rows_never_share():
    """CFG parallel runs row 0 on another rank's pool: the uncond rank would read pages it never wrote."""
    m = DiffusionKVCacheManager(40, BS, 2, prefix_caching=True, share_rows=False)
    rows = [RowLayout(0, 3 * BS + 5, 20, 3 * BS + 26), RowLayout(1, 3 * BS + 5, 20, 3 * BS + 26)]
    meta = m.reserve_request("a", rows, prefix_keys=[chain([1, 2, 3])] * 2)
    assert meta.rows[1].num_row0_tokens == 0 and not set(meta.rows[0].block_ids) & set(meta.rows[1].block_ids)


@pytest.mark.parametrize("quarantine", [False, True])
def test_ending_before_the_first_step_returns_every_reference(quarantine):
    m = DiffusionKVCacheManager(40, BS, 2, prefix_caching=True)
    rows = [RowLayout(0, 3 * BS + 5, 20, 3 * BS + 26), RowLayout(1, 3 * BS + 5, 20, 3 * BS + 26)]
    meta = m.reserve_request("a", rows, prefix_keys=[chain([1, 2, 3]), chain([1, 2, 9])])
    shared = meta.rows[0].block_ids[:2]
    assert meta.rows[1].block_ids[:2] == shared and list(m.pool.ref_count[list(shared)]) == [2, 2]
    assert m.pool.num_used == 2 * 5 - 2  # admission counted the shared pages once
    assert m.free_request("a", quarantine=quarantine)
    if quarantine:  # nothing is cached before the first step: both rows' references stay quarantined
        assert m.num_quarantined_blocks == 2 * 5 and list(m.pool.ref_count[list(shared)]) == [2, 2]
        assert m.release_quarantine("a")
    assert m.pool.num_free == 40 and int(m.pool.ref_count.sum()) == 0 and len(m.pool.cache) == 0


def test_a_first_step_that_fails_returns_every_page(edit_bundle):
    """The pass that writes the shared pages raises: the request fails and every page returns."""
    eng = Engine(EngineConfig(model="tiny-edit", device="cpu", dtype="float32", block_size=16, num_kv_blocks=256,
                              diffusion_kv_max_rows_per_request=2, enable_prefix_caching=True),
                 model_bundle=edit_bundle)
    runner, calls = eng.worker.runner, []
    forward = runner.forward_batch

    def failing(items):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("test: the prefill failed")
        return forward(items)

    runner.forward_batch = failing
    try:
        bad, good = edits(2)
        out = eng.generate(bad)
        assert not out.ok
        pool = eng.manager.pool
        assert pool.num_free == pool.num_blocks and int(pool.ref_count.sum()) == 0 and len(pool.cache) == 0
        again = eng.generate(good)  # nothing of the failed prefill was cached: computed (and shared) anew
        assert again.ok and again.stats.prefix_cache_hit_tokens == 0 and again.stats.prefix_shared_rows_tokens > 0
    finally:
        eng.shutdown()


def _row(i, ids, computed=0, cached=0, row0=0, prefix=40):
    from ditkv.core.metadata import RowMetadata

    # prefix 40: pages 0, 1 wholly before it, page 2 holds target slots
    return RowMetadata(i, prefix, 10, prefix + 10, (), ids, computed, cached, row0)


def test_the_worker_allows_row_0s_pages_only_where_row_0_writes_them_whole():
    from ditkv.core.metadata import DiffusionKVMetadata
    from ditkv.errors import MetadataError
    from ditkv.worker.rows import WorkerRows

    def meta(rid, *rows):
        return DiffusionKVMetadata(rid, 1, 16, rows)

    w = WorkerRows(20, 16, max_rows=6)
    bad = {
        "not marked": (meta("a", _row(0, (0, 1, 2, 3)), _row(1, (0, 4, 5, 6))), "already in use"),
        "other index": (meta("a", _row(0, (0, 1, 2, 3)), _row(1, (1, 4, 5, 6), 16, 16, 16)), "index 0"),
        "row 0's hit": (meta("a", _row(0, (0, 1, 2, 3), 16), _row(1, (0, 4, 5, 6), 16, 16, 16)), "index 0"),
        "boundary page": (meta("a", _row(0, (0, 1, 2, 3)), _row(1, (0, 1, 2, 6, 7), 48, 48, 48, prefix=60)),
                          "index 2"),
        "row 0 itself": (meta("a", _row(0, (0, 1, 2, 3), 16, 16, 16)), "first row"),
        "more than cached": (meta("a", _row(0, (0, 1, 2, 3)), _row(1, (0, 4, 5, 6), 16, 16, 32)), "num_row0_tokens"),
    }
    for name, (m, match) in bad.items():
        with pytest.raises(MetadataError, match=match):
            w.install(m)
        assert w.blocks_in_use() == set(), name  # refused before any state changed
    w.install(meta("a", _row(0, (0, 1, 2, 3)), _row(1, (0, 1, 5, 6), 32, 32, 32)))
    with pytest.raises(MetadataError, match="still written"):  # another request, before a's first step
        w.install(meta("b", _row(0, (0, 7, 8, 9), 16, 16)))
    w.seal("a")
    w.install(meta("b", _row(0, (0, 1, 8, 9), 32, 32)))  # after it: a cached page, as any other
    assert w.remove("a") and w.remove("b") and w.blocks_in_use() == set()
