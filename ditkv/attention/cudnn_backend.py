"""cuDNN paged SDPA backend (optional: `pip install ditkv[cudnn]`, i.e. `nvidia-cudnn-frontend`).

cuDNN's fused attention reads K/V straight from the page pool through per-row page tables
(`paged_attention_k_table` / `paged_attention_v_table` of the frontend's `sdpa` node), with the
padding mask and per-row sequence lengths the paged mode requires. It computes plain
(non-causal) attention over all of a row's `kv_len` keys, which is exactly the denoise phase:
the target's queries form one full-attention span ending at `kv_len`, so every query sees every
key of its row.

Designed split (not a silent fallback): a call whose rows are not all "plain" (the prefill
phase's mixed causal-prefix + full-target mask, AR decode/prefill) or whose rows have unequal
query counts goes to the Triton per-query-limit kernel (`triton_backend.paged_attention`); K/V
writes always use the Triton scatter kernel. `CudnnBackend.last_path` says which kernel served
the last call, and `calls` counts both.

`attention_backend='auto'` uses this backend only where it is installed and `AUTO_MIN_Q_LEN`
holds a measured crossover for the device, and then only for plain calls with at least that many
queries per row; the rest stays on Triton.

Pool layout: the per-layer view `[num_blocks, 2, Hkv, block_size, D]` that every backend gets
(`worker/page_pool.py`); K and V are the strided views `kv_layer[:, 0]` / `kv_layer[:, 1]`
(`[num_blocks, Hkv, block_size, D]`), which is cuDNN's paged container layout, so nothing is
copied. Graphs are built once per (rows, query length, page-table width bucket, pool geometry)
and cached; the page-table width is padded up to a multiple of `TABLE_BUCKET` pages so that
requests with different prefix lengths share a graph (the real lengths are read on the device).

Measured against the Triton kernel and SDPA dense on an H200: `tools/bench_paged_candidates.py`,
docs/benchmarks.md, "Paged attention candidates (issue 14 item 4)".
"""

from __future__ import annotations

import torch

from ..errors import BackendError
from .metadata import PagedAttentionMetadata
from .split_backend import PlainRowsSplit

INSTALL_HINT = "pip install 'ditkv[cudnn]' (the nvidia-cudnn-frontend package)"
TABLE_BUCKET = 32  # page-table width granularity of a cached graph (pages)

# Where `attention_backend='auto'` picks this backend: compute capability -> the smallest target
# length (queries per row) at which cuDNN's paged kernel measured faster than the Triton kernel
# at page 64 (tools/bench_paged_candidates.py; docs/benchmarks.md, "Paged attention candidates").
# Empty entry / missing capability: `auto` keeps Triton. Filled from the measured table only.
# sm90 (H200, 2026-12-01, cuDNN 9.19, frontend 1.32, P = 1024 / 6700, R = 2, 32/8 heads, D = 128):
# cuDNN / Triton = 0.95-0.96x at T = 1025, 1.04-1.05x at T = 2049 (P = 1024), 1.09-1.10x at T = 3073
# (P = 1024) and 4097.
AUTO_MIN_Q_LEN: dict[tuple[int, int], int] = {(9, 0): 2049}


def import_cudnn():
    """The `cudnn` frontend module, or a BackendError that says how to install it."""
    try:
        import cudnn  # noqa: PLC0415 - optional dependency
    except ImportError as e:
        raise BackendError(f"attention_backend='cudnn' needs the cuDNN frontend: {INSTALL_HINT} ({e})") from e
    return cudnn


def cudnn_available() -> bool:
    """Importable frontend and a CUDA device (does not build anything)."""
    if not torch.cuda.is_available():
        return False
    try:
        import_cudnn()
    except BackendError:
        return False
    return True


