"""Optional paged-attention backends (issue 14 item 4): `attention_backend='cudnn'`.

CPU: selecting `cudnn` without CUDA or without the `nvidia-cudnn-frontend` package is a clear
`BackendError`; `auto` never picks it there; the plain-rows rule (which phases cuDNN serves).
GPU (`-m gpu`, needs CUDA and `pip install 'ditkv[cudnn]'`): the cuDNN backend equals the torch
backend within bf16 tolerance on the denoise phase, hands the mixed-mask prefill phase to the
Triton kernel, replays correctly inside a CUDA graph with refilled metadata (`graph_safe`), and
`auto` follows the measured table (`cudnn_backend.AUTO_MIN_Q_LEN`).
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from ditkv.attention.backend import select_backend
from ditkv.attention.cudnn_backend import auto_prefers_cudnn, import_cudnn
from ditkv.attention.split_backend import MAX_LEAD, lead_queries, plain_rows
from ditkv.attention.metadata import RowPhase, build_paged_metadata
from ditkv.attention.torch_backend import TorchBackend
from ditkv.errors import BackendError


def _has_cudnn_frontend() -> bool:
    try:
        import_cudnn()
    except BackendError:
        return False
    return True


# --------------------------------------------------------------------------------------------
# CPU


def test_cudnn_without_cuda_is_a_clear_error():
    with pytest.raises(BackendError, match="needs a CUDA device"):
        select_backend("cudnn", "cpu", paged=True)


def test_cudnn_without_package_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "cudnn", None)  # import cudnn -> ImportError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(BackendError, match=r"pip install 'ditkv\[cudnn\]'"):
        select_backend("cudnn", "cuda", paged=True)
    assert not auto_prefers_cudnn("cpu")


def test_auto_on_cpu_is_torch_and_unknown_names_list_cudnn():
    assert select_backend("auto", "cpu", paged=True).name == "torch"
    with pytest.raises(BackendError, match="cudnn"):
        select_backend("nope", "cpu", paged=True)


def test_plain_rows_rule():
    p, t = 100, 65
    spans = ((p, p + t),)
    den = build_paged_metadata([RowPhase(0, p, t, p + t, spans), RowPhase(t, p, t, p + t, spans)],
                               [[0, 1, 2], [3, 4, 5]], 64)
    assert plain_rows(den)
    pre = build_paged_metadata([RowPhase(0, 0, p + t, p + t, spans)], [[0, 1, 2]], 64)
    assert not plain_rows(pre)  # causal prefix + full target: the mixed mask
    uneven = build_paged_metadata([RowPhase(0, p, t, p + t, spans), RowPhase(t, 10, 20, 30, ((10, 30),))],
                                  [[0, 1, 2], [3]], 64)
    assert not plain_rows(uneven)  # unequal query counts: no single dense Q view
    other_kv = build_paged_metadata([RowPhase(0, p, t, p + t, spans), RowPhase(t, 300, t, 300 + t, ((300, 365),))],
                                    [[0, 1, 2], [3, 4, 5, 6, 7, 8]], 64)
    assert plain_rows(other_kv)  # equal query counts, different key lengths: per-row seq_len_kv


def test_lead_queries_rule():
    p, t = 100, 65
    one = build_paged_metadata([RowPhase(0, p, t, p + t, ((p + 1, p + t),)),
                                RowPhase(t, 300, t, 300 + t, ((301, 300 + t),))], [[0, 1, 2], [3, 4, 5, 6, 7, 8]], 64)
    assert lead_queries(one) == 1 and not plain_rows(one)  # the timestep token, then the image span
    two = build_paged_metadata([RowPhase(0, p, t, p + t, ((p + 2, p + t),))] * 1, [[0, 1, 2]], 64)
    assert lead_queries(two) == 2  # timestep + guidance token (distilled models)
    unequal = build_paged_metadata([RowPhase(0, p, t, p + t, ((p + 1, p + t),)),
                                    RowPhase(t, p, t, p + t, ((p + 2, p + t),))], [[0, 1, 2], [3, 4, 5]], 64)
    assert lead_queries(unequal) is None  # rows must agree on their leading queries
    many = build_paged_metadata([RowPhase(0, p, t, p + t, ((p + MAX_LEAD + 1, p + t),))], [[0, 1, 2]], 64)
    assert lead_queries(many) is None
    no_span = build_paged_metadata([RowPhase(0, p, t, p + t, ((p, p + t - 1),))], [[0, 1, 2]], 64)
    assert lead_queries(no_span) is None  # no span ends at kv_len: the last query is causal


@pytest.mark.parametrize("guidance_token", [False, True])
def test_the_real_denoise_rows_have_leading_causal_queries(guidance_token):
    """A HunyuanImage denoise row starts with the timestep token (and the guidance token of a distilled
    model), which attends causally: before `lead_queries`, `plain_rows` refused every real denoise step,
    so fa4 / cudnn never served it (their benchmarks used one-span targets)."""
    from ditkv.core.metadata import DiffusionKVMetadata, RowMetadata
    from ditkv.models.hunyuan import HunyuanImage3Config, build_request_layout
    from ditkv.models.hunyuan.tokenizer import ByteTokenizer
    from ditkv.worker.rows import DENOISE, WorkerRows

    cfg = HunyuanImage3Config.tiny()
    if guidance_token:
        cfg = dataclasses.replace(cfg, use_guidance_token=True)
    layout = build_request_layout(cfg, ByteTokenizer(), "a small red circle", 64, 64, 4.0)
    rows, at, rmeta = WorkerRows(num_blocks=64, block_size=16, max_rows=2), 0, []
    for i, r in enumerate(layout.rows):
        n = -(-r.seq_len // 16)
        rmeta.append(RowMetadata(i, r.prefix_len, r.target_len, r.seq_len, r.full_attn_spans, tuple(range(at, at + n))))
        at += n
    rows.install(DiffusionKVMetadata("r", 1, 16, tuple(rmeta)))
    meta = rows.phase_metadata("r", DENOISE)
    assert lead_queries(meta) == (2 if guidance_token else 1)
    assert not plain_rows(meta)


# --------------------------------------------------------------------------------------------
# GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available() or not _has_cudnn_frontend(),
                         reason="needs CUDA and nvidia-cudnn-frontend (pip install 'ditkv[cudnn]')")


def _case(rows_spec, hq, hkv, d, bs, seed, dtype=torch.bfloat16, extra_blocks=5):
    """rows_spec: (q_start, q_len, kv_len, spans) per row; block-major pool, permuted pages."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    rows, off = [], 0
    for q_start, q_len, kv_len, spans in rows_spec:
        rows.append(RowPhase(off, q_start, q_len, kv_len, spans))
        off += q_len
    nblocks = [(r.kv_len + bs - 1) // bs for r in rows]
    total = sum(nblocks) + extra_blocks
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed)).tolist()
    ids, at = [], 0
    for n in nblocks:
        ids.append(perm[at:at + n])
        at += n
    meta = build_paged_metadata(rows, ids, bs, device=dev)
    pool = torch.randn(total, 2, 2, hkv, bs, d, device=dev, dtype=dtype, generator=g)
    q = torch.randn(off, hq, d, device=dev, dtype=dtype, generator=g)
    k = torch.randn(off, hkv, d, device=dev, dtype=dtype, generator=g)
    v = torch.randn(off, hkv, d, device=dev, dtype=dtype, generator=g)
    return meta, pool, q, k, v


