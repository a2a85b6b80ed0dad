"""`attention_backend='fa4'` (issue 26): flash-attn-4 paged attention for the denoise phase.

CPU: selecting fa4 without CUDA, off sm90/sm100 or without the extra is a `BackendError` naming the
fix; its page geometry is checked at startup; batch-invariant mode refuses it.
GPU (`-m gpu`, needs CUDA sm90/sm100 and `pip install 'ditkv[fa4]'`): fa4 equals the torch backend
within bf16 tolerance on the denoise phase (permuted pages, pages 64 and 128, rows with other key
lengths), hands the mixed-mask prefill phase to Triton, replays inside a CUDA graph with refilled
metadata (`graph_safe`) and refuses a capture that would compile; an engine request with fa4 and
CUDA graphs gives the Triton backend's image within a few levels.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from ditkv.attention.backend import check_page_geometry, select_backend
from ditkv.attention.metadata import build_paged_metadata
from ditkv.attention.fa4_backend import fa4_unusable, import_fa4
from ditkv.errors import BackendError, ConfigError
from test_attention_candidates import _case, _check, _reference, capture_paged, graph_replay_follows_refilled_metadata


def test_fa4_without_cuda_is_a_clear_error():
    with pytest.raises(BackendError, match="needs a CUDA device"):
        select_backend("fa4", "cpu", paged=True)


def test_fa4_without_the_extra_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # import flash_attn.cute -> ImportError
    with pytest.raises(BackendError, match=r"pip install 'ditkv\[fa4\]'"):
        import_fa4()


def test_fa4_off_hopper_and_blackwell_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (8, 0))
    assert "sm90" in fa4_unusable("cuda") and "sm80" in fa4_unusable("cuda")


def test_fa4_page_geometry_and_batch_invariance():
    from ditkv.config import EngineConfig
    from ditkv.worker.worker import attention_backend_for

    with pytest.raises(BackendError, match="block_size=48 cannot run attention_backend='fa4'"):
        check_page_geometry("fa4", 48)
    check_page_geometry("fa4", 128)
    assert EngineConfig(attention_backend="fa4").attention_backend == "fa4"
    with pytest.raises(ConfigError, match="triton"):
        attention_backend_for(EngineConfig(attention_backend="fa4", batch_invariant=True), torch.device("cuda"))


# --------------------------------------------------------------------------------------------
# GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available() or fa4_unusable("cuda") is not None,
                         reason="needs CUDA sm90/sm100 and flash-attn-4 (pip install 'ditkv[fa4]')")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("p,t,bs", [(1024, 1025, 64), (1024, 1025, 128), (100, 257, 64), (300, 129, 128)])
def test_gpu_fa4_denoise_matches_torch(p, t, bs):
    spans = ((p, p + t),)
    meta, pool, q, k, v = _case([(p, t, p + t, spans)] * 2, 32, 8, 128, bs, seed=p + t)  # random prefix pages
    b = select_backend("fa4", "cuda", paged=True, block_size=bs)
    b.write_kv(pool[:, 1], k, v, meta.slot_mapping)
    scale = 128 ** -0.5
    out = b.paged_attention(q, pool[:, 1], meta, scale)
    assert b.last_path == "fa4"
    _check(out, _reference(meta, pool, q, scale))


def _lead_spec(lead, t, starts=(1024, 1100)):
    """Real denoise rows: `lead` causal queries (timestep, guidance) before the image span; the CFG
    rows' prompts differ in length, so their q_start differ."""
    return [(p, t, p + t, ((p + lead, p + t),)) for p in starts]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("lead,t,bs", [(1, 1025, 64), (1, 1025, 128), (2, 257, 64)])
