"""AR rows in the prefix cache (issue 36, docs/prefix-cache-ar.md): an AR row's text head looks up
and commits its full pages under the DiT rows' keys; the handover keeps cached pages shared and never
written; preempted rows find their own pages again. Engine tests on CPU fp32: texts and images with the
cache on equal the cache off bit for bit, and the later requests really hit. A state machine checks the
manager: shared pages with several owners, eviction, cancel while shared, quarantine, fail-closed."""

import hashlib

import numpy as np
import pytest
from hypothesis import event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from stage_helpers import tiny_bundle
from ditkv.config import EngineConfig
from ditkv.core.kv_manager import DiffusionKVCacheManager, blocks_for
from ditkv.core.layout import RowLayout
from ditkv.engine.ar_phase import handover_cut
from ditkv.engine.engine import Engine
from ditkv.engine.messages import ARWork
from ditkv.engine.types import GenerationRequest
from ditkv.errors import AdmissionError, LayoutError, MetadataError
from test_rewrite import CASES, Forced, bundle_for, release_tok  # noqa: F401 (release_tok: a fixture)

BS = 16
SYSTEM = "you are a careful painter who draws exactly what is asked, in flat colours, with thick lines. " * 2


# ---- the engine (tiny model, CPU fp32) -----------------------------------------------------------
@pytest.fixture(scope="module")
def bundle():
    return tiny_bundle()


def engine(bundle, cache: bool, **kw):
    cfg = {"device": "cpu", "block_size": BS, "num_kv_blocks": 256, "max_num_seqs": 4, "max_image_height": 32,
           "max_image_width": 32, "max_prompt_tokens": 300, "enable_prefix_caching": cache, **kw}
    return Engine(EngineConfig(**cfg), model_bundle=bundle)


def ar_req(tail: str, seed: int, max_new: int = 8, rid: str | None = None, **kw):
    return GenerationRequest(prompt=SYSTEM + tail, height=32, width=32, steps=2, guidance_scale=2.0, seed=seed,
                             max_new_tokens=max_new, temperature=1.0, top_k=0, top_p=1.0, request_id=rid, **kw)


def idle(eng) -> bool:
    m = eng.manager
    return (m.pool.num_free == m.pool.num_blocks and m.num_requests == 0 and m.num_ar_rows == 0
            and int(m.pool.ref_count.sum()) == 0)


def serial(bundle, cache: bool, reqs):
    eng = engine(bundle, cache)
    try:
        outs = [eng.generate(r) for r in reqs]
        assert idle(eng)  # free + evictable == initial
        return outs, eng.manager.pool.num_evictable
    finally:
        eng.shutdown()


def same(a, b):
    assert a.ok and b.ok, (a.error, b.error)
    assert a.revised_prompt == b.revised_prompt
    assert a.stats.ar_generated_tokens == b.stats.ar_generated_tokens
    assert np.array_equal(a.image, b.image)  # bit for bit, CPU fp32


def test_ar_requests_behind_one_system_text_hit_and_equal_the_cache_off(bundle):
    reqs = [ar_req("a small red", 3), ar_req("a big blue", 4), ar_req("a small red", 3)]
    off, none = serial(bundle, False, reqs)
    on, kept = serial(bundle, True, reqs)
    assert none == 0 and kept > 0
    for a, b in zip(on, off):
        same(a, b)
        assert b.stats.prefix_cache_hit_tokens == 0
    assert on[0].stats.prefix_cache_hit_tokens == 0
    assert on[1].stats.prefix_cache_hit_tokens >= 160  # the shared system text's pages
    assert on[2].stats.prefix_cache_hit_tokens > on[1].stats.prefix_cache_hit_tokens  # its whole head but one token


