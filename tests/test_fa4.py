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

import sys

import pytest
import torch

from ditkv.attention.backend import check_page_geometry, select_backend
from ditkv.attention.fa4_backend import fa4_unusable, import_fa4
from ditkv.errors import BackendError, ConfigError
from test_attention_candidates import _case, _check, _reference, graph_replay_follows_refilled_metadata


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
