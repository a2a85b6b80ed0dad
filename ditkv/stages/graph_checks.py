"""The checks and pool sizing of a loaded stage graph (`graph.load_stage_graph` calls them): the AR -> DiT
edge (one transfer path, producer and consumer roles, one transport, device and page geometry), the
ranks a replica may span over which transport, and each stage's pool in blocks per rank. `ar`, `dit`
and `spec` are `graph.StageSpec`s."""

from __future__ import annotations

import logging
from dataclasses import replace

from ..errors import ConfigError
from ..transfer.config import CONSUMER_ROLES, GPU_TRANSPORTS, LEGACY, LEGACY_KEY, NATIVE, NATIVE_KEY, PRODUCER_ROLES
from .placement import check_disjoint, replica_devices, sizing_device

log = logging.getLogger("ditkv.stages")
_PARALLEL = ("tensor_parallel_size", "ulysses_degree", "cfg_parallel_size")
AR_DEFAULT_KV_BLOCKS = 1024  # the AR pool of a stage file that sizes it neither way (as before byte budgets)


def check_edge(ar, dit) -> None:
    a, d = ar.transfer, dit.transfer
    if a.mode != d.mode:
        raise ConfigError(f"stages[1].{d.key}", d.mode, f"stage 0 uses {a.key}; configure the same path "
                                                        "(native or legacy) on both stages")
    if a.kv_role not in PRODUCER_ROLES:
        raise ConfigError(f"stages[0].{a.key}.kv_role", a.kv_role,
                          f"the AR stage produces KV: use one of {', '.join(PRODUCER_ROLES)}")
    if d.kv_role not in CONSUMER_ROLES:
        raise ConfigError(f"stages[1].{d.key}.kv_role", d.kv_role,
                          f"the DiT stage consumes KV: use one of {', '.join(CONSUMER_ROLES)}")
    if a.engine_id == d.engine_id:
        raise ConfigError(f"stages[1].{d.key}.engine_id", d.engine_id, "engine ids must differ between stages")
    if a.kv_connector != d.kv_connector:
        raise ConfigError(f"stages[1].{d.key}.kv_connector", d.kv_connector,
                          f"stage 0 uses {a.kv_connector!r}; both ends need the same transport")
    for i, st in enumerate((ar, dit)):
        _check_device(f"stages[{i}]", st.engine.device, a.kv_connector)
    if d.mode == NATIVE and not dit.engine.paged:
        raise ConfigError("stages[1].engine.diffusion_kv_mode", dit.engine.diffusion_kv_mode,
                          "native KV transfer writes into the DiT's paged pool: set diffusion_kv_mode: "
                          f"paged_scheduler (or use {LEGACY_KEY} with dense_legacy)")
    if d.mode == LEGACY and dit.engine.paged:
        raise ConfigError("stages[1].engine.diffusion_kv_mode", dit.engine.diffusion_kv_mode,
                          "legacy KV transfer copies into the dense cache: set diffusion_kv_mode: dense_legacy "
                          f"(or use {NATIVE_KEY} for paged)")
    _check_dit_ranks(dit)
    _check_ar_ranks(ar)
    if ar.remote is None:  # a separate AR server places its ranks on its own host's GPUs
        check_disjoint(ar, dit)
    if ar.engine.block_size != dit.engine.block_size:
        raise ConfigError("stages[0].engine.block_size", ar.engine.block_size,
                          f"the AR and DiT pools need one page geometry; the DiT uses {dit.engine.block_size}")
    if ar.engine.model != dit.engine.model:
        raise ConfigError("stages[0].engine.model", ar.engine.model,
                          f"AR and DiT must run the same model (DiT: {dit.engine.model!r})")


def _check_dit_ranks(dit) -> None:
    """A DiT replica may span several ranks (TP / Ulysses / CFG parallel, one process per rank, each
    receiving its KV-head range into its own pool, or its dense cache on the legacy path) over a CPU
    transport."""
    sizes = {k: getattr(dit.engine, k, 1) for k in _PARALLEL}
    if all(v == 1 for v in sizes.values()):
        if dit.engine.enable_expert_parallel:  # one rank holds every expert: the flag would do nothing
            raise ConfigError("stages[1].engine.enable_expert_parallel", True,
                              "expert parallel splits the experts across a DiT replica's ranks and this replica "
                              "has one: set tensor_parallel_size (or ulysses_degree / cfg_parallel_size) > 1, "
                              "or remove enable_expert_parallel")
        return
    # expert parallel changes neither the ranks (it spans the replica's tp x sp x cfg ranks) nor the
    # KV heads a rank holds (experts are split, attention is not): KV import and placement are unchanged
    _cpu_transport_across_ranks(dit, 1, "multi-rank DiT replicas", "use one rank per DiT replica")


