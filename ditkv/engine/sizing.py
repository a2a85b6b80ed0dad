"""KV pool sizing from `num_kv_blocks`, `kv_cache_memory_bytes` or `gpu_memory_utilization`."""

from __future__ import annotations

import os

import torch

from ..errors import ConfigError

# On CPU there is no device memory to measure; the pool is sized against this host-memory
# analogue of "device memory" instead (times gpu_memory_utilization, minus the model).
CPU_MEMORY_ANALOGUE_BYTES = 256 << 20


def device_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return CPU_MEMORY_ANALOGUE_BYTES


def physical_memory_bytes(device: torch.device) -> int | None:
    """What the device really has (host RAM on CPU), or None where the OS does not say or the GPU is
    not visible from this process (a stage file sized on a host without its GPUs: the rank that
    binds the GPU checks its pool there)."""
    if device.type == "cuda":
        if not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count():
            return None
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _check_allocatable(field: str, value: int, pool_bytes: int, device: torch.device) -> None:
    """An explicit pool larger than the whole device can never be allocated: say so here, naming the
    setting, instead of failing inside the allocator."""
    have = physical_memory_bytes(device)
    if have is not None and pool_bytes > have:
        raise ConfigError(field, value, f"the KV pool would take {pool_bytes} bytes but the {device.type} device "
                                        f"has {have}; lower {field}")


def resolve_num_blocks(config, bytes_per_block: int, device: torch.device, non_kv_bytes: int,
                       reserved_bytes: int = 0) -> tuple[int, str]:
    """(num_blocks, how it was decided) — raises naming the numbers when nothing fits.

    `reserved_bytes` (the step cache's residual buffers, `profiling.residual_reserve`, and the encoder
    cache's entries, `profiling.encoder_reserve`) come out of the `gpu_memory_utilization` budget; an
    explicit `num_kv_blocks` / `kv_cache_memory_bytes` is the pool's own size, taken as given (the
    buffers then come on top of it)."""
    if config.num_kv_blocks:
        _check_allocatable("num_kv_blocks", config.num_kv_blocks, config.num_kv_blocks * bytes_per_block, device)
        return config.num_kv_blocks, f"num_kv_blocks={config.num_kv_blocks}"
    if config.kv_cache_memory_bytes:
        _check_allocatable("kv_cache_memory_bytes", config.kv_cache_memory_bytes, config.kv_cache_memory_bytes, device)
        n = config.kv_cache_memory_bytes // bytes_per_block
        if n < 1:
            raise ConfigError("kv_cache_memory_bytes", config.kv_cache_memory_bytes,
                              f"one block needs {bytes_per_block} bytes; give at least that")
        return n, f"kv_cache_memory_bytes={config.kv_cache_memory_bytes}"
    total = device_memory_bytes(device)
    util = config.gpu_memory_utilization
    avail = int(total * util) - non_kv_bytes - reserved_bytes
    held = f"{non_kv_bytes} non-KV bytes" + (f" and {reserved_bytes} reserved bytes (step-cache residuals, "
                                             "encoder cache)" if reserved_bytes else "")
    if device.type == "cuda":  # what other pools on this GPU hold (another stage, another process) is not free
        torch.cuda.empty_cache()  # the profile's cached activations are counted in non_kv_bytes already
        free = torch.cuda.mem_get_info(device)[0]
        capped = free - int(total * (1.0 - util)) - reserved_bytes
        if capped < avail:
            if capped < bytes_per_block:
                raise ConfigError("gpu_memory_utilization", util,
                                  f"no memory remains for the KV cache: the GPU has {free} bytes free now (other "
                                  f"pools or processes hold the rest) and {total} x (1 - {util}) must stay free, "
                                  f"leaving {capped} bytes (after {reserved_bytes} bytes reserved for step-cache "
                                  f"residuals and the encoder cache) < one block ({bytes_per_block}); free the "
                                  "GPU, raise gpu_memory_utilization or set kv_cache_memory_bytes")
            return capped // bytes_per_block, (f"gpu_memory_utilization={util}: capped by the {free} bytes the GPU "
                                               f"has free (other pools on it), minus {reserved_bytes} bytes "
                                               "reserved (step-cache residuals, encoder cache)")
    if avail < bytes_per_block:
        raise ConfigError("gpu_memory_utilization", config.gpu_memory_utilization,
                          f"no memory remains for the KV cache: {total} bytes x {config.gpu_memory_utilization} "
                          f"- {held} = {avail} bytes < one block ({bytes_per_block}); "
                          "raise gpu_memory_utilization or set kv_cache_memory_bytes")
    return avail // bytes_per_block, (f"gpu_memory_utilization={config.gpu_memory_utilization} of {total} bytes "
                                      f"minus {held}")
