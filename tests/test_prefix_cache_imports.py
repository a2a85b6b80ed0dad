"""Imported AR->DiT pages look up the DiT stage's prefix cache (issue 36, docs/prefix-cache-ar.md
"Imports"). A native import's rows begin with their cached pages, the destination tells the producer
to skip them (`RowDest.skip_pages`), and the producer writes only the rest. CPU fp32: the images equal
the same graph with the cache off and the single engine bit for bit; the transfer moves fewer bytes;
a cancel with shared pages quarantines only the pages the transfer may write."""

import threading
import time

import numpy as np
import pytest

from stage_helpers import rank_opts, tiny_bundle
from ditkv.config import EngineConfig
from ditkv.core.kv_manager import DiffusionKVCacheManager, ImportKeys
from ditkv.core.layout import RowLayout
from ditkv.engine.engine import Engine
from ditkv.engine.types import GenerationRequest
from ditkv.stages.graph import load_stage_graph
from ditkv.stages.kv_import import import_rows
from ditkv.stages.orchestrator import Orchestrator
from ditkv.transfer.base import RegionInfo
from ditkv.transfer.connector import native_descriptors
from ditkv.transfer.descriptors import PoolGeometry
from ditkv.transfer.ticket import DestEndpoint, RankDest, RowDest, SourceEndpoint, TransferTicket, validate_endpoints

BS = 16
SYSTEM = "you are a careful painter who draws exactly what is asked, in flat colours, with thick lines. " * 2
PAGE_ALIGNED = "a small red cats"  # with SYSTEM: a prefix of exactly 13 pages (checked below)


@pytest.fixture(scope="module")
def bundle():
    return tiny_bundle()


def graph(cache: bool, timeout: float = 30.0, **dit):
    t = {"kv_connector": "shm", "kv_role": "kv_producer", "engine_id": "ar"}
    return load_stage_graph({"stages": [
        {"stage_id": 0, "kind": "ar", "max_new_tokens": 0,
         "engine": {"model": "tiny", "device": "cpu", "block_size": BS, "num_kv_blocks": 64},
         "kv_transfer_config": t},
        {"stage_id": 1, "kind": "dit", "inputs": [0],
         "engine": {"model": "tiny", "device": "cpu", "block_size": BS, "num_kv_blocks": 256,
                    "max_prompt_tokens": 300, "enable_prefix_caching": cache, **dit},
         "kv_transfer_config": {**t, "kv_role": "kv_consumer", "engine_id": "dit", "transfer_timeout": timeout}}]})


def req(tail: str, seed: int) -> GenerationRequest:
    return GenerationRequest(prompt=SYSTEM + tail, height=32, width=32, steps=2, guidance_scale=2.0, seed=seed)


REQS = [req("a small red", 3), req("a big blue", 4), req(PAGE_ALIGNED, 5), req(PAGE_ALIGNED, 6)]


