"""Process groups of one DiT stage replica: tensor x Ulysses-sequence x CFG parallel (+ experts).

Rank order (TP innermost, so a TP group sits on neighbouring GPUs / one NVLink island):
    rank = (cfg_rank * ulysses_degree + sp_rank) * tensor_parallel_size + tp_rank
Groups:
- tp:  ranks that share (cfg, sp): same tokens, different head / intermediate shards (all-reduce);
- sp:  ranks that share (cfg, tp): different token shards, all-to-all over heads around attention;
- cfg: ranks that share (sp, tp): cond row on cfg-rank 0, uncond on cfg-rank 1 (velocity exchange);
- ep:  with `enable_expert_parallel`, the whole replica: experts are split across every rank and
       tokens travel to their experts' ranks (all-to-all).
A group of size 1 is `None` and every collective on it is skipped, so `ParallelContext.single()`
needs no `torch.distributed` at all.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import EngineConfig
from ..errors import ConfigError


@dataclass
class ParallelContext:
    rank: int = 0
    world_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    sp_rank: int = 0
    sp_size: int = 1
    cfg_rank: int = 0
    cfg_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1  # 1 = experts not split across ranks (TP shards each expert instead)
    tp_group: object = None
    sp_group: object = None
    cfg_group: object = None
    ep_group: object = None
    device: torch.device | None = None  # None: the worker resolves config.device itself
    backend: str | None = None  # "gloo" | "nccl" | None (single rank)

    @classmethod
    def single(cls) -> "ParallelContext":
        return cls()

    @property
    def is_single(self) -> bool:
        return self.world_size == 1

    @property
    def head_shards(self) -> int:
        """Attention heads (and KV heads) are split tp * sp ways: TP first, then Ulysses."""
        return self.tp_size * self.sp_size


def rank_coords(rank: int, tp: int, sp: int, cfg: int) -> tuple[int, int, int]:
    """(tp_rank, sp_rank, cfg_rank) of a global rank."""
    return rank % tp, (rank // tp) % sp, rank // (tp * sp)


def global_rank(tp_rank: int, sp_rank: int, cfg_rank: int, tp: int, sp: int) -> int:
    return (cfg_rank * sp + sp_rank) * tp + tp_rank


def validate_parallel(config: EngineConfig, model_config) -> None:
    """Startup checks of a parallel layout against the model; each error names the fix."""
    tp, sp, cfgp = config.tensor_parallel_size, config.ulysses_degree, config.cfg_parallel_size
    heads, kv_heads = model_config.num_attention_heads, model_config.num_key_value_heads
    # blame the Ulysses degree when it is on (TP alone was fine), else the TP size
    field, value = ("ulysses_degree", sp) if sp > 1 else ("tensor_parallel_size", tp)
    for name, n in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if n % (tp * sp):
            raise ConfigError(field, value,
                              f"{name}={n} must be divisible by tensor_parallel_size * ulysses_degree = "
                              f"{tp} * {sp}; pick degrees whose product divides {n} (KV heads are not "
                              "replicated across ranks)")
    if config.enable_expert_parallel:
        ws = config.world_size
        if model_config.num_experts % ws:
            raise ConfigError("enable_expert_parallel", True,
                              f"num_experts={model_config.num_experts} is not divisible by the replica's "
                              f"{ws} ranks; change the parallel degrees or disable expert parallel "
                              "(then TP shards each expert's intermediate dim)")
    elif tp > 1 and model_config.moe_intermediate_size % tp:
        raise ConfigError("tensor_parallel_size", tp,
                          f"moe_intermediate_size={model_config.moe_intermediate_size} must be divisible "
                          "by it; pick a divisor, or set enable_expert_parallel to split whole experts")
    shared = model_config.moe_intermediate_size * model_config.num_shared_expert
    if tp > 1 and shared % tp:
        raise ConfigError("tensor_parallel_size", tp,
                          f"the shared expert's intermediate size {shared} must be divisible by it")
    if cfgp > 1 and getattr(model_config, "use_guidance_token", False):
        raise ConfigError("cfg_parallel_size", cfgp,
                          "this checkpoint embeds guidance as a token (one row per request, no CFG "
                          "branches); set cfg_parallel_size=1")


def local_num_kv_heads(config: EngineConfig, model_config) -> int:
    """KV heads in one rank's page pool (TP shards heads, Ulysses splits the TP shard again)."""
    return model_config.num_key_value_heads // (config.tensor_parallel_size * config.ulysses_degree)


