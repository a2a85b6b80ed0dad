"""`MultiprocExecutor`: one spawned process per rank (`rank_group.RankGroup`), one `BatchStep`
to every rank per engine step (the requests that join and leave travel with it), and a stage
replica's KV receives. The image comes back from the output rank only.
"""

from __future__ import annotations

import time

from ..errors import ConfigError
from .frontend import load_frontend
from .hooks import rank_hooks
from .messages import ARWork, BatchDone, Msg, NewRequest, Received, RegisterReceive, Registered, Sent, Unregister
from .options import ExecutorOptions
from .outcome import ARReply, ar_reply, step_outcomes
from .rank_group import RankGroup
from .step_queue import StepQueue


class MultiprocExecutor(RankGroup):
    kind = "mp"

    def __init__(self, config, model_bundle=None, options: ExecutorOptions | None = None):
        opts = options or ExecutorOptions()
        world_size = rank_hooks(opts).num_ranks(config)
        if opts.devices is not None and len(opts.devices) != world_size:
            raise ConfigError("devices", opts.devices, f"needs one device per rank ({world_size})")
        self.config = config
        # the engine process only needs the model config and tokenizer (its processor: layouts, defaults)
        front = model_bundle() if callable(model_bundle) else model_bundle
        self.model_config, self.tokenizer = load_frontend(config, front)
        from ..worker.parallel import validate_parallel

        validate_parallel(config, self.model_config)  # fail before spawning anything, naming the fix
        self._received: list[Received] = []  # completion notices, collected by `take_received`
        self._sent: list[Sent] = []  # AR ranks' write reports, collected by `take_sent`
        self._registered: dict[tuple[int, str], Registered] = {}
        self._queue = StepQueue()  # sent with the next BatchStep
        self._ar = ARReply()  # the last step's AR results
        super().__init__(config, world_size, model_bundle, opts)

    def remove(self, request_id: str, generation: int | None) -> None:
        pass  # every rank cleared the rows before it reported

    # ---- the step loop (rank_steps.run_batch_step on every rank) ----------------------------
    def start(self, msg: NewRequest) -> None:
        """Join `msg` to the batch: sent with the next step; a bad input ends it in that step."""
        self._queue.start(msg)

    def drop(self, request_id: str) -> bool:
        """Leave the batch: the ranks clear its rows at the next step (`StepQueue.drop`)."""
        self._queue.drop(request_id)
        return True

    def queue_ar(self, works: list[ARWork]) -> None:
        """The AR work of the next step (prefill chunks, decode tokens), to every rank."""
        self._queue.ar(works)

    def end_ar(self, request_id: str) -> None:
        """Every rank forgets the request's AR row at the next step, before its starts."""
        self._queue.end_ar(request_id)

    def take_ar(self) -> ARReply:
        """The AR results of the last `step_batch`: the output rank's ids; a work failed on any rank
        is failed (empty when the step had no AR work)."""
        out, self._ar = self._ar, ARReply()
        return out

    def step_batch(self):
        """One `BatchStep` on every rank -> the `StepOutcome`s of the requests that ended in it."""
        msg = self._queue.take()
        self._ar = ARReply()
        replies = self.call_all(msg, BatchDone, msg.request_id)
        try:
            self._ar = ar_reply(replies, msg.ar, self.world_size)
            return step_outcomes(replies, self.world_size)
        except ValueError as e:  # the votes make ranks agree; a split is a protocol bug
            self._fail(str(e))

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
