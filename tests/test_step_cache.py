"""Step caching in the engine (issue 35, CPU fp32, eager): the layered pass equals the plain one when
every step computes, batched requests with mixed cached and computed rows equal each alone bit for
bit, forced fractions come out exactly, skipped layers leave the target pages alone, and the
per-request cache state is freed on every terminal path."""

import logging

import numpy as np
import pytest
import torch

from ditkv.attention.adapter import PagedAttentionAdapter
from ditkv.config import EngineConfig
from ditkv.engine.engine import Engine
from ditkv.engine.types import GenerationRequest
from ditkv.errors import ConfigError, LayoutError
from ditkv.models.hunyuan import HunyuanImage3Config, HunyuanImage3Model
from ditkv.models.hunyuan.codec import PixelCodec
from ditkv.models.hunyuan.tokenizer import ByteTokenizer

INF = float("inf")
PROMPTS = ["a red fox in the snow", "a tall tower", "wide sea", "two green circles", "one small cat"]


@pytest.fixture(scope="module")
def bundle():
    cfg = HunyuanImage3Config.tiny()
    model = HunyuanImage3Model.from_config(cfg, seed=1, zero_init_resblocks=False).eval()
    return model, ByteTokenizer(), PixelCodec(cfg.image_token_downsample)


def tiny_engine(bundle, **kw):
    cfg = {"device": "cpu", "block_size": 16, "num_kv_blocks": 600, "max_num_seqs": 5, "max_image_height": 128,
           "max_image_width": 128, "max_prompt_tokens": 96, **kw}
    return Engine(EngineConfig(**cfg), model_bundle=bundle)


def req(i, steps=8, **kw):
    return GenerationRequest(prompt=PROMPTS[i % len(PROMPTS)], height=64, width=64, steps=steps,
                             guidance_scale=2.0, seed=30 + i, request_id=kw.pop("request_id", f"r{i}"), **kw)


def run(eng, reqs):
    ids = [eng.add_request(r) for r in reqs]
    outs = {o.request_id: o for o in eng.run_until_complete()}
    assert all(outs[i].ok for i in ids), [outs[i].error for i in ids]
    return [outs[i] for i in ids]


def test_every_step_computed_equals_no_cache(bundle):
    """Threshold 0 never caches: the front/middle/back parts give the plain pass's bits."""
    plain = run(tiny_engine(bundle), [req(0)])[0]
    none = run(tiny_engine(bundle, cache_config={"type": "none"}), [req(0)])[0]
    parts = run(tiny_engine(bundle, cache_config={"type": "dbcache", "Fn": 1, "Bn": 1, "residual_threshold": 0.0,
                                                  "warmup_steps": 0}), [req(0)])[0]
    assert np.array_equal(plain.image, none.image) and np.array_equal(plain.image, parts.image)
    assert parts.stats.cached_steps == 0 and parts.stats.computed_steps == 8
    cached = run(tiny_engine(bundle, cache_config={"type": "fbcache", "residual_threshold": INF,
                                                   "warmup_steps": 2}), [req(0)])[0]
    assert cached.stats.cached_steps == 6 and not np.array_equal(plain.image, cached.image)  # it does change
    off = run(tiny_engine(bundle, cache_config={"type": "fbcache", "residual_threshold": INF}),
              [req(0, cache_config={"type": "none"})])[0]  # a request turns the engine's cache off
    assert off.stats.cached_steps == 0 and np.array_equal(plain.image, off.image)


MIXED = [  # per-request caches: in a batch some rows cache while others compute, with different Fn/Bn
    {"type": "fbcache", "residual_threshold": INF, "warmup_steps": 1, "steps_mask": [4]},
    {"type": "fbcache", "residual_threshold": INF, "warmup_steps": 3, "max_continuous_cached_steps": 1},
    None,  # the engine's: none
    {"type": "dbcache", "Fn": 2, "Bn": 1, "residual_threshold": INF, "warmup_steps": 2, "taylorseer": 2},
    {"type": "fbcache", "residual_threshold": 0.06, "warmup_steps": 1, "taylorseer": 1},  # the metric decides
]