def auto_prefers_cudnn(device: torch.device | str) -> bool:
    """`auto`'s rule: installed, on CUDA, and the measured table favours cuDNN on this device."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability(device) not in AUTO_MIN_Q_LEN:
        return False
    return cudnn_available()


def _bucket(width: int) -> int:
    return -(-width // TABLE_BUCKET) * TABLE_BUCKET


class _Plan:
    """One built cuDNN graph with its tensor handles and workspace (heuristic A's first plan that
    builds: of the two plans cuDNN 9.19 offers for this graph on sm90, it measured the faster)."""

    def __init__(self, cudnn, handle, key, device: torch.device):
        (rows, q_len, hq, d, q_strides, kv_shape, kv_strides, width, bs, dtype, scale) = key
        self.handle = handle
        self.rows, self.q_len, self.width = rows, q_len, width
        dt = {torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float16: cudnn.data_type.HALF}[dtype]
        g = cudnn.pygraph(io_data_type=dt, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)
        s_tok, s_head = q_strides
        q_dim = (rows, hq, q_len, d)
        q_stride = (q_len * s_tok, s_head, s_tok, 1)
        self.q = g.tensor(name="q", dim=q_dim, stride=q_stride, data_type=dt)
        self.k = g.tensor(name="k_pages", dim=kv_shape, stride=kv_strides, data_type=dt)
        self.v = g.tensor(name="v_pages", dim=kv_shape, stride=kv_strides, data_type=dt)
        i32 = cudnn.data_type.INT32
        self.table_k = g.tensor(name="table_k", dim=(rows, 1, width, 1), stride=(width, width, 1, 1), data_type=i32)
        self.table_v = g.tensor(name="table_v", dim=(rows, 1, width, 1), stride=(width, width, 1, 1), data_type=i32)
        self.seq_q = g.tensor(name="seq_q", dim=(rows, 1, 1, 1), stride=(1, 1, 1, 1), data_type=i32)
        self.seq_kv = g.tensor(name="seq_kv", dim=(rows, 1, 1, 1), stride=(1, 1, 1, 1), data_type=i32)
        o, _stats = g.sdpa(name="sdpa", q=self.q, k=self.k, v=self.v, attn_scale=scale, generate_stats=False,
                           use_padding_mask=True, seq_len_q=self.seq_q, seq_len_kv=self.seq_kv,
                           paged_attention_k_table=self.table_k, paged_attention_v_table=self.table_v,
                           paged_attention_max_seq_len_kv=width * bs,
                           compute_data_type=cudnn.data_type.FLOAT)
        o.set_output(True).set_dim(list(q_dim)).set_stride(list(q_stride)).set_data_type(dt)
        self.o = o
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.graph = g
        self.workspace = torch.empty(max(1, g.get_workspace_size()), dtype=torch.uint8, device=device)

    def run(self, pack: dict) -> None:
        self.graph.execute(pack, self.workspace, handle=self.handle)


class CudnnPaged:
    """Callable cuDNN paged attention for plain rows (the denoise phase); caches graphs by shape."""

    def __init__(self):
        self.cudnn = import_cudnn()
        self.handle = self.cudnn.create_handle()
        self.plans: dict = {}

    def plan_for(self, q: torch.Tensor, kv_layer: torch.Tensor, meta: PagedAttentionMetadata, scale: float):
        rows, q_len = meta.num_rows, meta.rows[0].q_len
        _nq, hq, d = q.shape
        bs = kv_layer.shape[3]
        k_view = kv_layer[:, 0]
        width = _bucket(meta.block_table.shape[1])
        key = (rows, q_len, hq, d, (q.stride(0), q.stride(1)), tuple(k_view.shape), tuple(k_view.stride()),
               width, bs, q.dtype, float(scale))
        plan = self.plans.get(key)
        if plan is None:
            if torch.cuda.is_current_stream_capturing():
                raise BackendError("the cuDNN plan of this shape must be built before CUDA-graph capture "
                                   "(run the step once outside capture, as worker/cuda_graph.py's warm-up does)")
            plan = self.plans[key] = _Plan(self.cudnn, self.handle, key, q.device)
        return plan

    def __call__(self, q: torch.Tensor, kv_layer: torch.Tensor, meta: PagedAttentionMetadata, scale: float,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        if q.dtype not in (torch.bfloat16, torch.float16):
            raise BackendError(f"cuDNN paged attention runs bf16/fp16, got {q.dtype}")
        if kv_layer.dtype != q.dtype:
            raise BackendError(f"pool dtype {kv_layer.dtype} differs from query dtype {q.dtype}")
        if q.stride(-1) != 1:
            q = q.contiguous()
        if out is None:
            out = torch.empty_like(q)
        if q.shape[0] == 0:
            return out
        plan = self.plan_for(q, kv_layer, meta, scale)
        rows = meta.num_rows
        table = meta.block_table
        if table.shape[1] != plan.width:  # pad the page table to the graph's bucket (entries past kv_len unread)
            padded = table.new_zeros((rows, plan.width))
            padded[:, : table.shape[1]] = table
            table = padded
        table = table.to(torch.int32).contiguous().view(rows, 1, plan.width, 1)
        seq_kv = meta.kv_lens.to(torch.int32).contiguous().view(rows, 1, 1, 1)
        seq_q = torch.full((rows, 1, 1, 1), plan.q_len, dtype=torch.int32, device=q.device)
        if out.stride() != q.stride():
            raise BackendError("cuDNN paged attention needs `out` laid out like `q`")
        self.cudnn.set_stream(self.handle, torch.cuda.current_stream(q.device).cuda_stream)
        pack = {plan.q: q, plan.k: kv_layer[:, 0], plan.v: kv_layer[:, 1], plan.table_k: table,
                plan.table_v: table, plan.seq_q: seq_q, plan.seq_kv: seq_kv, plan.o: out}
        plan.run(pack)
        return out


class CudnnBackend(PlainRowsSplit):
    """`attention_backend='cudnn'`: cuDNN paged SDPA for the denoise phase, Triton for the rest.

    `graph_safe`: the cuDNN graph is chosen from what a CUDA-graph bucket fixes (rows, queries per
    row, padded page-table width, pool geometry); key lengths, page tables and queries are read on
    the device, so a replay with refilled static buffers follows the new request
    (tests/test_attention_candidates.py checks this). A shape's plan must be built before capture;
    `worker/cuda_graph.py`'s warm-up does."""

    name = "cudnn"

    def __init__(self, device: torch.device | str = "cuda", min_q_len: int = 1):
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            raise BackendError(f"attention_backend='cudnn' needs a CUDA device, got {device}; "
                               "use attention_backend='torch' (or 'auto') on CPU")
        self._cudnn = CudnnPaged()  # raises BackendError with the install hint when missing
        super().__init__(min_q_len)

    def plain(self, q, kv_layer, meta: PagedAttentionMetadata, scale: float) -> torch.Tensor:
        return self._cudnn(q, kv_layer, meta, scale)