def test_batched_ar_requests_share_pages_while_they_run(bundle):
    """Later requests join while the first decodes: they share its committed head pages (several
    owners at once) and still equal the cache off, alone."""
    reqs = [ar_req("a small red", 3, rid="a"), ar_req("a big blue", 4, rid="b"), ar_req("green", 5, rid="c")]
    off, _ = serial(bundle, False, reqs)
    eng = engine(bundle, True)
    try:
        eng.add_request(reqs[0])
        eng.step()  # a's head is prefilled and committed
        for r in reqs[1:]:
            eng.add_request(r)
        eng.step()  # b and c admitted on a's pages
        shared = int((eng.manager.pool.ref_count > 1).sum())
        outs = {o.request_id: o for o in eng.run_until_complete()}
        assert idle(eng)
    finally:
        eng.shutdown()
    assert shared > 0
    for r, want in zip(reqs, off):
        same(outs[r.request_id], want)
    assert outs["b"].stats.prefix_cache_hit_tokens > 0 and outs["c"].stats.prefix_cache_hit_tokens > 0


def test_a_plain_request_hits_the_pages_an_ar_row_wrote(bundle):
    """AR and DiT rows share keys: a text-to-image request whose prompt is an earlier AR request's reads
    that AR row's committed pages, and its image equals the cache off (the AR's bytes are the DiT's)."""
    first = ar_req("a small red", 3, max_new=4)
    plain = GenerationRequest(prompt=SYSTEM + "a small red", height=32, width=32, steps=2, guidance_scale=2.0, seed=9)
    off, _ = serial(bundle, False, [first, plain])
    on, _ = serial(bundle, True, [first, plain])
    for a, b in zip(on, off):
        assert a.ok and np.array_equal(a.image, b.image)
    assert on[1].stats.prefix_cache_hit_tokens >= 160


def test_a_preempted_request_finds_its_own_pages_again(bundle):
    """A pool too small for every request at once: preempted AR rows' committed pages stay cached,
    and the recomputed request begins with them; texts and images equal an unpreempted cache-off run."""
    reqs = [ar_req(t, 10 + i, max_new=40, rid=f"r{i}") for i, t in enumerate(["red", "blue", "green", "grey"] * 2)]
    off, _ = serial(bundle, False, reqs)
    eng = engine(bundle, True, num_kv_blocks=56, max_num_seqs=8)
    try:
        ids = [eng.add_request(r) for r in reqs]
        outs = {o.request_id: o for o in eng.run_until_complete()}
        assert eng.scheduler.num_preempted > 0, eng.scheduler.preempted_for
        assert idle(eng)
    finally:
        eng.shutdown()
    for rid, want in zip(ids, off):
        same(outs[rid], want)


def test_an_abort_while_shared_returns_every_reference(bundle):
    eng = engine(bundle, True)
    try:
        eng.add_request(ar_req("a small red", 3, rid="a"))
        eng.step()
        eng.add_request(ar_req("a big blue", 4, rid="b"))
        eng.step()
        assert int((eng.manager.pool.ref_count > 1).sum()) > 0
        assert eng.abort("a")
        outs = {o.request_id: o for o in eng.run_until_complete()}
        assert outs["b"].ok and idle(eng)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("case", ["recaption-instruct", "think-dynamic-drop"])
def test_rewrites_behind_a_shared_system_prompt(release_tok, case):
    """think / recaption (the release template fixture, forced text): the system prompt's pages are
    shared by every rewrite request; the image row is rebuilt, row 0 adopts what agrees (cut back to
    whole cached pages), and texts and images equal the cache off bit for bit."""
    tok, base = release_tok
    settings_, text, max_new, _ = CASES[case]
    bundle = bundle_for(base.replace(extra=settings_), tok)
    reqs = [GenerationRequest(prompt=p, height=32, width=32, steps=2, guidance_scale=2.0, seed=7, max_new_tokens=max_new)
            for p in (SYSTEM + "a fox in the snow", SYSTEM + "a fox in the rain")]

    def go(cache):
        return forced_serial(bundle, tok.encode(text), cache, reqs)[0]

    off, on = go(False), go(True)
    for a, b in zip(on, off):
        assert a.ok and b.ok, (a.error, b.error)
        assert a.revised_prompt == b.revised_prompt and np.array_equal(a.image, b.image)
    assert on[1].stats.prefix_cache_hit_tokens > 0