def test_gpu_fa4_serves_real_denoise_rows_with_leading_causal_queries(lead, t, bs):
    meta, pool, q, k, v = _case(_lead_spec(lead, t), 32, 8, 128, bs, seed=lead + t)
    b = select_backend("fa4", "cuda", paged=True, block_size=bs)
    b.write_kv(pool[:, 1], k, v, meta.slot_mapping)
    scale = 128 ** -0.5
    out = b.paged_attention(q, pool[:, 1], meta, scale)
    assert b.last_path == "fa4" and b.calls["triton"] == 0
    exp = _reference(meta, pool, q, scale)
    _check(out, exp)
    rows = out.view(2, t, *out.shape[1:])[:, :lead].float()  # the leading queries alone (a few of t)
    ref = exp.view(2, t, *exp.shape[1:])[:, :lead]
    assert ((rows - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.gpu
@gpu
def test_gpu_fa4_leading_queries_replay_in_a_cuda_graph_with_refilled_limits():
    t, bs, scale = 257, 64, 128 ** -0.5
    meta_a, pool, q_a, _, _ = _case(_lead_spec(1, t, (300, 340)), 32, 8, 128, bs, seed=1, extra_blocks=40)
    ref_a = _reference(meta_a, pool, q_a, scale)
    nb = (520 + t + bs - 1) // bs  # the longer row's pages (the other row has one to spare)
    perm = torch.randperm(pool.shape[0], generator=torch.Generator().manual_seed(5)).tolist()
    rows_b = [dataclasses.replace(r, q_start=500 + 20 * i, kv_len=500 + 20 * i + t,
                                  spans=((501 + 20 * i, 500 + 20 * i + t),)) for i, r in enumerate(meta_a.rows)]
    meta_b = build_paged_metadata(rows_b, [perm[:nb], perm[nb:2 * nb]], bs, device="cuda")
    q_b = torch.randn_like(q_a)
    ref_b = _reference(meta_b, pool, q_b, scale)
    table = torch.zeros((2, meta_b.block_table.shape[1]), dtype=torch.int32, device="cuda")
    table[:, : meta_a.block_table.shape[1]] = meta_a.block_table
    meta = dataclasses.replace(meta_a, block_table=table, kv_lens=meta_a.kv_lens.clone(),
                               key_limit=meta_a.key_limit.clone())
    static_q = q_a.clone()
    graph, static_out = capture_paged(select_backend("fa4", "cuda", paged=True), static_q, pool[:, 1], meta, scale)
    graph.replay()
    torch.cuda.synchronize()
    _check(static_out, ref_a)
    table.copy_(meta_b.block_table)
    meta.kv_lens.copy_(meta_b.kv_lens)
    meta.key_limit.copy_(meta_b.key_limit)
    static_q.copy_(q_b)
    graph.replay()
    torch.cuda.synchronize()
    _check(static_out, ref_b)
    lead_out, lead_ref = static_out.view(2, t, 32, 128)[:, 0].float(), ref_b.view(2, t, 32, 128)[:, 0]
    assert ((lead_out - lead_ref).norm() / lead_ref.norm()).item() < 1e-2


@pytest.mark.gpu
@gpu
def test_gpu_fa4_rows_with_different_key_lengths_and_prefill_to_triton():
    t = 193
    spec = [(100, t, 100 + t, ((100, 100 + t),)), (700, t, 700 + t, ((700, 700 + t),))]
    meta, pool, q, _, _ = _case(spec, 32, 8, 128, 64, seed=3)
    b = select_backend("fa4", "cuda", paged=True)
    out = b.paged_attention(q, pool[:, 1], meta, 0.1)
    assert b.last_path == "fa4"
    _check(out, _reference(meta, pool, q, 0.1))
    spec = [(0, 1300, 1300, ((300, 1300),))] * 2  # a short prefill: Triton measured faster
    meta, pool, q, _, _ = _case(spec, 32, 8, 128, 64, seed=7)
    out = b.paged_attention(q, pool[:, 1], meta, 0.1)
    assert b.last_path == "triton" and b.calls["triton"] == 1
    _check(out, _reference(meta, pool, q, 0.1))


@pytest.mark.gpu
@gpu
def test_gpu_fa4_cuda_graph_replay_with_refilled_metadata():
    """Graph-safe: a replay follows refilled tables, lengths and queries; a capture that would compile
    a kernel FA4 has not run eagerly is refused."""
    graph_replay_follows_refilled_metadata("fa4", "compile inside a CUDA-graph")


@pytest.mark.gpu
@gpu
def test_gpu_engine_request_with_fa4_and_cuda_graphs():
    import numpy as np

    from ditkv.config import EngineConfig
    from ditkv.engine.engine import Engine
    from ditkv.engine.types import GenerationRequest

    images = {}
    for name in ("triton", "fa4"):
        e = Engine(EngineConfig(attention_backend=name, diffusion_kv_mode="paged_scheduler",
                                diffusion_kv_max_rows_per_request=2, device="cuda", dtype="bfloat16",
                                num_kv_blocks=256, profile_memory=False, cuda_graphs="auto"))
        try:
            out = e.generate(GenerationRequest(prompt="a large blue square", height=64, width=64, steps=6,
                                               guidance_scale=4.0, seed=1))
        finally:
            e.shutdown()
        assert out.ok, out.error
        images[name] = out.image.astype(int)
    assert np.abs(images["fa4"] - images["triton"]).mean() < 2.0  # bf16 kernels sum in other orders


@pytest.mark.gpu
@gpu
def test_gpu_auto_picks_fa4_by_the_measured_table():
    from ditkv.attention.fa4_backend import AUTO_MIN_Q_LEN

    b = select_backend("auto", "cuda", paged=True, block_size=64)
    cap = torch.cuda.get_device_capability()
    if cap not in AUTO_MIN_Q_LEN:
        assert b.name != "fa4"
        return
    assert b.name == "fa4" and b.min_q_len == AUTO_MIN_Q_LEN[cap]
    for t, path in ((AUTO_MIN_Q_LEN[cap] - 1, "triton"), (AUTO_MIN_Q_LEN[cap], "fa4")):
        meta, pool, q, _, _ = _case([(256, t, 256 + t, ((256, 256 + t),))] * 2, 32, 8, 128, 64, seed=t)
        out = b.paged_attention(q, pool[:, 1], meta, 0.1)
        assert b.last_path == path
        _check(out, _reference(meta, pool, q, 0.1))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("spec", [
    [(0, 1300, 1300, ((300, 1300),))] * 2,                         # causal prefix, full target
    [(0, 900, 900, ((40, 200), (250, 400), (500, 900)))] * 2,      # an edit prefix's image spans too
    [(256, 700, 956, ((400, 956),))] * 2,                          # after an imported prefix
])
def test_gpu_fa4_prefill_segments_match_torch(spec):
    meta, pool, q, _, _ = _case(spec, 32, 8, 128, 64, seed=11)
    b = select_backend("fa4", "cuda", paged=True)
    _check(b.prefill(q, pool[:, 1], meta, 0.1), _reference(meta, pool, q, 0.1))


@pytest.mark.gpu
@gpu
def test_gpu_fa4_takes_long_prefills_by_the_measured_table():
    from ditkv.attention.fa4_backend import PREFILL_MIN_Q_LEN

    b = select_backend("fa4", "cuda", paged=True)
    n = PREFILL_MIN_Q_LEN.get(torch.cuda.get_device_capability())
    if n is None:
        assert b.prefill_min_q_len is None
        return
    meta, pool, q, _, _ = _case([(0, n, n, ((1024, n),))] * 2, 32, 8, 128, 64, seed=13)
    out = b.paged_attention(q, pool[:, 1], meta, 0.1)
    assert b.last_path == "fa4-prefill"
    _check(out, _reference(meta, pool, q, 0.1))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("bs", [64, 128])
def test_gpu_fa4_ar_decode_rows_match_torch(bs):
    """AR decode (one query per row at its last position, rows of other lengths) on FA4's plain paged
    call when asked for (`decode=True`; `auto` follows `DECODE_FA4`), else on Triton."""
    from ditkv.attention.fa4_backend import DECODE_FA4, Fa4Backend

    spec = [(kv - 1, 1, kv, ()) for kv in (37, 1000, 4097, 130)]
    meta, pool, q, _, _ = _case(spec, 32, 8, 128, bs, seed=bs)
    ref = _reference(meta, pool, q, 0.1)
    on = Fa4Backend("cuda", decode=True)
    _check(on.paged_attention(q, pool[:, 1], meta, 0.1), ref)
    assert on.last_path == "fa4-decode"
    off = Fa4Backend("cuda", decode=False)
    _check(off.paged_attention(q, pool[:, 1], meta, 0.1), ref)
    assert off.last_path == "triton"
    default = Fa4Backend("cuda")
    assert default.decode_on == DECODE_FA4.get(torch.cuda.get_device_capability(), False)


@pytest.mark.gpu
@gpu
def test_gpu_dense_legacy_attention_on_fa4_matches_sdpa_segments():
    """The dense-legacy baseline's segments on FA4's dense forward (DenseAttention(fa4=True)) give
    the SDPA segments' output, prefill (causal prefix + full target) and denoise."""
    from ditkv.attention.metadata import RowPhase
    from ditkv.worker.dense_cache import DenseAttention, DenseKVCache

    g = torch.Generator(device="cuda").manual_seed(2)
    p, t = 300, 257
    for rows in ([RowPhase(0, 0, p + t, p + t, ((p, p + t),))] * 2, [RowPhase(0, p, t, p + t, ((p, p + t),))] * 2):
        rows = [RowPhase(i * rows[0].q_len, r.q_start, r.q_len, r.kv_len, r.spans) for i, r in enumerate(rows)]
        outs = []
        for fa4 in (False, True):
            cache = DenseKVCache(1, 2, p + t, 8, 128, torch.bfloat16, "cuda")
            cache.k[0].copy_(torch.randn(cache.k[0].shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0)))
            cache.v[0].copy_(torch.randn(cache.v[0].shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)))
            n = 2 * rows[0].q_len
            gq = torch.Generator(device="cuda").manual_seed(3)
            q, k, v = (torch.randn(n, h, 128, device="cuda", generator=gq).to(torch.bfloat16) for h in (32, 8, 8))
            outs.append(DenseAttention(cache, rows, 0.1, True, fa4=fa4)(0, q, k, v).float())
        err = ((outs[1] - outs[0]).norm() / outs[0].norm()).item()
        assert err < 1e-2, err
    with pytest.raises(BackendError, match="segments=True"):
        DenseAttention(DenseKVCache(1, 2, 8, 8, 128, torch.bfloat16, "cuda"),
                       [RowPhase(0, 0, 8, 8, ())], 0.1, False, fa4=True)


