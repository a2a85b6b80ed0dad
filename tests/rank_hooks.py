"""The `RankHooks` (ditkv/engine/hooks.py) that the multi-rank tests use, and options carrying them.

`hooked_options(...)` is an `ExecutorOptions` plus any of:
- `replicate_ranks=N`: N ranks that each run the full model (no sharding) in one gloo group, so the
  rank protocol (votes, aborts, failures) is tested without model parallelism;
- `inject_fault=(rank, request_id, step)`: that rank raises before that step of the request
  `request_id`;
- `send_gate=FOLDER`: every KV write of a producer rank r waits until the file FOLDER/r<r> exists.

`ServerGate(path)` is the hook of a gated AR stage server (`gated_stage.py`).

Spawned ranks unpickle these classes by module name: this folder is on their path (pytest puts it
on sys.path and spawned processes inherit it).
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass

from ditkv.engine.hooks import RankHooks
from ditkv.engine.options import ExecutorOptions
from ditkv.transfer.config import PRODUCER_ROLES


@dataclass
class RankTestHooks(RankHooks):
    replicate_ranks: int = 0
    inject_fault: tuple[int, str, int] | None = None
    send_gate: str | None = None

    def num_ranks(self, config) -> int:
        return self.replicate_ranks or config.world_size

    def init_group(self, config, rank, world_size, init_method, options):
        if not self.replicate_ranks:
            return super().init_group(config, rank, world_size, init_method, options)
        import torch
        import torch.distributed as dist

        if torch.cuda.is_available():
            from ditkv.worker.parallel import bind_device

            torch.cuda.set_device(torch.device(bind_device("cuda", rank, torch.cuda.device_count(), options.devices)))
        timeout = datetime.timedelta(seconds=options.collective_timeout_s or 600)
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
        return None  # no ParallelContext: every rank runs the whole model

    def at_step_boundary(self, rank, request_id, step) -> None:
        if self.inject_fault is not None and self.inject_fault == (rank, request_id, step):
            raise RuntimeError(f"injected fault on rank {rank} at step {step}")

    def on_transport(self, transport, rank, role) -> None:
        if self.send_gate and role in PRODUCER_ROLES:
            hold_writes(transport, os.path.join(self.send_gate, f"r{rank}"))


def hold_writes(transport, path: str, mark_waiting: bool = False) -> None:
    """Every `transport.write` waits until the file `path` exists; with `mark_waiting`, a waiting
    write first creates `path.waiting`."""
    write = transport.write

    def held(*args, **kwargs):
        if mark_waiting:
            open(path + ".waiting", "a").close()
        while not os.path.exists(path):
            time.sleep(0.005)
        return write(*args, **kwargs)
    transport.write = held


def hooked_options(replicate_ranks: int = 0, inject_fault=None, send_gate=None, **options) -> ExecutorOptions:
    hooks = RankTestHooks(replicate_ranks, inject_fault, send_gate)
    return ExecutorOptions(**options, hooks=hooks)


@dataclass
class ServerGate(RankHooks):
    """An AR stage server's writes wait until the file `path` exists (`path.waiting`: one is waiting)."""

    path: str

    def on_transport(self, transport, rank, role) -> None:
        hold_writes(transport, self.path, mark_waiting=True)
