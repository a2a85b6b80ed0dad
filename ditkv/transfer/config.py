"""Transfer configuration of one stage: which path (legacy / native), which transport, who we are.

A stage YAML carries at most one of `kv_transfer_config` (native: page-to-page into the DiT's
paged pool) and `legacy_kv_transfer` (the baseline: one contiguous tensor copied into the DiT's
dense cache). Every error names the field, the bad value and the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from ..errors import ConfigError

NATIVE, LEGACY = "native", "legacy"
ROLES = ("kv_producer", "kv_consumer", "kv_both")
PRODUCER_ROLES = ("kv_producer", "kv_both")
CONSUMER_ROLES = ("kv_consumer", "kv_both")
# mooncake: Mooncake Transfer Engine (TCP here, RDMA where the NICs exist); shm / cuda: same-host
# transports for co-located stages (POSIX shared memory for CPU pools; device-to-device copies
# in one process and CUDA IPC across processes for GPU pools).
TRANSPORTS = ("mooncake", "shm", "cuda")
GPU_TRANSPORTS = ("cuda",)
PROTOCOLS = ("tcp", "rdma")
DEFAULT_TIMEOUT_S = 60.0

NATIVE_KEY, LEGACY_KEY = "kv_transfer_config", "legacy_kv_transfer"


@dataclass
class TransferConfig:
    mode: str  # NATIVE | LEGACY (from the YAML key, not a field users write)
    engine_id: str | None = None
    kv_role: str | None = None
    kv_connector: str = "shm"
    kv_ip: str = "127.0.0.1"
    protocol: str = "tcp"
    transfer_timeout: float = DEFAULT_TIMEOUT_S
    # most descriptors per transport batch: bounds in-flight slices per peer (Mooncake wedges a
    # peer past a few thousand queued slices) while adjacent pages are merged first
    max_descriptors_per_batch: int = 512
    # legacy only: receive slots (requests whose KV may be in flight at once) and their size
    legacy_slots: int = 8
    legacy_max_tokens: int = 4096
    # not a YAML key: False when every producer of this consumer runs in its process (the stage
    # graph decides, `graph.py`), so the cuda transport exports no IPC handle of its pool
    ipc_export: bool = True

    def __post_init__(self):
        self.validate()

    @property
    def key(self) -> str:
        return NATIVE_KEY if self.mode == NATIVE else LEGACY_KEY

    def validate(self) -> None:
        k = self.key
        if self.mode not in (NATIVE, LEGACY):
            raise ConfigError("transfer mode", self.mode, f"use {NATIVE_KEY} or {LEGACY_KEY}")
        if not isinstance(self.engine_id, str) or not self.engine_id.strip():
            raise ConfigError(f"{k}.engine_id", self.engine_id,
                              "every transfer endpoint needs a non-empty engine_id (e.g. 'ar-0', 'dit-0')")
        if self.kv_role not in ROLES:
            raise ConfigError(f"{k}.kv_role", self.kv_role, f"choose one of {', '.join(ROLES)}")
        if self.kv_connector not in TRANSPORTS:
            raise ConfigError(f"{k}.kv_connector", self.kv_connector,
                              "choose 'mooncake' (Mooncake Transfer Engine), 'shm' (same host, CPU pools) "
                              "or 'cuda' (same host, GPU pools)")
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"{k}.protocol", self.protocol, "choose 'tcp' or 'rdma'")
        t = self.transfer_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ConfigError(f"{k}.transfer_timeout", t,
                              f"must be a positive finite number of seconds (default {DEFAULT_TIMEOUT_S})")
        for name in ("max_descriptors_per_batch", "legacy_slots", "legacy_max_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{k}.{name}", v, "must be a positive integer")


def transfer_from_stage(stage: dict, where: str) -> TransferConfig | None:
    """The transfer config of one stage mapping (None when it has none)."""
    native, legacy = stage.get(NATIVE_KEY), stage.get(LEGACY_KEY)
    if native is not None and legacy is not None:
        raise ConfigError(f"{where}.{NATIVE_KEY}", "both configured",
                          f"configure exactly one of {NATIVE_KEY} (native page transfer) and "
                          f"{LEGACY_KEY} (legacy contiguous copy)")
    data, mode = (native, NATIVE) if native is not None else (legacy, LEGACY)
    if data is None:
        return None
    key = NATIVE_KEY if mode == NATIVE else LEGACY_KEY
    if not isinstance(data, dict):
        raise ConfigError(f"{where}.{key}", data, "must be a mapping of transfer fields")
    names = {f.name for f in fields(TransferConfig)} - {"mode", "ipc_export"}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{where}.{key}.{unknown[0]}", data[unknown[0]],
                          f"unknown transfer key; valid keys: {', '.join(sorted(names))}")
    return TransferConfig(mode=mode, **data)
