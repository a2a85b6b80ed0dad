import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ditkv.core.block_pool import FREE
from ditkv.core.kv_manager import DiffusionKVCacheManager
from ditkv.core.layout import RowLayout
from ditkv.core.scheduler import RequestStatus, Scheduler
from ditkv.errors import AdmissionError


def rows(n=2, seq=40):
    return [RowLayout(i, 8, 20, seq, ((9, 28),)) for i in range(n)]


def sched(blocks=10, max_running=4, max_len=None):
    return Scheduler(DiffusionKVCacheManager(blocks, 16, 2, max_len), max_running=max_running)


def test_fifo_admission_and_backpressure():
    s = sched(blocks=10)
    s.add_request("a", rows())  # 6 blocks
    s.add_request("b", rows())  # 6 blocks: must wait
    s.add_request("c", rows(1))  # 3 blocks: fits, but stays behind b (strict FIFO)
    out = s.schedule()
    assert [r.request_id for r in out.admitted] == ["a"] and not out.finished
    assert s.get("b").status is RequestStatus.WAITING and s.num_waiting == 2
    assert s.schedule().admitted == []  # still short
    s.finish("a")
    out = s.schedule()
    assert [f.request_id for f in out.finished] == ["a"] and out.finished[0].status is RequestStatus.FINISHED_OK
    assert [r.request_id for r in out.admitted] == ["b", "c"]  # the head no longer blocks c
    assert out.admitted[0].metadata.generation == 2 and out.admitted[1].metadata.generation == 3


def test_impossible_request_rejected_at_once_and_queue_unblocked():
    s = sched(blocks=10, max_len=200)
    with pytest.raises(AdmissionError, match="required_blocks"):
        s.add_request("huge", rows(seq=64 * 3))  # would never fit: never queued
    with pytest.raises(AdmissionError, match="max_model_len"):
        s.add_request("long", [RowLayout(0, 8, 20, 201)])
    s.add_request("small", rows(1))
    assert [r.request_id for r in s.schedule().admitted] == ["small"]


def test_max_running_limits_admission():
    s = sched(blocks=100, max_running=1)
    s.add_request("a", rows())
    s.add_request("b", rows())
    assert len(s.schedule().admitted) == 1 and s.num_waiting == 1


def test_cancel_waiting_and_running_release_blocks():
    s = sched(blocks=10)
    s.add_request("a", rows())
    s.add_request("b", rows())
    s.schedule()
    assert s.cancel("b") and s.cancel("a")
    assert not s.cancel("a") and not s.cancel("zzz")
    out = s.schedule()
    fin = {f.request_id: f for f in out.finished}
    assert fin["a"].generation == 1  # running: its worker rows must be cleared
    assert fin["b"].generation is None  # never reached a worker
    assert all(f.status is RequestStatus.FINISHED_CANCELLED for f in out.finished)
    assert s.manager.pool.num_free == 10


def test_error_path_and_shutdown_free_everything():
    s = sched(blocks=20)
    for rid in "abc":
        s.add_request(rid, rows())
    s.schedule()
    s.finish("a", error="worker exploded")
    out = s.schedule()
    assert out.finished[0].status is RequestStatus.FINISHED_ERROR and "exploded" in out.finished[0].error
    s.add_request("d", rows())
    out = s.shutdown()
    assert {f.request_id for f in out.finished} == {"b", "c", "d"}
    assert s.manager.pool.num_free == 20 and not s.has_work()


