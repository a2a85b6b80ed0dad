"""The timestamp probe of `ditkv bench handoff` (handoff.py): wrappers installed on one run's stage
objects (no stage code changes) that mark, per request, when the AR stage finished, when the
producer wrote, when the DiT saw the notice, joined the batch and took its first step, and on CUDA
the GPU memory allocated in between."""

from __future__ import annotations

import threading
import time

import torch


def norm_device(dev) -> torch.device:
    """`cuda` / cuda:N -> a device with its index (one key per GPU)."""
    d = torch.device(dev)
    return torch.device("cuda", torch.cuda.current_device()) if d.type == "cuda" and d.index is None else d


class Probe:
    """Marks per request id (time.monotonic seconds, the clock of `TransferTicket.dispatched_at`)."""

    def __init__(self, orch):
        ar, dit = orch.ar[0], orch.dit[0]
        self.marks: dict[str, dict[str, float]] = {}
        self.gpu: dict[str, dict] = {}
        self.devs = sorted({str(norm_device(d)) for d in (ar.device, dit.device) if norm_device(d).type == "cuda"})
        self._local = threading.local()
        self._lock = threading.Lock()
        self.staging_bytes = _nbytes(getattr(ar.producer, "_staging", None))
        slots = dit.consumers[0].slots
        self.slot_bytes = _nbytes(slots.buffer if slots is not None else None)
        self.dense_bytes: dict[str, int] = {}
        self._last_dense = None  # the DiT thread's last dense cache (legacy), bytes
        _wrap(ar, "_deliver", self._ar_done)
        _wrap(ar.producer, "_send", self._send)
        _wrap(ar.producer.transport, "write", self._write)
        _wrap(dit, "submit", self._submit)
        _wrap(dit.consumers[0], "poll", self._poll)
        _wrap(dit.engine.executor.stepper, "start", self._start)
        _wrap(dit.worker.runner, "step", self._step)
        _wrap(dit.worker.runner, "new_dense_cache", self._dense)

    def mark(self, rid: str, what: str) -> None:
        """The first time `what` happens for `rid` (several notices: the first one)."""
        for d in self.devs:
            torch.cuda.synchronize(d)
        now = time.monotonic()
        with self._lock:
            self.marks.setdefault(rid, {}).setdefault(what, now)

    def _ar_done(self, orig):
        def deliver(out):  # the AR stage's engine ended a job: before its ticket goes to the DiT
            if out.status == "ok":
                rid = out.request_id
                self.mark(rid, "ar_end")
                if self.devs:  # the handoff's own peak: reset now, read at the first step
                    self.gpu[rid] = {"allocated_at_ar_end": {d: torch.cuda.memory_allocated(d) for d in self.devs}}
                    for d in self.devs:
                        torch.cuda.reset_peak_memory_stats(d)
            return orig(out)
        return deliver

    def _submit(self, orig):
        def submit(job):
            self.mark(job.request_id, "dit_submit")
            return orig(job)
        return submit

    def _send(self, orig):
        def send(ticket, on_done):
            rid = ticket.request_id
            with self._lock:
                self.marks.setdefault(rid, {})["dispatched"] = ticket.dispatched_at
            self._local.rid = rid
            self.mark(rid, "send_start")
            try:
                return orig(ticket, lambda t: (self.mark(rid, "send_end"), on_done(t)))
            finally:
                self._local.rid = None
        return send

    def _write(self, orig):
        def write(*a, **kw):
            rid = getattr(self._local, "rid", None)
            t0 = time.monotonic()
            try:
                return orig(*a, **kw)
            finally:
                if rid is not None:  # descriptors: > 1 takes CudaTransport's batched (index_select) copy
                    with self._lock:
                        m = self.marks.setdefault(rid, {})
                        m["write_s"] = m.get("write_s", 0.0) + time.monotonic() - t0
                        m["descriptors"] = m.get("descriptors", 0) + len(a[2] if len(a) > 2 else kw["descs"])
        return write

    def _poll(self, orig):
        def poll():
            got = orig()
            for tid, *_ in got:
                self.mark(tid.split("-", 1)[1], "notice")  # ticket ids are "t<n>-<request id>"
            return got
        return poll

    def _start(self, orig):
        def start(rid, *a, **kw):
            self.mark(rid, "run_start")
            return orig(rid, *a, **kw)
        return start

    def _dense(self, orig):
        def new(layout):
            cache = orig(layout)
            if cache is not None:
                self._last_dense = cache.nbytes
            return cache
        return new

    def _first_step(self, rid):
        if rid in self.marks and "first_step" in self.marks[rid]:
            return
        self.mark(rid, "first_step")
        if self._last_dense is not None:
            self.dense_bytes[rid], self._last_dense = self._last_dense, None
        if rid in self.gpu:
            g = self.gpu[rid]
            g["peak_allocated"] = {d: torch.cuda.max_memory_allocated(d) for d in self.devs}
            g["peak_extra_bytes"] = sum(g["peak_allocated"][d] - g["allocated_at_ar_end"][d] for d in self.devs)

    def _step(self, orig):
        def step(states):
            for st in states:
                if st.first_step:
                    self._first_step(st.request_id)
            return orig(states)
        return step

    def breakdown(self, rid: str) -> dict:
        """Milliseconds per phase of one handoff (None where a mark is missing)."""
        m = self.marks.get(rid, {})

        def d(a, b):
            return 1e3 * (m[b] - m[a]) if a in m and b in m and m[a] is not None and m[b] is not None else None
        send, write = d("send_start", "send_end"), 1e3 * m.get("write_s", 0.0)
        return {"handoff": d("ar_end", "first_step"), "to_dispatch": d("ar_end", "dispatched"),
                "orchestrator": d("ar_end", "dit_submit"), "dit_intake": d("dit_submit", "dispatched"),
                "send": send, "write": write, "send_outside_write": None if send is None else send - write,
                "to_notice": d("send_start", "notice"), "notice_to_run": d("notice", "run_start"),
                "run_to_step": d("run_start", "first_step")}


def _wrap(obj, name: str, make) -> None:
    setattr(obj, name, make(getattr(obj, name)))


def _nbytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()
