"""The tiny model edits (issue 16 item 2): the edit data split, training rows == engine rows for an
edit request, and the shipped weights editing held-out pairs through the real engine on CPU."""

import numpy as np
import pytest
import torch

from ditkv.config import EngineConfig
from ditkv.data import (EDIT_ATTRIBUTES, EditDataset, all_edit_pairs, all_edits, check, edits_for,
                        heldout_edits, heldout_specs, parse_instruction, render_pair, train_edits)
from ditkv.engine.engine import Engine
from ditkv.engine.types import GenerationRequest
from ditkv.models.hunyuan import ByteTokenizer, HunyuanImage3Config, HunyuanImage3Model, PixelCodec
from ditkv.models.hunyuan.layout import build_request_layout
from ditkv.train.batch import build_row_table, predict_velocity, sample_dense
from ditkv.train.edit import EDIT_CONFIG, cond_pixels, edit_rows
from ditkv.train.quality_check import generate_images, load_bundle


# ------------------------------------------------------------------------------ data
def test_instruction_grammar():
    assert len(all_edits()) == 20 and len(all_edit_pairs()) == 480 * 16
    for e in all_edits():
        assert parse_instruction(e.instruction) == e
    with pytest.raises(ValueError, match="edit grammar"):
        parse_instruction("make it bigger")
    p = next(p for p in all_edit_pairs() if p.instruction == "move it to the top left")
    assert p.target.position == "top left"
    assert all(getattr(p.target, f) == getattr(p.source, f) for f in EDIT_ATTRIBUTES if f != "position")
    assert all(len(edits_for(s)) == 16 for s in {p.source for p in all_edit_pairs()})


def test_split_never_overlaps_and_holds_out_combinations():
    held, train = heldout_edits(), train_edits()
    assert len(held) == 474  # seed 0; pinned so a change of the split is noticed
    assert not set(held) & set(train)
    assert heldout_edits(0) == held and heldout_edits(1) != held  # deterministic in the seed
    # unseen combinations: every held-out source and instruction occurs in training, never together
    train_sources, train_instr = {p.source for p in train}, {p.instruction for p in train}
    t2i_held = set(heldout_specs())
    for p in held:
        assert p.instruction in train_instr
        assert p.source in train_sources or p.source in t2i_held
    # the text-to-image held-out combinations stay unseen, as sources and as targets
    assert not any(p.source in t2i_held or p.target in t2i_held for p in train)
    # the training sampler draws only training pairs, deterministically
    a, b = EditDataset(3, 64), EditDataset(3, 64)
    seen = {a.pair(i)[0] for i in range(64)}
    assert seen <= set(train) and {p.attribute for p in seen} == set(EDIT_ATTRIBUTES)
    for i in (0, 17):
        pa, sa, ta = a.sample(i)
        pb, sb, tb = b.sample(i)
        assert pa == pb and np.array_equal(sa, sb) and np.array_equal(ta, tb)
    # source and target share the jitter: a colour edit keeps every pixel's coverage
    p = next(p for p in held if p.attribute == "color")
    src, tgt = render_pair(p, 64, 5)
    assert np.array_equal(src.max(-1) > 0, tgt.max(-1) > 0)


# ------------------------------------------------------------------ training == engine
def _edit_model(seed=1):
    cfg = HunyuanImage3Config.tiny().replace(num_hidden_layers=2, **EDIT_CONFIG)
    model = HunyuanImage3Model.from_config(cfg, seed=seed, zero_init_resblocks=False).eval()
    return model, ByteTokenizer(), PixelCodec(cfg.image_token_downsample)


def test_training_rows_are_the_engine_rows_of_an_edit_request():
    model, tok, codec = _edit_model()
    cfg = model.config
    table, n = edit_rows(cfg, tok)
    pair = heldout_edits()[3]
    src, _ = render_pair(pair, 64, 0)
    lay = build_request_layout(cfg, tok, pair.instruction, 64, 64, cfg.default_guidance, images=[src])
    ref = build_row_table(list(lay.rows), lay.h, lay.w, cfg.pad_token_id, images=[lay.images] * 2)
    i = all_edits().index(pair.edit)
    rows = table.take(torch.tensor([i, i + n]))
    length = lay.rows[0].seq_len
    for name in ("ids", "pos_y", "pos_x", "key_limit"):
        assert torch.equal(getattr(rows, name)[:, :length], getattr(ref, name)), name
    for name in ("ts_index", "img_index", "cond_ts_index", "cond_img_index"):
        assert torch.equal(getattr(rows, name), getattr(ref, name)), name
    # the training pixels are bit-identical to what the engine encodes
    u8 = torch.from_numpy(src)[None]
    assert torch.equal(cond_pixels(u8), lay.images[0].vae_pixels)
    cond = codec.encode(cond_pixels(u8))[:, None].expand(2, -1, -1, -1, -1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, cfg.latent_channels, 16, 16, generator=g)
    t = torch.full((2,), 700.0)
    with torch.no_grad():
        v_train = predict_velocity(model, rows, x, t, cond)
        v_ref = predict_velocity(model, ref, x, t, codec.encode_sample(lay.images[0].vae_pixels)[None].expand(2, -1, -1, -1, -1))
    assert torch.equal(v_train, v_ref)