def _reference(meta, pool, q, scale):
    return TorchBackend().paged_attention(q.float(), pool[:, 1].float(), meta, scale)


def _check(out, exp):
    err = ((out.float() - exp).norm() / exp.norm()).item()
    assert err < 1e-2, err
    assert (out.float() - exp).abs().max().item() < 3e-2
    assert not out.isnan().any()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("p,t,bs", [(1024, 1025, 64), (100, 257, 64), (300, 129, 16)])
def test_gpu_cudnn_denoise_matches_torch(p, t, bs):
    spans = ((p, p + t),)
    meta, pool, q, k, v = _case([(p, t, p + t, spans)] * 2, 32, 8, 128, bs, seed=p + t)
    b = select_backend("cudnn", "cuda", paged=True)
    b.write_kv(pool[:, 1], k, v, meta.slot_mapping)
    scale = 128 ** -0.5
    out = b.paged_attention(q, pool[:, 1], meta, scale)
    assert b.last_path == "cudnn"
    _check(out, _reference(meta, pool, q, scale))


@pytest.mark.gpu
@gpu
def test_gpu_auto_follows_the_measured_table():
    """`auto` picks cuDNN only on devices with a measured crossover, and then sends plain calls
    below it (T = 1025 on sm90) to Triton."""
    from ditkv.attention.cudnn_backend import AUTO_MIN_Q_LEN

    from ditkv.attention.fa4_backend import auto_prefers_fa4

    b = select_backend("auto", "cuda", paged=True)
    cap = torch.cuda.get_device_capability()
    if auto_prefers_fa4("cuda"):  # flash-attn-4 installed: its measured table comes first (test_fa4.py)
        assert b.name == "fa4"
        return
    if cap not in AUTO_MIN_Q_LEN:
        assert b.name == "triton"
        return
    assert b.name == "cudnn" and b.min_q_len == AUTO_MIN_Q_LEN[cap]
    scale = 128 ** -0.5
    for t, path in ((AUTO_MIN_Q_LEN[cap] - 1, "triton"), (AUTO_MIN_Q_LEN[cap], "cudnn")):
        meta, pool, q, _, _ = _case([(256, t, 256 + t, ((256, 256 + t),))] * 2, 32, 8, 128, 64, seed=t)
        out = b.paged_attention(q, pool[:, 1], meta, scale)
        assert b.last_path == path
        _check(out, _reference(meta, pool, q, scale))


