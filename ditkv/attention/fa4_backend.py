"""flash-attn-4 paged backend (optional: `pip install 'ditkv[fa4]'`: flash-attn-4 with
nvidia-cutlass-dsl and its cu13 libraries; Hopper sm90 or Blackwell sm100).

The denoise phase is plain attention: every image query of a row sees all `kv_len` keys (its
one full-attention span ends there), which is FA4's non-causal paged forward; the row's leading
timestep (and guidance) query attends causally, so it is redone by one more small call each with
its own key limit (`split_backend.lead_queries`; before that, the real step never reached FA4). FA4 reads K/V
straight from the page pool: the per-layer view `[num_blocks, 2, Hkv, block_size, D]` gives
K = `kv_layer[:, 0].permute(0, 2, 1, 3)`, a strided `[num_blocks, block_size, Hkv, D]` with a
contiguous last dim, the paged layout FA4 takes (no copy), the rows' block tables are its
`page_table` and their key lengths its `seqused_k`. Both are read on the device, so a CUDA graph
replay with refilled buffers follows the new request.

Designed split (not a silent fallback, as in the cuDNN backend): the prefill phase's mixed
causal/full mask runs as one FA4 call per planner segment where that measured faster (long rows,
`PREFILL_MIN_Q_LEN`); AR decode (one query per row, its row's last position) runs as FA4's plain
paged call where that measured faster (`DECODE_FA4`); shorter prefills, other AR calls and rows with
unequal query counts go to the Triton per-query-limit kernel; K/V writes always use the Triton
scatter kernel. `last_path` says which served the last
call and `calls` counts both.

Compilation: FA4 JIT-compiles one kernel per key of its own (dtype, head dims, GQA ratio, tile
sizes, whether K/V come paged, by TMA when a page holds whole key tiles, ...; sequence lengths,
batch and page-table width are not in it). ditkv's warm-up (the startup profile and every CUDA
graph's two eager passes) runs each shape before capture; a capture that would meet a shape never
run eagerly is refused (`_seen`).
"""

from __future__ import annotations

import time

import torch

from ..errors import BackendError
from .metadata import PagedAttentionMetadata
from .split_backend import PlainRowsSplit

INSTALL_HINT = "pip install 'ditkv[fa4]' (flash-attn-4 with nvidia-cutlass-dsl[cu13])"
ARCHS = (9, 10)  # compute capability majors FA4's paged forward runs on: sm90 (Hopper), sm100 (Blackwell)

# Where `attention_backend='auto'` picks fa4 (before cuDNN): compute capability -> the smallest target
# length (queries per row) at which FA4's paged denoise measured faster than both the Triton paged
# kernel and cuDNN, at page 64 (`ditkv bench attention`, docs/bench-attention.md "flash-attn-4").
# sm90 (H200, 2026-12-01, flash-attn-4 4.0.0b36, R = 2, 32/8 heads, D = 128): FA4 / Triton paged
# 1.21-1.26x and FA4 / SDPA-cuDNN dense 1.02-1.20x at T = 1025 and 4097 (P = 1024, 6700).
# Below the entry, and on devices without one, `auto` keeps the cuDNN / Triton rule.
AUTO_MIN_Q_LEN: dict[tuple[int, int], int] = {(9, 0): 1025}
# Prefill (the mixed mask as one FA4 call per planner segment) against the Triton per-query-limit kernel,
# page 64, same run: FA4 / Triton 0.62x at 2049 queries per row (P = 1024, T = 1025), 1.07x at 5121,
# 1.10x at 10797. Capability -> the smallest row length measured faster; below it (or without an
# entry) prefill stays on Triton, for `fa4` and `auto` alike.
PREFILL_MIN_Q_LEN: dict[tuple[int, int], int] = {(9, 0): 5121}
# AR decode (every row one query at its last position, which sees all kv_len keys: FA4's plain paged call
# with one query per row) on FA4 instead of Triton: capability -> True where that measured faster
# (`python tools/gpu_fa4_decode.py`, docs/bench-attention.md). Without an entry decode stays on Triton.
DECODE_FA4: dict[tuple[int, int], bool] = {}


