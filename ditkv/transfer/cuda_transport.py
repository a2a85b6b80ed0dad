"""`CudaTransport` (kv_connector `cuda`): the same-host transport for co-located GPU stages.

- Same process (the orchestrator runs replicas as threads): the writer finds the peer's pool in a
  process-wide registry and copies device to device (`copy_` per merged descriptor, peer-to-peer
  when the pools are on different GPUs) on a dedicated stream per device.
- Different processes: at registration the owner exports its pool through CUDA IPC
  (`torch.multiprocessing` reduction of the pool storage); the handle travels inside the
  `RegionInfo` (so once per region) and the writer opens it once and caches the mapping.

Ordering: the copy stream first waits for the source device's default stream (the AR's kernels
that wrote the pages, the legacy gather into staging) and, in-process, for the destination
device's default stream (kernels of a request that used those pages before). The write returns
only after an event recorded behind the copies completed, and only then is the completion
notice delivered, so a notice always arrives after its data. Notices go through an in-process
queue when the peer lives in this process, else over a ZeroMQ IPC socket.

On CPU tensors the in-process path is a plain `copy_` (the CPU tests use it; stage configs
reject `cuda` with CPU devices).
"""

from __future__ import annotations

import base64
import io
import logging
import math
import os
import pickle
import threading
import uuid

import numpy as np
import torch

from .descriptors import Desc
from .notices import NoticeChannel
from .base import RegionInfo, Transport, TransferFailed, TransportError

log = logging.getLogger("ditkv.transfer")
_LOCK = threading.Lock()
_LOCAL_REGIONS: dict[str, torch.Tensor] = {}  # token -> byte view of a region registered here

