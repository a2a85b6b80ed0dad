"""Connector exceptions never escape `schedule()` / `Engine.step` (issue 33, item 4).

- `start` raising ends that request only: an error result naming the cause, its pages quarantined
  (part of the write may have left) until the hook reports them settled or the engine closes; the
  other requests of the tick start and finish.
- `poll` raising fails the engine closed: every request ends with the cause, the replica is marked
  dead, and every page returns at once (the receivers are stopped first).
- the hook's `finished` raising quarantines (it cannot say whether a write may land).
First against the scheduler with a faulty fake hook, then through a stage graph with the real
`DiTImporter` and a faulty producer / consumer."""

import threading
import time

import pytest
from hypothesis import given, settings, strategies as st

from ditkv.core.kv_manager import DiffusionKVCacheManager
from ditkv.core.layout import RowLayout
from ditkv.core.scheduler import KVImportEvents, KVImportPollError, RequestStatus, Scheduler
from ditkv.stages.orchestrator import Orchestrator
from stage_helpers import full, gate_writes, req, tiny_bundle
from test_orchestrator import graph

BLOCKS = 48  # 6 blocks a request (2 rows of 40 tokens, block 16): 8 fit even if all stay quarantined


class Fatal(RuntimeError):
    """Stands for the engine's `ExecutorError`."""


class FaultyHook:
    """A KV-import hook whose `start` raises for the ids in `raise_on` (after "dispatching" them)
    or refuses those in `refuse`; `finished` raises for `finished_raises`; `poll` raises
    `poll_error` when set. Settled and ready events are queued by the test."""
    max_waiting_for_kv = 4

    def __init__(self, raise_on=(), refuse=(), finished_raises=()):
        self.raise_on, self.refuse, self.finished_raises = set(raise_on), set(refuse), set(finished_raises)
        self.started, self.in_flight, self.events = [], set(), KVImportEvents()
        self.poll_error = None

    def start(self, req):
        rid = req.request_id
        self.started.append(rid)
        if rid in self.refuse:
            return "KV receive registration failed: refused"
        self.in_flight.add(rid)
        if rid in self.raise_on:
            raise OSError(f"producer queue closed under {rid}")
        return None

    def poll(self):
        if self.poll_error is not None:
            raise self.poll_error
        ev, self.events = self.events, KVImportEvents()
        return ev

    def running(self, req):
        self.in_flight.discard(req.request_id)
        return None

    def finished(self, req, error, cancelled):
        if req.request_id in self.finished_raises:
            raise KeyError(f"no ticket for {req.request_id}")
        return req.request_id in self.in_flight


def rows(n=2):
    return [RowLayout(i, 20, 20, 40, ((21, 40),)) for i in range(n)]


def make(hook, **kw):
    m = DiffusionKVCacheManager(BLOCKS, 16, 2)
    return Scheduler(m, max_running=2, max_waiting_for_kv=hook.max_waiting_for_kv, kv_import=hook, **kw), m


def test_start_raising_ends_that_request_only_and_quarantines_until_settled():
    h = FaultyHook(raise_on={"b"})
    s, m = make(h)
    s.add_request("r", rows(), num_computed_tokens=[20, 0])
    s.schedule()
    h.events.ready.append("r")  # r runs in the same tick as b's start raises
    for rid in "abc":
        s.add_request(rid, rows(), num_computed_tokens=[20, 0])
    out = s.schedule()  # before: the OSError escaped, r was RUNNING in no output and c never started
    assert [r.request_id for r in out.admitted] == ["r"] and h.started == ["r", "a", "b", "c"]
    assert [(f.request_id, f.status) for f in out.finished] == [("b", RequestStatus.FINISHED_ERROR)]
    assert out.finished[0].error == "starting the KV transfer failed: OSError: producer queue closed under b"
    assert {rid: s.get(rid).status for rid in "ac"} == {"a": RequestStatus.WAITING_FOR_KV,
                                                        "c": RequestStatus.WAITING_FOR_KV}
    assert m.quarantined_requests() == ["b"] and m.pool.num_used == 4 * 6  # r, a, c and b's quarantine
    with pytest.raises(ValueError, match="quarantined"):
        s.add_request("b", rows(), num_computed_tokens=[20, 0])  # its pages may still be written
    h.events.settled.append("b")
    h.events.ready += ["a", "c"]
    s.finish("r")
    out = s.schedule()
    assert not m.quarantined_requests() and [r.request_id for r in out.admitted] == ["a", "c"]
    s.finish("a")
    s.finish("c")
    s.schedule()
    assert m.pool.num_free == BLOCKS and not s.has_work()