def bind_device(config_device: str, rank: int, visible_gpus: int, devices: list[str] | None = None,
                local_rank: int | None = None, env_local_rank: str | None = None) -> str:
    """The device string rank `rank` binds; pure (no CUDA call), so placement is testable on CPU.

    `devices` (the stage placement of this replica, one entry per rank) wins when its entry names a
    GPU index. Otherwise (the engine path without a stage file, `auto`, bare `cuda`) the historical
    rule: cuda:local_rank, local_rank = the argument, else $LOCAL_RANK, else rank % visible GPUs
    (an index in `config_device` is ignored there, as before).
    """
    dev = str(devices[rank] if devices else config_device).strip().lower()
    if dev == "auto":
        dev = "cuda" if visible_gpus > 0 else "cpu"
    if not dev.startswith("cuda"):
        return dev
    if devices and dev[5:].isdigit():
        return dev
    if local_rank is None:
        local_rank = int(env_local_rank) if env_local_rank is not None else rank % max(visible_gpus, 1)
    return f"cuda:{local_rank}"


def init_parallel(config: EngineConfig, rank: int, world_size: int, init_method: str | None = None,
                  local_rank: int | None = None, timeout_s: float | None = None,
                  devices: list[str] | None = None) -> ParallelContext:
    """Join the replica's default process group and build the tp / sp / cfg / ep subgroups.

    Backend: gloo on CPU, nccl on CUDA (device: `bind_device`, i.e. devices[rank] from a stage
    placement, else cuda:local_rank; local_rank defaults to $LOCAL_RANK, else rank % visible GPUs). If the default group already exists (several contexts in
    one process, as the tests do) it is reused; every rank must then call this in the same order.
    """
    if world_size != config.world_size:
        raise ConfigError("world_size", world_size,
                          f"must equal tensor_parallel_size * ulysses_degree * cfg_parallel_size = "
                          f"{config.world_size}; launch that many ranks")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} outside [0, {world_size})")
    from ..models.loader import resolve_device

    device = resolve_device(config.device if not devices else devices[rank])  # fails clearly without CUDA
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        device = torch.device(bind_device(config.device, rank, torch.cuda.device_count(), devices, local_rank,
                                          os.environ.get("LOCAL_RANK")))
        torch.cuda.set_device(device)
    if world_size == 1:
        ctx = ParallelContext.single()
        ctx.device = device
        return ctx
    if not dist.is_initialized():
        extra = {"device_id": device} if backend == "nccl" else {}
        if timeout_s is not None:
            extra["timeout"] = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, **extra)
    elif dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise RuntimeError(f"the default process group is rank {dist.get_rank()} of {dist.get_world_size()}, "
                           f"not {rank} of {world_size}")
    tp, sp, cfgp = config.tensor_parallel_size, config.ulysses_degree, config.cfg_parallel_size
    tp_rank, sp_rank, cfg_rank = rank_coords(rank, tp, sp, cfgp)

    def groups(size, members):
        """Every rank creates every group (new_group is collective); keep the one holding us."""
        mine = None
        if size == 1:
            return None
        for fixed in members:
            g = dist.new_group(fixed)
            if rank in fixed:
                mine = g
        return mine

    tp_group = groups(tp, [[global_rank(t, s, c, tp, sp) for t in range(tp)]
                           for c in range(cfgp) for s in range(sp)])
    sp_group = groups(sp, [[global_rank(t, s, c, tp, sp) for s in range(sp)]
                           for c in range(cfgp) for t in range(tp)])
    cfg_group = groups(cfgp, [[global_rank(t, s, c, tp, sp) for c in range(cfgp)]
                              for s in range(sp) for t in range(tp)])
    ep = config.enable_expert_parallel
    ep_group = groups(world_size, [list(range(world_size))]) if ep else None
    return ParallelContext(rank=rank, world_size=world_size, tp_rank=tp_rank, tp_size=tp, sp_rank=sp_rank,
                           sp_size=sp, cfg_rank=cfg_rank, cfg_size=cfgp, ep_rank=rank if ep else 0,
                           ep_size=world_size if ep else 1, tp_group=tp_group, sp_group=sp_group,
                           cfg_group=cfg_group, ep_group=ep_group, device=device, backend=backend)


# ---- collectives that vanish on a size-1 group ------------------------------------------
def all_reduce(t: torch.Tensor, group, size: int) -> torch.Tensor:
    if size > 1:
        dist.all_reduce(t, group=group)
    return t


def all_gather_cat(t: torch.Tensor, group, size: int) -> torch.Tensor:
    """Concatenate equal-shaped tensors of every group rank along dim 0, in group-rank order."""
    if size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts)