# what an IPC handle may name when it is unpickled (it travels inside tickets)
_IPC_GLOBALS = {("torch.multiprocessing.reductions", "rebuild_cuda_tensor"), ("torch", "Tensor"),
                ("torch", "Size"), ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage")}


class _HandleUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _IPC_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                   torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a CUDA IPC handle may not reference {module}.{name}")


def export_ipc(t: torch.Tensor) -> str:
    """A string a process on this host can turn back into a view of `t`'s memory."""
    from torch.multiprocessing.reductions import reduce_tensor

    return base64.b64encode(pickle.dumps(reduce_tensor(t), protocol=4)).decode()


def open_ipc(blob: str) -> torch.Tensor:
    fn, args = _HandleUnpickler(io.BytesIO(base64.b64decode(blob))).load()
    return fn(*args)


def _split_handle(handle: str) -> tuple[int, str, str]:
    pid, token, blob = handle.split(":", 2)
    return int(pid), token, blob


class CudaTransport(Transport):
    kind = "cuda"

    def __init__(self):
        self._notices = NoticeChannel("ditkv-cuda")
        self.endpoint = self._notices.endpoint
        self._lock = threading.Lock()
        self._regions: dict[str, tuple[str, torch.Tensor]] = {}  # name -> (token, byte view)
        self._peers: dict[str, torch.Tensor] = {}  # token -> opened IPC byte view
        self._streams: dict[int, torch.cuda.Stream] = {}

    # ---- registration ---------------------------------------------------------------------
    def register(self, name, tensor, export=True):
        if not tensor.is_contiguous():
            raise TransportError(f"region {name!r} must be contiguous to be registered")
        view = tensor.reshape(-1).view(torch.uint8)
        token = uuid.uuid4().hex
        blob = ""  # CPU regions (and GPU ones IPC cannot export) are reachable in this process only
        # torch's IPC export keeps the memory alive until a consumer process releases it: a region
        # that no other process ever opens would outlive its pool (20 GiB held after a stage graph's
        # shutdown, tools/gpu_stage_memory.py). So only regions other processes write are exported.
        if view.is_cuda and export:
            try:
                blob = export_ipc(view)
            except Exception as e:  # noqa: BLE001 - in-process peers still work without IPC
                log.warning("CUDA IPC export of region %r failed (%s); only in-process peers can write it", name, e)
        with _LOCK:
            _LOCAL_REGIONS[token] = view
        self._regions[name] = (token, view)
        return RegionInfo(self.kind, self.endpoint, name, f"{os.getpid()}:{token}:{blob}", view.numel())

    def _peer_bytes(self, dst: RegionInfo) -> tuple[torch.Tensor, bool]:
        """The peer region's bytes, and whether it lives in this process."""
        try:
            pid, token, blob = _split_handle(dst.handle)
        except ValueError as e:
            raise TransferFailed(f"malformed cuda region handle for {dst.name!r}") from e
        with _LOCK:
            local = _LOCAL_REGIONS.get(token)
        if local is not None:
            return local, True
        if pid == os.getpid():
            raise TransferFailed(f"peer region {dst.name!r} is gone (its transport closed)")
        if not blob:
            raise TransferFailed(f"peer region {dst.name!r} is CPU memory of process {pid}; only GPU "
                                 "regions can be opened across processes (CUDA IPC)")
        with self._lock:
            hit = self._peers.get(token)
            if hit is None:
                try:
                    hit = open_ipc(blob)
                except Exception as e:  # noqa: BLE001 - any failure to map is a failed write
                    raise TransferFailed(f"could not open the CUDA IPC handle of {dst.name!r} (process "
                                         f"{pid}): {type(e).__name__}: {e}") from e
                self._peers[token] = hit
            return hit, False

    # ---- data -----------------------------------------------------------------------------
    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            s = self._streams.get(device.index)
            if s is None:
                s = self._streams[device.index] = torch.cuda.Stream(device)
            return s

    def write(self, src, dst, descs: list[Desc], notify=None):
        sb = self._regions[src][1]
        db, in_process = self._peer_bytes(dst)
        for s, d, n in descs:
            if d + n > db.numel() or s + n > sb.numel():
                raise TransferFailed(f"descriptor ({s}, {d}, {n}) outside the registered regions")
        if sb.is_cuda and db.is_cuda:
            self._copy_cuda(sb, db, descs, in_process)
        elif sb.device == db.device:
            with torch.inference_mode():  # pools made under inference mode accept in-place writes here
                batched_copy(sb, db, descs)
        else:
            raise TransferFailed(f"cuda transport cannot copy {sb.device} -> {db.device}")
        if notify is not None:
            self._notices.send(dst.endpoint, notify)

    def _copy_cuda(self, sb: torch.Tensor, db: torch.Tensor, descs, in_process: bool) -> None:
        s_src = self._stream(sb.device)
        s_dst = self._stream(db.device)
        s_src.wait_stream(torch.cuda.default_stream(sb.device))
        if in_process:  # another process's stream cannot be waited on; its pages are reserved
            s_dst.wait_stream(torch.cuda.default_stream(db.device))
        # a cross-device copy_ runs on the source device's current stream and fences with the
        # destination device's current stream: make both of them ours, not the stages' streams
        with torch.cuda.stream(s_src), torch.cuda.stream(s_dst), torch.inference_mode():
            batched_copy(sb, db, descs)
            # the gather runs on the source stream, the scatter on the destination stream
            done = [torch.cuda.Event(), torch.cuda.Event()]
            done[0].record(s_src)
            done[1].record(s_dst)
        for ev in done:
            ev.synchronize()  # the data landed; only now may the notice go out

    def poll_notifies(self):
        return self._notices.poll()

    def close(self):
        with _LOCK:
            for token, _ in self._regions.values():
                _LOCAL_REGIONS.pop(token, None)
        with self._lock:
            self._peers.clear()  # dropping the views closes the IPC mappings
        self._regions.clear()
        self._notices.close()


# Below this many bytes per unit a gather/scatter is not worth its index tensors.
_MIN_BATCH_UNIT = 512
# Largest gather temporary of one batched copy (its rows are copied chunk by chunk).
_MAX_TEMP_BYTES = 64 << 20


def batched_copy(sb: torch.Tensor, db: torch.Tensor, descs: list[Desc]) -> None:
    """Copy every descriptor `(src_off, dst_off, nbytes)` between byte views in a few kernels.

    Scattered pages as one `copy_` each cost a launch (and a P2P setup) apiece: 64 scattered
    128 KiB pages ran at 0.1x a contiguous copy. All offsets and lengths here are multiples of
    one unit (a page, or a head slice of one), so the byte views become `[rows, unit]` matrices
    and the whole batch is one `index_select` on the source device, one device-to-device copy and
    one `index_copy_` on the destination.
    """
    if not descs:
        return
    unit = 0
    for s, d, n in descs:
        unit = math.gcd(unit, s, d, n)
    if len(descs) == 1 or unit < _MIN_BATCH_UNIT:
        for s, d, n in descs:
            db[d:d + n].copy_(sb[s:s + n], non_blocking=True)
        return
    word = 8 if unit % 8 == 0 and sb.numel() % 8 == 0 and db.numel() % 8 == 0 else 1
    src = (sb.view(torch.int64) if word == 8 else sb)[: sb.numel() // unit * (unit // word)].view(-1, unit // word)
    dst = (db.view(torch.int64) if word == 8 else db)[: db.numel() // unit * (unit // word)].view(-1, unit // word)
    src_rows, dst_rows = (torch.from_numpy(r) for r in _unit_rows(descs, unit))
    # the gathered rows are a temporary: in chunks, so a write never holds more than
    # _MAX_TEMP_BYTES beyond the two pools (a whole 6.7k-token prefix would be ~840 MiB)
    step = max(1, _MAX_TEMP_BYTES // unit)
    for i in range(0, len(src_rows), step):
        rows = src.index_select(0, src_rows[i:i + step].to(src.device, non_blocking=True))
        dst.index_copy_(0, dst_rows[i:i + step].to(dst.device, non_blocking=True), rows.to(dst.device, non_blocking=True))


def _unit_rows(descs: list[Desc], unit: int):
    """Row indices (in `unit`-byte rows) of every descriptor's source and destination, vectorised."""
    d = np.asarray(descs, dtype=np.int64).reshape(-1, 3) // unit
    counts = d[:, 2]
    within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(d[:, 0], counts) + within, np.repeat(d[:, 1], counts) + within