def wait_for(cond, timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


def settled(orch) -> bool:
    """Both pools back to free + evictable = all, nothing quarantined, no AR lease, no reference."""
    d = orch.dit[0]
    return (orch.pools_full() and not d.num_quarantined and orch.ar[0].num_leases == 0
            and int(d.manager.pool.ref_count.sum()) == 0)


def watch_tickets(orch) -> dict:
    """Every ticket the DiT side sent (`_send`) or let go unsent (`_abort_source`), by request id."""
    seen = {}
    for name in ("_send", "_abort_source"):
        orig = getattr(orch, name)
        setattr(orch, name, lambda t, orig=orig: (seen.setdefault(t.request_id, t), orig(t))[1])
    return seen


def run_graph(bundle, cache: bool, reqs, tp: int = 1):
    """Outputs, (bytes written, bytes skipped) per request, each request's ticket, and a page's bytes
    summed over the DiT ranks. `tp` > 1: DiT rank processes, each holding its share of the KV heads."""
    opts = {} if tp == 1 else {"executor_options": rank_opts()}
    orch = Orchestrator(graph(cache, tensor_parallel_size=tp), bundle, **opts)
    tickets = watch_tickets(orch)
    outs, moved = [], []
    try:
        for r in reqs:
            before = orch.transfers.snapshot()
            outs.append(orch.generate(r))
            assert wait_for(lambda: settled(orch))  # the write returned: its bytes are counted
            after = orch.transfers.snapshot()
            moved.append((after["bytes"] - before["bytes"], after["skipped_bytes"] - before["skipped_bytes"]))
        snap = orch.transfers.snapshot()
        assert (snap["ok"], snap["failures"], snap["cancelled"]) == (len(reqs), 0, 0)
        page_bytes = sum(c.rank_dest().geometry.page_bytes for c in orch.dit[0].consumers)
    finally:
        orch.shutdown()
    return outs, moved, [tickets[o.request_id] for o in outs], page_bytes


def test_imports_behind_one_system_prompt_hit_skip_pages_and_equal_cache_off_and_single_engine(bundle):
    on, moved_on, tickets_on, page = run_graph(bundle, True, REQS)
    off, moved_off, tickets_off, _ = run_graph(bundle, False, REQS)
    eng = Engine(EngineConfig(device="cpu", block_size=BS, num_kv_blocks=256, max_prompt_tokens=300,
                              enable_prefix_caching=False), model_bundle=bundle)
    try:
        single = [eng.generate(r) for r in REQS]
        prefix = eng.worker.layout(REQS[2].prompt, 32, 32, 2.0).rows[0].prefix_len
    finally:
        eng.shutdown()
    assert prefix == 13 * BS  # the page-aligned case: its repeat finds every imported page cached
    for a, b, c in zip(on, off, single):
        assert a.ok and b.ok and c.ok, (a.error, b.error, c.error)
        assert np.array_equal(a.image, b.image) and np.array_equal(a.image, c.image)  # bit for bit, CPU fp32
    # the cache off: nothing hit, every imported page moved
    assert all(o.stats.prefix_cache_hit_tokens == 0 for o in off)
    assert all(s == 0 and b > 0 for b, s in moved_off)
    assert all(r.skip_pages == 0 for t in tickets_off for r in t.dest.rows)
    # the first request finds nothing; the later ones hit the system prompt's pages and skip them
    assert on[0].stats.prefix_cache_hit_tokens == 0 and moved_on[0] == moved_off[0]
    for i in (1, 2, 3):
        cond = tickets_on[i].dest.rows[0]
        assert cond.row_id == 0 and cond.skip_pages >= 11  # SYSTEM: 190 characters, over 11 pages
        assert on[i].stats.prefix_cache_hit_tokens >= cond.skip_pages * BS
        assert on[i].stats.imported_tokens == off[i].stats.imported_tokens - cond.skip_pages * BS
        bytes_on, skipped = moved_on[i]
        assert skipped == sum(r.skip_pages for r in tickets_on[i].dest.rows) * page > 0
        assert bytes_on + skipped == moved_off[i][0]  # the saving is exactly the skipped pages
        assert bytes_on == sum(len(r.written()) for r in tickets_on[i].dest.rows) * page
    # the repeat of the page-aligned prompt: every imported page is cached, nothing is sent
    last = tickets_on[3].dest.rows
    assert all(len(r.written()) == 0 for r in last) and moved_on[3][0] == 0
    assert tickets_on[3].dispatched_at is None and on[3].stats.imported_tokens == 0
    assert on[3].stats.prefix_cache_hit_tokens >= prefix


def test_dit_tensor_parallel_ranks_skip_their_share_of_the_cached_pages(bundle):
    """DiT TP=2 rank processes (each a KV-head half, its own consumer): the same requests, cache on vs off.
    Every rank skips the same pages, the saving is exact, and the images equal bit for bit."""
    on, moved_on, tickets_on, page = run_graph(bundle, True, REQS, tp=2)
    off, moved_off, _, _ = run_graph(bundle, False, REQS, tp=2)
    for a, b in zip(on, off):
        assert a.ok and b.ok, (a.error, b.error)
        assert np.array_equal(a.image, b.image)
    assert [o.stats.prefix_cache_hit_tokens > 0 for o in on] == [False, True, True, True]
    for i in (1, 2, 3):
        assert moved_on[i][1] == sum(r.skip_pages for r in tickets_on[i].dest.rows) * page > 0
        assert moved_on[i][0] + moved_on[i][1] == moved_off[i][0]
    assert moved_on[3][0] == 0 and tickets_on[3].dispatched_at is None


def test_cancel_with_shared_pages_quarantines_only_the_written_ones(bundle):
    orch = Orchestrator(graph(True), bundle).start()
    gate = threading.Event()
    tp = orch.ar[0].transport
    orig = tp.write

    def held(*a, **kw):
        gate.wait()
        return orig(*a, **kw)
    try:
        assert orch.generate(REQS[0], timeout=60).ok  # its pages enter the cache
        d = orch.dit[0]
        assert wait_for(lambda: settled(orch))
        m, initial = d.manager, d.manager.pool.num_free
        tp.write = held
        rid = orch.submit(REQS[1])
        assert wait_for(lambda: d.scheduler.num_waiting_for_kv == 1)
        sreq = d.scheduler.get(rid)
        hit_pages = [b for r in sreq.metadata.rows for b in r.block_ids[:r.num_cached_tokens // BS]]
        assert hit_pages and sum(sreq.cache_hit_tokens) == len(hit_pages) * BS
        own = sum(len(r.block_ids) for r in sreq.metadata.rows) - len(hit_pages)
        assert orch.cancel(rid)
        assert orch.take(rid, timeout=30).status == "cancelled"
        assert d.num_quarantined == 1 and m.num_quarantined_blocks == own  # the hits are not held
        held_pages = {int(b) for ids in m._quarantined[rid].block_arrays for b in ids}
        assert not held_pages & set(hit_pages)
        assert not any(m.pool.cache.is_cached(b) for b in held_pages)
        assert all(m.pool.cache.is_cached(b) for b in hit_pages)  # still cached, this request's reference gone
        gate.set()
        assert wait_for(lambda: settled(orch))
        assert m.pool.num_free == initial == m.pool.num_blocks  # free + evictable: back to the start
        tp.write = orig
        again = orch.generate(REQS[1], timeout=60)
        assert again.ok and again.stats.prefix_cache_hit_tokens > 0  # the kept pages serve the retry
    finally:
        gate.set()
        orch.shutdown()


# ---- units: the producer's descriptors, validation, the manager's switch -------------------------
def geometry(num_blocks=32, heads=2):
    return PoolGeometry(num_blocks, num_layers=2, num_kv_heads=heads, block_size=4, head_dim=8, elem_size=4,
                        dtype="float32")


def rank_dest(rank=0, lo=0, hi=2):
    region = RegionInfo("shm", "ipc://x", "pool", "seg", 1 << 20)
    return RankDest(rank, "dit", "kv_consumer", region, geometry(heads=hi - lo), lo, hi)


def pages(spans, page_bytes: int) -> set[int]:
    """The pages that byte spans (offset, length) touch (coalesced descriptors may cover several)."""
    return {p for o, n in spans for p in range(o // page_bytes, (o + n - 1) // page_bytes + 1)}


def test_the_producer_writes_exactly_the_unskipped_pages():
    g = geometry()
    src = tuple(range(20, 26))
    rows = [RowDest(0, 24, (3, 9, 4, 11, 5, 6), skip_pages=4), RowDest(1, 10, (12, 13, 14), skip_pages=3),
            RowDest(2, 8, (7, 8), skip_pages=0)]
    for dest in (rank_dest(), rank_dest(1, 1, 2)):  # whole pages; one KV head of two
        descs = native_descriptors(g, dest, src, rows, head_lo=0)
        dp = dest.geometry.page_bytes
        assert pages(((d, n) for _, d, n in descs), dp) == {5, 6, 7, 8}  # row 0's last two, row 2's; none of row 1
        assert pages(((s, n) for s, _, n in descs), g.page_bytes) == {24, 25, 20, 21}  # their source pages
        assert sum(n for _, _, n in descs) == 4 * dp


def ticket_with(rows, legacy=False):
    g = geometry()
    region = RegionInfo("shm", "ipc://ar", "pool", "a", 1 << 20)
    t = TransferTicket("r", "native")
    t.bind_source(SourceEndpoint("ar", "kv_producer", 0, region, g, tuple(range(8)), 30))
    dest = rank_dest()
    if legacy:
        dest = RankDest(0, "dit", "kv_consumer", dest.region, None, 0, 2)
    t.bind_dest(DestEndpoint("dit", "kv_consumer", 0, (dest,), tuple(rows)))
    return t


def test_validation_refuses_writing_a_shared_page():
    ok = [RowDest(0, 12, (1, 2, 3), skip_pages=2), RowDest(1, 8, (1, 4), skip_pages=1)]
    assert validate_endpoints(ticket_with(ok), 1, frozenset({1, 2})) is None
    why = validate_endpoints(ticket_with([RowDest(0, 12, (1, 2, 3), skip_pages=1)]), 1, frozenset({1, 2}))
    assert "would write shared" in why and "[2]" in why
    why = validate_endpoints(ticket_with([RowDest(0, 12, (1, 2, 3)), RowDest(1, 4, (1,), skip_pages=1)]), 1)
    assert "row 0 would write shared" in why  # another row's skipped page is shared too
    assert "skips 4 of its 3" in validate_endpoints(ticket_with([RowDest(0, 12, (1, 2, 3), skip_pages=4)]), 1)
    why = validate_endpoints(ticket_with([RowDest(0, 12, skip_pages=1)], legacy=True), 1)
    assert "legacy receive slot is written whole" in why


def test_an_import_looks_up_only_with_import_keys():
    rows = [RowLayout(0, 40, 8, 48, ()), RowLayout(1, 40, 8, 48, ())]
    keys = [tuple(bytes([r, i]) for i in range(2)) for r in range(2)]
    m = DiffusionKVCacheManager(20, 16, 2, prefix_caching=True)
    m.reserve_request("a", rows, prefix_keys=keys)
    assert m.commit_prefix("a") == 4
    m.free_request("a")
    plain = m.reserve_request("legacy", rows, [40, 0], prefix_keys=keys)  # plain keys: no lookup
    assert [r.num_cached_tokens for r in plain.rows] == [0, 0] and m.cache_hit_tokens == 0
    m.free_request("legacy")
    meta = m.reserve_request("native", rows, [40, 0], prefix_keys=ImportKeys(keys))
    assert [r.num_cached_tokens for r in meta.rows] == [32, 32] and m.cache_hit_tokens == 64
    assert [r.num_computed_tokens for r in meta.rows] == [40, 32]
    dest, shared = import_rows(meta, [40, 0], 16)
    assert [(r.row_id, r.skip_pages, len(r.written())) for r in dest] == [(0, 2, 1)]
    assert shared == {b for r in meta.rows for b in r.block_ids[:2]}
    m.free_request("native", quarantine=True)  # a failed import: only its own page stays held
    assert m.num_quarantined_blocks == 3 - 2 + 3 - 2
    m.release_quarantine("native")
    assert m.pool.num_free == m.pool.num_blocks and int(m.pool.ref_count.sum()) == 0


def test_edit_imports_hit_through_and_inside_the_image_block_and_equal_the_cache_off():
    """Edits through a native graph (the sampled codec: skipped VAE samples show in the image). The repeat
    hits past the image, a prompt that differs after the image hits inside its block; both CFG rows
    import through the image and skip their hits. Images equal the cache-off graph and the single engine."""
    import msgspec
    from test_prefix_cache_ar_images import edit, sampled_bundle, serial
    from test_rewrite import graph as edit_graph

    bundle = sampled_bundle(1)
    reqs = [msgspec.structs.replace(r, request_id=f"e{i}")
            for i, r in enumerate([edit("a red circle"), edit("a red circle"), edit("a blue square")])]
    single, _, _ = serial(bundle, False, reqs)
    staged, tickets = {}, {}
    for cache in (True, False):
        orch = Orchestrator(edit_graph(max_new=3, enable_prefix_caching=cache), bundle)
        seen = watch_tickets(orch)
        try:
            staged[cache] = [orch.generate(r) for r in reqs]
            assert wait_for(lambda: settled(orch))
        finally:
            orch.shutdown()
        tickets[cache] = [seen[r.request_id] for r in reqs]
    for a, b, c in zip(staged[True], staged[False], single):
        assert a.ok and b.ok and c.ok, (a.error, b.error, c.error)
        assert a.revised_prompt == b.revised_prompt == c.revised_prompt
        assert np.array_equal(a.image, b.image) and np.array_equal(a.image, c.image)
    skips = [[r.skip_pages for r in t.dest.rows] for t in tickets[True]]
    rows = [[(r.num_tokens, len(r.block_ids)) for r in t.dest.rows] for t in tickets[True]]
    assert rows[0] == rows[1] == [(88, 6), (70, 5)] and skips[0] == [0, 0]  # both rows import the image
    # the repeat: cond hits 80 tokens (past the block), uncond all it imports (a row with nothing to write);
    # another prompt after the image: cond hits 64 tokens, inside the block
    assert skips[1] == [5, 5] and skips[2] == [4, 5]
    assert [len(r.written()) for r in tickets[True][2].dest.rows] == [2, 0]
    assert [o.stats.prefix_cache_hit_tokens for o in staged[True]] == [0, 160, 144]
    assert all(r.skip_pages == 0 for t in tickets[False] for r in t.dest.rows)
