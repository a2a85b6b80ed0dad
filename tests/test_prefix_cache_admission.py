"""Admission credits a request's expected prefix-cache hit in the step's token budget (issue 36,
docs/prefix-cache.md "Lookup and admission"): `max_num_batched_tokens` counts the tokens its first step
will compute given the pages the cache holds now, the intake still refuses on the whole prefill, and a
reservation whose hit came out smaller than credited is taken back with the request kept at the head."""

import numpy as np
import pytest
from hypothesis import event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from ditkv.core.kv_manager import DiffusionKVCacheManager
from ditkv.core.layout import RowLayout
from ditkv.core.scheduler import RequestStatus, Scheduler
from ditkv.errors import AdmissionError
from test_prefix_cache import BS, chain


def request(pages, cfg: bool, target: int = 20, same: int = 1):
    """Rows of len(pages) full prefix pages and a 5-token tail (the page holding `prefix_len`), and their keys
    (the uncond row's differ from page `same` on)."""
    prefix = len(pages) * BS + 5
    rows = [RowLayout(i, prefix, target, prefix + target + 1, ()) for i in range(2 if cfg else 1)]
    keys = [chain(pages), chain(pages[:same] + [9] * (len(pages) - same))][:len(rows)]
    return rows, keys


def scheduler(budget: int, blocks: int = 200) -> Scheduler:
    return Scheduler(DiffusionKVCacheManager(blocks, BS, 2, prefix_caching=True), max_running=4,
                     max_batched_tokens=budget)


def first_step(s: Scheduler, out) -> None:
    """The admitted requests' first step ran: their prefix pages enter the cache."""
    for r in out.admitted:
        s.manager.commit_prefix(r.request_id)


def step_tokens(s: Scheduler, out) -> int:
    new = {r.request_id for r in out.admitted}
    return sum(r.prefill_tokens if rid in new else r.denoise_tokens for rid, r in s.running.items())


@pytest.mark.parametrize("cfg", [False, True], ids=["one-row", "cfg"])
def test_a_request_whose_hit_fits_the_budget_is_admitted_in_the_same_tick(cfg):
    rows, keys = request([1, 2, 3, 4, 5, 6, 7, 8], cfg)
    budget = sum(r.seq_len for r in rows)  # the whole prefill just passes the intake
    s = scheduler(budget)
    s.add_request("a", rows, prefix_keys=keys)
    first_step(s, s.schedule())  # a runs alone: its pages are cached
    s.add_request("b", rows, prefix_keys=keys)
    out = s.schedule()
    # a's denoise tokens + b's whole prefill are over the budget; with b's hit (8 pages a row) they fit
    assert [r.request_id for r in out.admitted] == ["b"]
    b = out.admitted[0]
    assert b.cache_hit_tokens == (8 * BS,) * len(rows) and b.prefill_tokens == sum(r.seq_len - 8 * BS for r in rows)
    assert step_tokens(s, out) <= budget < s.running["a"].denoise_tokens + sum(r.seq_len for r in rows)


def test_the_intake_still_refuses_on_the_whole_prefill():
    """A hit is not guaranteed (the pages may be evicted before the request is admitted): a request whose
    whole first step is over the budget is refused at once, even while the cache holds its pages."""
    rows, keys = request([1, 2, 3, 4], False)
    s = scheduler(rows[0].seq_len)
    s.add_request("a", rows, prefix_keys=keys)
    first_step(s, s.schedule())
    small = Scheduler(s.manager, max_batched_tokens=rows[0].seq_len - 1)
    assert s.manager.expected_hit_tokens(rows, keys) == [4 * BS]
    with pytest.raises(AdmissionError, match="max_num_batched_tokens"):
        small.add_request("b", rows, prefix_keys=keys)


def test_a_hit_evicted_before_the_reservation_is_rolled_back_and_the_request_waits():
    """The credit is the hit the reservation gets (nothing changes the pool between the check and the
    reservation); should a smaller hit ever come (here: the cache emptied inside the reservation call),
    the reservation is taken back whole, the request keeps the head, and it runs later without the hit."""
    rows, keys = request([1, 2, 3, 4, 5, 6, 7, 8], False)
    budget = rows[0].seq_len
    s = scheduler(budget)
    m = s.manager
    s.add_request("a", rows, prefix_keys=keys)
    first_step(s, s.schedule())
    assert s.finish("a")  # its pages stay cached, evictable
    small_rows, small_keys = request([3], False)
    s.add_request("c", small_rows, prefix_keys=small_keys)
    assert [r.request_id for r in s.schedule().admitted] == ["c"]  # c runs: its denoise tokens take budget
    s.add_request("b", rows, prefix_keys=keys)
    s.add_request("d", small_rows, prefix_keys=small_keys)
    reserve = m.reserve_request

    def evicting(*a, **k):
        m.pool.drop_cache()  # another admission of this tick evicted the pages b was credited with
        return reserve(*a, **k)

    m.reserve_request = evicting
    before = (m.pool.num_free, m.pool.num_used, m.generation, dict(m.prefix_cache_stats()))
    out = s.schedule()
    m.reserve_request = reserve
    assert out.admitted == [] and list(s.waiting) == ["b", "d"]  # b keeps the head; d waits behind it
    b = s.waiting["b"]
    assert b.status is RequestStatus.WAITING and b.metadata is None and b.cache_hit_tokens is None
    assert m.num_requests == 1 and (m.pool.num_free, m.pool.num_used) == before[:2]
    assert m.prefix_cache_stats() == before[3]  # the taken-back lookup is not counted
    assert m.generation > before[2]  # a used generation is never handed out again
    assert s.finish("c")
    out = s.schedule()  # alone, b's whole prefill fits
    assert [r.request_id for r in out.admitted] == ["b"]
    assert out.admitted[0].cache_hit_tokens == (0,) and step_tokens(s, out) <= budget


