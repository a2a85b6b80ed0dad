"""The prefix cache in the control plane (core/prefix_cache.py, block_pool.py, kv_manager.py):
hits, shared pages with several owners, LRU eviction, cancel while shared, quarantine, fail-closed,
and invariant 3 restated: free + evictable returns to the initial count."""

import hashlib

import numpy as np
import pytest
from hypothesis import event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from ditkv.core.block_pool import BlockPool
from ditkv.core.kv_manager import DiffusionKVCacheManager
from ditkv.core.layout import RowLayout
from ditkv.errors import AdmissionError, LayoutError

BS = 16


def chain(pages) -> tuple[bytes, ...]:
    """Chained keys of a row whose full prefix pages hold `pages` (one label per page)."""
    out, prev = [], b"model"
    for p in pages:
        prev = hashlib.blake2b(prev + bytes([p]), digest_size=16).digest()
        out.append(prev)
    return tuple(out)


def rows_for(pages, cfg: bool, span: tuple[int, int] | None = None, tail: int = 5, same: int = 1):
    """One row (two with CFG: the uncond row differs from page `same` on) of len(pages) full prefix pages."""
    prefix = len(pages) * BS + tail
    spans = (span,) if span else ()
    rows = [RowLayout(0, prefix, 20, prefix + 21, spans)]
    keys = [chain(pages)]
    if cfg:
        rows.append(RowLayout(1, prefix, 20, prefix + 21, spans))
        keys.append(chain(pages[:same] + [9] * (len(pages) - same)))
    return rows, keys


def test_a_hit_reuses_the_pages_and_allocates_only_the_rest():
    m = DiffusionKVCacheManager(40, BS, 2, prefix_caching=True)
    rows, keys = rows_for([1, 2, 3], cfg=True)
    a = m.reserve_request("a", rows, prefix_keys=keys)
    # nothing is cached yet, but the uncond row begins with the cond row's first page (equal keys)
    assert [r.num_cached_tokens for r in a.rows] == [0, BS] and [r.num_row0_tokens for r in a.rows] == [0, BS]
    assert a.rows[1].block_ids[0] == a.rows[0].block_ids[0] and m.pool.ref_count[a.rows[0].block_ids[0]] == 2
    b0 = m.reserve_request("b0", rows, prefix_keys=keys)  # before a's first step: nothing is cached yet
    assert [r.num_cached_tokens for r in b0.rows] == [0, BS]
    assert m.stats()["prefix_cache_hit_tokens"] == 0 and m.stats()["prefix_shared_rows_tokens"] == 2 * BS
    assert m.commit_prefix("a") == 5  # row 0: 3 pages; row 1: its first page is row 0's -> 2 more
    assert m.commit_prefix("a") == 0  # once
    free = m.pool.num_free
    b = m.reserve_request("b", rows, prefix_keys=keys)
    assert [r.num_cached_tokens for r in b.rows] == [3 * BS, 3 * BS]
    assert [r.num_computed_tokens for r in b.rows] == [3 * BS, 3 * BS]
    assert b.rows[0].block_ids[:3] == a.rows[0].block_ids[:3]
    assert b.rows[1].block_ids[0] == a.rows[0].block_ids[0]  # cond and uncond share their first page
    assert free - m.pool.num_free == b.num_blocks - 6  # only the uncached pages were allocated
    assert m.pool.ref_count[a.rows[0].block_ids[0]] == 4  # both rows of a and of b: several owners
    assert m.stats()["prefix_cache_hit_tokens"] == 6 * BS and m.stats()["prefix_shared_rows_tokens"] == 2 * BS


def test_off_ignores_the_keys():
    m = DiffusionKVCacheManager(40, BS, 2)
    rows, keys = rows_for([1, 2], cfg=False)
    m.reserve_request("a", rows, prefix_keys=keys)
    assert m.commit_prefix("a") == 0 and len(m.pool.cache) == 0
    assert m.reserve_request("b", rows, prefix_keys=keys).rows[0].num_cached_tokens == 0


def test_a_hit_may_end_inside_a_full_attention_span():
    """Keys of pages touching a span name the whole span (the family's contract): a hit ending inside it
    is kept, and the row's first step starts there (tests/test_prefix_cache_edits.py runs it)."""
    m = DiffusionKVCacheManager(40, BS, 2, prefix_caching=True)
    rows, keys = rows_for([1, 2, 3], cfg=False, span=(20, 52))
    m.reserve_request("a", rows, prefix_keys=keys)
    m.commit_prefix("a")
    b = m.reserve_request("b", rows, prefix_keys=keys).rows[0]
    assert b.num_cached_tokens == b.num_computed_tokens == 3 * BS  # ends at 48, inside (20, 52)
    other, other_keys = rows_for([1, 2, 7], cfg=False, span=(20, 52))
    assert m.reserve_request("c", other, prefix_keys=other_keys).rows[0].num_cached_tokens == 2 * BS  # 32