@pytest.mark.gpu
@gpu
def test_gpu_step_level_batching_with_fa4_and_cuda_graphs():
    """Two requests batched into one step (max_num_seqs 2) on attention_backend='fa4' with CUDA graphs:
    each image stays within a few levels of the same request run alone."""
    import numpy as np

    from ditkv.config import EngineConfig
    from ditkv.engine.engine import Engine
    from ditkv.engine.types import GenerationRequest

    def run(n):
        e = Engine(EngineConfig(attention_backend="fa4", diffusion_kv_mode="paged_scheduler",
                                diffusion_kv_max_rows_per_request=2, device="cuda", dtype="bfloat16",
                                num_kv_blocks=256, profile_memory=False, cuda_graphs="auto", max_num_seqs=n))
        try:
            rids = [e.add_request(GenerationRequest(prompt=["a large blue square", "a small red circle"][i], height=64,
                                                    width=64, steps=5, guidance_scale=4.0, seed=1 + i))
                    for i in range(n)]
            outs = {o.request_id: o for o in e.run_until_complete()}
            sizes = dict(e.batch_sizes)
        finally:
            e.shutdown()
        assert all(o.ok for o in outs.values()), [o.error for o in outs.values()]
        return [outs[r].image.astype(int) for r in rids], sizes

    alone, _ = run(1)
    both, sizes = run(2)
    assert max(int(k) for k in sizes) == 2  # the steps really ran batched
    assert np.abs(both[0] - alone[0]).mean() < 2.0
