"""The official release config.json files load, and a request runs on them (random weights, CPU).

Until this test existed the fixtures used ditkv-chosen keys (vocab 384, bos 0, cla_share_factor 1,
routed_scaling_factor 1.0, cond_token_attn_type "full"), which is how the official file's
`cla_share_factor: 2`, `routed_scaling_factor: false` and `cond_token_attn_type: "joint_full"` stayed
refused. Here every key keeps its official value except widths, layer and expert counts and the
vision / VAE sizes (tests/release_folders.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from release_folders import SPECIAL_IDS, official, shrunk, write_folder

from ditkv.errors import ConfigError
from ditkv.models.hunyuan import HunyuanImage3Config
from ditkv.models.hunyuan.checkpoint import load_model_config


def test_the_official_base_file_is_the_release_key_set():
    c = official("base")
    assert c["vocab_size"] == 133120 and c["cla_share_factor"] == 2 and c["routed_scaling_factor"] is False
    assert c["cond_token_attn_type"] == "joint_full" and c["use_cla"] is False and c["moe_topk"] == [8] * 32
    assert (c["bos_token_id"], c["eos_token_id"], c["pad_token_id"], c["image_token_id"]) == \
        (127958, 127957, 128009, 128006)
    assert "image_base_size" not in c and "timestep_token_id" not in c


@pytest.mark.parametrize("name", ["base", "instruct", "instruct_distil"])
def test_each_official_config_loads_at_full_size(name, tmp_path):
    """The unshrunk file, as config.json of a folder with a tokenizer.json: every key accepted."""
    (tmp_path / "config.json").write_text(__import__("json").dumps(official(name)))
    from release_folders import tokenizer_json

    (tmp_path / "tokenizer.json").write_text(tokenizer_json())
    cfg = load_model_config(tmp_path)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_experts, cfg.moe_topk) == \
        (133120, 4096, 32, 64, 8)
    assert cfg.image_base_size == 1024  # the release class's default: sizes snap to its buckets
    assert cfg.timestep_token_id == SPECIAL_IDS["<timestep>"] and cfg.cfg_token_id == SPECIAL_IDS["<cfg>"]
    assert cfg.img_ratio_token_id == SPECIAL_IDS["<img_ratio_0>"]
    assert cfg.max_input_images == 3 and cfg.cond_image_type == "vae_vit"
    assert cfg.use_guidance_token is (name == "instruct_distil")
    extra = None if name == "base" else SPECIAL_IDS["<img_ratio_33>"]  # the Instruct code's 4 extra buckets
    assert cfg.img_ratio_extra_token_id == extra


def test_without_tokenizer_json_the_special_ids_are_an_error_naming_the_file(tmp_path):
    (tmp_path / "config.json").write_text(__import__("json").dumps(official("base")))
    with pytest.raises(ConfigError, match="tokenizer.json") as err:
        load_model_config(tmp_path)
    assert "timestep_token_id" in str(err.value) and str(tmp_path) in str(err.value)
    spelled = dict(official("base"), timestep_token_id=128017, boi_token_id=128000, eoi_token_id=128001,
                   cfg_token_id=128002, img_size_token_id=128003, img_ratio_token_id=128050)
    (tmp_path / "config.json").write_text(__import__("json").dumps(spelled))
    assert load_model_config(tmp_path).cfg_token_id == 128002  # spelled out in config.json: loads


def test_a_small_vocabulary_resolves_ids_before_checking_them(tmp_path):
    """Placeholder ids (128017, ...) are never checked against a vocabulary that a tokenizer.json
    will fill: resolve first, then check."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    c = dict(official("base"), vocab_size=608, bos_token_id=300, eos_token_id=301, pad_token_id=302, pad_id=302,
             image_token_id=303)
    names = ["<boi>", "<eoi>", "<img>", "<timestep>", "<cfg>", "<img_size_1024>"] + [f"<img_ratio_{k}>"
                                                                                    for k in range(33)]
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({n: 400 + i for i, n in enumerate(names)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens(names)
    (tmp_path / "config.json").write_text(json.dumps(c))
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = load_model_config(tmp_path)
    assert cfg.timestep_token_id == 403 and cfg.img_ratio_token_id == 406 and cfg.vocab_size == 608
    vocab["<img_ratio_5>"] = 700  # past the vocabulary: still refused, after resolution
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens(names)
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ConfigError, match="img_ratio"):
        load_model_config(tmp_path)


@pytest.mark.parametrize("key, value, why", [("cond_token_attn_type", "causal", "joint_full"),
                                             ("cond_token_attn_type", "full_causal", "joint_full"),
                                             ("use_cla", True, "use_cla"), ("norm_topk_prob", False, "norm_topk_prob"),
                                             ("moe_topk", [1] * 32, "moe_topk")])
def test_values_that_change_the_computation_are_refused_by_name(key, value, why):
    with pytest.raises(ConfigError, match=why):
        HunyuanImage3Config.from_dict({**official("base"), **dict.fromkeys(
            ("timestep_token_id", "boi_token_id", "eoi_token_id", "cfg_token_id", "img_size_token_id"), 128000),
            "img_ratio_token_id": 128050, key: value})


def test_joint_full_with_latent_tokens_only_is_refused():
    """The release's prepare_full_attn_slices knows only 'full' and 'causal' for cond_image_type 'vae'."""
    with pytest.raises(ConfigError, match="cond_image_type='vae'"):
        HunyuanImage3Config.tiny().replace(max_input_images=1, cond_image_type="vae",
                                           cond_token_attn_type="joint_full")


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("official_base"), shrunk(official("base")))