def test_a_handovers_uncond_row_hit_is_credited_before_and_after_its_reservation():
    """An AR->DiT handover: row 0's prefix is in the AR row's pages (`handover`), and an uncond row with
    nothing handed over looks up. The step's budget counts that row without the pages the cache holds,
    before the reservation (`_first_step_tokens`) and after it (`prefill_tokens`), and the two agree."""
    from ditkv.core.scheduler import SchedRequest

    pages = [1, 2, 3, 4, 5, 6]
    rows, keys = request(pages, True, same=len(pages))  # the uncond row's keys are the cached ones
    s = scheduler(10 * sum(r.seq_len for r in rows))
    s.add_request("warm", rows[:1], prefix_keys=keys[1:])  # one row with the uncond row's keys
    first_step(s, s.schedule())
    assert s.finish("warm")  # its pages stay cached
    m = s.manager
    assert m.reserve_ar("h", 3 * BS) is not None  # the AR row: 3 pages of row 0's prefix written
    req = SchedRequest("h", tuple(rows), handover=(3 * BS, 0), adopt=3, prefix_keys=keys)
    whole = sum(r.seq_len for r in rows) - 3 * BS
    assert req.prefill_tokens == whole  # before admission nothing is credited on the request itself
    credited = s._first_step_tokens(req)
    assert credited == whole - len(pages) * BS  # the uncond row's 6 cached pages
    meta = m.reserve_request("h", rows, req.handover, adopt=req.adopt, prefix_keys=keys, handover=True)
    assert [r.num_cached_tokens for r in meta.rows] == [0, len(pages) * BS]
    req.cache_hit_tokens = (0, meta.rows[1].num_cached_tokens)
    assert req.prefill_tokens == credited == sum(r.seq_len - r.num_computed_tokens for r in meta.rows)


class AdmissionMachine(RuleBasedStateMachine):
    """Requests with prefix keys join, run and leave; every tick's query tokens stay within the budget
    counted with the real metadata, and every credit the check gave equals the reservation's shared pages."""

    @initialize(budget=st.integers(60, 400), blocks=st.integers(12, 60), max_running=st.integers(1, 4))
    def setup(self, budget, blocks, max_running):
        self.s = Scheduler(DiffusionKVCacheManager(blocks, BS, 2, prefix_caching=True), max_running=max_running,
                           max_batched_tokens=budget)
        self.budget, self.total, self.n = budget, blocks, 0
        self.credit: dict[str, list[int]] = {}
        self.steps_left: dict[str, int] = {}
        expected = self.s.manager.expected_hit_tokens

        def recording(rows, keys, handover=None):
            out = expected(rows, keys, handover)
            self.credit[self._asked] = out
            return out
        self.s.manager.expected_hit_tokens = recording
        self._asked = None
        first = self.s._first_step_tokens

        def asking(req):
            self._asked = req.request_id
            return first(req)
        self.s._first_step_tokens = asking

    @rule(pages=st.lists(st.integers(0, 2), min_size=1, max_size=6), cfg=st.booleans(), same=st.integers(0, 6),
          tlen=st.integers(4, 40))
    def join(self, pages, cfg, same, tlen):
        rid, self.n = f"r{self.n}", self.n + 1
        rows, keys = request(pages, cfg, tlen, min(same, len(pages)))
        try:
            self.s.add_request(rid, rows, prefix_keys=keys)
        except AdmissionError:
            assert (sum(r.seq_len for r in rows) > self.budget
                    or self.s.manager.required_blocks(rows) > self.total)

    @rule(steps=st.integers(1, 3))
    def tick(self, steps):
        self.credit.clear()
        out = self.s.schedule()
        assert step_tokens(self.s, out) <= self.budget
        for r in out.admitted:
            lead = [row.num_cached_tokens for row in r.metadata.rows]
            assert self.credit[r.request_id] == lead  # the credit is the hit it got
            assert r.prefill_tokens == sum(row.seq_len - n for row, n in zip(r.rows, lead))
            event("admitted with a hit" if any(r.cache_hit_tokens) else "admitted")
            self.s.manager.commit_prefix(r.request_id)
            self.steps_left[r.request_id] = steps
        for rid in list(self.s.running):
            self.steps_left[rid] -= 1
            if not self.steps_left[rid]:
                del self.steps_left[rid]
                assert self.s.finish(rid)

    @invariant()
    def pages_accounted(self):
        if not hasattr(self, "s"):
            return
        pool = self.s.manager.pool
        owned = sum(len(row.block_ids) for r in self.s.running.values() for row in r.metadata.rows)
        assert pool.num_used <= owned and pool.num_free + pool.num_used == self.total
        if not self.s.running:
            assert pool.num_free == self.total and int(np.sum(pool.ref_count)) == 0


AdmissionMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
TestAdmissionMachine = AdmissionMachine.TestCase
