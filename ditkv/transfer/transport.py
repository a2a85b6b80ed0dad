"""Transports: move byte ranges from a local registered region into a peer's registered region,
then deliver a completion notice to that peer.

- `MooncakeTransport`: Mooncake Transfer Engine (P2P handshake, TCP here, RDMA where the NICs
  exist). The notice rides on the last batch (`TransferNotify`), so the peer sees it only after
  the data landed.
- `ShmTransport`: same-host stages. Pools live in POSIX shared memory; the writer maps the peer's
  segment and copies directly; the notice goes over a ZeroMQ IPC socket after the copy.
- `CudaTransport` (`cuda_transport.py`): same-host GPU stages; device-to-device copies in one
  process, CUDA IPC across processes.

`write` is synchronous (the caller runs it on a transfer thread) and raises `TransferFailed`;
after any failure the destination bytes are undefined (a timed-out write may still land).
"""

from __future__ import annotations

import ctypes
import os
import threading
import uuid
from multiprocessing import shared_memory

import torch

from .base import RegionInfo, TransferFailed, Transport, TransportError  # noqa: F401 (re-exported)
from .descriptors import split_batches
from .notices import NoticeChannel

NOTIFY_NAME = "ditkv"


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


# ---- Mooncake -------------------------------------------------------------------------------
class MooncakeTransport(Transport):
    kind = "mooncake"

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", max_descriptors_per_batch: int = 512):
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
        try:
            from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode
        except ImportError as e:
            raise TransportError(
                f"kv_connector 'mooncake' needs the Mooncake Transfer Engine ({e}); install it with "
                "`pip install ditkv[transfer]` (and `apt-get install libibverbs1`), or use kv_connector: shm "
                "for co-located stages") from e
        self._notify_cls, self._write_op = TransferNotify, TransferOpcode.Write
        self._engine = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            self._engine = None  # never call into an engine whose initialize failed (it crashes)
            raise TransportError(f"Mooncake initialize({host!r}, {protocol!r}) failed with rc={rc}")
        self.endpoint = f"{host}:{self._engine.get_rpc_port()}"
        self.max_batch = max_descriptors_per_batch
        self._regions: dict[str, tuple[int, int]] = {}

    def register(self, name, tensor, export=True):
        ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        if (ptr, nbytes) in self._regions.values():  # same memory again (a second producer on it):
            self._regions[name] = (ptr, nbytes)      # Mooncake refuses a re-registration (-7)
            return RegionInfo(self.kind, self.endpoint, name, str(ptr), nbytes)
        rc = self._engine.register_memory(ptr, nbytes)
        if rc != 0:
            raise TransportError(f"Mooncake register_memory({name!r}, {nbytes} bytes) failed with rc={rc}")
        self._regions[name] = (ptr, nbytes)
        return RegionInfo(self.kind, self.endpoint, name, str(ptr), nbytes)

    def write(self, src, dst, descs, notify=None):
        base, _ = self._regions[src]
        peer = int(dst.handle)
        batches = split_batches(descs, self.max_batch)
        for i, batch in enumerate(batches):
            srcs = [base + s for s, _, _ in batch]
            dsts = [peer + d for _, d, _ in batch]
            lens = [n for _, _, n in batch]
            if i == len(batches) - 1 and notify is not None:
                rc = self._engine.batch_transfer_sync(dst.endpoint, srcs, dsts, lens, self._write_op,
                                                      self._notify_cls(NOTIFY_NAME, notify))
            else:
                rc = self._engine.batch_transfer_sync_write(dst.endpoint, srcs, dsts, lens)
            if rc != 0:
                raise TransferFailed(f"Mooncake write to {dst.endpoint} failed (rc={rc}, batch {i + 1}/"
                                     f"{len(batches)})")

    def poll_notifies(self):
        return [n.msg for n in self._engine.get_notifies() if n.name == NOTIFY_NAME]

    def close(self):
        if self._engine is not None:
            for ptr in {ptr for ptr, _ in self._regions.values()}:
                self._engine.unregister_memory(ptr)
            self._regions.clear()
            self._engine = None


# ---- same host: shared memory ----------------------------------------------------------------
_SEGMENTS: dict[int, shared_memory.SharedMemory] = {}  # data_ptr -> segment we created
_SEG_LOCK = threading.Lock()


