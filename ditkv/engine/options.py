"""Options of the executors (timeouts, transfer role, placement of rank processes, rank hooks)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ExecutorOptions:
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 30.0  # no heartbeat this long -> the rank stopped answering
    startup_timeout_s: float = 600.0  # model load + pool allocation on every rank
    drain_timeout_s: float = 60.0  # after a rank failed a request, the others must report within this
    step_timeout_s: float | None = 600.0  # no step progress this long -> fail closed (a wedged group)
    shutdown_timeout_s: float = 10.0
    collective_timeout_s: float | None = None  # process-group timeout (None = torch's default)
    dist_init_method: str | None = None  # None = a file store in a private temp dir (one host)
    # stage replicas: each rank hosts a KV consumer for its own pool with this `TransferConfig`
    transfer: object = None
    register_timeout_s: float = 30.0  # a rank must answer a RegisterReceive within this
    # a rank service that replaces the KV consumer on every rank, e.g. the AR stage's runner + producer
    # (`stages/ar_ranks.py` ARSide): called (transfer, worker, parallel, rank) in the rank
    # process; a class or module-level function, so it pickles by reference and the engine layer
    # never imports the stage machinery
    rank_service: object = None
    # stage placement: the device string of each rank (`stages/placement.py`); None = rank % visible GPUs
    devices: list[str] | None = None
    # rank hooks (`engine/hooks.py` RankHooks: how many ranks, the process group, step boundaries, KV
    # transports); None = the defaults. A module-level class: it travels to the rank processes
    hooks: object = None
