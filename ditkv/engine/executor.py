"""Executors: carry each request's metadata snapshot to every rank and bring one result back.

- `InprocExecutor`: one rank, in the engine's process (the default for world_size == 1).
- `MultiprocExecutor`: one spawned process per rank. One ZeroMQ ROUTER socket in the engine; each
  rank connects a DEALER for commands/replies and a second one from a heartbeat thread. Messages
  are msgspec structs (`messages.py`); the image comes back from the output rank only.

Failure model of the multi-process executor (it *fails closed*: kills every rank and raises
`ExecutorError`; the engine then fails all its requests and frees their pages):
- a rank process exits (checked on every poll, so detection is immediate);
- a rank sends no heartbeat for `heartbeat_timeout_s` (frozen process);
- after one rank failed a request, the others do not report within `drain_timeout_s` (a group
  wedged in a collective); optionally no step progress for `step_timeout_s`;
- startup does not complete within `startup_timeout_s`.
An exception inside a rank is not a replica failure: it fails only that request, with the rank's message.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import shutil
import signal
import tempfile
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from ..errors import ConfigError, DitkvError, LayoutError
from ..models.hunyuan.layout import build_request_layout
from .proc import (OUTPUT_RANK, _Receiver, build_worker, plan_num_blocks, resolve_bundle, run_request,
                   worker_main)
from .messages import (Abort, Ack, BatchDone, BatchStep, Execute, InitCache, Msg, RankStats, Ready, Received,
                       RegisterReceive, Registered, RequestDone, Sent, Shutdown, StepDone, Unregister, decode, encode)
from .options import ExecutorOptions
from .test_seam import hooks

log = logging.getLogger("ditkv.executor")


class ExecutorError(DitkvError):
    """The replica failed closed (a rank died, stopped answering or wedged); the engine is unusable."""


@dataclass
class Outcome:
    status: str  # "ok" | "stopped" | "error"
    error: str | None = None
    image: np.ndarray | None = None
    stats: RankStats | None = None
    stopped_at: int | None = None


def combine(done: dict[int, RequestDone], world_size: int) -> Outcome:
    """One outcome from every rank's report: the first rank error wins, then a stop, else the image."""
    for r in sorted(done):
        d = done[r]
        if d.status == "error":
            return Outcome("error", f"rank {r}: {d.error}" if world_size > 1 else d.error)
    stopped = [d for d in done.values() if d.status == "stopped"]
    if stopped:
        return Outcome("stopped", stopped[0].error, stopped_at=stopped[0].stopped_at)
    out = done[OUTPUT_RANK]
    img = np.frombuffer(out.image, dtype=np.uint8).reshape(out.image_shape).copy()
    return Outcome("ok", image=img, stats=out.stats)


class InprocExecutor:
    kind = "inproc"
    world_size = 1

    def __init__(self, config, model_bundle=None, options: ExecutorOptions | None = None):
        """With `options.transfer` the rank hosts a KV consumer for its pool (a stage's DiT rank),
        as each rank process of the multi-process executor does (`proc._Receiver`)."""
        bundle = resolve_bundle(config, model_bundle)
        self.num_blocks = plan_num_blocks(config, bundle[0], bundle[1])
        self.worker = build_worker(config, self.num_blocks, bundle)
        self.model_config, self.tokenizer = self.worker.model.config, self.worker.tokenizer
        self._stepper = None
        self.receiver = None
        transfer = getattr(options, "transfer", None)
        if transfer is not None:
            self.receiver = _Receiver(transfer, self.worker, None, 0)
        self.rank_dests = [self.receiver.rank_dest()] if self.receiver is not None else []

    def layout(self, prompt, height, width, guidance, negative_prompt=None, images=None):
        """The request's layout from the model's preprocessing; `images` (input images, uint8
        [H, W, 3]) go to `DiTWorker.layout` only when there are some."""
        return self.worker.layout(prompt, height, width, guidance, negative_prompt, **_images_kw(images))

    def execute(self, msg: Execute, layout=None, on_step=None, should_stop=None) -> Outcome:
        dense = None
        if msg.legacy is not None:  # legacy import: the dense cache is filled from the receive slot
            dense = lambda li=msg.legacy: self.receiver.dense_import(li)  # noqa: E731
        return combine({0: run_request(self.worker, msg, layout=layout, on_step=on_step, check_stop=should_stop,
                                       dense_import=dense)}, 1)

    def remove(self, request_id: str, generation: int | None) -> None:
        self.worker.remove(request_id, generation)

    # ---- step-level batching (worker/batch.py) ------------------------------------------
    def start(self, msg: Execute, layout) -> None:
        """Join `msg` to the running batch from the next step; raises for bad input."""
        self.stepper.start(msg.request_id, layout, msg.steps, msg.guidance, msg.seed, msg.metadata,
                           msg.reuse_prefix)

    def step_batch(self):
        """One step of every running request -> the `StepOutcome`s of those that ended."""
        return self.stepper.step()

    def drop(self, request_id: str) -> bool:
        return self.stepper.drop(request_id)

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