def test_finished_raising_quarantines_instead_of_escaping():
    h = FaultyHook(raise_on={"a"}, finished_raises={"a", "b"})
    s, m = make(h)
    s.add_request("a", rows(), num_computed_tokens=[20, 0])
    s.add_request("b", rows(), num_computed_tokens=[20, 0])
    out = s.schedule()  # a: start raises, then finished raises too
    assert [f.request_id for f in out.finished] == ["a"] and m.quarantined_requests() == ["a"]
    h.events.failed.append(("b", "timed out receiving KV", False))
    out = s.schedule()  # b: a failed event whose finished raises
    assert [(f.request_id, f.error) for f in out.finished] == [("b", "timed out receiving KV")]
    assert sorted(m.quarantined_requests()) == ["a", "b"]
    s.shutdown()  # nothing settles them: they return when the engine closes
    assert m.pool.num_free == BLOCKS


@settings(max_examples=60, deadline=None)
@given(plan=st.lists(st.sampled_from(["ok", "ok", "raise", "refuse"]), min_size=1, max_size=8),
       settle=st.booleans(), wait=st.integers(1, 4))
def test_every_start_fault_ends_one_request_and_no_page_leaks(plan, settle, wait):
    ids = [f"r{i}" for i in range(len(plan))]
    h = FaultyHook(raise_on={i for i, p in zip(ids, plan) if p == "raise"},
                   refuse={i for i, p in zip(ids, plan) if p == "refuse"})
    h.max_waiting_for_kv = wait
    s, m = make(h)
    for rid in ids:
        s.add_request(rid, rows(), num_computed_tokens=[20, 0])
    ended = {}
    for _ in range(3 * len(ids) + 2):
        out = s.schedule()  # never raises
        for f in out.finished:
            assert f.request_id not in ended
            ended[f.request_id] = f
        for r in out.reserved:
            if r.request_id in s.waiting_for_kv:
                h.events.ready.append(r.request_id)
        for r in out.admitted:
            s.finish(r.request_id)
        quarantined = set(m.quarantined_requests())
        assert quarantined <= h.raise_on  # only a raising start quarantines here
        live = list(s.running) + list(s.waiting_for_kv)
        assert m.pool.num_used == 6 * (len(live) + len(quarantined))
        if settle:
            h.events.settled += sorted(quarantined)
    assert set(ended) == set(ids)
    for rid, f in ended.items():
        if rid in h.raise_on:
            assert f.status is RequestStatus.FINISHED_ERROR and "OSError: producer queue closed" in f.error
        elif rid in h.refuse:
            assert f.status is RequestStatus.FINISHED_ERROR and "registration failed" in f.error
        else:
            assert f.status is RequestStatus.FINISHED_OK
    s.schedule()
    assert set(m.quarantined_requests()) == (set() if settle else h.raise_on)
    s.shutdown()
    assert m.pool.num_free == BLOCKS


def test_poll_raising_is_a_kv_import_poll_error_and_fatal_errors_pass_through():
    h = FaultyHook()
    s, m = make(h, fatal_errors=(Fatal,))
    s.add_request("a", rows(), num_computed_tokens=[20, 0])
    s.schedule()
    h.poll_error = ConnectionResetError("notice socket reset")
    with pytest.raises(KVImportPollError, match="KV import poll failed: ConnectionResetError: notice socket reset") \
            as e:
        s.schedule()
    assert isinstance(e.value.__cause__, ConnectionResetError)
    h.poll_error = Fatal("rank 1 died")
    with pytest.raises(Fatal, match="rank 1 died"):  # the engine's own error, as it is
        s.schedule()
    h.poll_error = None
    h.start = lambda req: (_ for _ in ()).throw(Fatal("rank 0 went silent"))
    s.add_request("b", rows(), num_computed_tokens=[20, 0])
    with pytest.raises(Fatal, match="went silent"):  # not turned into one request's error
        s.schedule()


# ---- through a stage graph: the real DiTImporter, a faulty producer or consumer ----------------
@pytest.fixture(scope="module")
def bundle():
    return tiny_bundle()


def step_until(orch, cond, timeout=30.0):
    """Drive the (not started) graph until `cond` holds; the producer writes on its own threads."""
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        orch.step()
        time.sleep(0.002)
    return cond()