def shm_tensor(shape, dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor backed by a named POSIX shared-memory segment (so a co-located
    peer process can map it). The segment is unlinked when its `ShmTransport` closes."""
    nbytes = max(1, int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size())
    seg = shared_memory.SharedMemory(create=True, size=nbytes, name=f"ditkv-{uuid.uuid4().hex[:16]}")
    t = torch.frombuffer(seg.buf, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)
    t.zero_()
    with _SEG_LOCK:
        _SEGMENTS[t.data_ptr()] = seg
    return t


def _attach(name: str) -> shared_memory.SharedMemory:
    with _SEG_LOCK:  # a segment this process created: use it as is (no second tracker entry)
        for seg in _SEGMENTS.values():
            if seg.name == name:
                return seg
    return _Mapping(name)


class _Mapping:
    """A peer's segment mapped without `SharedMemory`: on Python 3.11 attaching registers it with
    the resource tracker, which spawned processes share; unregistering then would drop the
    creator's own entry (a KeyError later, and no cleanup if the creator dies)."""

    def __init__(self, name: str):
        import _posixshmem
        import mmap

        fd = _posixshmem.shm_open("/" + name.lstrip("/"), os.O_RDWR, mode=0o600)
        try:
            self._mmap = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.name, self.buf = name, memoryview(self._mmap)


class ShmTransport(Transport):
    kind = "shm"

    def __init__(self):
        self._notices = NoticeChannel("ditkv-shm")
        self.endpoint = self._notices.endpoint
        self._lock = threading.Lock()
        self._peers: dict[str, tuple[shared_memory.SharedMemory, torch.Tensor]] = {}
        self._regions: dict[str, tuple[torch.Tensor, shared_memory.SharedMemory]] = {}

    def register(self, name, tensor, export=True):
        with _SEG_LOCK:
            seg = _SEGMENTS.get(tensor.data_ptr())
        if seg is None:
            raise TransportError(f"region {name!r} is not in shared memory: allocate it with "
                                 "ditkv.transfer.transport.shm_tensor (kv_connector: shm)")
        self._regions[name] = (_byte_view(tensor), seg)
        return RegionInfo(self.kind, self.endpoint, name, seg.name, tensor.numel() * tensor.element_size())

    def _peer_bytes(self, dst: RegionInfo) -> torch.Tensor:
        with self._lock:
            hit = self._peers.get(dst.handle)
            if hit is None:
                try:
                    seg = _attach(dst.handle)
                except FileNotFoundError as e:
                    raise TransferFailed(f"peer segment {dst.handle} is gone (peer exited?)") from e
                hit = (seg, torch.frombuffer(seg.buf, dtype=torch.uint8))
                self._peers[dst.handle] = hit
            return hit[1]

    def write(self, src, dst, descs, notify=None):
        sbytes = self._regions[src][0]
        dbytes = self._peer_bytes(dst)
        sbase, dbase, slen = sbytes.data_ptr(), dbytes.data_ptr(), sbytes.numel()
        for s, d, n in descs:
            if d + n > dst.nbytes or s + n > slen:
                raise TransferFailed(f"descriptor ({s}, {d}, {n}) outside the registered regions")
        for s, d, n in descs:  # plain memmove: ~1 us per descriptor, and it releases the GIL
            ctypes.memmove(dbase + d, sbase + s, n)
        if notify is not None:
            self._notices.send(dst.endpoint, notify)

    def poll_notifies(self):
        return self._notices.poll()

    def close(self):
        with self._lock:
            self._peers.clear()  # views keep the mapping alive; it is released with them
        self._notices.close()
        for _, seg in self._regions.values():
            try:
                seg.unlink()
            except FileNotFoundError:
                pass
            with _SEG_LOCK:
                for ptr in [p for p, s in _SEGMENTS.items() if s is seg]:
                    del _SEGMENTS[ptr]
        self._regions.clear()


def make_transport(kind: str, host: str = "127.0.0.1", protocol: str = "tcp",
                   max_descriptors_per_batch: int = 512) -> Transport:
    if kind == "mooncake":
        return MooncakeTransport(host, protocol, max_descriptors_per_batch)
    if kind == "shm":
        return ShmTransport()
    if kind == "cuda":
        from .cuda_transport import CudaTransport

        return CudaTransport()
    raise TransportError(f"unknown kv_connector {kind!r}; choose 'mooncake', 'shm' or 'cuda'")


def alloc_region(kind: str, shape, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """Memory a transport of `kind` can register (shared memory for 'shm' on CPU; plain device
    memory for 'cuda', which exports it through CUDA IPC when it registers it)."""
    if kind == "shm":
        if torch.device(device).type != "cpu":
            raise TransportError("kv_connector 'shm' moves CPU pools; for GPU pools use kv_connector 'cuda' "
                                 "(same host) or 'mooncake'")
        return shm_tensor(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)