@pytest.mark.slow  # the VAE decodes 1024 x 1024 at its smallest widths: about 25 s on 2 CPU cores
def test_text_to_image_runs_on_the_official_base_config(base_folder):
    """`ditkv generate` on the folder: a 1024 x 1024 request (the base size) in paged mode with CFG."""
    from ditkv.config import EngineConfig
    from ditkv.engine.engine import Engine
    from ditkv.engine.types import GenerationRequest

    e = Engine(EngineConfig(model=str(base_folder), device="cpu", dtype="float32", block_size=64,
                            num_kv_blocks=256, diffusion_kv_mode="paged_scheduler",
                            diffusion_kv_max_rows_per_request=2, profile_memory=False))
    try:
        out = e.generate(GenerationRequest(prompt="a red fox in the snow", height=1000, width=1000, steps=2,
                                           guidance_scale=4.0, seed=3))
        cfg = e.worker.runner.model.config
    finally:
        e.shutdown()
    assert out.ok, out.error
    assert out.image.shape == (1024, 1024, 3) and out.image.dtype == np.uint8  # snapped to the 1024 bucket
    assert (cfg.vocab_size, cfg.moe_topk, cfg.cond_token_attn_type) == (133120, 8, "joint_full")


def test_joint_full_spans_one_block_per_input_image(base_folder):
    """joint_full: each input image's latent tokens, <joint_img_sep> and vision tokens are one
    full-attention span (full: two spans, the separator causal)."""
    from ditkv.models.hunyuan import build_request_layout
    from ditkv.models.loader import load_model

    model, tok, _ = load_model(str(base_folder), torch.device("cpu"), torch.float32)
    img = np.random.default_rng(0).integers(0, 256, (96, 128, 3), dtype=np.uint8)
    joint = build_request_layout(model.config, tok, "make it blue", 1024, 1024, 4.0, images=[img, img])
    full = build_request_layout(model.config.replace(cond_token_attn_type="full"), tok, "make it blue", 1024, 1024,
                                4.0, images=[img, img])
    assert [r.token_ids.tolist() for r in joint.rows] == [r.token_ids.tolist() for r in full.rows]
    for im in joint.images:
        sep = im.vae_start + im.h * im.w
        assert joint.rows[0].token_ids[sep] == SPECIAL_IDS["<joint_img_sep>"]
        assert (im.vae_start, im.vit_start + im.vit_len) in joint.rows[0].full_attn_spans
        assert (im.vae_start, sep) in full.rows[0].full_attn_spans
        assert (im.vit_start, im.vit_start + im.vit_len) in full.rows[0].full_attn_spans
    assert len(joint.rows[0].full_attn_spans) == 3 and len(full.rows[0].full_attn_spans) == 5
