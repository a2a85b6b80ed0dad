"""The tiny trained model: training pieces agree with inference, and the shipped weights draw
what the caption says through the real engine (paged == dense)."""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ditkv.config import EngineConfig
from ditkv.data import check, parse_caption
from ditkv.engine.engine import Engine
from ditkv.engine.types import GenerationRequest
from ditkv.models.hunyuan import (ByteTokenizer, HunyuanImage3Config, HunyuanImage3Model, PixelCodec,
                                  euler_step, flow_sigmas, load_checkpoint)
from ditkv.models.loader import TINY_ASSET
from ditkv.train.batch import sample_dense
from ditkv.train.quality_check import compare_modes, generate_images, load_bundle
from ditkv.train.tiny import add_arguments, flow_pair, shifted_sigma, train

CAPTIONS = [
    "a large blue square",
    "a small red circle in the top left",
    "a medium green triangle in the bottom right",
    "a yellow cross",
    "a large purple circle in the top right",  # a held-out combination (never trained on)
    "an orange triangle",
]


# ------------------------------------------------------------------ training vs inference
def test_flow_target_sign_matches_the_sampler():
    """Integrating the training target with the sampler's Euler step from noise lands on x0."""
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(2, 48, 4, 4, generator=g), torch.randn(2, 48, 4, 4, generator=g)
    sig = flow_sigmas(8, 3.0)
    x = noise.clone()
    for i in range(8):
        x_t, v = flow_pair(x0, noise, sig[i].expand(2))
        assert torch.allclose(x, x_t, atol=1e-5)
        x = euler_step(x, v, sig[i], sig[i + 1])
    assert torch.allclose(x, x0, atol=1e-5)
    # training draws sigma with the same shift the sampler spaces its steps with
    u = torch.linspace(1, 0, 9)
    assert torch.allclose(shifted_sigma(u, 3.0), sig, atol=1e-6)


def test_training_rows_match_engine_generation():
    """Padded, batched full-row forward (training path) == engine dense generation."""
    cfg = HunyuanImage3Config.tiny()
    model = HunyuanImage3Model.from_config(cfg, seed=1, zero_init_resblocks=False).eval()
    bundle = (model, ByteTokenizer(), PixelCodec(cfg.image_token_downsample))
    caps = CAPTIONS[:2]  # different lengths: the shorter row is padded
    engine = Engine(EngineConfig(diffusion_kv_mode="dense_legacy"), model_bundle=bundle)
    ref = [engine.generate(GenerationRequest(prompt=c, steps=3, guidance_scale=4.0, seed=i)).image
           for i, c in enumerate(caps)]
    x = sample_dense(model, bundle[1], caps, 3, 4.0, [0, 1])
    img = bundle[2].decode(x).clamp(-1, 1)
    for i in range(2):
        u8 = ((img[i] + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()
        assert np.abs(u8.astype(int) - ref[i].astype(int)).max() <= 1


def test_train_smoke_is_deterministic_and_loadable(tmp_path):
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    outs = []
    for name in ("a", "b"):
        args = p.parse_args(["--out", str(tmp_path / name), "--device", "cpu", "--steps", "2",
                             "--batch-size", "2", "--pool-size", "16", "--workers", "1", "--no-eval",
                             "--log-every", "1", "--warmup", "1"])
        res = train(args)
        assert all(np.isfinite(h["loss"]) for h in res["history"])
        outs.append(load_file(str(tmp_path / name / "model-00001-of-00001.safetensors")))
    assert outs[0].keys() == outs[1].keys()
    assert all(torch.equal(outs[0][k], outs[1][k]) for k in outs[0])
    model = load_checkpoint(tmp_path / "a", dtype=torch.float32)
    assert model.dtype == torch.float32
    assert model.model.layers[0].mlp.gate.wg.weight.dtype == torch.float32


# ------------------------------------------------------------------------ shipped weights
shipped = pytest.mark.skipif(not (TINY_ASSET / "config.json").is_file(), reason="no shipped tiny weights")


@pytest.fixture(scope="module")
def shipped_images():
    bundle = load_bundle("tiny", "cpu")
    seeds = list(range(len(CAPTIONS)))
    return {mode: generate_images(bundle, mode, CAPTIONS, seeds)
            for mode in ("paged_scheduler", "dense_legacy")}


@shipped
def test_shipped_model_draws_the_captions(shipped_images):
    specs = [parse_caption(c) for c in CAPTIONS]
    results = [check(im, s) for im, s in zip(shipped_images["paged_scheduler"], specs)]
    n = len(CAPTIONS)
    for field in ("shape", "color", "size", "position"):
        ok = sum(r[f"{field}_ok"] for r in results)
        assert ok >= n - 1, f"{field}: {ok}/{n} correct; predicted {[r['predicted'] for r in results]}"
    assert sum(r["all_ok"] for r in results) >= n - 1, [r["predicted"] for r in results]
    assert results[0]["all_ok"], f"'a large blue square' drew {results[0]['predicted']}"


@shipped
def test_shipped_model_paged_equals_dense(shipped_images):
    specs = [parse_caption(c) for c in CAPTIONS]
    cmp = compare_modes(shipped_images["paged_scheduler"], shipped_images["dense_legacy"], specs)
    assert cmp["max_abs_pixel_diff"] <= 1 and cmp["same_verdicts"], cmp


@shipped
def test_shipped_checkpoint_is_small_bf16_loading_as_fp32():
    model = load_checkpoint(TINY_ASSET, dtype=torch.float32)
    assert model.dtype == torch.float32
    size = sum(f.stat().st_size for f in TINY_ASSET.glob("*.safetensors"))
    assert size < 8 * 2**20