def test_evictable_pages_count_as_free_and_are_evicted_oldest_first():
    m = DiffusionKVCacheManager(10, BS, 2, prefix_caching=True)
    for rid, label in (("a", 1), ("b", 2)):
        rows, keys = rows_for([label, label], cfg=False)
        m.reserve_request(rid, rows, prefix_keys=keys)
        m.commit_prefix(rid)
        m.free_request(rid)
    assert m.pool.num_free == 10 and m.pool.num_evictable == 4 and m.pool.num_used == 0
    a_pages = chain([1, 1])
    big = [RowLayout(0, 0, 1, 8 * BS)]  # 8 pages: 6 queued + the 2 oldest evictable (a's)
    m.reserve_request("c", big)
    assert m.pool.lookup(a_pages) == [] and len(m.pool.lookup(chain([2, 2]))) == 2
    assert m.pool.cache.evictions == 2


def test_share_refuses_uncached_pages_and_cache_refuses_free_pages():
    p = BlockPool(4, BS)
    ids = p.allocate(2, 0)
    with pytest.raises(ValueError, match="does not hold"):
        p.share(ids)
    p.free(ids)
    with pytest.raises(ValueError, match="no request holds it"):
        p.cache_pages(ids, chain([1, 2]))


def test_bad_keys_are_refused():
    m = DiffusionKVCacheManager(40, BS, 2, prefix_caching=True)
    rows, keys = rows_for([1, 2], cfg=False)
    with pytest.raises(LayoutError, match="prefix_keys"):
        m.reserve_request("a", rows, prefix_keys=[chain([1, 2, 3])])  # a key for the boundary page
    assert m.pool.num_free == 40


