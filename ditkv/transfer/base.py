"""What every transport shares: the `Transport` interface, the region a peer writes into, and the
two failures (a write that did not complete; a transport that could not start). The transports
(`transport.py`: Mooncake, shm and the factory; `cuda_transport.py`) build on this module only.
"""

from __future__ import annotations

import msgspec
import torch

from .descriptors import Desc


class TransferFailed(RuntimeError):
    """A write did not complete; the destination pages are undefined."""


class TransportError(RuntimeError):
    """A transport could not start or register memory (a configuration / environment problem)."""


class RegionInfo(msgspec.Struct, frozen=True):
    """A registered memory region as a peer sees it (travels inside tickets)."""

    transport: str
    endpoint: str  # the owner's address: mooncake "host:port", shm "ipc://…"
    name: str
    handle: str  # mooncake: base address (decimal); shm: segment name
    nbytes: int


class Transport:
    kind = "base"
    endpoint = ""

    def register(self, name: str, tensor: torch.Tensor, export: bool = True) -> RegionInfo:
        """Make `tensor` a named region. `export` False: no peer in another process will write it
        (a producer's own pool, or a consumer whose producers all run in this process); a
        transport that must pay to open a region across processes (CUDA IPC) skips that."""
        raise NotImplementedError

    def write(self, src: str, dst: RegionInfo, descs: list[Desc], notify: str | None = None) -> None:
        raise NotImplementedError

    def poll_notifies(self) -> list[str]:
        raise NotImplementedError

    def close(self) -> None:
        pass
