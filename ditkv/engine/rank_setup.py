"""Rank setup, shared by both executors: the model bundle, the KV pool size, the worker, and (in a
rank process) the process group and the device placement."""

from __future__ import annotations

import logging

import torch

from .hooks import rank_hooks
from .profiling import encoder_reserve, residual_reserve
from .sizing import resolve_num_blocks
from ..models.family import family_of
from ..models.loader import load_model, load_model_shard, param_bytes, resolve_device, resolve_dtype
from ..worker.page_pool import bytes_per_block
from ..worker.worker import DiTWorker

log = logging.getLogger("ditkv.worker")


def resolve_bundle(config, model_bundle, parallel=None):
    """A (model, tokenizer, codec) tuple, a zero-argument factory returning one, or None = load `config.model`.

    A TP/EP rank (`parallel` with tp or ep > 1) loading `config.model` itself reads only its shard
    (`load_checkpoint_shard`); the model comes back already sharded and marked `_ditkv_sharded`."""
    if callable(model_bundle):
        return model_bundle()
    if model_bundle is not None:
        return model_bundle
    if parallel is not None and (parallel.tp_size > 1 or parallel.ep_size > 1):
        device = parallel.device or resolve_device(config.device)
        bundle = load_model_shard(config.model, parallel, device, resolve_dtype(config.dtype, device),
                                  config.quantization, tuple(config.quantization_ignored_layers))
        if bundle is not None:
            return bundle
    device = resolve_device(config.device)
    return load_model(config.model, device, resolve_dtype(config.dtype, device), config.quantization,
                      tuple(config.quantization_ignored_layers))


def profile_non_kv_bytes(config, model, tokenizer, parallel=None) -> int:
    """Run the maximum-shape profile request (dense) and return its non-KV peak.

    Unsharded model: one rank runs the whole model alone (an upper bound for any parallel layout).
    Sharded model (`parallel` given): it cannot run alone, so every rank of the replica profiles
    its own shard in lockstep through a parallel runner (the collectives pair up across ranks)."""
    from .profiling import default_envelope, profile_max_shape
    from ..worker.dit_runner import DiTRunner

    env = default_envelope(config, model.config)
    res = profile_max_shape(DiTRunner(model, paged=False, parallel=parallel), model, tokenizer, env)
    log.info("memory profile %dx%d, %d prompt tokens (%d tokens, CFG on): non-KV peak %d bytes in %.2fs",
             env.max_width, env.max_height, env.max_prompt_tokens, res.tokens, res.non_kv_bytes, res.seconds)
    return res.non_kv_bytes


def profiles_memory(config, device: torch.device) -> bool:
    """`profile_memory` as set, or unset (auto): on CUDA only. Every rank of a replica decides alike
    (one device type), so a sharded profile's collectives still pair up."""
    return device.type == "cuda" if config.profile_memory is None else config.profile_memory


def plan_num_blocks(config, model, tokenizer=None, parallel=None) -> int | None:
    """KV blocks this rank can afford (None in dense mode); the executor takes the min over ranks.
    Counts rank-local KV heads; the non-KV memory is the model's parameters (a sharded model: the
    rank's shard; else the unsharded weights, an upper bound) or the profile's peak if larger."""
    if not config.paged:
        return None
    bpb = kv_bytes_per_block(config, model.config, model.dtype)
    non_kv = param_bytes(model)
    device = resolve_device(config.device)
    if profiles_memory(config, device) and not config.num_kv_blocks:
        par = parallel if family_of(model.config).shard_of(model) is not None else None  # an unsharded model profiles alone, as before
        non_kv = max(non_kv, profile_non_kv_bytes(config, model, tokenizer, par))
    # the step cache's residual buffers come out of a budget; an explicitly sized pool is taken as given
    sized = config.num_kv_blocks or config.kv_cache_memory_bytes
    reserve = None if sized else residual_reserve(config, model.config, tokenizer, model.dtype)
    encoders, encoders_why = (0, "") if sized else encoder_reserve(config, model.config, model.dtype)
    n, why = resolve_num_blocks(config, bpb, device, non_kv, (reserve.total if reserve else 0) + encoders)
    log.info("KV pool: %d blocks x %d tokens, %d bytes (%s)", n, config.block_size, n * bpb, why)
    if reserve is not None and reserve.total:
        log.info("step-cache residuals: %d bytes reserved = %d requests x (%d stored + %d in a step) + %d "
                 "transient (%s)", reserve.total, reserve.seqs, reserve.stored, reserve.working, reserve.transient,
                 reserve.why)
    if encoders:
        log.info("%d bytes reserved for the %s", encoders, encoders_why)
    return n


def kv_bytes_per_block(config, model_config, dtype: torch.dtype) -> int:
    """Bytes of one block of one rank's pool: every layer's K and V of the rank-local KV heads."""
    from ..worker.parallel import local_num_kv_heads

    return bytes_per_block(model_config.num_hidden_layers, local_num_kv_heads(config, model_config),
                           config.block_size, model_config.attention_head_dim, dtype)


def plan_sized_blocks(config, model_config, dtype: torch.dtype, device: torch.device) -> tuple[int, int, str]:
    """(blocks, bytes per block, how it was decided) of a rank's pool given an explicit size
    (`num_kv_blocks`, or `kv_cache_memory_bytes` per rank): `plan_num_blocks`' rule for a pool that
    is sized before any weights load (a stage graph sizes its AR and DiT pools this way). The
    `gpu_memory_utilization` rule needs the loaded model and its profile: only `plan_num_blocks`."""
    if not (config.num_kv_blocks or config.kv_cache_memory_bytes):
        raise ValueError("plan_sized_blocks needs num_kv_blocks or kv_cache_memory_bytes")
    bpb = kv_bytes_per_block(config, model_config, dtype)
    n, why = resolve_num_blocks(config, bpb, device, 0)
    return n, bpb, why


def build_worker(config, num_blocks, bundle, parallel=None) -> DiTWorker:
    return DiTWorker(config, num_blocks=num_blocks, model_bundle=bundle, parallel=parallel)


def init_group(config, rank: int, world_size: int, init_method: str, opts):
    """The replica's process group and this rank's `ParallelContext` (None with one rank);
    `RankHooks.init_group` builds it (`init_parallel` unless a hook says otherwise)."""
    if world_size == 1:
        return None
    return rank_hooks(opts).init_group(config, rank, world_size, init_method, opts)


def placed_config(config, parallel, opts, rank: int):
    """With a stage placement, the rank's config names its bound device, so that the model load,
    the memory plan and the pool all land on that GPU (not on the stage's base device)."""
    if not getattr(opts, "devices", None):
        return config
    from dataclasses import replace

    from ..worker.parallel import bind_device

    dev = str(parallel.device) if parallel is not None and parallel.device is not None else \
        bind_device(config.device, rank, torch.cuda.device_count(), opts.devices)
    return replace(config, device=dev)