class PrefixMachine(RuleBasedStateMachine):
    """The manager against a model: which request holds which page, what each page holds, the cache's
    keys and the LRU order of evictable pages."""

    @initialize(blocks=st.integers(6, 30))
    def setup(self, blocks):
        self.total = blocks
        self._fresh()

    def _fresh(self):
        self.m = DiffusionKVCacheManager(self.total, BS, 2, prefix_caching=True)
        self.live: dict[str, tuple[list[list[int]], list[tuple[bytes, ...]], list[int]]] = {}
        self.quarantined: dict[str, list[int]] = {}
        self.committed: set[str] = set()
        self.content: dict[int, bytes] = {}  # page -> the key whose tokens it holds (written pages only)
        self.cached: dict[bytes, int] = {}  # the model's cache
        self.lru: list[int] = []  # evictable pages, oldest first
        self.n = 0

    @rule(pages=st.lists(st.integers(0, 1), min_size=1, max_size=4), cfg=st.booleans(),
          span=st.sampled_from([None, (BS // 2, 3 * BS // 2), (0, BS)]), same=st.integers(0, 4))
    def reserve(self, pages, cfg, span, same):
        """`same`: leading pages the uncond row's keys share with the cond row's (it takes those past
        its own hit from row 0, as the writer's sibling)."""
        rid, self.n = f"r{self.n}", self.n + 1
        rows, keys = rows_for(pages, cfg, span, same=min(same, len(pages)))
        if sum(-(-r.seq_len // BS) for r in rows) > self.total:
            with pytest.raises(AdmissionError, match="can never fit"):
                self.m.reserve_request(rid, rows, prefix_keys=keys)
            return
        hits = []
        for k in keys:
            found = []
            for key in k:
                if key not in self.cached:
                    break
                found.append(self.cached[key])
            hits.append(found)  # a hit may end inside a span
        sib = [0] + [self._from_row0(k, h, keys[0], hits[0]) for k, h in zip(keys[1:], hits[1:])]
        need = sum(-(-r.seq_len // BS) - len(h) - n for r, h, n in zip(rows, hits, sib))
        revive = len({b for h in hits for b in h} & set(self.lru))
        queued = self.total - self._referenced_count() - len(self.lru)
        before = (self.m.pool.num_free, self.m.pool.num_used)
        state = self._state()
        expected = self.m.expected_hit_tokens(rows, keys)  # the scheduler's credit (test_prefix_cache_admission)
        assert expected == [(len(h) + n) * BS for h, n in zip(hits, sib)] and self._state() == state  # a query only
        meta = self.m.reserve_request(rid, rows, prefix_keys=keys)
        if need + revive > queued + len(self.lru):
            assert meta is None and (self.m.pool.num_free, self.m.pool.num_used) == before
            return
        assert meta is not None and [r.num_cached_tokens for r in meta.rows] == expected
        self.lru = [b for b in self.lru if b not in {x for h in hits for x in h}]
        evict = max(0, need - queued)
        for b in self.lru[:evict]:  # the oldest evictable pages lose their keys
            self.cached = {k: v for k, v in self.cached.items() if v != b}
        self.lru = self.lru[evict:]
        event("hit" if any(hits) else "miss")
        if any(sib):
            event("a row took row 0's pages")
        if evict:
            event("evicted")
        if any(b in self.live_blocks() for h in hits for b in h):
            event("shared with a live request")
        tables = []
        for row, h, k, n in zip(meta.rows, hits, keys, sib):
            assert list(row.block_ids[:len(h)]) == h and row.num_cached_tokens == (len(h) + n) * BS
            assert row.num_row0_tokens == n * BS and row.num_computed_tokens == row.num_cached_tokens
            lead = slice(len(h), len(h) + n)  # row 0's fresh pages at the same indices: allocated once
            assert row.block_ids[lead] == meta.rows[0].block_ids[lead]
            for j, b in enumerate(h):
                assert self.content[b] == k[j], "a hit gave a page holding other tokens"
            for b in row.block_ids[len(h):]:
                self.content.pop(b, None)  # a fresh page: written by its first step
            tables.append(list(row.block_ids))
        leads = [len(h) + n for h, n in zip(hits, sib)]
        private = [b for t, n in zip(tables, leads) for b in t[n:]]  # allocated once: in one row only
        assert len(set(private)) == len(private)
        self.live[rid] = (tables, keys, leads)

    def _state(self):
        """What a lookup must leave alone: references, the LRU order, the keys and the counters."""
        pool = self.m.pool
        return (pool.ref_count.tobytes(), list(pool.cache._evictable), dict(pool.cache._block_of),
                self.m.prefix_cache_stats(), pool.num_free)

    @staticmethod
    def _from_row0(k, h, k0, h0) -> int:
        """The model of `_row_shares`: keys equal to row 0's past this row's hit (and row 0's)."""
        n = 0
        if len(h) >= len(h0):
            while len(h) + n < min(len(k), len(k0)) and k[len(h) + n] == k0[len(h) + n]:
                n += 1
        return n

    @rule(data=st.data())
    def first_step(self, data):
        if not self.live:
            return
        rid = data.draw(st.sampled_from(sorted(self.live)))
        tables, keys, hits = self.live[rid]
        if rid in self.committed:
            assert self.m.commit_prefix(rid) == 0  # once
            return
        self.committed.add(rid)
        expect = 0
        for t, k, h in zip(tables, keys, hits):
            for j in range(len(k)):
                assert self.content.setdefault(t[j], k[j]) == k[j]  # the step wrote the computed pages
                if j >= h and k[j] not in self.cached and t[j] not in self.cached.values():
                    self.cached[k[j]] = t[j]
                    expect += 1
        assert self.m.commit_prefix(rid) == expect

    @rule(data=st.data(), quarantine=st.booleans())
    def end(self, data, quarantine):
        """finish or cancel, possibly while other requests share its pages."""
        if not self.live:
            return
        rid = data.draw(st.sampled_from(sorted(self.live)))
        refs = self._refs()
        tables, _, _ = self.live.pop(rid)
        self.committed.discard(rid)
        assert self.m.free_request(rid, quarantine=quarantine)
        cached_blocks = set(self.cached.values())
        if quarantine:  # its references to cached pages go now, the rest stay until released
            self.quarantined[rid] = [b for t in tables for b in t if b not in cached_blocks]
            for t in tables:
                self._drop(refs, sorted(b for b in t if b in cached_blocks))
        else:
            for t in tables:
                self._drop(refs, sorted(t))

    @rule(data=st.data())
    def settle(self, data):
        if not self.quarantined:
            return
        rid = data.draw(st.sampled_from(sorted(self.quarantined)))
        assert self.m.release_quarantine(rid)
        self.quarantined.pop(rid)

    @rule(now=st.integers(0, 7))
    def fail_closed(self, now):
        """Shutdown / fail-closed with shared pages held: every page returns, the cache empties."""
        if now:  # rarely: it starts over
            return
        self.m.close()
        assert self.m.pool.num_free == self.total and self.m.pool.num_evictable == 0
        assert int(self.m.pool.ref_count.sum()) == 0
        self._fresh()

    def live_blocks(self) -> set[int]:
        return {b for tables, _, _ in self.live.values() for t in tables for b in t}

    def _drop(self, refs, ids):
        """One free call (one row, ids sorted): pages reaching 0 refs that are cached become evictable."""
        cached_blocks = set(self.cached.values())
        for b in ids:
            refs[b] -= 1
            if refs[b] == 0 and b in cached_blocks:
                self.lru.append(b)

    def _refs(self) -> dict[int, int]:
        refs: dict[int, int] = {}
        for tables, _, _ in self.live.values():
            for t in tables:
                for b in t:
                    refs[b] = refs.get(b, 0) + 1
        for ids in self.quarantined.values():
            for b in ids:
                refs[b] = refs.get(b, 0) + 1
        return refs

    def _referenced_count(self) -> int:
        return len(self._refs())

    @invariant()
    def pages_accounted(self):
        if not hasattr(self, "m"):
            return
        pool, refs = self.m.pool, self._refs()
        assert {b: int(pool.ref_count[b]) for b in np.flatnonzero(pool.ref_count)} == refs
        assert pool.num_used == len(refs)
        assert pool.num_evictable == len(self.lru) and not set(self.lru) & set(refs)
        assert list(pool.cache._evictable) == self.lru  # LRU order
        assert pool.num_free + pool.num_used == self.total
        for key, b in self.cached.items():
            assert pool.lookup([key]) == [b]
        assert len(pool.cache) == len(self.cached)
        if not self.live and not self.quarantined:  # invariant 3: free + evictable == initial
            assert pool.num_free == self.total


PrefixMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestPrefixMachine = PrefixMachine.TestCase
