"""Completion notices between same-host transports: "these bytes landed" after the data.

Each transport owns one channel: a ZeroMQ PULL socket on a private IPC path for writers in other
processes, and a queue for writers in this process (found through a process-wide registry, so
no socket round trip when both stages share a process).
"""

from __future__ import annotations

import os
import queue
import tempfile
import threading
import uuid

_LOCK = threading.Lock()
_LOCAL: dict[str, queue.SimpleQueue] = {}  # endpoint -> inbox of a channel in this process


class NoticeChannel:
    def __init__(self, prefix: str):
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self._path = os.path.join(tempfile.gettempdir(), f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock")
        self.endpoint = f"ipc://{self._path}"
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(self.endpoint)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._push: dict[str, object] = {}
        with _LOCK:
            _LOCAL[self.endpoint] = self._inbox

    def send(self, endpoint: str, msg: str) -> None:
        with _LOCK:
            inbox = _LOCAL.get(endpoint)
        if inbox is not None:
            inbox.put(msg)
            return
        with self._lock:
            sock = self._push.get(endpoint)
            if sock is None:
                sock = self._ctx.socket(self._zmq.PUSH)
                sock.setsockopt(self._zmq.LINGER, 0)
                sock.connect(endpoint)
                self._push[endpoint] = sock
            sock.send_string(msg)

    def poll(self) -> list[str]:
        out = []
        while True:
            try:
                out.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        while True:
            try:
                out.append(self._pull.recv_string(self._zmq.NOBLOCK))
            except self._zmq.Again:
                return out

    def close(self) -> None:
        with _LOCK:
            _LOCAL.pop(self.endpoint, None)
        with self._lock:
            for sock in self._push.values():
                sock.close(0)
            self._push.clear()
        self._pull.close(0)
        try:
            os.unlink(self._path)
        except FileNotFoundError:
            pass