def _check_ar_ranks(ar) -> None:
    """A tensor-parallel AR replica (one process per rank, each writing its KV-head range: pages on
    the native path, its chunk of the contiguous tensor on the legacy path) needs a CPU transport."""
    tp = ar.engine.tensor_parallel_size
    if tp == 1:
        return
    _cpu_transport_across_ranks(ar, 0, "tensor-parallel AR replicas", "use tensor_parallel_size: 1")


def _cpu_transport_across_ranks(spec, index: int, what: str, fix: str) -> None:
    """Rank processes move pages over 'shm' or 'mooncake'; 'cuda' across processes is unverified."""
    if spec.transfer.kv_connector in GPU_TRANSPORTS:
        raise ConfigError(f"stages[{index}].{NATIVE_KEY}.kv_connector", spec.transfer.kv_connector,
                          f"{what} are supported over 'shm' and 'mooncake' for now (the 'cuda' transport across "
                          f"rank processes is GPU-only and untested, see docs/transfer.md); {fix}")


def size_pools(ar, dit) -> None:
    """Each stage's page pool, in blocks per rank, fixed at load so that every part of the graph
    (replicas, rank processes, admission, a remote AR stage's summary) sees one number: `num_kv_blocks`
    as given, or `kv_cache_memory_bytes` (per rank) by the single engine's rule (`rank_setup.
    plan_sized_blocks`: the budget // one block of the rank's KV heads, in the stage's dtype)."""
    for i, spec in enumerate((ar, dit)):
        e, where = spec.engine, f"stages[{i}].engine"
        if e.num_kv_blocks and e.kv_cache_memory_bytes:
            raise ConfigError(f"{where}.kv_cache_memory_bytes", e.kv_cache_memory_bytes,
                              f"num_kv_blocks={e.num_kv_blocks} sizes this pool already: set one of num_kv_blocks "
                              "(blocks per rank) or kv_cache_memory_bytes (bytes per rank)")
        if spec.kind == "dit" and not e.paged:
            if e.kv_cache_memory_bytes:
                raise ConfigError(f"{where}.kv_cache_memory_bytes", e.kv_cache_memory_bytes,
                                  "the legacy path's DiT (dense_legacy) has no page pool to size: remove it (its "
                                  "transfer memory is legacy_slots x legacy_max_tokens)")
            continue
        if e.kv_cache_memory_bytes:
            spec.engine = replace(e, num_kv_blocks=_budget_blocks(spec, where))
        elif not e.num_kv_blocks and spec.kind == "ar":
            spec.engine = replace(e, num_kv_blocks=AR_DEFAULT_KV_BLOCKS)
        # a paged DiT stage sized neither way sizes its pool when its engine starts, as a single engine
        # does (gpu_memory_utilization minus the profiled peak, capped by the GPU's free memory, so an
        # AR stage built before it on the same GPU is left its share)


def _budget_blocks(spec, where: str) -> int:
    """`kv_cache_memory_bytes` -> blocks per rank, for the model's KV geometry (its config, no weights)."""
    from ..engine.frontend import load_frontend
    from ..engine.rank_setup import plan_sized_blocks
    from ..models.loader import resolve_dtype
    cfg = spec.engine
    name = replica_devices(spec, 0)[0]  # the first rank's device: its memory and dtype
    try:
        device = sizing_device(name)
        mc = load_frontend(cfg, None)[0]
        n, bpb, why = plan_sized_blocks(cfg, mc, resolve_dtype(cfg.dtype, device), device)
    except ConfigError as e:
        raise ConfigError(f"{where}.{e.field}", e.value, e.fix) from e
    log.info("stage %d (%s) KV pool: %d blocks x %d tokens per rank, %d bytes per rank (%s)", spec.stage_id,
             spec.kind, n, cfg.block_size, n * bpb, why)
    return n


def _check_device(where: str, device: str, connector: str) -> None:
    """The transport must match where the pools live: `cuda` moves GPU pools, `shm` CPU pools."""
    dev = str(device).strip().lower()
    if connector in GPU_TRANSPORTS:
        if dev == "auto":
            import torch

            if torch.cuda.is_available():
                return
            raise ConfigError(f"{where}.engine.device", device,
                              f"kv_connector {connector!r} moves GPU pools but no CUDA device is visible; "
                              "use kv_connector: shm on CPU")
        if not dev.startswith("cuda"):
            raise ConfigError(f"{where}.engine.device", device,
                              f"kv_connector {connector!r} moves GPU pools: set engine.device: cuda:N "
                              "(or use kv_connector: shm for CPU stages)")
    elif connector == "shm" and dev.startswith("cuda"):
        raise ConfigError(f"{where}.engine.device", device,
                          "kv_connector 'shm' moves CPU pools: use kv_connector: cuda for GPU stages on one "
                          "host (or mooncake)")
