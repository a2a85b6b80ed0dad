"""Paged and dense modes compute the same images (fp32 CPU), and prefix reuse equals recompute."""

import numpy as np
import pytest
import torch
from worker_helpers import no_rows_bound

from ditkv.config import EngineConfig
from ditkv.engine.engine import Engine
from ditkv.engine.types import GenerationRequest
from ditkv.errors import MetadataError
from ditkv.models.hunyuan import HunyuanImage3Config, HunyuanImage3Model, PixelCodec
from ditkv.models.hunyuan.tokenizer import ByteTokenizer
from ditkv.worker.batch import BatchStepper
from ditkv.worker.denoising import denoise
from ditkv.engine.messages import SamplingParams


@pytest.fixture(scope="module")
def bundle():
    cfg = HunyuanImage3Config.tiny()
    model = HunyuanImage3Model.from_config(cfg, seed=1, zero_init_resblocks=False).eval()
    return model, ByteTokenizer(), PixelCodec(cfg.image_token_downsample)


def engine(bundle, mode, bs=16, backend="torch"):
    paged = mode == "paged_scheduler"
    cfg = EngineConfig(diffusion_kv_mode=mode, diffusion_kv_max_rows_per_request=2 if paged else None,
                       block_size=bs, num_kv_blocks=64 if paged else None, attention_backend=backend)
    return Engine(cfg, model_bundle=bundle)


def latents(e, req, reuse=True):
    """Run one request through the engine's worker and return its fp32 latents."""
    rid = e.add_request(req)
    out = e.scheduler.schedule()
    (sreq,) = out.admitted
    job = sreq.payload
    p = job.params
    if sreq.metadata is not None:
        e.worker.install(sreq.metadata)
    x, stats = denoise(e.worker.runner, rid, job.layout, p.steps, p.guidance, p.seed, reuse_prefix=reuse)
    e.scheduler.finish(rid)
    e._retire(e.scheduler.take_finished())
    return x, stats


# prompt "a red circle" = 12 bytes: image_start = 1 + 12 + 3 + 1 = 17; "a red circ" = 10 -> 15 ...
# "abcdefghijk" = 11 bytes -> image_start 16, image end 16 + 64 = 80: span exactly on 16-token pages.
CASES = [
    ("no-cfg", "a blue square", 32, 32, 1.0, 16),
    ("cfg", "a large red circle", 32, 32, 4.0, 16),
    ("cfg-rect", "a green triangle", 48, 32, 4.0, 64),
    ("span-on-block-boundary", "abcdefghijk", 32, 32, 3.0, 16),
    ("cfg-64", "a small yellow cross in the top left", 64, 64, 2.5, 64),
]


@pytest.mark.parametrize("name, prompt, h, w, g, bs", CASES, ids=[c[0] for c in CASES])
def test_paged_equals_dense(bundle, name, prompt, h, w, g, bs):
    req = dict(prompt=prompt, height=h, width=w, steps=3, guidance_scale=g, seed=7)
    xd, sd = latents(engine(bundle, "dense_legacy", bs), GenerationRequest(**req))
    ep = engine(bundle, "paged_scheduler", bs)
    xp, sp = latents(ep, GenerationRequest(**req))
    diff = (xd - xp).abs().max().item()
    assert diff < 1e-4, f"{name}: paged vs dense max abs diff {diff}"
    assert sp.prefix_tokens_reused == sd.prefix_tokens_reused > 0
    assert ep.manager.pool.num_free == 64  # every block returned
    if name == "span-on-block-boundary":
        row = ep.worker.layout(prompt, h, w, g).rows[0]
        assert row.image_start % bs == 0 and (row.image_start + 64) % bs == 0


def test_segments_backend_equals_limits_backend(bundle):
    req = dict(prompt="a white cross", height=32, width=32, steps=2, guidance_scale=3.0, seed=3)
    a, _ = latents(engine(bundle, "paged_scheduler", 16, "torch"), GenerationRequest(**req))
    b, _ = latents(engine(bundle, "paged_scheduler", 16, "torch-segments"), GenerationRequest(**req))
    assert (a - b).abs().max().item() < 1e-4


@pytest.mark.parametrize("mode", ["paged_scheduler", "dense_legacy"])
def test_prefix_reuse_equals_full_recompute(bundle, mode):
    req = dict(prompt="a purple square in the center", height=32, width=32, steps=4, guidance_scale=3.0, seed=5)
    reuse, s1 = latents(engine(bundle, mode), GenerationRequest(**req), reuse=True)
    full, s2 = latents(engine(bundle, mode), GenerationRequest(**req), reuse=False)
    assert (reuse - full).abs().max().item() < 1e-4
    assert s1.tokens_computed < s2.tokens_computed and s2.prefix_tokens_reused == 0


