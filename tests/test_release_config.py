"""Release config.json keys are honoured or refused by name (issue 13 item 6).

Every key of the release config class (hunyuan_image_3/configuration_hunyuan.py of
Tencent-Hunyuan/HunyuanImage-3.0) is a ditkv field, an alias of one, a behaviour flag checked at the
value ditkv implements, read here, read elsewhere in ditkv, or listed as deliberately unused with a
reason. A value ditkv does not implement is a ConfigError naming the key.
"""

import json
from pathlib import Path

import pytest

from ditkv.errors import ConfigError
from ditkv.models.hunyuan import HunyuanImage3Config
from ditkv.models.hunyuan import config as C
from ditkv.models.hunyuan.layout import image_grid

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = json.loads((ROOT / "tests" / "fixtures" / "release_transformer_tiny.json").read_text())["config"]

# The keyword parameters of the release `HunyuanImage3Config.__init__` (configuration_hunyuan.py), plus the
# bookkeeping keys transformers writes into a config.json.
RELEASE_CLASS_KEYS = (
    "vocab_size hidden_size intermediate_size moe_intermediate_size num_hidden_layers num_attention_heads "
    "num_key_value_heads attention_head_dim hidden_act max_position_embeddings initializer_range rms_norm_eps "
    "use_cache pad_token_id bos_token_id eos_token_id eod_token_id im_start_id im_end_id text_start_id "
    "text_end_id image_token_id video_start_id video_end_id im_newline_id mask_init_id pretraining_tp "
    "tie_word_embeddings rope_theta rope_scaling attention_bias mlp_bias attention_dropout use_qk_norm "
    "use_rotary_pos_emb use_cla cla_share_factor norm_type num_experts use_mixed_mlp_moe num_shared_expert "
    "moe_topk capacity_factor moe_drop_tokens moe_random_routing_dropped_token use_mla kv_lora_rank "
    "q_lora_rank qk_rope_head_dim v_head_dim qk_nope_head_dim moe_layer_num_skipped norm_topk_prob "
    "routed_scaling_factor group_limited_greedy n_group topk_group add_classification_head class_num "
    "pool_type pad_id moe_impl vae_downsample_factor img_proj_type patch_size patch_embed_hidden_dim "
    "image_base_size vae vit vit_processor vit_aligner dense_list "
    "model_type architectures auto_map transformers_version torch_dtype dtype"
).split()


def handling(key: str) -> str:
    fields = {f for f in HunyuanImage3Config.__dataclass_fields__} - {"extra"}
    tables = [("field", fields), ("alias", C._ALIASES), ("flag", C.BEHAVIOUR_FLAGS),
              ("flag", C.BEHAVIOUR_CHOICES), ("read here", C.READ_HERE), ("read elsewhere", C.READ_ELSEWHERE),
              ("unused", C.RELEASE_UNUSED)]
    found = [name for name, table in tables if key in table]
    assert len(found) <= 1, f"{key} is in more than one table: {found}"
    return found[0] if found else "unknown"


def tiny(**changes):
    return {**HunyuanImage3Config.tiny().to_dict(), **changes}


def release(**changes):
    """The release-spelled fixture config (made by the release config class), changed."""
    out = json.loads(json.dumps(FIXTURE))
    for k, v in changes.items():
        if v is _DROP:
            out.pop(k, None)
        else:
            out[k] = v
    return out


_DROP = object()


def refused(data, *names):
    with pytest.raises(ConfigError) as e:
        HunyuanImage3Config.from_dict(data)
    for name in names:
        assert name in str(e.value), f"{name!r} not named in: {e.value}"
    return e.value


# ------------------------------------------------------------------ every key is handled, once
@pytest.mark.parametrize("key", RELEASE_CLASS_KEYS)
def test_every_release_config_key_is_read_checked_or_unused_with_a_reason(key):
    assert handling(key) != "unknown"
    if key in C.RELEASE_UNUSED:
        assert len(C.RELEASE_UNUSED[key]) > 20  # a reason, not a placeholder


def test_every_key_of_the_release_spelled_fixture_is_handled_and_it_loads():
    assert [k for k in FIXTURE if handling(k) == "unknown"] == []
    cfg = HunyuanImage3Config.from_dict(FIXTURE)
    assert (cfg.image_token_downsample, cfg.latent_channels, cfg.attention_head_dim) == (16, 8, 16)
    assert (cfg.pad_token_id, cfg.img_token_id, cfg.torch_dtype) == (256, 261, "float32")
    assert cfg.extra["eod_token_id"] == 3 and cfg.extra["vit"] is None  # unused keys round-trip
    again = HunyuanImage3Config.from_dict(cfg.to_dict())
    assert again == cfg