def import_fa4():
    """FA4's `flash_attn_varlen_func`, or a BackendError that names the extra."""
    try:
        from flash_attn.cute import flash_attn_varlen_func  # noqa: PLC0415 - optional dependency
    except ImportError as e:
        raise BackendError(f"attention_backend='fa4' needs flash-attn-4: {INSTALL_HINT} ({e})") from e
    return flash_attn_varlen_func


def fa4_unusable(device: torch.device | str) -> str | None:
    """Why FA4 cannot run on `device` (None: it can); imports nothing when the device already fails."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"attention_backend='fa4' needs a CUDA device, got {device}; use attention_backend='torch' on CPU"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in ARCHS:
        return (f"attention_backend='fa4' runs on sm90 (Hopper) or sm100 (Blackwell); this GPU is sm{major}{minor}: "
                "use attention_backend='triton'")
    try:
        import_fa4()
    except BackendError as e:
        return str(e)
    return None


def auto_prefers_fa4(device: torch.device | str) -> bool:
    """`auto`'s rule: installed, on a GPU it runs on, and the measured table has this device."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) in AUTO_MIN_Q_LEN and fa4_unusable(device) is None


def decode_rows(meta: PagedAttentionMetadata) -> bool:
    """AR decode: every row has one query, at its last readable position (it sees all kv_len keys)."""
    return all(r.q_len == 1 and r.q_start == r.kv_len - 1 and r.q_offset == i for i, r in enumerate(meta.rows))


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """FA4's dense forward: q [B, Lq, Hq, D], k / v [B, Lk, Hkv, D] (last dim contiguous) -> like q;
    `causal` aligned bottom-right (query i of Lq sees keys j <= i + Lk - Lq), as the planner's causal
    segments need. The dense-legacy baseline on a GPU (`worker/dense_cache.py`)."""
    from flash_attn.cute import flash_attn_func  # noqa: PLC0415 - optional dependency, checked by the caller

    out, _ = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)
    return out