def test_whole_image_equal_and_pool_full_again(bundle):
    req = GenerationRequest(prompt="a blue circle", height=32, width=32, steps=2, guidance_scale=2.0, seed=1)
    od = engine(bundle, "dense_legacy").generate(req)
    ep = engine(bundle, "paged_scheduler")
    op = ep.generate(req)
    assert od.ok and op.ok and od.image.shape == (32, 32, 3) and od.image.dtype == np.uint8
    assert np.abs(od.image.astype(int) - op.image.astype(int)).max() <= 1
    assert op.stats.blocks > 0 and ep.manager.pool.num_free == ep.manager.pool.num_blocks


def test_no_silent_fallback(bundle):
    ep = engine(bundle, "paged_scheduler")
    layout = ep.worker.layout("a red square", 32, 32, 2.0)
    with pytest.raises(MetadataError, match="no installed paged metadata"):
        BatchStepper(ep.worker).start("never-admitted", layout, SamplingParams(steps=2, guidance=2.0, seed=0))
    ed = engine(bundle, "dense_legacy")
    rid = ep.add_request(GenerationRequest(prompt="a red square", height=32, width=32, steps=2))
    meta = ep.scheduler.schedule().admitted[0].metadata
    with pytest.raises(MetadataError, match="dense"):
        ed.worker.install(meta)
    ep.scheduler.cancel(rid)


def test_request_error_does_not_leak_or_stop_engine(bundle, monkeypatch):
    ep = engine(bundle, "paged_scheduler")
    calls = {"n": 0}
    real = ep.worker.runner.step

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected failure")
        return real(*a, **k)

    monkeypatch.setattr(ep.worker.runner, "step", flaky)
    r1 = ep.add_request(GenerationRequest(prompt="a red square", height=32, width=32, steps=2))
    r2 = ep.add_request(GenerationRequest(prompt="a blue square", height=32, width=32, steps=2))
    outs = {o.request_id: o for o in ep.run_until_complete()}
    assert outs[r1].status == "error" and "injected failure" in outs[r1].error
    assert outs[r2].ok
    assert ep.manager.pool.num_free == 64 and no_rows_bound(ep.worker.rows)


def test_abort_running_request_stops_at_step_boundary(bundle):
    ep = engine(bundle, "paged_scheduler")
    rid = ep.add_request(GenerationRequest(prompt="a red square", height=32, width=32, steps=5))
    ep.on_step = lambda r, i, n: ep.abort(r) if i == 1 else None
    outs = ep.run_until_complete()
    assert outs[0].status == "cancelled" and outs[0].request_id == rid
    assert ep.manager.pool.num_free == 64 and no_rows_bound(ep.worker.rows)


def test_bad_requests_rejected_with_named_field(bundle):
    ep = engine(bundle, "paged_scheduler")
    from ditkv.errors import AdmissionError, LayoutError

    with pytest.raises(LayoutError, match="height"):
        ep.add_request(GenerationRequest(prompt="x", height=30, width=32))
    with pytest.raises(LayoutError, match="steps"):
        ep.add_request(GenerationRequest(prompt="x", height=32, width=32, steps=0))
    with pytest.raises(AdmissionError, match="envelope|max_model_len|required_blocks"):
        ep.add_request(GenerationRequest(prompt="x", height=256, width=256))
    assert ep.manager.pool.num_free == 64 and not ep.scheduler.has_work()
    torch.manual_seed(0)


@pytest.mark.parametrize("phase", ["prefill", "prefill_from_imported", "denoise"])
def test_dense_segments_equal_the_masked_dense_attention(phase):
    """The GPU's fair dense baseline (the mask split into causal / full segments, each on SDPA's
    fused kernels) computes what the one masked SDPA computes, on every phase geometry."""
    from ditkv.attention.metadata import RowPhase
    from ditkv.worker.dense_cache import DenseAttention, DenseKVCache

    torch.manual_seed(0)
    seq, spans = 40, ((5, 9), (12, 40))  # a full-attention span mid-prompt, then the target
    start, kv = {"prefill": (0, seq), "prefill_from_imported": (7, seq), "denoise": (12, seq)}[phase]
    rows = [RowPhase(0, start, seq - start, kv, spans), RowPhase(seq - start, start, seq - start, kv, spans)]
    out = {}
    for segments in (False, True):
        cache = DenseKVCache(1, 2, seq, 2, 8, torch.float32, "cpu")
        for t in cache.k + cache.v:  # an imported prefix already in place
            t[:, :start] = torch.randn(2, start, 2, 8, generator=torch.Generator().manual_seed(1))
        g = torch.Generator().manual_seed(2)
        n = 2 * (seq - start)
        q, k, v = (torch.randn(n, h, 8, generator=g) for h in (4, 2, 2))
        out[segments] = DenseAttention(cache, rows, 8 ** -0.5, segments=segments)(0, q, k, v)
        assert (DenseAttention(cache, rows, 8 ** -0.5, segments=segments).segments is not None) == segments
    torch.testing.assert_close(out[True], out[False], atol=1e-5, rtol=1e-5)