def test_batched_equals_alone_with_mixed_cached_and_computed_rows(bundle):
    reqs = [req(i, cache_config=c) for i, c in enumerate(MIXED)]
    eng = tiny_engine(bundle)
    batched = run(eng, reqs)
    assert eng.batch_sizes.get(5, 0) == 8  # every step ran all five together
    alone = [run(tiny_engine(bundle, max_num_seqs=1), [r])[0] for r in reqs]
    for b, a in zip(batched, alone):
        assert np.array_equal(b.image, a.image), b.request_id
        assert (b.stats.cached_steps, b.stats.computed_steps) == (a.stats.cached_steps, a.stats.computed_steps)
    cached = [o.stats.cached_steps for o in batched]
    # A: 1..7 minus step 4; B: 3, 5, 7 (never two in a row); none; D: 2..7; E: what the metric said
    assert cached[:4] == [6, 3, 0, 6] and 0 < cached[4] < 7, cached


@pytest.mark.parametrize("cache, steps, want", [
    ({"type": "fbcache", "residual_threshold": INF, "warmup_steps": 0, "steps_mask": [0, 3, 6]}, 10, 7),
    ({"type": "fbcache", "residual_threshold": INF, "warmup_steps": 0, "steps_mask": [0, 5]}, 10, 8),
    ({"type": "fbcache", "residual_threshold": INF, "warmup_steps": 1, "max_continuous_cached_steps": 2}, 10, 6),
    ({"type": "fbcache", "residual_threshold": INF, "warmup_steps": 1, "max_cached_steps": 3}, 10, 3),
    ({"type": "dbcache", "Fn": 2, "Bn": 1, "residual_threshold": INF, "warmup_steps": 4}, 10, 6),  # middle: 1 layer
    ({"type": "fbcache", "residual_threshold": INF, "warmup_steps": 10}, 10, 0),
])
def test_forced_fractions(bundle, cache, steps, want):
    out = run(tiny_engine(bundle, cache_config=cache), [req(1, steps=steps)])[0]
    assert (out.stats.cached_steps, out.stats.computed_steps) == (want, steps - want)


def test_skipped_layers_leave_the_target_pages_alone(bundle, monkeypatch):
    """fbcache on 4 layers: a cached step runs layer 0 only; layers 1-3 keep the K/V of the last
    computed step (no read, no write), layer 0's target pages are rewritten."""
    calls = []
    orig = PagedAttentionAdapter.__call__
    monkeypatch.setattr(PagedAttentionAdapter, "__call__",
                        lambda self, layer, q, k, v: calls.append(layer) or orig(self, layer, q, k, v))
    eng = tiny_engine(bundle, cache_config={"type": "fbcache", "residual_threshold": INF, "warmup_steps": 2})
    eng.add_request(req(2, steps=5))
    pool = eng.worker.pool
    per_step, snaps = [], []
    while eng.scheduler.has_work():
        calls.clear()
        eng.step()
        per_step.append(list(calls))
        snaps.append([pool.layer(i).clone() for i in range(4)])
    assert per_step[:5] == [[0, 1, 2, 3], [0, 1, 2, 3], [0], [0], [0]]
    for i in range(1, 4):
        assert torch.equal(snaps[1][i], snaps[4][i])  # middle layers: as the last computed step left them
    assert not torch.equal(snaps[1][0], snaps[2][0])  # the front layer wrote this step's target K/V


def test_request_errors_and_notes(bundle, caplog):
    eng = tiny_engine(bundle)
    with pytest.raises(LayoutError, match=r"cache_config.Fn.*leaves no middle block") as e:
        eng.add_request(req(0, cache_config={"type": "dbcache", "Fn": 3, "Bn": 1}))
    assert e.value.field == "cache_config"
    with pytest.raises(LayoutError, match=r"cache_config.steps_mask.*outside the request's steps \[0, 8\)"):
        eng.add_request(req(0, cache_config={"type": "fbcache", "steps_mask": [8]}))
    with pytest.raises(LayoutError, match="cache_config.residual_threshold"):
        eng.add_request(req(0, cache_config={"type": "fbcache", "residual_threshold": -1}))
    with caplog.at_level(logging.INFO, logger="ditkv.engine"):
        out = run(eng, [req(0, steps=4, cache_config={"type": "fbcache", "warmup_steps": 4})])[0]
    assert out.stats.cached_steps == 0 and "no step of this request is cached" in caplog.text
    with pytest.raises(ConfigError, match="leaves no middle block"):  # the engine's own: at startup
        tiny_engine(bundle, cache_config={"type": "dbcache", "Fn": 4})