class Fa4Backend(PlainRowsSplit):
    """`attention_backend='fa4'`: FA4 paged attention for the denoise phase and long prefills,
    Triton for the rest (`split_backend.py`)."""

    name = "fa4"
    serves_lead = True

    def __init__(self, device: torch.device | str = "cuda", min_q_len: int = 1, *, decode: bool | None = None):
        """`decode`: AR decode rows on FA4 (True) or Triton (False); None: the measured table (`DECODE_FA4`)."""
        why = fa4_unusable(device)
        if why is not None:
            raise BackendError(why)
        self._fa4 = import_fa4()
        self._seen: set = set()
        self.compile_s: dict = {}  # shape key -> seconds of its first (compiling) call
        cap = torch.cuda.get_device_capability(device)
        self.prefill_min_q_len = PREFILL_MIN_Q_LEN.get(cap)
        self.decode_on = DECODE_FA4.get(cap, False) if decode is None else bool(decode)
        super().__init__(min_q_len)

    def plain(self, q, kv_layer, meta: PagedAttentionMetadata, scale: float) -> torch.Tensor:
        return self.denoise(q, kv_layer, meta, scale)

    def extra(self, q, kv_layer, meta: PagedAttentionMetadata, scale: float) -> torch.Tensor | None:
        if self.decode_on and decode_rows(meta):
            self._count("fa4-decode", "fa4")
            return self.denoise(q, kv_layer, meta, scale)  # one query per row over all its keys
        if not self._prefill_here(q, kv_layer, meta):
            return None
        self._count("fa4-prefill", "fa4")
        return self.prefill(q, kv_layer, meta, scale)

    def _prefill_here(self, q, kv_layer, meta: PagedAttentionMetadata) -> bool:
        """Long homogeneous rows (where FA4's segments measured faster), never inside a CUDA graph."""
        return (self.prefill_min_q_len is not None and meta.homogeneous
                and meta.rows[0].q_len >= self.prefill_min_q_len and not torch.cuda.is_current_stream_capturing())

    def prefill(self, q, kv_layer, meta: PagedAttentionMetadata, scale: float) -> torch.Tensor:
        """The mixed causal/full mask of homogeneous rows (the CFG rows of one request) as FA4 calls,
        one per planner segment: a causal run [s, e) sees K[:e] bottom-right aligned (FA4's causal
        for fewer queries than keys), a full span [a, b) sees K[:b]; both rows in one call."""
        from .planner import plan_row

        if not meta.homogeneous:
            raise BackendError("fa4 prefill takes homogeneous rows (one request's CFG rows)")
        r0, rows = meta.rows[0], meta.num_rows
        k, v = kv_layer[:, 0].permute(0, 2, 1, 3), kv_layer[:, 1].permute(0, 2, 1, 3)
        table = meta.block_table.to(torch.int32)
        qb = q.view(rows, r0.q_len, *q.shape[1:])
        out = torch.empty_like(qb)
        for seg in plan_row(r0):
            lo, hi = seg.q_lo - r0.q_start, seg.q_hi - r0.q_start
            used = torch.full((rows,), seg.kv_len, dtype=torch.int32, device=q.device)
            out[:, lo:hi], _ = self._fa4(qb[:, lo:hi].contiguous(), k, v, seqused_k=used, page_table=table,
                                         softmax_scale=scale, causal=seg.causal)
        return out.view(q.shape)

    def denoise(self, q, kv_layer, meta: PagedAttentionMetadata, scale: float) -> torch.Tensor:
        """q `[R * T, Hq, D]` (row r's T queries at r * T) over each row's `kv_len` keys -> like q."""
        rows, t = meta.num_rows, meta.rows[0].q_len
        out = self._paged(q.view(rows, t, *q.shape[1:]), kv_layer, meta.kv_lens.to(torch.int32), meta, scale)
        return out.view(q.shape)

    def lead(self, out, q, kv_layer, meta: PagedAttentionMetadata, scale: float, n: int) -> None:
        """Query j < n of every row (the timestep / guidance token) sees keys [0, key_limit): one FA4
        call per j with one query per row. The limits are read on the device (graph-safe)."""
        rows, t = meta.num_rows, meta.rows[0].q_len
        qb, ob = q.view(rows, t, *q.shape[1:]), out.view(rows, t, *out.shape[1:])
        limits = meta.key_limit.view(rows, t)
        for j in range(n):
            ob[:, j:j + 1] = self._paged(qb[:, j:j + 1].contiguous(), kv_layer, limits[:, j].contiguous(), meta, scale)

    def _paged(self, qb, kv_layer, seqused_k, meta: PagedAttentionMetadata, scale: float) -> torch.Tensor:
        """FA4's non-causal paged forward: qb [R, t, Hq, D], row r sees its first seqused_k[r] keys."""
        k = kv_layer[:, 0].permute(0, 2, 1, 3)  # [num_blocks, block_size, Hkv, D]: strided, no copy
        v = kv_layer[:, 1].permute(0, 2, 1, 3)
        key = (qb.dtype, qb.shape[2], k.shape[2], qb.shape[3], k.shape[1], qb.shape[0], qb.shape[1])
        first = key not in self._seen
        if first and torch.cuda.is_current_stream_capturing():
            raise BackendError(f"FA4 has not run shape {key} eagerly, so its kernel would compile inside a CUDA-graph "
                               "capture: run the step once first (worker/cuda_graph.py's warm-up does)")
        t0 = time.perf_counter() if first else 0.0
        out, _ = self._fa4(qb, k, v, seqused_k=seqused_k, page_table=meta.block_table.to(torch.int32),
                           softmax_scale=scale, causal=False)
        if first:
            torch.cuda.synchronize(qb.device)
            self._seen.add(key)
            self.compile_s[key] = time.perf_counter() - t0
        return out
