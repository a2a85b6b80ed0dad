"""Exported AR rows in the KV manager (a stage graph's AR stage, `core/kv_manager.py`), which took over
from the AR stage's own lease manager: every page is in exactly one AR row or export, or free; an
export keeps the row's first pages and returns the rest at once; a stale or repeated release frees
nothing; growing a row extends its table (append-only, a new generation)."""

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from ditkv.core.kv_manager import DiffusionKVCacheManager
from ditkv.errors import LayoutError

BS = 16


def test_errors_name_the_problem():
    m = DiffusionKVCacheManager(8, BS, 2)
    m.reserve_ar("a", 40)  # 3 pages
    with pytest.raises(LayoutError, match="already holds pages"):
        m.reserve_ar("a", 1)
    with pytest.raises(LayoutError, match="no AR row to export"):
        m.export_ar("b", "t", 1, 1)
    with pytest.raises(LayoutError, match="the AR row holds 3"):
        m.export_ar("a", "t", 4, 40)
    with pytest.raises(LayoutError, match="the AR row holds 3"):
        m.export_ar("a", "t", 1, BS + 1)  # more tokens than the kept pages hold
    m.export_ar("a", "t", 3, 40)
    m.reserve_ar("c", 1)
    with pytest.raises(LayoutError, match="already held"):
        m.export_ar("c", "t", 1, 1)


class ExportMachine(RuleBasedStateMachine):
    @initialize(blocks=st.integers(1, 24))
    def setup(self, blocks):
        self.m, self.total, self.n = DiffusionKVCacheManager(blocks, BS, 2), blocks, 0
        self.rows: dict[str, list[int]] = {}  # request -> its AR row's pages, in order
        self.exports: dict[str, tuple[tuple[int, ...], int]] = {}  # key -> (pages, generation)

    @rule(tokens=st.integers(1, 8 * BS))
    def reserve(self, tokens):
        rid = f"r{self.n}"
        self.n += 1
        need = -(-tokens // BS)
        row = self.m.reserve_ar(rid, tokens)
        if need > self.total - self._held():
            assert row is None  # not free now: nothing taken
            return
        assert row is not None and len(row.block_ids) == need
        self.rows[rid] = list(row.block_ids)

    @rule(data=st.data(), more=st.integers(1, 3 * BS))
    def grow(self, data, more):
        if not self.rows:
            return
        rid = data.draw(st.sampled_from(sorted(self.rows)))
        before = self.m.ar_row(rid)
        old, gen = list(before.block_ids), before.generation
        row = self.m.grow_ar(rid, before.tokens + more)
        if row is None:
            assert self.m.ar_row(rid).block_ids == old and self.m.ar_row(rid).generation == gen
            return
        assert row.block_ids[:len(old)] == old  # append-only
        assert row.generation > gen or row.block_ids == old
        self.rows[rid] = list(row.block_ids)

    @rule(data=st.data())
    def export(self, data):
        if not self.rows:
            return
        rid = data.draw(st.sampled_from(sorted(self.rows)))
        pages = self.rows[rid]
        keep = data.draw(st.integers(0, len(pages)))
        tokens = data.draw(st.integers(0, min(self.m.ar_row(rid).tokens, keep * BS)))
        free = self.m.pool.num_free
        out = self.m.export_ar(rid, "t:" + rid, keep, tokens)
        assert out.block_ids == tuple(pages[:keep]) and self.m.ar_row(rid) is None
        assert self.m.pool.num_free == free + len(pages) - keep  # the rest returned at once
        del self.rows[rid]
        self.exports[out.key] = (out.block_ids, out.generation)

    @rule(data=st.data(), stale=st.booleans())
    def release(self, data, stale):
        if not self.exports:
            return
        key = data.draw(st.sampled_from(sorted(self.exports)))
        gen = self.exports[key][1]
        if stale:
            assert not self.m.release_export(key, generation=gen + 1000)
            return
        assert self.m.release_export(key, generation=gen)
        assert not self.m.release_export(key, generation=gen)  # repeated: nothing twice
        del self.exports[key]

    @rule(data=st.data())
    def free_row(self, data):
        if not self.rows:
            return
        rid = data.draw(st.sampled_from(sorted(self.rows)))
        assert self.m.free_ar(rid) and not self.m.free_ar(rid)
        del self.rows[rid]

    @rule()
    def release_all(self):
        assert self.m.release_exports() == len(self.exports)
        self.exports.clear()

    def _held(self) -> int:
        return sum(len(p) for p in self.rows.values()) + sum(len(p) for p, _ in self.exports.values())

    @invariant()
    def pages_accounted(self):
        if not hasattr(self, "m"):
            return
        held = [b for p in self.rows.values() for b in p] + [b for p, _ in self.exports.values() for b in p]
        assert len(held) == len(set(held)), "a page is in two holders"
        assert self.m.pool.num_used == len(held)
        assert self.m.pool.num_free + self.m.pool.num_used == self.total
        assert self.m.num_exports == len(self.exports) and self.m.num_ar_rows == len(self.rows)


ExportMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
TestExportMachine = ExportMachine.TestCase
