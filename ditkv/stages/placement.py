"""Device placement of stage replicas: which GPU each rank of each replica uses.

Per stage either an explicit `devices: [..]` list (GPU indices, consumed replica by replica, rank
by rank) or the stage's `engine.device: cuda:B` as the base: replica i of a stage with world size
W uses cuda:(B + i*W + rank). A CPU stage places every rank on the CPU. Validation (at load time,
no GPU needed): too few devices for replicas x world size, a device listed twice, and two stages
sharing a GPU while the DiT profiles its pool from the free memory are errors naming the fix.
"""

from __future__ import annotations

from ..errors import ConfigError


def world_size(spec) -> int:
    return getattr(spec.engine, "world_size", None) or spec.engine.tensor_parallel_size


def _base(device: str) -> int | None:
    """`cuda:B` -> B, `cuda` -> 0; None for a non-CUDA device (auto counts as CPU here: unknown)."""
    dev = str(device).strip().lower()
    if dev == "cuda":
        return 0
    if dev.startswith("cuda:") and dev[5:].isdigit():
        return int(dev[5:])
    return None


def stage_gpus(spec) -> list[int] | None:
    """Every GPU index the stage uses, replica-major then rank; None for a non-CUDA stage."""
    need = spec.replicas * world_size(spec)
    if spec.devices is not None:
        return list(spec.devices[:need])
    base = _base(spec.engine.device)
    return None if base is None else list(range(base, base + need))


def replica_devices(spec, i: int) -> list[str]:
    """The device string of each rank of replica `i`."""
    w = world_size(spec)
    if not 0 <= i < spec.replicas:
        raise ValueError(f"replica {i} outside [0, {spec.replicas})")
    gpus = stage_gpus(spec)
    if gpus is None:
        return [str(spec.engine.device)] * w
    return [f"cuda:{g}" for g in gpus[i * w:(i + 1) * w]]


def rank_device(spec, replica: int, rank: int) -> str:
    """The device string rank `rank` of replica `replica` binds (what its rank process or, for a
    single-rank replica, its in-process worker is given)."""
    devs = replica_devices(spec, replica)
    if not 0 <= rank < len(devs):
        raise ValueError(f"rank {rank} outside [0, {len(devs)})")
    return devs[rank]


def sizing_device(name: str):
    """The torch device a rank's pool is sized for (`graph_checks.size_pools`). A GPU stage file may be
    sized on a host without its GPUs: `cuda...` is parsed only (each rank checks its pool against
    its GPU when it starts); anything else is resolved (`auto`, `cpu`)."""
    import torch

    from ..models.loader import resolve_device

    if not name.strip().lower().startswith("cuda"):
        return resolve_device(name)
    try:
        return torch.device(name)
    except RuntimeError as e:  # torch's parse error
        raise ConfigError("device", name, "not a device name; use auto, cpu, cuda or cuda:N") from e


def check_devices(where: str, devices, spec) -> list[int] | None:
    """Validate one stage's `devices` list (None when absent)."""
    if devices is None:
        return None
    if not isinstance(devices, list) or not devices or any(
            isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in devices):
        raise ConfigError(f"{where}.devices", devices, "must be a non-empty list of GPU indices (ints >= 0)")
    if len(set(devices)) != len(devices):
        raise ConfigError(f"{where}.devices", devices, "lists a GPU twice; give each rank its own GPU")
    if _base(spec.engine.device) is None:
        raise ConfigError(f"{where}.devices", devices, "places ranks on GPUs: set engine.device: cuda")
    need = spec.replicas * world_size(spec)
    if len(devices) < need:
        raise ConfigError(f"{where}.devices", devices,
                          f"{spec.replicas} replicas x {world_size(spec)} ranks need {need} GPUs, "
                          f"{len(devices)} listed")
    return devices


def check_disjoint(ar, dit) -> None:
    """Two stages share a GPU only when the DiT has a page pool: an explicit size, or one sized at its
    startup from gpu_memory_utilization, which is capped by what the GPU has free once the AR stage (built
    first) holds its pool (`engine/sizing.py`). A dense_legacy DiT's caches grow per request: refused."""
    a, d = stage_gpus(ar), stage_gpus(dit)
    if a is None or d is None:
        return
    both = sorted(set(a) & set(d))
    if both and not dit.engine.paged:
        raise ConfigError("stages[1].devices", d, f"GPUs {both} are also used by stage 0 ({a}); give the "
                          "stages disjoint devices (e.g. AR on 0-3, DiT on 4-7) or move engine.device, or "
                          "use the paged DiT (diffusion_kv_mode: paged_scheduler) so both pools fit on the shared GPUs")