def _cache_of(eng, rid):
    return eng.executor.stepper.running[rid].cache


def test_state_freed_on_finish_cancel_and_failure(bundle, monkeypatch):
    cache = {"type": "fbcache", "residual_threshold": INF, "warmup_steps": 1, "taylorseer": 2}
    eng = tiny_engine(bundle, cache_config=cache)
    eng.add_request(req(0, steps=6))
    eng.add_request(req(1, steps=20))
    eng.step(), eng.step(), eng.step()
    states = {rid: _cache_of(eng, rid) for rid in ("r0", "r1")}
    assert all(s.nbytes() > 0 and not s.released for s in states.values())
    eng.abort("r1")
    eng.step()
    assert states["r1"].released and states["r1"].nbytes() == 0  # cancelled
    assert not states["r0"].released
    outs = eng.run_until_complete()
    assert [o.status for o in outs if o.request_id == "r0"] == ["ok"]
    assert states["r0"].released and states["r0"].nbytes() == 0  # finished
    assert not eng.executor.stepper.running

    import ditkv.worker.dit_runner as dr

    eng.add_request(req(2, steps=6))
    eng.step(), eng.step()
    st = _cache_of(eng, "r2")
    monkeypatch.setattr(dr, "forward_cached", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    outs = eng.step()
    assert [o.status for o in outs] == ["error"] and st.released and st.nbytes() == 0  # failed
    assert not eng.executor.stepper.running


def test_taylorseer_changes_what_a_cached_step_adds(bundle):
    base = {"type": "fbcache", "residual_threshold": INF, "warmup_steps": 3}
    imgs = [run(tiny_engine(bundle, cache_config={**base, **extra}), [req(3)])[0].image
            for extra in ({}, {"taylorseer": 1}, {"taylorseer": 2})]
    assert not np.array_equal(imgs[0], imgs[1]) and not np.array_equal(imgs[1], imgs[2])


def test_backbone_layer_ranges_compose(bundle):
    model = bundle[0]
    n = 7
    h = torch.randn(n, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(n)

    def attn(layer, q, k, v):  # plain full attention over the tokens: enough to compare compositions
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
        return torch.einsum("hqk,khd->qhd", torch.softmax(torch.einsum("qhd,khd->hqk", q, k), -1), v)

    whole = model.backbone(h, pos, pos, attn)
    parts = model.backbone(model.backbone(model.backbone(h, pos, pos, attn, range(0, 1)), pos, pos, attn,
                                          range(1, 3)), pos, pos, attn, range(3, 4))
    assert torch.equal(whole, parts)
    for bad in (range(0, 5), range(0, 4, 2), range(-1, 2)):
        with pytest.raises(ValueError, match="contiguous range"):
            model.backbone(h, pos, pos, attn, bad)


def test_edits_cache_and_batch_like_text_requests():
    """Input images (tiny-edit): their slots are filled at step 0, a computed prefill; cached steps after
    it give the same bits batched as alone."""
    src = (np.indices((64, 64)).sum(0) % 7 * 30).astype(np.uint8)[..., None].repeat(3, -1)
    reqs = [GenerationRequest(prompt=p, images=[src], height=64, width=64, steps=6, guidance_scale=3.0, seed=i,
                              request_id=f"e{i}", cache_config=c)
            for i, (p, c) in enumerate([("make it red", {"type": "fbcache", "residual_threshold": INF,
                                                         "warmup_steps": 2}),
                                        ("move it left", {"type": "fbcache", "residual_threshold": INF,
                                                          "warmup_steps": 1, "steps_mask": [4], "taylorseer": 1})])]
    eng = Engine(EngineConfig(model="tiny-edit", device="cpu", max_num_seqs=2))
    try:
        batched = run(eng, reqs)
        assert eng.batch_sizes.get(2, 0) == 6
        alone = [run(eng, [r])[0] for r in reqs]
    finally:
        eng.shutdown()
    assert [o.stats.cached_steps for o in batched] == [4, 4]
    for b, a in zip(batched, alone):
        assert np.array_equal(b.image, a.image)
