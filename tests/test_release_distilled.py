"""Distilled checkpoints (the `<guidance>` token path) against upstream's code, by numbers (issue 13).

tests/fixtures/release_distilled_tiny.{safetensors,json}: upstream's Instruct-Distil model code
(`HunyuanImage3ForCausalMM` with `cfg_distilled=True`, from the fork suryatmodulus/HunyuanImage-3.0@1ea1526;
the official release has no distilled code) with seeded weights (tiny: 2 layers, 4 experts top-2 + shared
expert, the ResBlock image path, the guidance embedder), run for the first step of a one-row text-to-image
request on CPU in float32 at two guidance scales: its token ids, RoPE positions, guidance values and
velocities. `tools/make_distilled_fixture.py --reference CHECKOUT` regenerates them.

Here the same weights are written as a release-format folder (the fork's config.json: `cfg_distilled`),
loaded by ditkv's loader, and ditkv's first step (dense and paged) must give upstream's velocity; a wrong
guidance rule must not. Last, a tiny distilled model generates an image end to end with one row per step.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_release_transformer import BS, _write_release_folder, seeded_weights

import ditkv.models.hunyuan.model as hunyuan_model
from ditkv.attention.torch_backend import TorchBackend
from ditkv.config import EngineConfig
from ditkv.core.metadata import DiffusionKVMetadata, RowMetadata
from ditkv.engine.engine import Engine
from ditkv.engine.types import GenerationRequest
from ditkv.errors import LayoutError
from ditkv.models.hunyuan import (ByteTokenizer, HunyuanImage3Config, HunyuanImage3Model, PixelCodec,
                                  build_request_layout)
from ditkv.models.hunyuan.model import guidance_value
from ditkv.models.loader import load_model
from ditkv.worker.dit_runner import DiTRunner
from ditkv.worker.page_pool import PagePool
from ditkv.worker.rows import PREFILL, WorkerRows

HERE = Path(__file__).parent / "fixtures"  # tracked in git: a missing fixture fails, never skips
TOL = 1e-5  # fp32, relative to the largest velocity


@pytest.fixture(scope="module")
def release():
    data = load_file(HERE / "release_distilled_tiny.safetensors")
    meta = json.loads((HERE / "release_distilled_tiny.json").read_text())
    return data, meta


@pytest.fixture(scope="module")
def loaded(release, tmp_path_factory):
    data, meta = release
    state = seeded_weights({k: tuple(v) for k, v in meta["weight_shapes"].items()})
    folder = _write_release_folder(tmp_path_factory.mktemp("distilled_ckpt"), meta["config"], state)
    model, tok, _ = load_model(str(folder), torch.device("cpu"), torch.float32)
    req = meta["request"]
    layout = build_request_layout(model.config, tok, req["prompt"], req["height"], req["width"],
                                  req["guidance_scale"])
    return model, layout


def _first_step(model, layout, x, t, guidance, paged: bool) -> torch.Tensor:
    """ditkv's step-0 velocity [R, C, h, w] through `DiTRunner.forward_step` (prefill of the whole row)."""
    if paged:
        c = model.config
        blocks = sum(-(-r.seq_len // BS) for r in layout.rows) + 3
        pool = PagePool(blocks, c.num_hidden_layers, c.num_key_value_heads, BS, c.attention_head_dim)
        rows, metas, nxt = WorkerRows(blocks, BS, 2), [], 3  # a few leading blocks left unused
        for i, r in enumerate(layout.rows):
            nb = -(-r.seq_len // BS)
            metas.append(RowMetadata(i, r.prefix_len, r.target_len, r.seq_len, r.full_attn_spans,
                                     tuple(range(nxt, nxt + nb))))
            nxt += nb
        rows.install(DiffusionKVMetadata("r", 1, BS, tuple(metas)))
        runner, cache = DiTRunner(model, TorchBackend(), pool, rows), None
    else:
        runner = DiTRunner(model, paged=False)
        cache = runner.new_dense_cache(layout)
    with torch.inference_mode():
        v, n = runner.forward_step("r", layout, x, t, PREFILL, True, cache, guidance=guidance)
    assert n == sum(r.seq_len for r in layout.rows)
    return v


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_config_and_parameters_are_the_distilled_ones(loaded, release):
    """`cfg_distilled` (the fork's spelling) turns the guidance token on; `guidance_emb.*` loads."""
    model, _ = loaded
    assert release[1]["config"]["cfg_distilled"] is True and model.config.use_guidance_token
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert shapes == release[1]["weight_shapes"]
    assert any(k.startswith("guidance_emb.") for k in shapes)


def test_layout_is_one_row_with_guidance_after_timestep(loaded, release):
    _, layout = loaded
    data, meta = release
    assert len(layout.rows) == 1 and layout.cfg_factor == 1  # no CFG branch, even at guidance 5
    (row,) = layout.rows
    assert row.token_ids.tolist() == data["token_ids"][0].tolist()
    assert row.pos_y.tolist() == data["pos"][0, :, 0].tolist()
    assert row.pos_x.tolist() == data["pos"][0, :, 1].tolist()
    assert (row.timestep_index, row.guidance_index) == (meta["timestep_index"], meta["guidance_index"])
    assert [list(s) for s in row.full_attn_spans] == [meta["image_span"]]
    assert row.target_len == 2 + layout.num_image_tokens  # <timestep> <guidance> + image: rewritten every step


def test_guidance_value_is_1000x_scale_in_bfloat16(release):
    data, meta = release
    req = meta["request"]
    got = torch.cat([guidance_value(req["guidance_scale"]), guidance_value(req["guidance_scale_2"])])
    assert got.tolist() == data["guidance"].tolist() == [4992.0, 2496.0]  # not 5000 / 2500: bf16
    assert guidance_value(1.0).item() == 1000.0 and guidance_value(0.0).item() == 0.0  # <= 1: embedded as is
    with pytest.raises(LayoutError, match="guidance_scale"):
        guidance_value(1e39)


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_first_step_velocity_equals_upstream(loaded, release, paged):
    model, layout = loaded
    data, meta = release
    req = meta["request"]
    for scale, key in ((req["guidance_scale"], "velocity"), (req["guidance_scale_2"], "velocity_2")):
        v = _first_step(model, layout, data["latents"], data["timestep"], scale, paged)
        want = data[key]
        assert v.shape == want.shape and v.dtype == torch.float32
        assert _rel(v, want) <= TOL, f"{key}: max abs {(v - want).abs().max().item():.3g}, rel {_rel(v, want):.3g}"
    assert _rel(data["velocity"], data["velocity_2"]) > 100 * TOL  # the guidance value reaches the image


WRONG = {
    "scale, not 1000 x scale": lambda s: torch.tensor([float(s)]),
    "100 x scale": lambda s: torch.tensor([100.0 * s]),
    "1000 x scale without the bf16 rounding": lambda s: torch.tensor([1000.0 * s]),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_a_wrong_guidance_rule_misses_upstream_by_far(loaded, release, monkeypatch, name):
    model, layout = loaded
    data, meta = release
    monkeypatch.setattr(hunyuan_model, "guidance_value", WRONG[name])  # what the family's guidance_value calls
    v = _first_step(model, layout, data["latents"], data["timestep"], meta["request"]["guidance_scale"], False)
    assert _rel(v, data["velocity"]) > 100 * TOL, name


def test_guidance_through_the_timestep_embedder_misses_upstream(loaded, release, monkeypatch):
    """Upstream's guidance_emb is its own TimestepEmbedder, not timestep_emb."""
    model, layout = loaded
    data, meta = release
    monkeypatch.setattr(model, "guidance_token", model.timestep_token)
    v = _first_step(model, layout, data["latents"], data["timestep"], meta["request"]["guidance_scale"], False)
    assert _rel(v, data["velocity"]) > 100 * TOL


def _distilled_bundle():
    cfg = HunyuanImage3Config.tiny().replace(use_guidance_token=True)
    model = HunyuanImage3Model.from_config(cfg, seed=3, zero_init_resblocks=False).eval()
    return model, ByteTokenizer(), PixelCodec(cfg.image_token_downsample)


@pytest.mark.parametrize("mode", ["dense_legacy", "paged_scheduler", "batched"])
def test_distilled_generate_runs_one_row_per_step(mode):
    """End to end through the engine: one row (no CFG branch) every step, the guidance embedded every
    step, an image out; the guidance scale changes the image; every execution path gives the same one."""
    model, tok, codec = _distilled_bundle()
    calls = []
    model.guidance_emb.register_forward_hook(lambda mod, args, out: calls.append(tuple(args[0].shape)))
    paged = {"diffusion_kv_mode": "paged_scheduler", "diffusion_kv_max_rows_per_request": 1}  # one row fits
    kw = {"dense_legacy": {"diffusion_kv_mode": "dense_legacy"}, "paged_scheduler": paged,
          "batched": dict(paged, max_num_seqs=2)}[mode]
    engine = Engine(EngineConfig(**kw, device="cpu", dtype="float32"), model_bundle=(model, tok, codec))
    calls.clear()  # the paged engine's start-up step (sizing) embeds the default guidance once
    steps = 3
    outs = [engine.generate(GenerationRequest(prompt="a red circle", steps=steps, guidance_scale=g, seed=0))
            for g in (4.0, 1.0)]
    for o in outs:
        assert o.ok, o.error
        assert o.image.shape == (64, 64, 3) and o.image.dtype == np.uint8
        assert o.stats.steps == steps
    assert calls == [(1,)] * (2 * steps)  # one row per step, guidance embedded each step
    layout = build_request_layout(model.config, tok, "a red circle", 64, 64, 4.0)
    (row,) = layout.rows
    # one row's tokens: the whole row at step 0, then its target (<timestep> <guidance> + image) per step
    assert outs[0].stats.tokens_computed == row.seq_len + (steps - 1) * row.target_len
    assert np.abs(outs[0].image.astype(int) - outs[1].image.astype(int)).max() > 0  # guidance matters
    ref = _reference_images()
    for o, r in zip(outs, ref):
        assert np.abs(o.image.astype(int) - r.astype(int)).max() <= 1


_REF: list = []


def _reference_images():
    """The request loop on a dense runner, once per test session (the other modes must agree)."""
    if not _REF:
        model, tok, codec = _distilled_bundle()
        engine = Engine(EngineConfig(diffusion_kv_mode="dense_legacy", device="cpu", dtype="float32"),
                        model_bundle=(model, tok, codec))
        _REF.extend(engine.generate(GenerationRequest(prompt="a red circle", steps=3, guidance_scale=g, seed=0)).image
                    for g in (4.0, 1.0))
    return _REF