@pytest.mark.gpu
@gpu
def test_gpu_cudnn_rows_with_different_key_lengths():
    t = 193
    spec = [(100, t, 100 + t, ((100, 100 + t),)), (700, t, 700 + t, ((700, 700 + t),))]
    meta, pool, q, k, v = _case(spec, 32, 8, 128, 64, seed=3)
    b = select_backend("cudnn", "cuda", paged=True)
    scale = 0.1
    out = b.paged_attention(q, pool[:, 1], meta, scale)
    assert b.last_path == "cudnn"
    _check(out, _reference(meta, pool, q, scale))


@pytest.mark.gpu
@gpu
def test_gpu_cudnn_delegates_mixed_mask_prefill_to_triton():
    spec = [(0, 1300, 1300, ((300, 1300),)), (0, 1300, 1300, ((300, 1300),))]
    meta, pool, q, k, v = _case(spec, 32, 8, 128, 64, seed=7)
    b = select_backend("cudnn", "cuda", paged=True)
    scale = 128 ** -0.5
    out = b.paged_attention(q, pool[:, 1], meta, scale)
    assert b.last_path == "triton" and b.calls == {"cudnn": 0, "triton": 1}
    _check(out, _reference(meta, pool, q, scale))


@pytest.mark.gpu
@gpu
def test_gpu_cudnn_cuda_graph_replay_with_refilled_metadata():
    """Capture one denoise call, then refill the static table / lengths / queries with another
    request's (same bucket: rows, queries per row, table width) and replay: the output must follow
    the new data: what `graph_safe` promises `worker/cuda_graph.py`. Building a plan inside
    capture is refused with a clear error."""
    graph_replay_follows_refilled_metadata("cudnn", "before CUDA-graph capture")


def capture_paged(b, q, kv_layer, meta, scale):
    """(graph, its static output) of one paged call, after an eager call on a side stream (plans and
    compiles happen there, never inside the capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        b.paged_attention(q, kv_layer, meta, scale)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = b.paged_attention(q, kv_layer, meta, scale)
    return graph, out


def graph_replay_follows_refilled_metadata(name: str, refusal: str) -> None:
    """The graph-safety check shared by the cuDNN and fa4 backends (tests/test_fa4.py)."""
    t, bs = 257, 64
    spans_a = ((300, 300 + t),)
    meta_a, pool, q_a, _, _ = _case([(300, t, 300 + t, spans_a)] * 2, 32, 8, 128, bs, seed=1, extra_blocks=40)
    scale = 128 ** -0.5
    ref_a = _reference(meta_a, pool, q_a, scale)
    nb_b = (500 + t + bs - 1) // bs
    perm = torch.randperm(pool.shape[0], generator=torch.Generator().manual_seed(5)).tolist()
    rows_b = [RowPhase(r * t, 500, t, 500 + t, ((500, 500 + t),)) for r in range(2)]
    meta_b = build_paged_metadata(rows_b, [perm[:nb_b], perm[nb_b:2 * nb_b]], bs, device="cuda")
    q_b = torch.randn_like(q_a)
    ref_b = _reference(meta_b, pool, q_b, scale)
    width = meta_b.block_table.shape[1]
    static_table = torch.zeros((2, width), dtype=torch.int32, device="cuda")
    static_table[:, : meta_a.block_table.shape[1]] = meta_a.block_table
    meta = dataclasses.replace(meta_a, block_table=static_table, kv_lens=meta_a.kv_lens.clone())
    static_q = q_a.clone()
    b = select_backend(name, "cuda", paged=True)
    graph, static_out = capture_paged(b, static_q, pool[:, 1], meta, scale)
    graph.replay()
    torch.cuda.synchronize()
    _check(static_out, ref_a)
    other = torch.cuda.CUDAGraph()
    with pytest.raises(BackendError, match=refusal):
        with torch.cuda.graph(other):
            b.paged_attention(static_q[: t], pool[:, 1], dataclasses.replace(
                meta, rows=(meta.rows[0],), block_table=static_table[:1], kv_lens=meta.kv_lens[:1]), scale)
    static_table.copy_(meta_b.block_table)
    meta.kv_lens.copy_(meta_b.kv_lens)
    static_q.copy_(q_b)
    graph.replay()
    torch.cuda.synchronize()
    _check(static_out, ref_b)