@pytest.mark.parametrize("write", ["settled", "in-flight", "never"])
def test_dispatch_raising_fails_that_request_and_quarantines_until_settled_or_closed(bundle, write):
    """The producer's dispatch raises for the first ticket after its write went out and settled,
    while it is still in flight, or before it started: that request ends with the cause, the
    others finish, and its DiT pages stay quarantined until the write settles, or until shutdown
    when none ever will."""
    orch = Orchestrator(graph(), bundle)  # not started: orch.step() drives Engine.step here
    d, orig, first, gate = orch.dit[0], orch._send, [], threading.Event()
    tp = orch.ar[0].transport
    write_pages = tp.write

    def held_write(*a, notify=None, **kw):  # only the first ticket's write waits for the gate
        if notify is not None and notify.startswith(first[0] + "|"):
            gate.wait()
        return write_pages(*a, notify=notify, **kw)
    tp.write = held_write

    def send(t):
        if first:
            return orig(t)
        first.append(t.ticket_id)
        if write != "never":
            orig(t)
        if write == "settled":  # finished() then sees nothing in flight, the scheduler quarantines anyway
            gate.set()
            while not t.settled():
                time.sleep(0.001)
        raise RuntimeError("cannot schedule new futures after shutdown")
    orch._send = send
    try:
        outs = {o.request_id: o for o in orch.run([req(0), req(1), req(2)], concurrency=3)}
        bad = outs.pop(first[0].split("-", 1)[1])
        assert bad.status == "error" and bad.error == (
            "starting the KV transfer failed: RuntimeError: cannot schedule new futures after shutdown")
        assert all(o.ok for o in outs.values()), [o.error for o in outs.values()]
        assert not d.dead
        if write == "in-flight":
            assert d.num_quarantined == 1 and d.manager.num_quarantined_blocks > 0
            gate.set()
        if write != "never":  # the write lands, the ticket settles, the pages and the AR lease return
            assert step_until(orch, lambda: full(orch))
        else:  # nothing will ever settle it: held, while the replica keeps serving
            assert d.num_quarantined == 1 and d.manager.num_quarantined_blocks > 0
            assert orch.generate(req(3)).ok
            assert d.manager.num_quarantined_blocks > 0
    finally:
        gate.set()
        orch.shutdown()
    assert full(orch)


def test_registration_raising_rolls_back_without_quarantine(bundle):
    """Any exception from a rank's registration comes before the dispatch: that request ends, its
    pages and the AR's return at once, and the next request is served."""
    orch = Orchestrator(graph(), bundle)
    d = orch.dit[0]
    orig = d.consumers[0].register

    def register(t):
        d.consumers[0].register = orig  # once
        raise OSError("control socket closed")
    d.consumers[0].register = register
    try:
        out = orch.generate(req(0))
        assert out.status == "error" and out.error == "KV receive registration failed: OSError: control socket closed"
        assert d.manager.num_quarantined_blocks == 0 and not d.consumers[0].expecting
        assert step_until(orch, lambda: full(orch))
        assert orch.generate(req(1)).ok
    finally:
        orch.shutdown()
    assert full(orch)


def test_a_raising_start_on_a_legacy_slot_retry_ends_that_request_only(bundle):
    """Legacy: a request reserved while no receive slot was free starts from `poll` later; a raise
    there is that request's error, not the whole poll's (which would fail the replica closed)."""
    orch = Orchestrator(graph("legacy"), bundle)
    d, orig = orch.dit[0], orch._send
    slots = d.consumers[0].slots
    take, calls = slots.take, []
    slots.take = lambda: calls.append(1) or (take() if len(calls) > 1 else None)  # first try: none free

    def send(t):
        orch._send = orig
        raise RuntimeError("producer gone")
    orch._send = send
    try:
        out = orch.generate(req(0))
        assert len(calls) >= 2 and out.status == "error" and "RuntimeError: producer gone" in out.error
        assert not d.dead
        assert orch.generate(req(1)).ok
    finally:
        orch.shutdown()
    assert full(orch)


def test_poll_raising_fails_the_replica_closed_and_returns_every_page(bundle):
    """Option (b) of issue 33: a poll that raised may have dropped notices, so the replica fails
    closed; the request in flight ends with the cause, all of its pages return at once."""
    orch = Orchestrator(graph(), bundle)
    gates = [threading.Event()]
    gate_writes(orch, gates)  # hold the write: the request waits for its KV
    d = orch.dit[0]
    try:
        rid = orch.submit(req(0))
        assert step_until(orch, lambda: d.scheduler.num_waiting_for_kv == 1)
        assert d.manager.pool.num_free < d.manager.pool.num_blocks

        def broken():
            raise OSError("notice socket closed")
        d.consumers[0].poll = broken
        orch.step()  # before: the OSError escaped Engine.step on every tick, the request hung
        out = orch.take(rid, timeout=30)
        assert out.status == "error" and "failed closed" in out.error
        assert "KV import poll failed: OSError: notice socket closed" in out.error
        assert d.dead and "notice socket closed" in d.dead and d.stats()["dead"]
        assert d.manager.pool.num_free == d.manager.pool.num_blocks and d.manager.num_quarantined_blocks == 0
        late = orch.generate(req(1))
        assert late.status == "error" and "no live DiT replica" in late.error
    finally:
        gates[0].set()
        orch.shutdown()
    assert full(orch)
