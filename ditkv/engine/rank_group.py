"""The rank processes of a multi-process replica, seen from the engine process: spawning them,
the start-up handshake, the control socket, liveness, failing closed and shutdown.

One ZeroMQ ROUTER socket in the engine; each rank (`proc.worker_main`) connects a DEALER for
commands and replies and a second one from its heartbeat thread. Messages are msgspec structs
(`messages.py`). `MultiprocExecutor` (`mp_executor.py`) routes requests over it.

Failure model (the group *fails closed*: kills every rank and raises `ExecutorError`; the engine
then fails all its requests and frees their pages):
- a rank process exits (checked on every poll, so detection is immediate);
- a rank sends no heartbeat for `heartbeat_timeout_s` (frozen process);
- after one rank failed a request, the others do not report within `drain_timeout_s` (a group
  wedged in a collective); optionally no step progress for `step_timeout_s`;
- startup does not complete within `startup_timeout_s`.
An exception inside a rank is not a replica failure: it fails only that request, with the rank's message.
"""

from __future__ import annotations

import logging
import pickle
import multiprocessing as mp
import shutil
import signal
import tempfile
import time
import weakref
from pathlib import Path

import msgspec

from ..errors import ConfigError, DitkvError
from .messages import Ack, InitCache, Msg, Ready, Shutdown, decode, encode
from .options import ExecutorOptions
from .proc import worker_main

log = logging.getLogger("ditkv.executor")


class ExecutorError(DitkvError):
    """The replica failed closed (a rank died, stopped answering or wedged); the engine is unusable."""


class RankGroup:
    """`world_size` spawned rank processes of one replica, started up and ready for commands
    (`num_blocks`, and per rank `rank_devices`, `rank_weight_bytes`, `rank_dests`, come from the
    handshake). `procs`: the rank processes (multiprocessing), in rank order."""

    def __init__(self, config, world_size: int, model_bundle, opts: ExecutorOptions):
        import zmq

        self.opts, self.world_size = opts, world_size
        self.failed: str | None = None
        self.rank_dests: list = []  # per rank, where producers write (with `options.transfer`)
        self._zctx = zmq.Context()
        self._sock = self._zctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished rank raises, never drops
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self._tmp = tempfile.mkdtemp(prefix="ditkv-exec-")
        init_method = opts.dist_init_method or f"file://{Path(self._tmp) / 'dist-store'}"
        ctx = mp.get_context("spawn")  # fork is unsafe with threads, CUDA and zmq contexts
        self.procs = [ctx.Process(target=worker_main, name=f"ditkv-rank{r}", daemon=True,
                                  args=(r, world_size, config, f"tcp://127.0.0.1:{port}", model_bundle,
                                        opts, init_method))
                      for r in range(world_size)]
        self._finalizer = weakref.finalize(self, _cleanup, self.procs, self._sock, self._zctx, self._tmp)
        try:
            for p in self.procs:
                p.start()
        except (AttributeError, TypeError, pickle.PicklingError) as e:  # spawn pickles the arguments
            self._finalizer()
            raise ConfigError("model_bundle", type(model_bundle).__name__,
                              f"rank processes cannot receive it ({e}); pass a picklable bundle or a "
                              "module-level function that returns one") from e
        self._last_seen = [time.monotonic()] * world_size
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

    # ---- lockstep calls ------------------------------------------------------------------
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
                self._fail(f"{type(msg).__name__} {request_id!r} made no step progress for "
                           f"step_timeout_s={self.opts.step_timeout_s}")
        return got

    def broadcast(self, msg: Msg) -> None:
        self._ensure_alive()
        self._broadcast(msg)

    def check_health(self) -> None:
        """Drain heartbeats and fail closed if a rank is gone or silent (call from the engine loop)."""
        self._ensure_alive()
        while self._recv(0) is not None:  # heartbeats queued while the engine was idle
            pass
        self._check_ranks()

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
        """The next message (heartbeats included), or None when nothing arrived in time; a
        subclass keeps the messages that may arrive at any time by overriding this."""
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


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _kill(procs) -> None:
    started = [p for p in procs if p.pid is not None]  # a failed start leaves the rest unstarted
    for p in started:
        if p.exitcode is None:
            p.kill()
    for p in started:
        p.join(timeout=5)


def _cleanup(procs, sock, zctx, tmp) -> None:
    _kill(procs)
    sock.close(0)
    zctx.term()
    shutil.rmtree(tmp, ignore_errors=True)
