"""The torch intra-op thread count of a process, set from the engine config's `torch_threads`.

Every process of an engine or stage graph (the engine or orchestrator, rank processes, `ditkv
stage` servers) calls `apply_torch_threads` with the same configured number: CPU fp32 sums split
across a different number of threads round differently, so results that are promised to be
bit-identical across processes must not depend on the host's core count or on `OMP_NUM_THREADS`.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("ditkv.threads")


def apply_torch_threads(n: int) -> None:
    if torch.get_num_threads() != n:
        log.debug("torch intra-op threads: %d -> %d (torch_threads)", torch.get_num_threads(), n)
        torch.set_num_threads(n)


def apply_process_settings(config) -> None:
    """The process-wide settings of an engine config: `torch_threads`, `torch_compile` (the
    compiled CUDA elementwise chains of the model layers; the CPU path never compiles),
    `batch_invariant` (fixed-tiling CUDA kernels; configs without the field, the AR stage's: off),
    `fp8_fast_accum` (the CUDA FP8 GEMMs' fast accumulation; unset or without the field: on) and
    `fp8_grouped_gemm` (the routed experts' FP8 GEMM kernel; unset or without the field: auto)."""
    from ..models import fp8
    from ..models.family import families

    apply_torch_threads(config.torch_threads)
    accum = getattr(config, "fp8_fast_accum", None)
    fp8.set_fast_accum(True if accum is None else accum)
    fp8.set_grouped_gemm(getattr(config, "fp8_grouped_gemm", None))
    for family in families():  # process-wide: whichever family the process runs
        family.set_fused_elementwise(config.torch_compile)
        family.set_batch_invariant(getattr(config, "batch_invariant", False))
