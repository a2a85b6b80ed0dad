"""The startup memory plan reserves the step cache's residual buffers (`profiling.residual_reserve`), and a
request's stored state (`RequestCache.nbytes`) never exceeds the per-request bound it reserves."""

from __future__ import annotations

import pytest
import torch

from ditkv.config import EngineConfig
from ditkv.engine import rank_setup
from ditkv.engine.engine import Engine
from ditkv.engine.profiling import residual_reserve
from ditkv.engine.sizing import CPU_MEMORY_ANALOGUE_BYTES, resolve_num_blocks
from ditkv.engine.types import GenerationRequest
from ditkv.errors import ConfigError
from ditkv.models.hunyuan import ByteTokenizer, HunyuanImage3Config, HunyuanImage3Model
from ditkv.models.hunyuan.codec import PixelCodec
from ditkv.models.loader import param_bytes
from ditkv.step_cache_config import state_bytes

CPU = torch.device("cpu")
INF = float("inf")


@pytest.fixture(scope="module")
def bundle():
    cfg = HunyuanImage3Config.tiny()
    model = HunyuanImage3Model.from_config(cfg, seed=1, zero_init_resblocks=False).eval()
    return model, ByteTokenizer(), PixelCodec(cfg.image_token_downsample)


def _cfg(**kw):
    return EngineConfig(**{"device": "cpu", "block_size": 16, "max_image_height": 64, "max_image_width": 64,
                           "max_prompt_tokens": 64, **kw})


def test_the_reserve_is_the_worst_request_times_max_num_seqs():
    tiny, tok = HunyuanImage3Config.tiny(), ByteTokenizer()
    r = residual_reserve(_cfg(max_num_seqs=3), tiny, tok, torch.float32)
    # 64x64 pixels at downsample 4: 16x16 latents; 2 CFG rows of <timestep> + 256 image tokens
    front, middle = 2 * 256 * tiny.hidden_size * 4, 2 * 257 * tiny.hidden_size * 4
    assert r.order == 2 and r.stored == front + 3 * middle == state_bytes(512, 514, tiny.hidden_size, 4, 2)
    assert r.working == front + middle and r.transient == max(3 * middle, 3 * front)
    assert r.total == 3 * (r.stored + r.working) + r.transient
    # the model dtype: bf16 halves every buffer; its fp64 metric copy is 4x a bf16 front residual
    half = residual_reserve(_cfg(max_num_seqs=3), tiny, tok, torch.bfloat16)
    assert (half.stored, half.working, half.transient) == (r.stored // 2, r.working // 2, 5 * front // 2)
    # every paged engine reserves (a request may bring a cache, CUDA graphs or not); a dense one caches nothing
    assert residual_reserve(_cfg(cuda_graphs="on"), tiny, tok, torch.float32) == \
        residual_reserve(_cfg(cache_config={"type": "fbcache"}), tiny, tok, torch.float32)
    assert residual_reserve(_cfg(diffusion_kv_mode="dense_legacy"), tiny, tok, torch.float32).total == 0


def test_resolve_num_blocks_takes_the_reserve_out_of_the_utilization_budget_only():
    cfg = _cfg(gpu_memory_utilization=0.5)
    base, _ = resolve_num_blocks(cfg, 1, CPU, 1000)
    n, why = resolve_num_blocks(cfg, 1, CPU, 1000, 123_457)
    # one-byte blocks: exact
    assert base - n == 123_457 and "123457 reserved bytes (step-cache residuals, encoder cache)" in why
    assert resolve_num_blocks(cfg, 1000, CPU, 1000, 123_457)[0] == \
        (int(CPU_MEMORY_ANALOGUE_BYTES * 0.5) - 1000 - 123_457) // 1000
    assert resolve_num_blocks(_cfg(num_kv_blocks=7), 1000, CPU, 0, 10**9)[0] == 7  # an explicit pool is as given
    assert resolve_num_blocks(_cfg(kv_cache_memory_bytes=10_500), 1000, CPU, 0, 10**9)[0] == 10
    with pytest.raises(ConfigError, match=r"reserved bytes \(step-cache residuals"):
        resolve_num_blocks(cfg, 1000, CPU, 1000, CPU_MEMORY_ANALOGUE_BYTES)


def test_the_pool_shrinks_by_exactly_the_reserve(bundle, caplog):
    model, tok, _ = bundle
    bpb = rank_setup.kv_bytes_per_block(_cfg(), model.config, model.dtype)
    budget = int(CPU_MEMORY_ANALOGUE_BYTES * 0.9) - param_bytes(model)
    with caplog.at_level("INFO", logger="ditkv.worker"):
        n = rank_setup.plan_num_blocks(_cfg(max_num_seqs=4), model, tok)
    one = residual_reserve(_cfg(), model.config, tok, model.dtype)
    reserve = residual_reserve(_cfg(max_num_seqs=4), model.config, tok, model.dtype).total
    assert reserve == one.total + 3 * (one.stored + one.working) > 0
    assert n == (budget - reserve) // bpb < budget // bpb
    assert rank_setup.plan_num_blocks(_cfg(), model, tok) == (budget - one.total) // bpb
    assert f"{reserve} bytes reserved = 4 requests" in caplog.text
    assert rank_setup.plan_num_blocks(_cfg(num_kv_blocks=9, max_num_seqs=4), model, tok) == 9  # as given


def _running_caches(eng):
    return [d.cache for d in eng.executor.stepper.running.values() if d.cache is not None]


@pytest.mark.parametrize("taylorseer", [None, 1, 2])
def test_a_request_never_holds_more_than_its_reserved_bound(bundle, taylorseer):
    """Envelope-sized CFG requests (the largest admitted) and a smaller one, computed and cached steps
    mixed (a mask with an infinite threshold): every step's nbytes stays at or under the bound, and the
    largest request reaches it once order + 1 steps have computed (the bound is tight)."""
    cfg = _cfg(num_kv_blocks=400, max_num_seqs=3)
    eng = Engine(cfg, model_bundle=bundle)
    reserve = residual_reserve(cfg, bundle[0].config, bundle[1], bundle[0].dtype)
    order = taylorseer or 0
    bound = state_bytes(512, 514, bundle[0].config.hidden_size, 4, order)
    assert bound <= reserve.stored
    cache = {"type": "fbcache", "residual_threshold": INF, "warmup_steps": 0, "steps_mask": [0, 2, 3, 6, 9],
             "taylorseer": taylorseer}
    for i, (side, guidance) in enumerate([(64, 2.0), (64, 3.0), (32, 1.0)]):
        eng.add_request(GenerationRequest(prompt="a red circle" * (i + 1), height=side, width=side, steps=10,
                                          guidance_scale=guidance, seed=i, request_id=f"r{i}", cache_config=cache))
    seen = []
    while eng.scheduler.has_work():
        eng.step()
        seen.extend(c.nbytes() for c in _running_caches(eng))
    eng.step()
    assert seen and max(seen) == bound and all(0 < b <= reserve.stored for b in seen)
