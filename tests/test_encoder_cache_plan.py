"""The encoder cache is on by default (issue 36): its entries are reserved in the startup memory plan
(`profiling.encoder_reserve`: the bound in images x the largest input image's embedding tokens), the bound
is tight (an image at the envelope's size fills exactly one entry's share), and the images it served are
counted per request (`RequestStats.encoder_cache_hits`), in `Engine.stats()` and on /metrics."""

from __future__ import annotations

import numpy as np
import torch

from ditkv.config import EngineConfig
from ditkv.engine import rank_setup
from ditkv.engine.profiling import encoder_reserve, residual_reserve
from ditkv.engine.sizing import CPU_MEMORY_ANALOGUE_BYTES
from ditkv.engine.types import GenerationRequest
from ditkv.models.family import family_of
from ditkv.models.hunyuan import HunyuanImage3Config
from ditkv.models.loader import param_bytes
from test_encoder_cache import PROMPTS, A, B, edit, engine, run, weights  # noqa: F401 - weights is a fixture

SIDE = 64  # the envelope of these engines: 64x64 pixels


def _cfg(**kw) -> EngineConfig:
    return EngineConfig(**{"model": "tiny-edit", "device": "cpu", "dtype": "float32", "block_size": 16,
                           "max_image_height": SIDE, "max_image_width": SIDE, "max_prompt_tokens": 64, **kw})


def test_the_encoder_cache_is_on_by_default_with_the_prefix_cache():
    assert EngineConfig().encoder_cache_images == 4
    assert EngineConfig(diffusion_kv_mode="dense_legacy").prefix_caching is False  # then no cache (worker.py)


def test_the_reserve_is_the_bound_times_the_largest_images_tokens(weights):
    model, _ = weights
    mc = model.config
    tokens = family_of(mc).input_image_tokens(mc, SIDE, SIDE)
    ds = mc.image_token_downsample
    vit = tokens - (SIDE // ds) ** 2
    assert vit >= 0 and (vit > 0) == (mc.cond_image_type == "vae_vit")
    got, why = encoder_reserve(_cfg(encoder_cache_images=3), mc, torch.float32)
    assert got == 3 * tokens * mc.hidden_size * 4 and "3 images" in why
    assert encoder_reserve(_cfg(encoder_cache_images=3), mc, torch.bfloat16)[0] == got // 2
    assert encoder_reserve(_cfg(encoder_cache_images=0), mc, torch.float32)[0] == 0
    assert encoder_reserve(_cfg(enable_prefix_caching=False), mc, torch.float32)[0] == 0
    assert encoder_reserve(_cfg(), HunyuanImage3Config.tiny(), torch.float32)[0] == 0  # takes no input images


def test_the_release_reserve_is_about_40_mib_an_image_in_bf16():
    """The release's largest input image: 4096 latent cells (the 1024^2 bucket; no other bucket or extra size
    has more) plus its vision tokens, 4096 wide."""
    from release_folders import official

    mc = HunyuanImage3Config.from_dict(official("instruct"))
    assert mc.max_input_images > 0 and mc.hidden_size == 4096
    tokens = family_of(mc).input_image_tokens(mc, 1024, 1024)
    assert 4096 < tokens <= 4096 + 1024
    got, _ = encoder_reserve(EngineConfig(encoder_cache_images=1), mc, torch.bfloat16)
    assert got == tokens * 4096 * 2 and 32 << 20 < got <= 40 << 20


def test_the_bound_is_tight_an_image_at_the_envelope_fills_one_share(weights):
    big = GenerationRequest(prompt=PROMPTS[0], request_id="big", height=SIDE, width=SIDE, steps=1, guidance_scale=2.0,
                            seed=5, images=[A])
    outs, cache = run(weights, [big], True)
    assert outs["big"][0].ok
    (vae, vit), = cache._entries.values()
    got = vae.nbytes + (0 if vit is None else vit.nbytes)
    share = encoder_reserve(_cfg(encoder_cache_images=1), weights[0].config, vae.dtype)[0]
    assert got == share


def test_the_pool_shrinks_by_exactly_the_reserve(weights):
    model, tok = weights
    bpb = rank_setup.kv_bytes_per_block(_cfg(), model.config, model.dtype)
    budget = int(CPU_MEMORY_ANALOGUE_BYTES * 0.9) - param_bytes(model)
    step = residual_reserve(_cfg(), model.config, tok, model.dtype).total
    for n in (0, 4, 9):
        enc = encoder_reserve(_cfg(encoder_cache_images=n), model.config, model.dtype)[0]
        assert (enc > 0) == (n > 0)
        assert rank_setup.plan_num_blocks(_cfg(encoder_cache_images=n), model, tok) == (budget - step - enc) // bpb


def test_each_request_counts_the_images_the_cache_served(weights):
    """Per request, in `Engine.stats()` and on /metrics; the multi-process executor's wire carries it too."""
    from ditkv.engine.outcome import rank_end
    from ditkv.entrypoints.metrics import TRANSFERS, _EngineCollector
    from ditkv.worker.batch import StepOutcome
    from ditkv.worker.denoising import RunStats
    from test_prefix_cache_images import Counting

    reqs = [edit(f"e{i}", p, [A, B]) for i, p in enumerate(PROMPTS[:3])]
    eng = engine(weights, Counting(True))
    try:
        outs = {r.request_id: eng.generate(r) for r in reqs}
        stats = eng.stats()
    finally:
        eng.shutdown()
    # e0 encodes both; later edits skip image 0 (inside the prefix-cache hit) and take image 1 from the cache
    assert [outs[r].stats.encoder_cache_hits for r in ("e0", "e1", "e2")] == [0, 1, 1]
    assert stats["encoder_cache_hits"] == 2
    got = {m.name: m.samples[0].value for m in _EngineCollector(lambda: stats, TRANSFERS).collect() if m.samples}
    assert got["ditkv_encoder_cache_hits"] == 2
    off, _ = run(weights, reqs, True, images=0)
    assert all(o.stats.encoder_cache_hits == 0 for o, _, _ in off.values())
    for rid in outs:
        assert np.array_equal(outs[rid].image, off[rid][0].image)
    wire = rank_end(StepOutcome("x", "ok", stats=RunStats(encoder_cache_hits=3)), 0, "peer")
    assert wire.stats.encoder_cache_hits == 3
