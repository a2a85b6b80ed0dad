"""AR-stage leases (core/leases.py): every page is owned by exactly one lease or free, hand-over keeps
the prefix pages and returns the tail at once, stale releases free nothing."""

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from ditkv.core.leases import LeaseManager


def test_hand_over_keeps_the_prefix_and_returns_the_tail():
    m = LeaseManager(10, 16)
    job = m.acquire("job:a", 6)
    ticket = m.hand_over(job, "t1", 4)
    assert ticket.block_ids == job.block_ids[:4] and ticket.generation > job.generation
    assert m.pool.num_free == 6 and m.get("job:a") is None
    assert not m.release("t1", generation=job.generation)  # stale: another generation
    assert m.release("t1", generation=ticket.generation) and m.pool.num_free == 10
    assert not m.release("t1")  # already released: nothing to free twice


def test_errors_name_the_problem():
    m = LeaseManager(4, 16)
    lease = m.acquire("job:a", 2)
    with pytest.raises(ValueError, match="already held"):
        m.acquire("job:a", 1)
    with pytest.raises(ValueError, match="cannot allocate 3"):
        m.acquire("job:b", 3)
    with pytest.raises(ValueError, match="keep=3"):
        m.hand_over(lease, "t", 3)
    m.release("job:a")
    with pytest.raises(ValueError, match="not held"):
        m.hand_over(lease, "t", 1)


class LeaseMachine(RuleBasedStateMachine):
    @initialize(blocks=st.integers(1, 24))
    def setup(self, blocks):
        self.m, self.total, self.n = LeaseManager(blocks, 16), blocks, 0
        self.model: dict[str, int] = {}  # key -> pages held

    @rule(n=st.integers(0, 8))
    def acquire(self, n):
        key = f"job:{self.n}"
        self.n += 1
        if n > self.m.pool.num_free:
            with pytest.raises(ValueError):
                self.m.acquire(key, n)
            return
        assert len(self.m.acquire(key, n).block_ids) == n
        self.model[key] = n

    @rule(data=st.data())
    def hand_over(self, data):
        jobs = sorted(k for k in self.model if k.startswith("job:"))
        if not jobs:
            return
        key = data.draw(st.sampled_from(jobs))
        keep = data.draw(st.integers(0, self.model[key]))
        free = self.m.pool.num_free
        new = self.m.hand_over(self.m.get(key), "ticket:" + key, keep)
        assert self.m.pool.num_free == free + self.model.pop(key) - keep
        self.model[new.key] = keep

    @rule(data=st.data(), stale=st.booleans())
    def release(self, data, stale):
        if not self.model:
            return
        key = data.draw(st.sampled_from(sorted(self.model)))
        lease = self.m.get(key)
        if stale:
            assert not self.m.release(key, generation=lease.generation + 1000)
            return
        assert self.m.release(key, generation=lease.generation)
        self.model.pop(key)

    @rule()
    def release_all(self):
        assert self.m.release_all() == len(self.model)
        self.model.clear()

    @invariant()
    def pages_accounted(self):
        if not hasattr(self, "m"):
            return
        held = [b for k in self.model for b in self.m.get(k).block_ids]
        assert len(held) == len(set(held)), "a page is in two leases"
        assert self.m.pool.num_used == len(held) == sum(self.model.values())
        assert self.m.pool.num_free + self.m.pool.num_used == self.total
        assert self.m.num_leases == len(self.model)


LeaseMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
TestLeaseMachine = LeaseMachine.TestCase
