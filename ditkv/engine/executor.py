"""Executors: run one engine step on every rank of a replica (`start` and `drop` queue the
requests that join and leave, `queue_ar` and `end_ar` the step's AR work; `step_batch` sends them
with the step) and bring back the requests that ended in it (`take_ar`: what its AR pass drew).

- `InprocExecutor` (here): one rank, in the engine's process (the default for world_size == 1).
- `MultiprocExecutor` (`mp_executor.py`): one spawned process per rank (`rank_group.py`: spawning,
  the control socket, liveness and the failure model; `proc.py`: the rank process itself).

Both run a rank's work through `rank_steps.py` over a worker built by `rank_setup.py`; `options`
(`ExecutorOptions`) may carry `RankHooks` (`hooks.py`), the extension point of the ranks.
"""

from __future__ import annotations

from .frontend import load_frontend
from .hooks import rank_hooks
from .messages import ARWork, NewRequest
from .mp_executor import MultiprocExecutor
from .options import ExecutorOptions
from .outcome import ARReply, ar_reply, combine, step_outcomes
from .rank_group import ExecutorError
from .rank_receiver import RankReceiver
from .rank_setup import build_worker, plan_num_blocks, resolve_bundle
from .rank_steps import run_batch_step
from .step_queue import StepQueue
from ..errors import ConfigError

__all__ = ["ExecutorError", "ExecutorOptions", "InprocExecutor", "MultiprocExecutor", "combine",
           "load_frontend", "make_executor"]


class InprocExecutor:
    kind = "inproc"
    world_size = 1

    def __init__(self, config, model_bundle=None, options: ExecutorOptions | None = None):
        """With `options.transfer` the rank hosts a KV consumer for its pool (a stage's DiT rank),
        as each rank process of the multi-process executor does (`rank_receiver.RankReceiver`)."""
        bundle = resolve_bundle(config, model_bundle)
        self.num_blocks = plan_num_blocks(config, bundle[0], bundle[1])
        self.worker = build_worker(config, self.num_blocks, bundle)
        self.model_config, self.tokenizer = self.worker.model.config, self.worker.tokenizer
        self._stepper = None
        self._queue = StepQueue()  # sent with the next step, as the multi-process executor does
        self._ar = ARReply()  # the last step's AR results
        self.receiver = None
        self.hooks = rank_hooks(options)
        transfer = getattr(options, "transfer", None)
        if transfer is not None:
            self.receiver = RankReceiver(transfer, self.worker, None, 0)
            self.hooks.on_transport(self.receiver.transport, 0, transfer.kv_role)
        self.rank_dests = [self.receiver.rank_dest()] if self.receiver is not None else []

    def remove(self, request_id: str, generation: int | None) -> None:
        self.worker.remove(request_id, generation)

    # ---- the step loop (rank_steps.run_batch_step, as on every rank of the multi-process executor) ----
    def start(self, msg: NewRequest) -> None:
        """Join `msg` to the batch from the next step (a bad input ends it in that step)."""
        self._queue.start(msg)

    def drop(self, request_id: str) -> bool:
        """Leave the batch before the next step (its rows are cleared there)."""
        self._queue.drop(request_id)
        return True

    def queue_ar(self, works: list[ARWork]) -> None:
        """The AR work of the next step (prefill chunks, decode tokens)."""
        self._queue.ar(works)

    def end_ar(self, request_id: str) -> None:
        """The rank forgets the request's AR row at the next step, before its starts."""
        self._queue.end_ar(request_id)

    def take_ar(self) -> ARReply:
        """The AR results of the last `step_batch` (empty when it had no AR work)."""
        out, self._ar = self._ar, ARReply()
        return out

    def step_batch(self):
        """One step of every running request -> the `StepOutcome`s of those that ended."""
        msg = self._queue.take()
        self._ar = ARReply()
        legacy = None if self.receiver is None else self.receiver.dense_import
        done = run_batch_step(self.stepper, msg, hooks=self.hooks, legacy=legacy)
        self._ar = ar_reply({0: done}, msg.ar, 1)
        return step_outcomes({0: done}, 1)

    @property
    def stepper(self):
        if self._stepper is None:
            from ..worker.batch import BatchStepper

            self._stepper = BatchStepper(self.worker)
        return self._stepper

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver, r = None, self.receiver
            r.close()


def make_executor(kind: str, config, model_bundle=None, options: ExecutorOptions | None = None):
    """`auto`: in-process for one rank, multi-process otherwise; `inproc` / `mp` force one."""
    if kind not in ("auto", "inproc", "mp"):
        raise ConfigError("executor", kind, "choose auto, inproc or mp")
    ranks = rank_hooks(options).num_ranks(config)
    if kind == "inproc" and ranks > 1:
        raise ConfigError("executor", kind, f"{ranks} ranks need the multi-process executor; use auto or mp")
    if kind == "inproc" or (kind == "auto" and ranks == 1):
        return InprocExecutor(config, model_bundle, options)
    return MultiprocExecutor(config, model_bundle, options)
