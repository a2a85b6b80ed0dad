"""State-machine rules for step-level batch formation (issue 15): requests join and leave the
running batch between steps, a cancel mid-batch ends only that request, and every step stays
within `max_num_seqs` (max_running) and `max_num_batched_tokens`."""

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ditkv.core.kv_manager import DiffusionKVCacheManager
from ditkv.core.layout import RowLayout
from ditkv.core.scheduler import RequestStatus, Scheduler
from ditkv.errors import AdmissionError


def rows(n: int, seq: int) -> list[RowLayout]:
    return [RowLayout(i, 8, 20, seq, ((9, 28),)) for i in range(n)]


class BatchFormationMachine(RuleBasedStateMachine):
    """The engine's view of a tick: `schedule()` forms the step's batch (the running requests, with
    the newly admitted ones running their prefill), then the batch runs one step; requests leave
    when done, on error, or cancelled mid-batch."""

    @initialize(blocks=st.integers(6, 48), max_running=st.integers(1, 6),
                max_tokens=st.one_of(st.none(), st.integers(40, 600)))
    def setup(self, blocks, max_running, max_tokens):
        self.s = Scheduler(DiffusionKVCacheManager(blocks, 16, 2, None), max_running=max_running,
                           max_batched_tokens=max_tokens)
        self.total, self.max_running, self.max_tokens = blocks, max_running, max_tokens
        self.n = 0
        self.order: list[str] = []  # arrival order of plain (non-importing) requests still waiting
        self.steps_left: dict[str, int] = {}
        self.closed = False

    def _add(self, n_rows: int, seq: int, imported: int | None) -> None:
        rid = f"r{self.n}"
        self.n += 1
        computed = None if imported is None else [imported] + [min(imported, 1)] * (n_rows - 1)
        try:
            req = self.s.add_request(rid, rows(n_rows, seq), num_computed_tokens=computed)
        except AdmissionError:
            need = sum(seq - c for c in (computed or [0] * n_rows))
            too_big = self.s.manager.required_blocks(rows(n_rows, seq)) > self.total
            assert too_big or (self.max_tokens is not None and need > self.max_tokens)
            return
        assert req.status is RequestStatus.WAITING
        if imported is None:
            self.order.append(rid)

    @precondition(lambda self: not self.closed)
    @rule(n_rows=st.integers(1, 2), seq=st.integers(29, 160))
    def join(self, n_rows, seq):
        self._add(n_rows, seq, None)

    @precondition(lambda self: not self.closed)
    @rule(seq=st.integers(29, 120), imported=st.integers(0, 8))
    def join_by_transfer(self, seq, imported):
        self._add(2, seq, imported)

    @precondition(lambda self: not self.closed)
    @rule(data=st.data())
    def kv_ready(self, data):
        if self.s.waiting_for_kv:
            self.s.kv_ready(data.draw(st.sampled_from(sorted(self.s.waiting_for_kv))))

    @precondition(lambda self: not self.closed)
    @rule(steps=st.integers(1, 4))
    def step(self, steps):
        """One tick: form the batch, check its bounds, run one denoising step for everyone."""
        before = dict(self.s.running)
        out = self.s.schedule()
        new = {r.request_id for r in out.admitted}
        batch = self.s.running
        assert set(before) <= set(batch)  # nobody leaves at a tick; they leave by finish/cancel
        assert len(batch) <= self.max_running
        tokens = sum(r.prefill_tokens if rid in new else r.denoise_tokens for rid, r in batch.items())
        if self.max_tokens is not None:
            assert tokens <= self.max_tokens, (tokens, self.max_tokens)
        plain = [r.request_id for r in out.admitted if not r.imports_kv]
        assert plain == self.order[:len(plain)], "plain requests join in arrival order (FIFO)"
        del self.order[:len(plain)]
        for rid in new:
            self.steps_left[rid] = steps
        for rid in list(batch):  # the batch runs; requests whose last step this was leave
            self.steps_left[rid] -= 1
            if self.steps_left[rid] == 0:
                del self.steps_left[rid]
                assert self.s.finish(rid)

    @precondition(lambda self: not self.closed)
    @rule(data=st.data(), error=st.booleans())
    def leave_mid_batch(self, data, error):
        """A cancel or error of one running request: only it ends, its blocks come back at once."""
        if not self.s.running:
            return
        rid = data.draw(st.sampled_from(sorted(self.s.running)))
        others = set(self.s.running) - {rid}
        held = sum(len(r.block_ids) for r in self.s.running[rid].metadata.rows)
        free = self.s.manager.pool.num_free
        if error:
            assert self.s.finish(rid, error="decode failed")
        else:
            assert self.s.cancel(rid)
        self.steps_left.pop(rid, None)
        assert set(self.s.running) == others
        assert self.s.manager.pool.num_free == free + held

    @precondition(lambda self: not self.closed)
    @rule(data=st.data())
    def cancel_waiting(self, data):
        if self.s.waiting:
            rid = data.draw(st.sampled_from(sorted(self.s.waiting)))
            assert self.s.cancel(rid)
            if rid in self.order:
                self.order.remove(rid)

    @rule()
    def shutdown(self):
        self.s.shutdown()
        self.closed = True
        assert self.s.manager.pool.num_free == self.total

    @invariant()
    def blocks_accounted(self):
        if not hasattr(self, "s"):
            return
        pool = self.s.manager.pool
        live = list(self.s.running.values()) + list(self.s.waiting_for_kv.values())
        owned = [b for r in live for row in r.metadata.rows for b in row.block_ids]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert len(owned) == pool.num_used  # no quarantine in this machine: every used block is owned
        if not self.s.has_work():
            assert pool.num_free == self.total

    @invariant()
    def running_matches_steps(self):
        if hasattr(self, "s") and not self.closed:
            assert set(self.steps_left) == set(self.s.running)


BatchFormationMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=60, deadline=None)
TestBatchFormation = BatchFormationMachine.TestCase


def test_waiting_head_blocks_smaller_requests_until_it_fits_the_token_bound():
    """Strict FIFO under the token bound: a big head waits for tokens; a small one behind it must
    not overtake it (the head would otherwise starve)."""
    s = Scheduler(DiffusionKVCacheManager(64, 16, 2, None), max_running=8, max_batched_tokens=200)
    s.add_request("a", rows(1, 120))
    assert [r.request_id for r in s.schedule().admitted] == ["a"]  # a now denoises 20 tokens a step
    s.add_request("big", rows(2, 100))  # prefill 200: 20 + 200 > 200, must wait for a to leave
    s.add_request("small", rows(1, 40))
    assert s.schedule().admitted == []
    s.finish("a")
    assert [r.request_id for r in s.schedule().admitted] == ["big"]
    assert s.num_waiting == 1  # small: big's prefill (200) + 40 > 200 in big's first step
    assert [r.request_id for r in s.schedule().admitted] == ["small"]  # then 40 denoise + 40 prefill
