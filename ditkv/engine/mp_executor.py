"""`MultiprocExecutor`: one spawned process per rank (`rank_group.RankGroup`), and the requests
routed over them: whole requests (`Execute`, progress and aborts relayed), step-level batching
(one `BatchStep` per engine step) and a stage replica's KV receives. The image comes back from the
output rank only.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

from ..errors import ConfigError, LayoutError
from ..models.hunyuan.layout import build_request_layout
from .frontend import images_kw, load_frontend
from .hooks import rank_hooks
from .messages import (Abort, BatchDone, BatchStep, Execute, Msg, Received, RegisterReceive, Registered, RequestDone,
                       Sent, StepDone, Unregister)
from .options import ExecutorOptions
from .outcome import Outcome, combine
from .rank_group import RankGroup


class MultiprocExecutor(RankGroup):
    kind = "mp"

    def __init__(self, config, model_bundle=None, options: ExecutorOptions | None = None):
        opts = options or ExecutorOptions()
        world_size = rank_hooks(opts).num_ranks(config)
        if opts.devices is not None and len(opts.devices) != world_size:
            raise ConfigError("devices", opts.devices, f"needs one device per rank ({world_size})")
        self.config = config
        # the engine process only needs the model config and tokenizer (layouts, defaults)
        front = model_bundle() if callable(model_bundle) else model_bundle
        self.model_config, self.tokenizer = load_frontend(config, front)
        from ..worker.parallel import validate_parallel

        validate_parallel(config, self.model_config)  # fail before spawning anything, naming the fix
        self._received: list[Received] = []  # completion notices, collected by `take_received`
        self._sent: list[Sent] = []  # AR ranks' write reports, collected by `take_sent`
        self._registered: dict[tuple[int, str], Registered] = {}
        self._batch_starts: list[Execute] = []  # step-level batching: sent with the next BatchStep
        self._batch_drops: list[str] = []
        self._batch_ids = itertools.count()
        super().__init__(config, world_size, model_bundle, opts)

    # ---- the request path ---------------------------------------------------------------
    def layout(self, prompt, height, width, guidance, negative_prompt=None, images=None):
        """Built here from the model config and tokenizer (no weights in this process); every rank
        rebuilds it from the `Execute` message (`rank_steps.layout_of`), input images included."""
        layout = build_request_layout(self.model_config, self.tokenizer, prompt, height, width, guidance,
                                      negative_prompt, **images_kw(images))
        cfg = self.config.cfg_parallel_size
        if cfg > 1 and len(layout.rows) != cfg:  # the ranks would reject it: say so at intake
            raise LayoutError(f"cfg_parallel_size={cfg} needs a CFG request with {cfg} rows (cond, uncond), "
                              f"got {len(layout.rows)}; use guidance_scale > 1, or cfg_parallel_size=1",
                              field="guidance_scale")
        return layout

    def execute(self, msg: Execute, layout=None, on_step: Callable[[int], None] | None = None,
                should_stop: Callable[[], bool] | None = None) -> Outcome:
        """Broadcast `msg`, relay progress, forward an abort, and wait for every rank's report."""
        self._ensure_alive()
        rid, o = msg.request_id, self.opts
        self._broadcast(msg)
        done: dict[int, RequestDone] = {}
        aborted, failed_at, progress_at = False, None, time.monotonic()
        while len(done) < self.world_size:
            if not aborted and should_stop is not None and should_stop():
                self._broadcast(Abort(request_id=rid))
                aborted = True
            m = self._recv(min(0.05, o.heartbeat_interval_s))
            now = time.monotonic()
            if isinstance(m, StepDone) and m.request_id == rid:
                progress_at = now
                if on_step is not None:
                    on_step(m.step)
            elif isinstance(m, RequestDone) and m.request_id == rid:
                done[m.rank] = m
                if m.status == "error" and failed_at is None:
                    failed_at = now
                    if not aborted:  # ranks without a group learn of it here; grouped ranks also vote
                        self._broadcast(Abort(request_id=rid))
                        aborted = True
            self._check_ranks() if m is None else self._check_exits()  # silence counts once the queue is empty
            if failed_at is not None and now - failed_at > o.drain_timeout_s:
                bad = min(r for r, d in done.items() if d.status == "error")
                missing = sorted(set(range(self.world_size)) - set(done))
                self._fail(f"request {rid!r} failed on rank {bad} ({done[bad].error}) and ranks {missing} did "
                           f"not stop within drain_timeout_s={o.drain_timeout_s}: the group is wedged")
            if o.step_timeout_s is not None and now - progress_at > o.step_timeout_s:
                self._fail(f"request {rid!r} made no step progress for step_timeout_s={o.step_timeout_s}")
        return combine(done, self.world_size)

    def remove(self, request_id: str, generation: int | None) -> None:
        pass  # every rank cleared the rows before it reported

    # ---- step-level batching (worker/batch.py on every rank) -----------------------------
    def start(self, msg: Execute, layout) -> None:
        """Join `msg` to the batch: sent with the next step; a bad input ends it in that step."""
        self._batch_starts.append(msg)

    def drop(self, request_id: str) -> bool:
        """Leave the batch: the ranks clear its rows at the next step, before any start of that step
        (so pages the scheduler frees now are reused only after the rows are gone)."""
        queued = [m for m in self._batch_starts if m.request_id != request_id]
        if len(queued) != len(self._batch_starts):
            self._batch_starts = queued
        else:
            self._batch_drops.append(request_id)
        return True

    def step_batch(self):
        """One `BatchStep` on every rank -> the `StepOutcome`s of the requests that ended in it."""
        from ..worker.batch import StepOutcome

        msg = BatchStep(request_id=f"batch-{next(self._batch_ids)}", starts=self._batch_starts,
                        drops=self._batch_drops)
        self._batch_starts, self._batch_drops = [], []
        replies = self.call_all(msg, BatchDone, msg.request_id)
        per_req: dict[str, dict[int, RequestDone]] = {}
        for r, rep in replies.items():
            for d in rep.ended:
                per_req.setdefault(d.request_id, {})[r] = d
        outcomes = []
        for rid, done in per_req.items():
            if len(done) != self.world_size:  # the votes make ranks agree; a split is a protocol bug
                self._fail(f"ranks disagree on the end of request {rid!r}: only ranks {sorted(done)} reported it")
            o = combine(done, self.world_size)
            outcomes.append(StepOutcome(rid, "ok" if o.status == "ok" else "error", image=o.image, stats=o.stats,
                                        error=o.error))
        return outcomes

    # ---- KV receives (stage replicas) ---------------------------------------------------
    def register(self, rank: int, ticket_id: str, rows) -> Registered:
        """Ask `rank` to expect `ticket_id` (rows: (row id, tokens, block ids)); its answer (`error`
        set when it refused).
        A rank that dies or stays silent fails the replica closed (`ExecutorError`)."""
        self._ensure_alive()
        self._send_to(rank, RegisterReceive(ticket_id=ticket_id, rows=[(r, n, list(b)) for r, n, b in rows]))
        deadline = time.monotonic() + self.opts.register_timeout_s
        while (rank, ticket_id) not in self._registered:
            if self._recv(0.05) is None:
                self._check_ranks()
            if time.monotonic() > deadline:
                self._fail(f"rank {rank} did not answer a receive registration within "
                           f"register_timeout_s={self.opts.register_timeout_s}")
        return self._registered.pop((rank, ticket_id))

    def unregister(self, rank: int, ticket_id: str) -> None:
        if self.failed is None:
            self._send_to(rank, Unregister(ticket_id=ticket_id))

    def take_received(self) -> list[Received]:
        """Completion notices forwarded by the ranks since the last call (drains the socket and
        checks the ranks' health first)."""
        self.check_health()
        out, self._received = self._received, []
        return out

    def take_sent(self) -> list[Sent]:
        """AR ranks' write reports since the last call (after a health check)."""
        self.check_health()
        out, self._sent = self._sent, []
        return out

    def _recv(self, timeout_s: float) -> Msg | None:
        m = super()._recv(timeout_s)
        if isinstance(m, Received):  # may arrive while a request runs: kept for the replica
            self._received.append(m)
        elif isinstance(m, Sent):
            self._sent.append(m)
        elif isinstance(m, Registered):
            self._registered[(m.rank, m.ticket_id)] = m
        return m