def forced_serial(bundle, text_ids, cache: bool, reqs, watch=None):
    """`reqs` one after another through an engine whose AR phase writes `text_ids` for each (`Forced`) ->
    (their outputs, `watch(engine)`'s result or None); every page returns after them."""
    eng = Engine(EngineConfig(device="cpu", block_size=BS, num_kv_blocks=512, enable_prefix_caching=cache),
                 model_bundle=bundle)
    seen = watch(eng) if watch is not None else None
    forced = eng.worker.model = Forced(eng.worker.model, text_ids)
    try:
        outs = []
        for r in reqs:
            forced.calls = 0  # every request writes the same forced text
            outs.append(eng.generate(r))
        assert idle(eng)
        return outs, seen
    finally:
        eng.shutdown()


# ---- pieces --------------------------------------------------------------------------------------
def test_the_handover_never_ends_inside_a_cached_page():
    assert handover_cut(40, 2, BS, ()) == 40  # the cached pages lie inside the agreement
    assert handover_cut(40, 3, BS, ()) == 32  # page 2 is cached and the DiT would write it from 40
    assert handover_cut(40, 3, BS, ((20, 36),)) == 16  # and not inside a full-attention span
    assert handover_cut(5, 1, BS, ()) == 0


def test_ar_keys_equal_a_dit_rows_keys_for_the_same_text(bundle):
    from ditkv.models.hunyuan.layout import build_request_layout
    from ditkv.models.hunyuan.prefix_keys import prefix_block_keys, text_head_keys

    model, tok = bundle[0], bundle[1]
    layout = build_request_layout(model.config, tok, SYSTEM + "a small red", 32, 32, 2.0)
    dit = prefix_block_keys(model.config, layout, 0, BS)[0]
    head = layout.cond_text_ids()
    ar = text_head_keys(model.config, head, BS)
    assert len(ar) == len(head) // BS and ar == dit[:len(ar)]
    assert text_head_keys(model.config, head[:-1] + [head[-1] ^ 1], BS)[:-1] == ar[:-1]


def test_the_manager_refuses_a_stale_hit_and_a_handover_writing_a_cached_page():
    m = DiffusionKVCacheManager(20, BS, 2, prefix_caching=True)
    keys = chain([1, 2, 3])
    row = m.reserve_ar("a", 3 * BS + 4, keys)
    assert m.commit_ar("a", 3 * BS + 4) == 3 and m.ar_cached_pages("a") == 3
    hit = m.ar_hit(keys, 3 * BS + 4)
    assert hit == row.block_ids[:3]
    with pytest.raises(LayoutError, match="ar_hit"):
        m.reserve_ar("b", 3 * BS + 4, chain([1, 9, 9]), hit)
    rows = [RowLayout(0, 3 * BS + 4, 8, 3 * BS + 12, ())]
    with pytest.raises(LayoutError, match="shared page"):  # the DiT would write page 2 from token 40
        m.reserve_request("a", rows, (40,), adopt=3, prefix_keys=[keys], handover=True)
    meta = m.reserve_request("a", rows, (32,), adopt=2, prefix_keys=[keys], handover=True)
    assert meta.rows[0].num_cached_tokens == 32 and meta.rows[0].num_computed_tokens == 32
    assert m.free_request("a") and m.pool.num_free == 20


def test_the_rank_refuses_a_shared_page_that_a_row_still_writes():
    from ditkv.worker.ar_batch import ARRow, check_pages

    work = ARWork(request_id="b", generation=1, block_ids=[4, 5, 6], token_ids=[1], start=2 * BS, cached=2 * BS)
    owner = {4: {"a"}, 5: {"a"}}
    check_pages(work, owner, {}, (set(), set()), BS)  # a's written pages, nobody writes them
    with pytest.raises(MetadataError, match="still written"):
        check_pages(work, owner, {5: "a"}, (set(), set()), BS)
    with pytest.raises(MetadataError, match="in use"):
        check_pages(work, {6: {"a"}}, {}, (set(), set()), BS)
    with pytest.raises(MetadataError, match="still written by a DiT row"):
        check_pages(work, {}, {}, ({4}, {4}), BS)
    assert ARRow(1, [1]).length == 0


