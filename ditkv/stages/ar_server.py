"""`ditkv stage`: the AR stage of a stage file as a separate server (ZeroMQ ROUTER, msgspec).

    ditkv stage --config STAGES.yaml --stage 0 --bind tcp://0.0.0.0:7100

Runs the AR stage's replicas (`ARReplica`, one thread each, as in the orchestrator) and serves them
to orchestrators whose stage file says `remote: tcp://HOST:7100` (`remote_ar.py` has the messages
and the client). Per ticket the server keeps a mirror `TransferTicket` under the orchestrator's
ticket id: the replica binds its source there, the local producer writes from it (completion
notices go straight to the DiT consumers), and every write report is forwarded. A client that says
bye or stops sending heartbeats loses its queued jobs and its leases that were never dispatched;
dispatched writes finish and return their pages. A client that says hello again (it reconnected;
its DEALER keeps its routing id, ROUTER_HANDOVER lets the new connection take it over) starts a new
session the same way, and the `Welcome` lists its tickets whose dispatched write is still unsettled
(`held`), so it can release the DiT pages of every other one. Each server process has a random
`instance` id (in `Welcome`): a client that finds a different instance knows the old one, and any
write it could still make, is gone. SIGINT/SIGTERM: stop, return every lease, stop the ranks.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field

import msgspec

from ..errors import ConfigError
from ..engine.hooks import RankHooks
from ..worker.threads import apply_process_settings
from ..models.text_settings import from_wire
from .ar_side import ARJob, ARReplica
from .remote_messages import (PROTOCOL, ARDone, Beat, Bye, Cancel, Dispatch, Hello, Refused, Release, RMsg, Sent, Settled,
                              Submit, Welcome, decode, encode, stage_summary)
from ..transfer.stats import TransferStats
from ..transfer.ticket import TransferTicket

log = logging.getLogger("ditkv.stage")


class _ByteTap(TransferStats):
    """Bytes a producer counted on this thread since the last `take` (it counts, then reports)."""

    def __init__(self):
        super().__init__()
        self._tl = threading.local()

    def add_bytes(self, nbytes: int) -> None:
        super().add_bytes(nbytes)
        self._tl.n = getattr(self._tl, "n", 0) + int(nbytes)

    def take(self) -> int:
        n, self._tl.n = getattr(self._tl, "n", 0), 0
        return n


class _Mirror(TransferTicket):
    """The server's copy of an orchestrator's ticket: same id; write reports are forwarded."""

    def __init__(self, ticket_id: str, request_id: str, mode: str, forward):
        super().__init__(request_id, mode)
        self.ticket_id, self._forward = ticket_id, forward

    def report_sent(self, rank: int, error: str | None = None, src: int = 0) -> None:
        super().report_sent(rank, error, src)
        self._forward(self, rank, error, src)


@dataclass
class _Client:
    interval: float
    timeout: float
    seen: float = field(default_factory=time.monotonic)
    beat_at: float = 0.0
    last_stats: list = field(default_factory=list)


class ARStageServer:
    def __init__(self, graph, bind: str, model_bundle=None, hooks: RankHooks | None = None):
        """`hooks` (`RankHooks`, engine/hooks.py): each in-process replica's transport goes through
        `on_transport` (as rank 0 of its replica) before its first write."""
        import zmq

        from .replicas import bundle_on, norm_device, replica_plan, replica_transfer
        from ..models.loader import resolve_device, resolve_dtype

        spec = self.spec = graph.ar
        apply_process_settings(spec.engine)  # the orchestrator checks the number matches its own
        self.bind = bind
        self.stats = _ByteTap()
        dev = norm_device(resolve_device(spec.engine.device))
        self.dtype = str(resolve_dtype(spec.engine.dtype, dev)).removeprefix("torch.")
        self.replicas: list[ARReplica] = []
        bundles: dict = {}
        try:
            for i in range(spec.replicas):
                p = replica_plan(spec, i, None)
                bundle = None
                if not p["ranks"]:
                    d = norm_device(resolve_device(p["engine"].device))
                    if d not in bundles:
                        bundles[d] = bundle_on(model_bundle, spec.engine.model, d, resolve_dtype(spec.engine.dtype, d))
                    bundle = bundles[d]
                self.replicas.append(ARReplica(i, p["engine"], replica_transfer(spec.transfer, i, spec.replicas),
                                               bundle, stats=self.stats, executor_options=p["options"]))
        except BaseException:
            for r in self.replicas:
                r.close()
            raise
        hooks = hooks or RankHooks()
        for r in self.replicas:
            if r.transport is not None:
                hooks.on_transport(r.transport, 0, spec.transfer.kv_role)
        self._lock = threading.Lock()
        self._out: list[tuple[bytes, bytes]] = []  # (client, message) from other threads
        self._clients: dict[bytes, _Client] = {}
        self._mirrors: dict[tuple[bytes, str], tuple[_Mirror, ARReplica]] = {}
        self._stop = threading.Event()
        self.instance = uuid.uuid4().hex
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished client raises, never blocks
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting client (same routing id) takes over
        try:
            self._sock.bind(bind)
        except zmq.ZMQError as e:
            self.close()
            raise ConfigError("--bind", bind, f"cannot bind ({e}); pick a free port / a local address") from e
        self._threads = [threading.Thread(target=self._run_replica, args=(r,), daemon=True, name=f"ar-{r.index}")
                         for r in self.replicas]
        for th in self._threads:
            th.start()

    # ---- replica threads ------------------------------------------------------------------------
    def _run_replica(self, r: ARReplica) -> None:
        while not self._stop.is_set():
            try:
                r.step(block_s=r.wait_hint())
            except Exception:
                log.exception("AR replica loop error")

    def _post(self, client: bytes, m: RMsg) -> None:
        with self._lock:
            self._out.append((client, encode(m)))

    # ---- serving --------------------------------------------------------------------------------
    def serve(self, stop: threading.Event | None = None) -> None:
        import zmq

        msg = f"AR stage serving {len(self.replicas)} replicas on {self.bind} (instance {self.instance[:12]})"
        log.info(msg)
        print(msg, flush=True)
        stop = stop or threading.Event()
        while not stop.is_set():
            if self._sock.poll(10, zmq.POLLIN):
                while True:
                    try:
                        frames = self._sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        self._handle(frames)
                    except Exception:  # a bad message never ends the server
                        log.exception("error handling a control message")
            with self._lock:
                out, self._out = self._out, []
            for client, data in out:
                self._send_raw(client, data)
            self._tick()

    def _send_raw(self, client: bytes, data: bytes) -> None:
        import zmq

        try:
            self._sock.send_multipart([client, data], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.warning("message to a client dropped (%s)", e)

    def _tick(self) -> None:
        now = time.monotonic()
        stats = [{k: int(v) for k, v in r.stats().items()} for r in self.replicas]
        for cid, c in list(self._clients.items()):
            if now - c.seen > c.timeout:
                log.warning("client %s sent no heartbeat for %.1fs: dropping its jobs and leases", cid.hex(),
                            now - c.seen)
                self._drop_client(cid)
            elif stats != c.last_stats or now - c.beat_at >= c.interval:
                c.beat_at, c.last_stats = now, stats
                self._send_raw(cid, encode(Beat(stats=stats)))

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            return log.warning("ignoring a message of %d frames", len(frames))
        cid, data = frames
        try:
            m = decode(data)
        except msgspec.DecodeError as e:
            log.warning("ignoring an undecodable message from %s: %s", cid.hex(), e)
            return self._send_raw(cid, encode(Refused(error=f"undecodable message: {e}")))
        if isinstance(m, Hello):
            return self._hello(cid, m)
        c = self._clients.get(cid)
        if c is None:
            return self._send_raw(cid, encode(Refused(error=f"{type(m).__name__} before Hello")))
        c.seen = time.monotonic()
        if isinstance(m, Submit):
            self._submit(cid, m)
        elif isinstance(m, Dispatch):
            self._dispatch(cid, m)
        elif isinstance(m, Release):
            with self._lock:
                entry = self._mirrors.get((cid, m.ticket_id))
                if entry is not None and entry[0].dispatched_at is None:
                    del self._mirrors[cid, m.ticket_id]
            if entry is not None and entry[0].dispatched_at is None:
                entry[1].release(entry[0])
        elif isinstance(m, Cancel):
            if 0 <= m.replica < len(self.replicas):
                self.replicas[m.replica].cancel(m.request_id)
        elif isinstance(m, Bye):
            self._drop_client(cid)
        elif not isinstance(m, Beat):
            self._send_raw(cid, encode(Refused(error=f"unexpected {type(m).__name__}")))

    def _hello(self, cid: bytes, m: Hello) -> None:
        if m.protocol != PROTOCOL:
            return self._send_raw(cid, encode(Welcome(protocol=PROTOCOL, error=f"protocol {m.protocol} != "
                                                      f"{PROTOCOL}: run the same ditkv version on both hosts")))
        if not (0 < m.heartbeat_interval < m.heartbeat_timeout):
            return self._send_raw(cid, encode(Welcome(protocol=PROTOCOL, error="bad heartbeat settings")))
        if cid in self._clients:  # it reconnected: what it queued or leased before is no longer its
            log.warning("client %s said hello again: its earlier queued jobs and undispatched leases are dropped",
                        cid.hex())
            self._drop_client(cid)
        with self._lock:  # atomically with `_settled`: a write settled before this is not in `held`
            self._clients[cid] = _Client(m.heartbeat_interval, m.heartbeat_timeout)
            held = [tid for (c, tid), (t, _) in self._mirrors.items() if c == cid and t.dispatched_at is not None]
        log.info("client %s connected (%d of its writes unsettled)", cid.hex(), len(held))
        self._send_raw(cid, encode(Welcome(protocol=PROTOCOL, stage=stage_summary(self.spec), dtype=self.dtype,
                                           geometry=[r.producer.geometry for r in self.replicas], pid=os.getpid(),
                                           instance=self.instance, held=held)))

    def _submit(self, cid: bytes, m: Submit) -> None:
        if not 0 <= m.replica < len(self.replicas) or m.mode != self.spec.transfer.mode:
            return self._post(cid, ARDone(ticket_id=m.ticket_id, request_id=m.request_id,
                                          error=f"bad submit (replica {m.replica}, mode {m.mode!r})"))
        r = self.replicas[m.replica]
        t = _Mirror(m.ticket_id, m.request_id, m.mode, lambda t, rank, err, src: self._sent(cid, t, rank, err, src))
        with self._lock:
            if (cid, m.ticket_id) in self._mirrors:
                return self._send_raw(cid, encode(Refused(error=f"ticket {m.ticket_id} submitted twice")))
            self._mirrors[cid, m.ticket_id] = (t, r)
        r.submit(ARJob(m.request_id, t, list(m.head_ids), list(m.tail_ids), from_wire(m),
                       lambda job, res, err: self._ar_done(cid, r, job, res, err), stop_ids=tuple(m.stop_ids),
                       images=m.images, choice=tuple(m.choice)))

    def _ar_done(self, cid: bytes, r: ARReplica, job: ARJob, res, error: str | None) -> None:  # replica thread
        t = job.ticket
        with self._lock:
            gone = cid not in self._clients
            if error is not None or res is None or gone:
                self._mirrors.pop((cid, t.ticket_id), None)
        if res is not None and (error is not None or gone):
            r.release(t)
        if gone:
            return
        if error is not None or res is None:
            return self._post(cid, ARDone(ticket_id=t.ticket_id, request_id=job.request_id, error=error or "no result"))
        self._post(cid, ARDone(ticket_id=t.ticket_id, request_id=job.request_id, token_ids=list(res.token_ids),
                               generated_ids=list(res.generated_ids), tokens_computed=res.tokens_computed,
                               source=t.source, chosen=res.chosen, stats=dict(res.stats)))

    def _dispatch(self, cid: bytes, m: Dispatch) -> None:
        with self._lock:
            entry = self._mirrors.get((cid, m.ticket_id))
        if entry is None or entry[0].source is None or entry[0].dispatched_at is not None:
            return self._send_raw(cid, encode(Settled(ticket_id=m.ticket_id,
                                                      error=f"the AR stage holds no pages for {m.ticket_id}")))
        t, r = entry
        t.bind_dest(m.dest)
        t.mark_dispatched(m.timeout_s)
        r.producer.dispatch(t, on_done=lambda t: self._settled(cid, r, t))

    def _sent(self, cid: bytes, t: _Mirror, rank: int, error: str | None, src: int) -> None:
        n = self.stats.take() if error is None else 0
        self._post(cid, Sent(ticket_id=t.ticket_id, src=src, dst=rank, error=error, nbytes=n))

    def _settled(self, cid: bytes, r: ARReplica, t: _Mirror) -> None:  # a send thread: the pages are free to go
        r.release(t)
        with self._lock:
            self._mirrors.pop((cid, t.ticket_id), None)
            if cid in self._clients:
                self._out.append((cid, encode(Settled(ticket_id=t.ticket_id))))

    def _drop_client(self, cid: bytes) -> None:
        """Its queued jobs are cancelled, its undispatched leases return; dispatched writes finish."""
        with self._lock:
            self._clients.pop(cid, None)
            mine = [(k, v) for k, v in self._mirrors.items() if k[0] == cid and v[0].dispatched_at is None]
            for k, _ in mine:
                del self._mirrors[k]
        for _, (t, r) in mine:
            if t.source is not None:
                r.release(t)
            else:  # queued: cancelled; running: its result finds the client gone and returns the pages
                r.cancel(t.request_id)

    # ---- teardown -------------------------------------------------------------------------------
    def close(self) -> None:
        self._stop.set()
        for th in getattr(self, "_threads", []):
            th.join(timeout=10)
        for r in self.replicas:
            r.close()  # every lease returns; rank processes stop
        leases = sum(r.num_leases for r in self.replicas)
        full = all(r.blocks.num_free == r.blocks.num_blocks for r in self.replicas)
        if hasattr(self, "_sock"):
            self._sock.close(0)
            self._ctx.term()
        print(f"AR stage shut down (leases held: {leases}, pools full: {full})", flush=True)
