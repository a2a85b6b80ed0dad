"""The routed experts' FP8 GEMMs on quack's varlen GEMM (quack-kernels, a CuTe-DSL library that
comes with `pip install 'ditkv[fa4]'`; Hopper sm90).

quack runs a grouped GEMM as `cu_seqlens_m` segments of A (one per expert), can load the rows of A
through an index (`A_idx`: the k-fold gather of the token rows happens in the kernel's loads, no
copy) and takes an epilogue written in Python: here `acc * token_scale[m] * weight_scale[e, n]`, the
rowwise-scaled W8A8 product. At the release step's shapes (8194 tokens, 64 experts, top-8) on the
H200 it ran the gate/up GEMM at 1227 TFLOP/s with the gather included and the down GEMM at 1359,
against ~1000 for torch's `_scaled_grouped_mm`, and its outputs were bit-equal to torch's with fast
accumulation (`python tools/gpu_quack_grouped.py`, docs/quantization.md).

Only with fast accumulation (`fp8.FAST_ACCUM`): quack's sm90 FP8 kernel promotes its partial sums
to fp32 every k-tile unless told otherwise, and that mode measured 3-40x slower at these shapes, so
with `fp8_fast_accum: false` torch's kernel runs.

Compilation: quack JIT-compiles one kernel per (tile config, dtypes, epilogue) at its first call
(2-4 s; the row counts are symbolic, so a new batch shape reuses it) and keeps a host launch plan
per exact tensor shapes. ditkv's warm-up (the startup profile, and every CUDA graph's eager passes
before capture) makes those first calls.
"""

from __future__ import annotations

import functools

import torch

INSTALL_HINT = "pip install 'ditkv[fa4]' (flash-attn-4 brings quack-kernels and nvidia-cutlass-dsl[cu13])"
# (tile_m, tile_n, cluster_m, cluster_n, pingpong) per GEMM kind, the fastest of 8 measured on the H200
# (tools/gpu_quack_grouped.py): with the row gather (gate/up, 4096 -> 6144) and without (down, 3072 -> 4096).
# The gather needs cluster_n = 1.
TILES = {"gather": (128, 192, 2, 1, True), "plain": (128, 192, 1, 2, True)}
RANGE = "ditkv::fp8_grouped_mm_quack"  # profiler range: the bench counts it as a GEMM op


def rowwise_scaled(acc, token_scale, weight_scale):
    """The epilogue: row m (a slot) times its token's scale, column n times expert e's channel scale."""
    return {"D": acc * token_scale * weight_scale}


@functools.lru_cache(maxsize=1)
def _epilogue():
    from quack.epilogue.frontend import EpiMod  # optional dependency

    return EpiMod(rowwise_scaled)


def unusable(device: torch.device | str) -> str | None:
    """Why quack's grouped FP8 GEMM cannot run on `device` (None: it can)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"quack's grouped FP8 GEMM runs on CUDA, got {device}"
    if not torch.cuda.is_available():
        return "quack's grouped FP8 GEMM runs on CUDA, and no CUDA device is available"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"quack's grouped FP8 GEMM is measured and tuned on sm90 (Hopper) only; this GPU is sm{major}{minor}"
    try:
        _epilogue()
    except ImportError as e:
        return f"quack-kernels is not importable: {INSTALL_HINT} ({e})"
    except (OSError, RuntimeError) as e:  # installed but broken (e.g. the CuTe DSL's native libraries)
        return f"quack-kernels failed to load ({type(e).__name__}: {e}); reinstall with {INSTALL_HINT}"
    return None


def grouped_mm(q: torch.Tensor, s: torch.Tensor, ends: torch.Tensor, w8: torch.Tensor, ws: torch.Tensor,
               out_dtype: torch.dtype, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Slot i = row `rows[i]` of (q [M, K] e4m3, s [M, 1] fp32) (or row i without `rows`); slots
    [ends[e-1], ends[e]) times expert e's weight (w8 [E, N, K], ws [E, N]): [slots, N] in out_dtype.
    No host sync: the segment bounds stay on the device."""
    slots = q.shape[0] if rows is None else rows.shape[0]
    out = torch.empty(slots, w8.shape[1], dtype=out_dtype, device=q.device)
    if slots == 0:  # a shape test, not a sync
        return out
    token_scale = s.reshape(-1) if rows is None else s.reshape(-1).index_select(0, rows)
    cu = torch.cat([ends.new_zeros(1), ends])
    tm, tn, cm, cn, pingpong = TILES["plain" if rows is None else "gather"]
    kwargs = {"A_idx": rows.to(torch.int32)} if rows is not None else {}
    with torch.autograd.profiler.record_function(RANGE):
        _epilogue().gemm(q, w8, out, epi_args={"token_scale": token_scale.float().contiguous(),
                                               "weight_scale": ws.float().contiguous()},
                         tile_M=tm, tile_N=tn, cluster_M=cm, cluster_N=cn, pingpong=pingpong, persistent=True,
                         cu_seqlens_m=cu, post_init_attrs=(("fp8_slow_accum", False),), **kwargs)
    return out
