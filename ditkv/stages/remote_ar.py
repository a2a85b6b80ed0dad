"""A separately deployed AR stage, seen from the orchestrator: one proxy per remote AR replica.

`ditkv stage --config STAGES.yaml --stage 0 --bind tcp://HOST:PORT` (`ar_server.py`) runs the AR
replicas; an orchestrator whose stage file says `remote: tcp://HOST:PORT` on the AR stage connects
one ZeroMQ DEALER to it and builds a `RemoteARReplica` per server replica. The proxies offer what
the orchestrator uses of `ARReplica` (submit, release, cancel, step / wait_hint, stats, dead,
num_leases, producer.geometry / dispatch, blocks.num_free / num_blocks, close).

The `TransferTicket` stays here; the server keeps a mirror per ticket id. Control messages
(msgspec, msgpack) carry: the job (token ids) out; the AR result + `SourceEndpoint` back (bound on
the real ticket); at dispatch the ticket's `DestEndpoint` out (the server's producer writes the
pages; its completion notices reach the DiT consumers directly, as in one process); each
(source rank, destination rank) write report back (`ticket.report_sent`), then `Settled` once the
server's producer is done with the source pages. Heartbeats flow both ways (the server's carry its
replicas' gauges). Losing the server (no heartbeat for `heartbeat_timeout`) takes the stage
down: every proxy turns dead with a reason naming the address, queued and running AR jobs fail,
tickets whose write was dispatched but not settled are failed without a `sent` report (the peer may
still write: the DiT keeps their pages quarantined), and a later dispatch settles at once (nothing
was sent). The I/O thread then says hello again with a backoff (`heartbeat_interval`, doubling up
to `_RETRY_CAP` s) on a fresh DEALER with the same routing id. A `Welcome` that passes the checks of
the first connect (same replica count and page geometry too) makes the proxies live again. The
quarantined tickets ("orphans") are settled (their unsent pairs reported failed, so the DiT frees
their pages) when the answer comes from a different server instance (the old one released the port:
none of its writes can land any more) or, from the same instance, for every ticket not in its
`held` list; a held one waits for its `Settled`. A refused `Welcome` keeps the stage down with the
reason in `dead` and `status()`, and the retries go on. Malformed or unexpected messages are logged
and dropped on both sides.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid

import msgspec

from ..errors import ConfigError, DitkvError
from ..worker.ar_runner import ARResult
from .remote_messages import (PROTOCOL, ARDone, Beat, Bye, Dispatch, Hello, Refused, Release, RMsg, Sent,
                              Settled, Welcome, decode, encode, stage_summary)
from ..transfer.ticket import TransferTicket
from .remote_replica import RemoteARReplica

log = logging.getLogger("ditkv.remote_ar")
_RETRY_CAP = 5.0  # seconds between reconnect attempts at most (the backoff starts at heartbeat_interval)

# ---- orchestrator side -------------------------------------------------------------------------
class RemoteARStage:
    """The connection to one `ditkv stage` server and its proxies (`replicas`)."""

    def __init__(self, spec, stats=None, dtype: str | None = None, model_config=None):
        import zmq

        self.spec, self.opts, self.address = spec, spec.remote, spec.remote.address
        self.transfer_stats = stats
        self._dtype, self._model_config = dtype, model_config
        self.lock = threading.RLock()
        self.closed = False
        self._out: queue.Queue = queue.Queue()
        self._dispatched: dict[str, tuple] = {}  # ticket id -> (replica, ticket, on_done)
        self._orphans: dict[str, tuple] = {}  # dispatched when the server was lost, not settled since
        self._client_id = b"ditkv-" + uuid.uuid4().hex.encode()  # routing id, kept across reconnects
        self._ctx = zmq.Context()
        self._sock = self._socket()
        try:
            welcome = self._hello()
            self._check(welcome)
        except BaseException:
            self._sock.close(0)
            self._ctx.term()
            raise
        self.server_pid, self.instance, self._geometry = welcome.pid, welcome.instance, list(welcome.geometry)
        self.replicas = [RemoteARReplica(self, i, g) for i, g in enumerate(welcome.geometry)]
        self.state, self.error, self.reconnects = "connected", None, 0
        self._down: str | None = None  # why the server is lost (None while connected)
        self._retry_at = self._backoff = 0.0
        self._last_seen = time.monotonic()
        self._stop = threading.Event()
        self._io = threading.Thread(target=self._loop, daemon=True, name="remote-ar-io")
        self._io.start()
        log.info("connected to the AR stage at %s (%d replicas, pid %d, instance %s)", self.address,
                 len(self.replicas), welcome.pid, welcome.instance[:12] or "?")

    # ---- startup ------------------------------------------------------------------------------
    def _socket(self):
        import zmq

        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, self._client_id)
        sock.connect(self.address)
        return sock

    def _hello_msg(self) -> bytes:
        o = self.opts
        return encode(Hello(protocol=PROTOCOL, heartbeat_interval=o.heartbeat_interval,
                            heartbeat_timeout=o.heartbeat_timeout))

    def _hello(self) -> Welcome:
        import zmq

        o = self.opts
        self._sock.send(self._hello_msg())
        deadline = time.monotonic() + o.connect_timeout
        while time.monotonic() < deadline:
            if not self._sock.poll(50, zmq.POLLIN):
                continue
            try:
                m = decode(self._sock.recv(zmq.NOBLOCK))
            except msgspec.DecodeError as e:
                log.warning("ignoring an undecodable message from %s: %s", self.address, e)
                continue
            if isinstance(m, Welcome):
                if m.error:
                    raise DitkvError(f"the AR stage server at {self.address} refused us: {m.error}")
                return m
        raise DitkvError(f"the AR stage server at {self.address} did not answer within connect_timeout="
                         f"{o.connect_timeout:g}s; start it with `ditkv stage --config STAGES.yaml --stage 0 "
                         f"--bind {self.address}` (and check the address, port and firewall)")

    def _check(self, w: Welcome) -> None:
        dtype, model_config = self._dtype, self._model_config
        if w.protocol != PROTOCOL:
            raise DitkvError(f"the AR stage server at {self.address} speaks protocol {w.protocol}, we speak "
                             f"{PROTOCOL}: run the same ditkv version on both hosts")
        local = stage_summary(self.spec)
        diff = [f"{k}: server {w.stage.get(k)!r}, here {v!r}" for k, v in local.items() if w.stage.get(k) != v]
        if dtype is not None and w.dtype != dtype:
            diff.append(f"dtype: server {w.dtype}, DiT here {dtype}")
        if model_config is not None and w.geometry:
            g, mc = w.geometry[0], model_config
            for name, want in (("num_layers", mc.num_hidden_layers), ("num_kv_heads", mc.num_key_value_heads),
                               ("head_dim", mc.attention_head_dim)):
                if getattr(g, name) != want:
                    diff.append(f"page geometry {name}: server {getattr(g, name)}, here {want}")
        if not w.geometry:
            diff.append("the server runs no replica")
        if diff:
            raise ConfigError("stages[0].remote", self.address,
                              "the AR stage server's stage differs from this stage file: " + "; ".join(diff)
                              + ". Start both from the same stage file")

    # ---- thread-safe entry points -------------------------------------------------------------
    def send(self, m: RMsg) -> None:
        self._out.put(encode(m))

    def dispatch(self, ticket: TransferTicket, on_done) -> None:
        with self.lock:
            replica = self.replicas[ticket.source.replica]
            why = replica.dead or ("AR stage shut down" if self.closed else None)
            if why is None:
                self._dispatched[ticket.ticket_id] = (replica, ticket, on_done)
                self.send(Dispatch(ticket_id=ticket.ticket_id, dest=ticket.dest,
                                   timeout_s=float((ticket.deadline or 0) - (ticket.dispatched_at or 0))))
                return
        for s, d in ticket.pairs():  # nothing went out: no byte of it can land
            ticket.report_sent(d, f"not sent: {why}", s)
        on_done(ticket)

    def status(self) -> dict:
        """The connection, for `/health` and logs: state is connected / reconnecting / refused."""
        with self.lock:
            return {"address": self.address, "state": "closed" if self.closed else self.state, "error": self.error,
                    "instance": self.instance, "pid": self.server_pid, "reconnects": self.reconnects,
                    "quarantined_tickets": len(self._orphans)}

    # ---- I/O thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        import zmq

        o, beat_at = self.opts, 0.0
        while not self._stop.is_set():
            if self._down is not None and time.monotonic() >= self._retry_at:
                self._attempt()
            if self._sock.poll(10, zmq.POLLIN):
                while True:
                    try:
                        data = self._sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        if self._down is not None:
                            self._answer(data)
                            continue
                        self._last_seen = time.monotonic()
                        self.handle(data)
                    except Exception:  # never let one message end the connection
                        log.exception("error handling a message from %s", self.address)
            if self._down is not None:  # nobody to send to: what was queued was for the lost server
                while not self._out.empty():
                    self._out.get_nowait()
                continue
            while True:
                try:
                    self._sock.send(self._out.get_nowait(), zmq.NOBLOCK)
                except queue.Empty:
                    break
                except zmq.ZMQError as e:
                    log.warning("control message to %s dropped: %s", self.address, e)
            now = time.monotonic()
            if now - beat_at >= o.heartbeat_interval:
                beat_at = now
                self.send(Beat())
            if now - self._last_seen > o.heartbeat_timeout:
                self.lost(f"the remote AR stage at {self.address} is lost: no heartbeat for "
                          f"{now - self._last_seen:.1f}s (heartbeat_timeout={o.heartbeat_timeout:g}s)")

    def _attempt(self) -> None:
        """One reconnect attempt: a fresh DEALER (nothing stale queued on it), one hello."""
        self._sock.close(0)
        self._sock = self._socket()
        self._sock.send(self._hello_msg())
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, max(_RETRY_CAP, self.opts.heartbeat_interval))
        log.debug("hello again to the AR stage at %s", self.address)

    def _answer(self, data: bytes) -> None:
        """A message while the server is lost: a `Welcome` answers our hello; anything else is stale."""
        try:
            w = decode(data)
        except msgspec.DecodeError:
            return
        if not isinstance(w, Welcome):
            return
        try:
            if w.error:
                raise DitkvError(f"the server refused us: {w.error}")
            self._check(w)
            if len(w.geometry) != len(self.replicas):
                raise DitkvError(f"the server now runs {len(w.geometry)} replicas, this orchestrator was built for "
                                 f"{len(self.replicas)}: start it with the same replica count, or restart the "
                                 f"orchestrator")
            if list(w.geometry) != self._geometry:
                raise DitkvError(f"the server's page pools differ from before ({list(w.geometry)} vs "
                                 f"{self._geometry}): restart the orchestrator")
        except DitkvError as e:
            return self._refused(str(e))
        self._rejoin(w)

    def _refused(self, why: str) -> None:
        msg = f"the AR stage at {self.address} is back but cannot be used: {why}"
        import zmq

        try:
            self._sock.send(encode(Bye()), zmq.NOBLOCK)  # it registered us: end that session at once
        except zmq.ZMQError:
            pass  # it drops us when our heartbeats stop
        with self.lock:
            changed = msg != self.error
            self.state, self.error = "refused", msg
            for r in self.replicas:
                r.dead = msg
        if changed:
            log.error("%s (the stage stays down; retrying every %gs)", msg, self._backoff)

    def _rejoin(self, w: Welcome) -> None:
        """The server answered and matches: proxies live again; settle what can no longer be written."""
        same = bool(w.instance) and w.instance == self.instance
        unknown = not w.instance or not self.instance  # a server without instance ids: cannot tell
        held = set(w.held)
        with self.lock:
            orphans, self._orphans, settle = self._orphans, {}, []
            for tid, entry in orphans.items():
                if same and tid in held:
                    self._dispatched[tid] = entry  # its `Settled` will come on this session
                elif unknown:
                    self._orphans[tid] = entry  # the old peer may still write: stays quarantined
                else:
                    settle.append(entry)
            old = self.instance
            self.instance, self.server_pid = w.instance, w.pid
            for r in self.replicas:
                r.remote_stats, r.dead = {}, None
                r.blocks.num_free = r.blocks.num_blocks
            self._down, self.state, self.error = None, "connected", None
            self.reconnects += 1
            self._last_seen = time.monotonic()
        why = (f"the AR stage server instance {old[:12]} that was writing it is gone (instance "
               f"{w.instance[:12]} now answers at {self.address}): no byte of it can land any more") if not same else \
            f"the AR stage server at {self.address} settled this write while we were disconnected"
        for _, t, on_done in settle:
            self._settle(t, on_done, why)
        log.warning("reconnected to the AR stage at %s (%s instance %s, pid %d): %d quarantined tickets released, "
                    "%d still being written, %d kept (instance unknown)", self.address, "same" if same else "new",
                    w.instance[:12] or "?", w.pid, len(settle), len(held & set(orphans)), len(self._orphans))

    @staticmethod
    def _settle(t: TransferTicket, on_done, error: str) -> None:
        for s, d in t.pairs():  # pairs never reported are failed: the DiT may free their pages
            if not t.was_sent(d, s):
                t.report_sent(d, error, s)
        on_done(t)

    def handle(self, data: bytes) -> None:
        """One message from the server (malformed or unexpected ones are logged and dropped)."""
        try:
            m = decode(data)
        except msgspec.DecodeError as e:
            log.warning("ignoring an undecodable message from %s: %s", self.address, e)
            return
        if isinstance(m, Beat):
            for r, s in zip(self.replicas, m.stats):
                r.remote_stats = s
                if r.dead is None:
                    r.blocks.num_free = int(s.get("kv_free_blocks", r.blocks.num_free))
        elif isinstance(m, ARDone):
            self._ar_done(m)
        elif isinstance(m, Sent):
            entry = self._dispatched.get(m.ticket_id)
            if entry is None:
                return log.warning("write report for unknown ticket %s from %s", m.ticket_id, self.address)
            if m.error is None and m.nbytes and self.transfer_stats is not None:
                self.transfer_stats.add_bytes(m.nbytes)  # before report_sent: a settled ticket's bytes count
            entry[1].report_sent(m.dst, m.error, m.src)
        elif isinstance(m, Settled):
            with self.lock:
                entry = self._dispatched.pop(m.ticket_id, None)
            if entry is None:
                return
            _, t, on_done = entry
            # normally every pair was reported (`Sent` comes first); reports lost while disconnected fail
            self._settle(t, on_done, m.error or "settled, but its write report was lost while disconnected")
        elif isinstance(m, Refused):
            log.warning("the AR stage server at %s refused a message: %s", self.address, m.error)
        else:
            log.warning("ignoring an unexpected %s from %s", type(m).__name__, self.address)

    def _ar_done(self, m: ARDone) -> None:
        replica = None
        with self.lock:
            for r in self.replicas:
                job = r._jobs.pop(m.ticket_id, None)  # noqa: SLF001
                if job is not None:
                    replica = r
                    break
            if replica is None:  # not ours (any more): the pages go back
                if m.error is None:
                    self.send(Release(ticket_id=m.ticket_id))
                return
            if m.error is None and m.source is not None:
                replica._leases.add(m.ticket_id)  # noqa: SLF001
        if m.error is not None or m.source is None:
            return replica.post(job.on_done, job, None, m.error or "the AR stage server sent no source endpoint")
        res = ARResult(m.request_id, list(m.token_ids), list(m.generated_ids), m.tokens_computed, m.chosen,
                       dict(m.stats))
        replica.post(replica._bind, job, res, m.source)  # noqa: SLF001

    # ---- failure and teardown -----------------------------------------------------------------
    def lost(self, reason: str) -> None:
        """The server is gone: jobs fail, unsettled writes stay unsettled (their pages stay
        quarantined until a reconnect proves they can no longer land), reconnecting starts."""
        reason = f"{reason}; reconnecting"
        with self.lock:
            if self._down is not None or self.closed:
                return
            log.error("%s", reason)
            self._down, self.state, self.error = reason, "reconnecting", reason
            self._backoff = self.opts.heartbeat_interval
            self._retry_at = time.monotonic() + self._backoff
            jobs = [(r, j) for r in self.replicas for j in r._jobs.values()]  # noqa: SLF001
            for r in self.replicas:
                r._jobs.clear()  # noqa: SLF001
                r._leases.clear()  # noqa: SLF001  the server and its pool are gone
                r.blocks.num_free = r.blocks.num_blocks
                r.dead = reason
            dispatched, self._dispatched = self._dispatched, {}
            self._orphans.update(dispatched)
        for r, job in jobs:
            r.post(job.on_done, job, None, f"AR replica {r.index} failed closed: {reason}")
        for _, t, _ in dispatched.values():  # a write of a lost peer may still land: no `sent` report
            t.fail(f"{reason}; its writes may still land, so the DiT keeps these pages until the stage is back "
                   "(or shutdown)")

    def close(self) -> None:
        """Shutdown: queued jobs fail ("AR stage shut down"); the server returns our leases."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            jobs = [(r, j) for r in self.replicas for j in r._jobs.values()]  # noqa: SLF001
            for r in self.replicas:
                r._jobs.clear()  # noqa: SLF001
                r._leases.clear()  # noqa: SLF001
            down = self._down is not None
        if not down:
            self.send(Bye())
            time.sleep(0.05)  # let the I/O thread flush it
        self._stop.set()
        self._io.join(timeout=5)
        self._sock.close(0)
        self._ctx.term()
        for r, job in jobs:
            r.post(job.on_done, job, None, "AR stage shut down")
        for r in self.replicas:
            r.step(0)
