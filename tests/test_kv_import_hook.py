"""The scheduler's KV-import hook (engine/kv_import.py): reserve -> start -> poll -> kv_ready ->
running; the scheduler quarantines the pages of a request ended while the hook says a write may
still land, frees them when the hook reports it settled, and rolls back a failed start."""

from ditkv.core.kv_manager import DiffusionKVCacheManager
from ditkv.core.layout import RowLayout
from ditkv.core.scheduler import KVImportEvents, RequestStatus, Scheduler


class FakeHook:
    max_waiting_for_kv = 4

    def __init__(self):
        self.started, self.in_flight, self.events = [], set(), KVImportEvents()
        self.start_error = None
        self.ended = []

    def start(self, req):
        self.started.append(req.request_id)
        if self.start_error:
            return self.start_error
        self.in_flight.add(req.request_id)
        return None

    def poll(self):
        ev, self.events = self.events, KVImportEvents()
        return ev

    def running(self, req):
        return ("slot", req.request_id)

    def finished(self, req, error, cancelled):
        self.ended.append((req.request_id, req.status, error, cancelled))
        return req.request_id in self.in_flight


def rows(n=2):
    return [RowLayout(i, 20, 20, 40, ((21, 40),)) for i in range(n)]


def make():
    m = DiffusionKVCacheManager(20, 16, 2)
    h = FakeHook()
    return Scheduler(m, max_running=2, max_waiting_for_kv=h.max_waiting_for_kv, kv_import=h), m, h


def test_reserve_start_ready_running():
    s, m, h = make()
    s.add_request("a", rows(), num_computed_tokens=[20, 1])
    out = s.schedule()
    assert [r.request_id for r in out.reserved] == ["a"] and h.started == ["a"] and not out.admitted
    assert s.get("a").status is RequestStatus.WAITING_FOR_KV
    h.in_flight.discard("a")
    h.events.ready.append("a")
    out = s.schedule()  # ready at this tick's poll: it runs now
    assert [r.request_id for r in out.admitted] == ["a"] and out.admitted[0].import_params == ("slot", "a")
    s.finish("a")
    assert h.ended[-1][:2] == ("a", RequestStatus.RUNNING)
    assert m.pool.num_free == m.pool.num_blocks


def test_cancel_in_flight_quarantines_until_settled():
    s, m, h = make()
    s.add_request("a", rows(), num_computed_tokens=[20, 1])
    s.schedule()
    assert s.cancel("a", "cancelled")  # the hook says the write may land: the scheduler quarantines
    assert h.ended == [("a", RequestStatus.WAITING_FOR_KV, "cancelled", True)]
    assert m.num_quarantined_blocks > 0 and m.pool.num_free < m.pool.num_blocks
    h.events.settled.append("a")
    s.schedule()
    assert m.num_quarantined_blocks == 0 and m.pool.num_free == m.pool.num_blocks


def test_failed_event_quarantines_and_a_failed_start_rolls_back():
    s, m, h = make()
    s.add_request("a", rows(), num_computed_tokens=[20, 1])
    s.schedule()
    h.events.failed.append(("a", "timed out receiving KV", False))
    out = s.schedule()
    assert [(f.request_id, f.status, f.error) for f in out.finished] == [
        ("a", RequestStatus.FINISHED_ERROR, "timed out receiving KV")]
    assert m.num_quarantined_blocks > 0
    h.start_error = "KV receive registration failed: no"
    s.add_request("b", rows(), num_computed_tokens=[20, 1])
    out = s.schedule()  # nothing was dispatched: freed at once, no quarantine for b
    assert [(f.request_id, f.error) for f in out.finished] == [("b", "KV receive registration failed: no")]
    assert "b" not in m.quarantined_requests()
    h.events.settled.append("a")
    s.schedule()
    assert m.pool.num_free == m.pool.num_blocks