def test_duplicate_live_id_rejected_but_reusable_after_finish():
    s = sched()
    s.add_request("a", rows(1))
    with pytest.raises(ValueError, match="already live"):
        s.add_request("a", rows(1))
    s.schedule()
    s.finish("a")
    s.add_request("a", rows(1))


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / schedule / finish / cancel / error / shutdown; invariants after every step."""

    @initialize(blocks=st.integers(4, 40), max_running=st.integers(1, 4))
    def setup(self, blocks, max_running):
        self.s = sched(blocks=blocks, max_running=max_running)
        self.total = blocks
        self.n = 0
        self.last_gen = 0
        self.closed = False
        self.quarantined = {}

    @precondition(lambda self: not self.closed)
    @rule(n_rows=st.integers(1, 2), seq=st.integers(29, 200))
    def add(self, n_rows, seq):
        rid = f"r{self.n}"
        self.n += 1
        try:
            self.s.add_request(rid, rows(n_rows, seq))
        except AdmissionError:
            assert self.s.manager.required_blocks(rows(n_rows, seq)) > self.total

    @precondition(lambda self: not self.closed)
    @rule()
    def schedule(self):
        out = self.s.schedule()
        fresh = out.reserved + [r for r in out.admitted if not r.imports_kv]  # new reservations this tick
        # one tick may admit one request and reserve another: check them in reservation order
        for req in sorted(fresh, key=lambda r: r.metadata.generation):
            assert req.metadata.generation > self.last_gen
            self.last_gen = req.metadata.generation
        for req in out.admitted:
            assert req.metadata.generation <= self.last_gen

    @precondition(lambda self: not self.closed)
    @rule(data=st.data(), error=st.booleans())
    def finish(self, data, error):  # running requests only
        if self.s.running:
            rid = data.draw(st.sampled_from(sorted(self.s.running)))
            self.s.finish(rid, error="boom" if error else None)

    @precondition(lambda self: not self.closed)
    @rule(data=st.data())
    def cancel(self, data):
        live = sorted(self.s.running) + sorted(self.s.waiting)
        if live:
            self.s.cancel(data.draw(st.sampled_from(live)))

    @precondition(lambda self: not self.closed)
    @rule(seq=st.integers(29, 120), imported=st.integers(0, 8))
    def add_importing(self, seq, imported):
        """A request whose prefix arrives by transfer: reserved first, runs after kv_ready."""
        rid = f"r{self.n}"
        self.n += 1
        try:
            self.s.add_request(rid, rows(2, seq), num_computed_tokens=[imported, min(imported, 1)])
        except AdmissionError:
            assert self.s.manager.required_blocks(rows(2, seq)) > self.total

    @precondition(lambda self: not self.closed)
    @rule(data=st.data())
    def kv_ready(self, data):
        if self.s.waiting_for_kv:
            self.s.kv_ready(data.draw(st.sampled_from(sorted(self.s.waiting_for_kv))))

    @precondition(lambda self: not self.closed)
    @rule(data=st.data(), cancel=st.booleans())
    def fail_in_flight(self, data, cancel):
        """Timeout / cancel during a transfer: pages stay quarantined until every rank settles."""
        if self.s.waiting_for_kv:
            rid = data.draw(st.sampled_from(sorted(self.s.waiting_for_kv)))
            held = sum(len(r.block_ids) for r in self.s.waiting_for_kv[rid].metadata.rows)
            free = self.s.manager.pool.num_free
            if cancel:
                self.s.cancel(rid, quarantine=True)
            else:
                self.s.fail(rid, "timed out receiving KV", quarantine=True)
            assert self.s.manager.pool.num_free == free  # nothing reused while in flight
            self.quarantined[rid] = held

    @precondition(lambda self: not self.closed)
    @rule(data=st.data())
    def settle(self, data):
        if self.quarantined:
            rid = data.draw(st.sampled_from(sorted(self.quarantined)))
            free = self.s.manager.pool.num_free
            assert self.s.release_quarantine(rid)
            assert self.s.manager.pool.num_free == free + self.quarantined.pop(rid)

    @rule()
    def shutdown(self):
        self.s.shutdown()
        self.closed = True
        self.quarantined.clear()
        assert self.s.manager.pool.num_free == self.total

    @invariant()
    def pool_consistent(self):
        if not hasattr(self, "s"):
            return
        pool = self.s.manager.pool
        assert pool.num_free + pool.num_used == self.total
        live = list(self.s.running.values()) + list(self.s.waiting_for_kv.values())
        owned = [b for r in live for row in r.metadata.rows for b in row.block_ids]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert len(owned) + self.s.manager.num_quarantined_blocks == pool.num_used
        assert (pool.owner[owned] != FREE).all()  # no owned block is in the free pool
        if not self.s.has_work() and not self.quarantined:
            assert pool.num_free == self.total


SchedulerMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=100, deadline=None)
TestSchedulerMachine = SchedulerMachine.TestCase