class MultiprocExecutor:
    kind = "mp"

    def __init__(self, config, model_bundle=None, options: ExecutorOptions | None = None):
        import zmq

        self.config, self.opts = config, options or ExecutorOptions()
        self.world_size = hooks(self.opts).replicate_ranks or config.world_size
        if self.opts.devices is not None and len(self.opts.devices) != self.world_size:
            raise ConfigError("devices", self.opts.devices, f"needs one device per rank ({self.world_size})")
        # the engine process only needs the model config and tokenizer (layouts, defaults)
        front = model_bundle() if callable(model_bundle) else model_bundle
        self.model_config, self.tokenizer = load_frontend(config, front)
        if not hooks(self.opts).replicate_ranks:  # fail before spawning anything, naming the fix
            from ..worker.parallel import validate_parallel

            validate_parallel(config, self.model_config)
        self.failed: str | None = None
        self.last_reports: dict[int, RequestDone] = {}
        self.rank_dests: list = []  # per rank, where producers write (with `options.transfer`)
        self._received: list[Received] = []  # completion notices, collected by `take_received`
        self._sent: list[Sent] = []  # AR ranks' write reports, collected by `take_sent`
        self._registered: dict[tuple[int, str], Registered] = {}
        self._batch_starts: list[Execute] = []  # step-level batching: sent with the next BatchStep
        self._batch_drops: list[str] = []
        self._batch_ids = itertools.count()
        self._zctx = zmq.Context()
        self._sock = self._zctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished rank raises, never drops
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self._tmp = tempfile.mkdtemp(prefix="ditkv-exec-")
        init_method = self.opts.dist_init_method or f"file://{Path(self._tmp) / 'dist-store'}"
        ctx = mp.get_context("spawn")  # fork is unsafe with threads, CUDA and zmq contexts
        self.procs = [ctx.Process(target=worker_main, name=f"ditkv-rank{r}", daemon=True,
                                  args=(r, self.world_size, config, f"tcp://127.0.0.1:{port}", model_bundle,
                                        self.opts, init_method))
                      for r in range(self.world_size)]
        self._finalizer = weakref.finalize(self, _cleanup, self.procs, self._sock, self._zctx, self._tmp)
        for p in self.procs:
            p.start()
        self._last_seen = [time.monotonic()] * self.world_size
        try:
            self._startup()
        except BaseException:
            self.shutdown()
            raise

    # ---- startup ------------------------------------------------------------------------
    def _startup(self) -> None:
        deadline = time.monotonic() + self.opts.startup_timeout_s
        ready = self._gather(Ready, deadline, "start")
        counts = [m.num_blocks for m in ready.values() if m.num_blocks is not None]
        self.num_blocks = min(counts) if counts else None  # block ids must mean the same pages everywhere
        self.rank_devices = [ready[r].device for r in range(self.world_size)]
        self.rank_weight_bytes = [ready[r].weight_bytes for r in range(self.world_size)]
        self._broadcast(InitCache(num_blocks=self.num_blocks))
        acks = self._gather(Ack, deadline, "build its worker")
        self.rank_dests = [acks[r].dest for r in range(self.world_size)]
        self._last_seen = [time.monotonic()] * self.world_size

    def _gather(self, kind, deadline: float, what: str) -> dict[int, Msg]:
        """One `kind` reply per rank; a rank's reported error is raised as is (not as a bare exit)."""
        got: dict[int, Msg] = {}
        while len(got) < self.world_size:
            m = self._recv(0.05)
            if isinstance(m, kind):
                if m.error:
                    raise ExecutorError(f"rank {m.rank} failed to {what}: {m.error}")
                got[m.rank] = m
            elif m is None:  # queue empty: a rank that exited has no last words left unread
                if any(p.exitcode is not None for p in self.procs):
                    late = self._recv(0.5)  # ...unless its report is still in flight
                    if isinstance(late, kind) and late.error:
                        raise ExecutorError(f"rank {late.rank} failed to {what}: {late.error}")
                    self._check_exits()
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.world_size)) - set(got))
                    raise ExecutorError(f"ranks {missing} did not {what} within startup_timeout_s="
                                        f"{self.opts.startup_timeout_s}")
        return got

    # ---- the request path ---------------------------------------------------------------
    def layout(self, prompt, height, width, guidance, negative_prompt=None, images=None):
        """Built here from the model config and tokenizer (no weights in this process); every rank
        rebuilds it from the `Execute` message (`proc.layout_of`), input images included."""
        layout = build_request_layout(self.model_config, self.tokenizer, prompt, height, width, guidance,
                                      negative_prompt, **_images_kw(images))
        cfg = 1 if hooks(self.opts).replicate_ranks else self.config.cfg_parallel_size
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
        self.last_reports = done  # per-rank reports of the last request (diagnostics, tests)
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

    def check_health(self) -> None:
        """Drain heartbeats and fail closed if a rank is gone or silent (call from the engine loop)."""
        self._ensure_alive()
        while self._recv(0) is not None:  # heartbeats queued while the engine was idle
            pass
        self._check_ranks()

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

    def call_all(self, msg: Msg, kind, request_id: str) -> dict[int, Msg]:
        """Broadcast `msg` and wait for one `kind` reply (same `request_id`) per rank. Ranks run in
        lockstep: once one reported an error, the others must answer within `drain_timeout_s`
        (else they are wedged in a collective); `step_timeout_s` bounds the whole call."""
        self._ensure_alive()
        self.broadcast(msg)
        got: dict[int, Msg] = {}
        start, failed_at = time.monotonic(), None
        while len(got) < self.world_size:
            m = self._recv(0.05)
            now = time.monotonic()
            if isinstance(m, kind) and m.request_id == request_id:
                got[m.rank] = m
                if m.error and failed_at is None:
                    failed_at = now
            self._check_ranks() if m is None else self._check_exits()
            if failed_at is not None and now - failed_at > self.opts.drain_timeout_s:
                self._fail(f"{type(msg).__name__} {request_id!r} failed on a rank and ranks "
                           f"{sorted(set(range(self.world_size)) - set(got))} did not answer within drain_timeout_s")
            if self.opts.step_timeout_s is not None and now - start > self.opts.step_timeout_s:
                self._fail(f"{type(msg).__name__} {request_id!r} did not finish within step_timeout_s")
        return got

    def broadcast(self, msg: Msg) -> None:
        self._ensure_alive()
        self._broadcast(msg)

    # ---- transport ----------------------------------------------------------------------
    def _send_to(self, rank: int, msg: Msg) -> None:
        import zmq

        try:
            self._sock.send_multipart([f"r{rank}".encode(), encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            self._unreachable(rank, e)

    def _broadcast(self, msg: Msg) -> None:
        import zmq

        data = encode(msg)  # encoded once, the same bytes to every rank
        for r in range(self.world_size):
            try:
                self._sock.send_multipart([f"r{r}".encode(), data], zmq.NOBLOCK)
            except zmq.ZMQError as e:
                self._unreachable(r, e)

    def _unreachable(self, rank: int, e) -> None:
        """A send found `rank`'s socket gone. A killed rank's socket closes a moment before the OS
        reports its exit: wait that moment, so the error names the cause (e.g. SIGKILL) when there is one."""
        self.procs[rank].join(timeout=1.0)
        self._check_exits()
        self._fail(f"rank {rank} is unreachable ({e}); it stopped answering")

    def _recv(self, timeout_s: float) -> Msg | None:
        """The next message (heartbeats included), or None when nothing arrived in time."""
        import zmq

        if not self._sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            return None
        frames = self._sock.recv_multipart(zmq.NOBLOCK)
        try:
            m = decode(frames[-1])
        except msgspec.DecodeError as e:  # a rank speaking another protocol version: not recoverable
            self._fail(f"undecodable control message from {frames[0]!r}: {e}")
        if hasattr(m, "rank") and 0 <= m.rank < self.world_size:
            self._last_seen[m.rank] = time.monotonic()  # any message proves the rank is alive
        if isinstance(m, Received):  # may arrive while a request runs: kept for the replica
            self._received.append(m)
        elif isinstance(m, Sent):
            self._sent.append(m)
        elif isinstance(m, Registered):
            self._registered[(m.rank, m.ticket_id)] = m
        return m

    # ---- failure ------------------------------------------------------------------------
    def _check_exits(self) -> None:
        for r, p in enumerate(self.procs):
            if p.exitcode is not None:
                self._fail(f"rank {r} (pid {p.pid}) died: {_describe_exit(p.exitcode)}")

    def _check_ranks(self) -> None:
        self._check_exits()
        now = time.monotonic()
        for r, seen in enumerate(self._last_seen):
            if now - seen > self.opts.heartbeat_timeout_s:
                self._fail(f"rank {r} (pid {self.procs[r].pid}) stopped answering: no heartbeat for "
                           f"{now - seen:.1f}s (heartbeat_timeout_s={self.opts.heartbeat_timeout_s})")

    def _fail(self, reason: str):
        log.error("executor failed closed: %s", reason)
        self.failed = reason
        _kill(self.procs)  # no rank may touch pages once the scheduler frees them
        raise ExecutorError(reason)

    def _ensure_alive(self) -> None:
        if self.failed is not None:
            raise ExecutorError(self.failed)

    def shutdown(self) -> None:
        """Ask every rank to exit, then kill stragglers. Idempotent."""
        if self._finalizer.alive and self.failed is None:
            try:
                self._broadcast(Shutdown())
            except ExecutorError:
                pass
            deadline = time.monotonic() + self.opts.shutdown_timeout_s
            for p in self.procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        self._finalizer()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]


def _images_kw(images) -> dict:
    """`images=` for the model's layout, only when the request has input images: a text-to-image
    request calls the layout exactly as before image inputs existed."""
    return {"images": list(images)} if images else {}


def load_frontend(config, bundle):
    """(model config, tokenizer) without loading weights, mirroring `models.loader.load_model`."""
    from ..models.hunyuan import ByteTokenizer, HunyuanImage3Config, load_tokenizer
    from ..models.hunyuan.checkpoint import load_model_config
    from ..models.loader import MODEL_FIX, bundled_or_path

    if bundle is not None:
        return bundle[0].config, bundle[1]
    folder = bundled_or_path(config.model)
    if config.model == "tiny" and not (folder / "config.json").is_file():
        return HunyuanImage3Config.tiny(), ByteTokenizer()
    if not (folder / "config.json").is_file():
        raise ConfigError("model", config.model, MODEL_FIX)
    return load_model_config(folder), load_tokenizer(folder)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _kill(procs) -> None:
    for p in procs:
        if p.exitcode is None:
            p.kill()
    for p in procs:
        p.join(timeout=5)


def _cleanup(procs, sock, zctx, tmp) -> None:
    _kill(procs)
    sock.close(0)
    zctx.term()
    shutil.rmtree(tmp, ignore_errors=True)


def make_executor(kind: str, config, model_bundle=None, options: ExecutorOptions | None = None):
    """`auto`: in-process for one rank, multi-process otherwise; `inproc` / `mp` force one."""
    if kind not in ("auto", "inproc", "mp"):
        raise ConfigError("executor", kind, "choose auto, inproc or mp")
    ranks = hooks(options).replicate_ranks or config.world_size
    if kind == "inproc" and ranks > 1:
        raise ConfigError("executor", kind, f"{ranks} ranks need the multi-process executor; use auto or mp")
    if kind == "inproc" or (kind == "auto" and ranks == 1):
        return InprocExecutor(config, model_bundle, options)
    return MultiprocExecutor(config, model_bundle, options)