# ---- the manager against a model -----------------------------------------------------------------
def chain(pages) -> tuple[bytes, ...]:
    out, prev = [], b"model"
    for p in pages:
        prev = hashlib.blake2b(prev + bytes([p]), digest_size=16).digest()
        out.append(prev)
    return tuple(out)


class ARCacheMachine(RuleBasedStateMachine):
    """AR rows and the DiT rows they hand over to, against a model of what each page holds: a hit or a
    shared page always holds its key's tokens, a cached page is never written, references equal holders,
    and the pool returns to free + evictable == initial."""

    @initialize(blocks=st.integers(10, 30))
    def setup(self, blocks):
        self.total = blocks
        self._fresh()

    def _fresh(self):
        self.m = DiffusionKVCacheManager(self.total, BS, 2, prefix_caching=True)
        self.ar: dict[str, dict] = {}  # rid -> head pages, keys, head_len, computed, planned, table
        self.dit: dict[str, dict] = {}  # rid -> table, keys, first step done
        self.quarantined: dict[str, list[int]] = {}
        self.content: dict[int, object] = {}  # page -> what it holds (a key, or a private label)
        self.n = 0

    def _write(self, b: int, what) -> None:
        assert not self.m.pool.cache.is_cached(b), "a cached (shared, read-only) page was written"
        self.content[b] = what

    @rule(pages=st.lists(st.integers(0, 1), min_size=1, max_size=3), extra=st.integers(1, BS - 1),
          chunk=st.integers(BS // 2, 3 * BS))
    def admit_ar(self, pages, extra, chunk):
        rid, self.n = f"r{self.n}", self.n + 1
        keys, head_len = chain(pages), len(pages) * BS + extra
        hit = self.m.ar_hit(keys, head_len)
        for j, b in enumerate(hit):
            assert self.content[b] == keys[j], "a hit gave a page holding other tokens"
        planned = min(len(hit) * BS + chunk, head_len)
        row = self.m.reserve_ar(rid, planned, keys, hit)
        if row is None:
            return
        event("ar hit" if hit else "ar miss")
        if any(b in self._held() for b in hit):
            event("shared with a live row")
        for b in row.block_ids[len(hit):]:
            self.content.pop(b, None)
        self.ar[rid] = dict(keys=keys, head_len=head_len, computed=len(hit) * BS, planned=planned,
                            table=list(row.block_ids))

    @rule(data=st.data(), n=st.integers(1, 2 * BS))
    def step(self, data, n):
        """The planned work ran on every rank: its pages are written, the head's full ones committed;
        then the next work is planned (a chunk, or a decode token past the head)."""
        if not self.ar:
            return
        rid = data.draw(st.sampled_from(sorted(self.ar)))
        a = self.ar[rid]
        for j in range(a["computed"] // BS, blocks_for(a["planned"], BS)):
            self._write(a["table"][j], a["keys"][j] if (j + 1) * BS <= a["head_len"] else ("ar", rid, j))
        a["computed"] = a["planned"]
        self.m.commit_ar(rid, a["computed"])
        row = self.m.grow_ar(rid, a["computed"] + n)
        if row is not None:
            a["planned"], a["table"] = a["computed"] + n, list(row.block_ids)

    @rule(data=st.data())
    def end_ar(self, data):
        """Cancel, fail or preempt an AR row, maybe while others share its pages."""
        if not self.ar:
            return
        rid = data.draw(st.sampled_from(sorted(self.ar)))
        del self.ar[rid]
        assert self.m.free_ar(rid)

    @rule(data=st.data(), agree=st.integers(0, 4 * BS), cfg=st.booleans())
    def handover(self, data, agree, cfg):
        """The text ended: row 0 adopts what agrees with the AR row (cut to whole cached pages), an uncond
        row looks up; the DiT rows commit after their first step."""
        ready = sorted(r for r, a in self.ar.items() if a["computed"] >= a["head_len"])
        if not ready:
            return
        rid = data.draw(st.sampled_from(ready))
        a = self.ar[rid]
        agree = min(agree, a["computed"])
        cut = handover_cut(agree, self.m.ar_cached_pages(rid), BS, ())
        if cut < agree:
            event("handover cut to whole cached pages")
        prefix = a["computed"] + 3
        same = cut // BS  # the DiT row's pages equal the AR's up to the agreement
        k0 = a["keys"][:same]
        k0 += chain([7] * (prefix // BS))[len(k0):]
        rows = [RowLayout(0, prefix, 8, prefix + 8, ())]
        keys = [k0]
        if cfg:
            rows.append(RowLayout(1, prefix, 8, prefix + 8, ()))
            keys.append(a["keys"][:1] + chain([5] * (prefix // BS))[1:])
        computed = (cut,) + (0,) * (len(rows) - 1)
        adopt = blocks_for(cut, BS)
        if self.m.required_blocks(rows) > self.total:
            with pytest.raises(AdmissionError, match="never fit"):
                self.m.reserve_request(rid, rows, computed, adopt=adopt, prefix_keys=keys, handover=True)
            return
        credit = self.m.expected_hit_tokens(rows, keys, computed)  # the scheduler's token-budget credit
        meta = self.m.reserve_request(rid, rows, computed, adopt=adopt, prefix_keys=keys, handover=True)
        if meta is None:
            return
        event("handover")
        assert credit[0] == 0 and list(credit[1:]) == [r.num_cached_tokens for r in meta.rows[1:]]
        if meta.rows[0].num_cached_tokens:
            event("row 0 adopts cached pages")
        del self.ar[rid]
        tables = [list(r.block_ids) for r in meta.rows]
        for r, t in zip(meta.rows, tables):
            for j, b in enumerate(t[:r.num_cached_tokens // BS]):
                assert self.m.pool.cache.is_cached(b)
                assert r.row_id != 1 or self.content[b] == keys[1][j]
            if r.row_id == 1 and r.num_cached_tokens:
                event("uncond hit")
        for j in range(meta.rows[0].num_cached_tokens // BS, cut // BS):  # adopted, agreed, AR-written pages:
            self.content[tables[0][j]] = k0[j] if j < len(k0) else ("dit", rid, 0, j)  # the DiT's tokens
        for b in tables[0][adopt:]:
            self.content.pop(b, None)
        for t in tables[1:]:
            for b in t[meta.rows[1].num_cached_tokens // BS:]:
                self.content.pop(b, None)
        self.dit[rid] = dict(rows=meta.rows, tables=tables, keys=keys, stepped=False)

    @rule(data=st.data())
    def first_step(self, data):
        todo = sorted(r for r, d in self.dit.items() if not d["stepped"])
        if not todo:
            return
        rid = data.draw(st.sampled_from(todo))
        d = self.dit[rid]
        for r, t, k in zip(d["rows"], d["tables"], d["keys"]):
            for j in range(r.num_computed_tokens // BS, len(t)):
                self._write(t[j], k[j] if j < len(k) else ("dit", rid, r.row_id, j))
        d["stepped"] = True
        self.m.commit_prefix(rid)

    @rule(data=st.data(), quarantine=st.booleans())
    def end_dit(self, data, quarantine):
        if not self.dit:
            return
        rid = data.draw(st.sampled_from(sorted(self.dit)))
        d = self.dit.pop(rid)
        assert self.m.free_request(rid, quarantine=quarantine)
        if quarantine:  # only its private pages stay; the cache's lose this reference now
            self.quarantined[rid] = [b for t in d["tables"] for b in t if not self.m.pool.cache.is_cached(b)]

    @rule(data=st.data())
    def settle(self, data):
        if self.quarantined:
            rid = data.draw(st.sampled_from(sorted(self.quarantined)))
            assert self.m.release_quarantine(rid)
            del self.quarantined[rid]

    @rule(now=st.integers(0, 9))
    def fail_closed(self, now):
        if now:
            return
        self.m.close()
        assert self.m.pool.num_free == self.total and self.m.pool.num_evictable == 0
        self._fresh()

    def _holders(self) -> dict[int, int]:
        refs: dict[int, int] = {}
        tables = [a["table"] for a in self.ar.values()] + [t for d in self.dit.values() for t in d["tables"]]
        tables += list(self.quarantined.values())
        for t in tables:
            for b in t:
                refs[b] = refs.get(b, 0) + 1
        return refs

    def _held(self) -> set[int]:
        return set(self._holders())

    @invariant()
    def pages_accounted(self):
        if not hasattr(self, "m"):
            return
        pool, refs = self.m.pool, self._holders()
        assert {b: int(pool.ref_count[b]) for b in np.flatnonzero(pool.ref_count)} == refs
        for b, n in refs.items():
            assert n == 1 or pool.cache.is_cached(b), "a page with several owners is not a cached page"
        for b in self._quarantined_pages():
            assert not pool.cache.is_cached(b), "a quarantined page is cached"
        for key, b in pool.cache._block_of.items():
            assert self.content.get(b) == key, "a cached page holds other tokens than its key's"
        assert pool.num_free + pool.num_used == self.total
        assert all(pool.ref_count[b] == 0 for b in pool.cache._evictable)
        if not refs:
            assert pool.num_free == self.total  # invariant 3: free + evictable == initial

    def _quarantined_pages(self):
        return [b for ids in self.quarantined.values() for b in ids]


ARCacheMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)
TestARCacheMachine = ARCacheMachine.TestCase


def test_imported_pages_enter_the_dit_stages_cache(bundle):
    """A stage graph: the DiT stage's imported AR->DiT pages (after kv_ready, the AR stage's bytes) and
    the rest of its prefix are committed after the first step. A plain request on that DiT stage's
    engine then begins with them, and its image equals a cache-off engine's bit for bit."""
    from ditkv.stages.graph import load_stage_graph
    from ditkv.stages.orchestrator import Orchestrator

    t = {"kv_connector": "shm", "kv_role": "kv_producer", "engine_id": "ar"}
    graph = load_stage_graph({"stages": [
        {"stage_id": 0, "kind": "ar", "max_new_tokens": 0,
         "engine": {"model": "tiny", "device": "cpu", "block_size": BS, "num_kv_blocks": 64},
         "kv_transfer_config": t},
        {"stage_id": 1, "kind": "dit", "inputs": [0],
         "engine": {"model": "tiny", "device": "cpu", "block_size": BS, "num_kv_blocks": 256,
                    "max_prompt_tokens": 300},
         "kv_transfer_config": {**t, "kv_role": "kv_consumer", "engine_id": "dit"}}]})
    prompt = SYSTEM + "a small red"
    plain = GenerationRequest(prompt=prompt, height=32, width=32, steps=2, guidance_scale=2.0, seed=9)
    orch = Orchestrator(graph, bundle)
    try:
        first = orch.generate(GenerationRequest(prompt=prompt, height=32, width=32, steps=2, guidance_scale=2.0, seed=3))
        dit = orch.dit[0].engine
        assert first.ok and first.stats.imported_tokens > 0 and dit.manager.pool.num_evictable > 0
        again = dit.generate(plain)
    finally:
        orch.shutdown()
    ref, _ = serial(bundle, False, [plain])
    assert again.ok and again.stats.prefix_cache_hit_tokens >= 160
    assert np.array_equal(again.image, ref[0].image)


def test_the_think_bench_case_on_tiny_sizes(bundle):
    from ditkv.bench.prefix_think import think_case

    r = think_case(bundle, n=2, max_new_tokens=2, size=32, steps=1, max_num_seqs=2, num_kv_blocks=256,
                   device="cpu", dtype="float32")
    assert r["bit_identical"] and r["n"] == 2
    off, on = r["cache_off"], r["cache_on"]
    assert len(on["ttfs_s"]) == len(off["ttfs_s"]) == 2 and all(t > 0 for t in on["ttfs_s"] + off["ttfs_s"])
    assert off["hit_tokens"] == 0 and on["hit_tokens"] > 0
    assert r["ar_prefill_tokens_saved"] == off["ar_prefill_tokens"] - on["ar_prefill_tokens"] > 0
    with pytest.raises(ValueError, match="max_new_tokens"):
        think_case(bundle, n=1, max_new_tokens=0)