def test_training_path_matches_engine_edit_generation():
    """Padded, batched edit rows (training path) == the engine's dense and paged generation."""
    bundle = _edit_model()
    pairs = [heldout_edits()[0], heldout_edits()[40]]  # instructions of different lengths
    srcs = [render_pair(p, 64, i)[0] for i, p in enumerate(pairs)]
    caps = [p.instruction for p in pairs]
    assert len(caps[0]) != len(caps[1])
    x = sample_dense(bundle[0], bundle[1], caps, 3, 4.0, [0, 1], images=[[s] for s in srcs], codec=bundle[2])
    mine = ((bundle[2].decode(x).clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    for mode in ("dense_legacy", "paged_scheduler"):
        kw = {"diffusion_kv_max_rows_per_request": 2, "num_kv_blocks": 64} if mode == "paged_scheduler" else {}
        engine = Engine(EngineConfig(diffusion_kv_mode=mode, **kw), model_bundle=bundle)
        try:
            for i, (c, s) in enumerate(zip(caps, srcs)):
                out = engine.generate(GenerationRequest(prompt=c, steps=3, guidance_scale=4.0, seed=i, images=[s]))
                assert out.ok, out.error
                assert np.abs(out.image.astype(int) - mine[i].astype(int)).max() <= 1, mode
        finally:
            engine.shutdown()
    # the input image reaches the prediction
    y = sample_dense(bundle[0], bundle[1], caps, 3, 4.0, [0, 1], images=[[srcs[1]], [srcs[0]]], codec=bundle[2])
    assert (y - x).abs().max() > 1e-3


# ---------------------------------------------------------------- the shipped weights
# held-out pairs (never trained on), one per edit kind
EDIT_CASES = [
    ("a large red square in the top right", "make it green"),
    ("a large red triangle in the center", "move it to the bottom left"),
    ("a large yellow cross in the top right", "make it a triangle"),
    ("a large orange square in the top left", "make it medium"),
]


def test_shipped_tiny_model_edits_held_out_pairs():
    bundle = load_bundle("tiny-edit")
    cfg = bundle[0].config
    assert cfg.max_input_images == 1 and cfg.cond_image_type == "vae"
    held = {(p.source.caption(), p.instruction): (i, p) for i, p in enumerate(heldout_edits())}
    ds = EditDataset(0, None, 64, holdout=True)
    cases = [held[c] for c in EDIT_CASES]  # KeyError = no longer held out
    srcs = [ds.sample(i)[1] for i, _ in cases]
    images = generate_images(bundle, "dense_legacy", [p.instruction for _, p in cases], [i for i, _ in cases],
                             input_images=[[s] for s in srcs])
    results = [check(im, p.target) for im, (_, p) in zip(images, cases)]
    for (_, p), r in zip(cases, results):
        assert r[f"{p.attribute}_ok"], (p.source.caption(), p.instruction, r["predicted"])
    assert sum(not r["all_ok"] for r in results) <= 1, [r["predicted"] for r in results]


def test_train_tiny_edit_smoke(tmp_path):
    """Two CPU steps from the shipped weights: finite losses, a loadable checkpoint that takes images."""
    import argparse

    from ditkv.models.hunyuan import load_checkpoint
    from ditkv.train.edit import add_arguments, train

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--out", str(tmp_path / "e"), "--device", "cpu", "--steps", "2", "--edit-rows", "2",
                         "--t2i-rows", "1", "--edit-pool", "4", "--t2i-pool", "4", "--workers", "1", "--no-eval",
                         "--log-every", "1", "--warmup", "1"])
    res = train(args)
    assert all(np.isfinite(h["loss_edit"]) and np.isfinite(h["loss_t2i"]) for h in res["history"])
    model = load_checkpoint(tmp_path / "e", dtype=torch.float32)
    assert model.config.max_input_images == 1 and model.config.cond_image_type == "vae"


def test_tiny_edit_is_a_bundled_model_name_for_every_executor_front_end():
    """`--model tiny-edit` resolves to the bundled editing checkpoint in the engine process's front end
    (the multi-process executor reads the config there) as in `load_model`."""
    from ditkv.engine.executor import load_frontend
    from ditkv.errors import ConfigError

    cfg, _ = load_frontend(EngineConfig(model="tiny-edit", device="cpu"), None)
    assert cfg.max_input_images == 1 and cfg.cond_image_type == "vae"
    assert load_frontend(EngineConfig(model="tiny", device="cpu"), None)[0].max_input_images == 0
    with pytest.raises(ConfigError, match="'tiny-edit'"):
        load_frontend(EngineConfig(model="/no/such/folder", device="cpu"), None)


@pytest.mark.parametrize("edit", [False, True], ids=["captions", "edits"])
def test_bench_quality_command_line_scores_both_kinds(edit, capsys):
    import argparse
    import json

    from ditkv.bench.quality import add_arguments, run

    p = argparse.ArgumentParser()
    add_arguments(p)
    result = run(p.parse_args(["--limit", "1", "--seeds", "1", "--json"] + (["--edit"] if edit else [])))
    printed = json.loads(capsys.readouterr().out)
    assert printed["model"] == ("tiny-edit" if edit else "tiny") == result["model"]
    assert set(printed["modes"]) == {"paged_scheduler", "dense_legacy"}