def test_the_bundled_tiny_config_still_loads():
    cfg = HunyuanImage3Config.from_json_file(ROOT / "ditkv" / "assets" / "tiny" / "config.json")
    assert cfg.image_token_downsample == 4 and cfg.codec == "pixel" and cfg.extra == {}


def test_a_key_outside_every_table_is_kept_in_extra_unread():
    cfg = HunyuanImage3Config.from_dict(tiny(some_future_key=[1, 2]))
    assert handling("some_future_key") == "unknown" and cfg.extra["some_future_key"] == [1, 2]
    assert cfg.to_dict()["some_future_key"] == [1, 2]


# ------------------------------------------------------------------ behaviour flags
NEW_FLAGS = [("patch_size", 2), ("patch_size", 8), ("patch_size", True), ("img_proj_type", "linear"),
             ("hidden_act", "gelu"), ("use_rotary_pos_emb", False), ("add_classification_head", True),
             ("tie_word_embeddings", True), ("use_meanflow", True)]


@pytest.mark.parametrize("key, bad", NEW_FLAGS)
def test_flag_loads_at_the_implemented_value_and_is_refused_by_name_otherwise(key, bad):
    want = C.BEHAVIOUR_FLAGS[key][0]
    assert HunyuanImage3Config.from_dict(tiny(**{key: want})).extra[key] == want
    assert HunyuanImage3Config.from_dict(release(**{key: want})).extra[key] == want
    err = refused(tiny(**{key: bad}), f"invalid {key}=", json.dumps(want))
    assert err.field == key


def test_every_behaviour_flag_is_refused_at_another_value():
    for key, (want, _) in C.BEHAVIOUR_FLAGS.items():
        bad = (not want) if isinstance(want, bool) else ("other" if isinstance(want, str) else want + 1)
        assert refused(tiny(**{key: bad}), key).field == key


@pytest.mark.parametrize("value", ["hf_rms", "rms"])
def test_norm_type_accepts_both_rms_spellings(value):
    assert HunyuanImage3Config.from_dict(tiny(norm_type=value)).extra["norm_type"] == value


@pytest.mark.parametrize("value", ["fused", "torch_nn", None, 1])
def test_norm_type_layernorm_is_refused(value):
    assert refused(tiny(norm_type=value), "invalid norm_type=").field == "norm_type"


@pytest.mark.parametrize("value", [None, {"type": "custom"}, {"type": "custom", "factor": 1.0, "alpha": 1.0}])
def test_rope_scaling_custom_loads(value):
    HunyuanImage3Config.from_dict(tiny(rope_scaling=value))


@pytest.mark.parametrize("value", [{"type": "linear", "factor": 2.0}, {"type": "dynamic"}, {}, "custom"])
def test_rope_scaling_other_types_are_refused(value):
    assert refused(tiny(rope_scaling=value), "invalid rope_scaling=", "custom").field == "rope_scaling"


# ------------------------------------------------------------------ image geometry: patch_size, vae_downsample_factor
def test_vae_downsample_factor_sets_the_latent_cell():
    cfg = HunyuanImage3Config.from_dict(release(vae_downsample_factor=[8, 8], vae={"latent_channels": 8,
                                                                                     "ffactor_spatial": 8}))
    assert cfg.image_token_downsample == 8
    assert image_grid(288, 224, cfg.image_token_downsample) == (36, 28)  # the layout's token grid follows
    assert "vae_downsample_factor" not in cfg.extra  # the field carries it: no stale copy after replace()
    assert HunyuanImage3Config.from_dict(cfg.to_dict()) == cfg
    # the release value: 16 px per cell, as ditkv assumed
    assert HunyuanImage3Config.from_dict(release()).image_token_downsample == 16


def test_vae_downsample_factor_equal_to_image_token_downsample_loads():
    cfg = HunyuanImage3Config.from_dict(release(image_token_downsample=16))
    assert cfg.image_token_downsample == 16


@pytest.mark.parametrize("value, words", [([16, 8], "square"), ([8, 16], "square"), ([16], "[h, w]"),
                                          ([0, 0], "positive"), (["16", "16"], "positive"),
                                          ([True, True], "positive"), (16, "[h, w]"), (None, "[h, w]")])
def test_vae_downsample_factor_ditkv_cannot_take_is_refused(value, words):
    err = refused(release(vae_downsample_factor=value), "invalid vae_downsample_factor=", words)
    assert err.field == "vae_downsample_factor"


