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

The gate/up GEMM can also finish the SwiGLU in its epilogue (`grouped_swiglu`, on unless
`set_gate_epilogue(False)`): the kernel reads w13 [gate-input x1; gate x2] as adjacent column pairs
(quack's `concat_layout`, no copy of the weight), computes x1 * silu(x2) from the scaled fp32 sums and
writes the [slots, I] bf16 activation instead of the [slots, 2I] pre-activation; the down projection's
quantizer then reads half as much.

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
GATE = {"on": True}  # the SwiGLU in the gate/up GEMM's epilogue (`grouped_swiglu`)


def rowwise_scaled(acc, token_scale, weight_scale):
    """The epilogue: row m (a slot) times its token's scale, column n times expert e's channel scale."""
    return {"D": acc * token_scale * weight_scale}


@functools.lru_cache(maxsize=1)
def _epilogue():
    from quack.epilogue.frontend import EpiMod  # optional dependency

    return EpiMod(rowwise_scaled)


@functools.lru_cache(maxsize=1)
def _gate_epilogue():
    from quack.activation import swiglu  # optional dependency
    from quack.epilogue.frontend import EpiMod
    from quack.epilogue.math import unpack

    def rowwise_swiglu(acc, token_scale, weight_scale):
        # the pair (x1[j], x2[j]) arrives as adjacent columns; swiglu(g, u) = silu(g) * u
        x1, x2 = unpack(acc * token_scale * weight_scale)
        return {"postact": swiglu(x2, x1)}

    return EpiMod(rowwise_swiglu, outputs=("postact",), mode="acc_pair")


def set_gate_epilogue(on: bool) -> None:
    """Whether `layers.grouped_swiglu_fp8` finishes the SwiGLU in quack's gate/up epilogue (default on)."""
    GATE["on"] = bool(on)


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


def grouped_swiglu(q: torch.Tensor, s: torch.Tensor, ends: torch.Tensor, w13: torch.Tensor, ws13: torch.Tensor,
                   out_dtype: torch.dtype, rows: torch.Tensor) -> torch.Tensor:
    """`grouped_mm` of the gate/up projection (w13 [E, 2I, K] = [x1; x2] rows, ws13 [E, 2I]) followed by
    the SwiGLU x1 * silu(x2), in one kernel: [slots, I] in out_dtype."""
    slots, inter = rows.shape[0], w13.shape[1] // 2
    out = torch.empty(slots, inter, dtype=out_dtype, device=q.device)
    if slots == 0:
        return out
    token_scale = s.reshape(-1).index_select(0, rows).float()
    # the scales as the kernel sees the columns: x1[0], x2[0], x1[1], ... (1.5 MB per layer)
    weight_scale = ws13.float().unflatten(1, (2, inter)).transpose(1, 2).flatten(1)
    tm, tn, cm, cn, pingpong = TILES["gather"]
    with torch.autograd.profiler.record_function(RANGE):
        _gate_epilogue().gemm(q, w13, None, epi_args={"token_scale": token_scale, "weight_scale": weight_scale,
                                                       "postact": out},
                              tile_M=tm, tile_N=tn, cluster_M=cm, cluster_N=cn, pingpong=pingpong, persistent=True,
                              cu_seqlens_m=torch.cat([ends.new_zeros(1), ends]), A_idx=rows.to(torch.int32),
                              concat_layout=("B",), post_init_attrs=(("fp8_slow_accum", False),))
    return out