def test_vae_downsample_factor_conflicting_with_image_token_downsample_names_both():
    err = refused(release(image_token_downsample=8, vae={"latent_channels": 8, "ffactor_spatial": 8}),
                  "vae_downsample_factor", "image_token_downsample=8")
    assert err.field == "vae_downsample_factor"


def test_vae_section_must_match_vae_downsample_factor():
    err = refused(release(vae_downsample_factor=[8, 8]), "vae.ffactor_spatial", "vae_downsample_factor=[8, 8]")
    assert err.field == "vae.ffactor_spatial"
    # without vae_downsample_factor the VAE is checked against image_token_downsample
    refused(release(vae_downsample_factor=_DROP, image_token_downsample=8), "vae.ffactor_spatial",
            "image_token_downsample=8")
    assert HunyuanImage3Config.from_dict(release(vae_downsample_factor=_DROP)).image_token_downsample == 16
    refused(tiny(vae={"ffactor_spatial": 16}), "vae.ffactor_spatial", "image_token_downsample")
    assert HunyuanImage3Config.from_dict(tiny(vae={"ffactor_spatial": 4})).extra["vae"] == {"ffactor_spatial": 4}


def test_vae_latent_channels_conflicting_with_latent_channels_names_both():
    err = refused(release(latent_channels=16), "vae.latent_channels", "latent_channels=16")
    assert err.field == "vae.latent_channels"
    assert HunyuanImage3Config.from_dict(release(latent_channels=8)).latent_channels == 8


# ------------------------------------------------------------------ aliases: precedence and conflicts
@pytest.mark.parametrize("alias, field, a, b", [
    ("pad_id", "pad_token_id", 5, 256),
    ("image_token_id", "img_token_id", 8, 261),
    ("head_dim", "attention_head_dim", 32, 16),
    ("dtype", "torch_dtype", "bfloat16", "float32"),
    ("cfg_distilled", "use_guidance_token", True, False),
])
def test_alias_conflicting_with_its_field_names_both_keys_in_either_order(alias, field, a, b):
    base = {k: v for k, v in FIXTURE.items() if k not in (alias, field)}
    for data in ({**base, alias: a, field: b}, {field: b, alias: a, **base}):
        err = refused(data, alias, field)
        assert err.field == alias
    # agreeing spellings load
    assert getattr(HunyuanImage3Config.from_dict({**base, alias: b, field: b}), field) == b


def test_release_class_defaults_do_not_misload_the_pad_id():
    # the release config class writes pad_id=-1 when unset; the release reads pad_token_id
    cfg = HunyuanImage3Config.from_dict(release(pad_id=-1))
    assert cfg.pad_token_id == 256 and "pad_id" not in cfg.extra
    cfg = HunyuanImage3Config.from_dict(release(pad_id=-1, pad_token_id=_DROP, vocab_size=133120))
    assert cfg.pad_token_id == HunyuanImage3Config.__dataclass_fields__["pad_token_id"].default
    # a pad_id that is a real id and disagrees is an error, never a silent pick
    refused(release(pad_id=8), "pad_id", "pad_token_id=256")


def test_alias_fills_its_field_when_the_field_key_is_absent():
    cfg = HunyuanImage3Config.from_dict(release(pad_token_id=_DROP, pad_id=300, image_token_id=262,
                                                attention_head_dim=_DROP, head_dim=16))
    assert (cfg.pad_token_id, cfg.img_token_id, cfg.attention_head_dim) == (300, 262, 16)


def test_cfg_distilled_is_the_guidance_token_variant():
    assert HunyuanImage3Config.from_dict(release(cfg_distilled=True)).use_guidance_token is True
    assert HunyuanImage3Config.from_dict(release(cfg_distilled=False)).use_guidance_token is False
    refused(release(cfg_distilled="yes"), "use_guidance_token")


def test_null_head_dim_and_kv_heads_derive_as_in_the_release():
    cfg = HunyuanImage3Config.from_dict(release(attention_head_dim=None, num_key_value_heads=None))
    assert cfg.attention_head_dim == 64 // 4 and cfg.num_key_value_heads == 4


def test_a_refused_flag_in_a_config_file_names_the_flag_and_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(release(patch_size=2)))
    with pytest.raises(ConfigError, match=r"invalid patch_size=2.*config\.json"):
        HunyuanImage3Config.from_json_file(path)


def test_one_expert_is_refused_the_release_runs_a_dense_mlp_there():
    from ditkv.errors import ConfigError
    from ditkv.models.hunyuan.config import HunyuanImage3Config

    with pytest.raises(ConfigError, match="num_experts.*dense MLP"):
        HunyuanImage3Config.tiny().replace(num_experts=1, moe_topk=1)
