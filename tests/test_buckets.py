"""Resolution buckets and `<img_ratio_k>` against the release code's numbers.

tests/fixtures/release_buckets.json holds the release `ResolutionGroup(1024)` table and its
(bucket, ratio index) for a sweep of requested sizes; `tools/make_bucket_fixture.py --reference
CHECKOUT` regenerates it from a checkout of Tencent-Hunyuan/HunyuanImage-3.0.
"""

import dataclasses
import json
from pathlib import Path

import pytest

from ditkv.models.hunyuan import HunyuanImage3Config, buckets
from ditkv.models.hunyuan.layout import build_request_layout
from ditkv.models.hunyuan.tokenizer import ByteTokenizer

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "release_buckets.json").read_text())


def test_bucket_table_equals_the_release():
    assert [list(b) for b in buckets.bucket_table(FIXTURE["base_size"])] == FIXTURE["buckets"]
    assert len(FIXTURE["buckets"]) == 33 and FIXTURE["buckets"][16] == [1024, 1024]


@pytest.mark.parametrize("case", FIXTURE["requests"], ids=lambda c: f"{c['height']}x{c['width']}")
def test_snap_and_ratio_token_equal_the_release(case):
    h, w = case["height"], case["width"]
    assert buckets.ratio_index(h, w) == case["ratio_index"]
    assert buckets.snap(h, w) == (case["bucket_height"], case["bucket_width"])


def test_every_bucket_is_its_own_snap_and_names_its_index():
    for k, (h, w) in enumerate(buckets.bucket_table()):
        assert buckets.snap(h, w) == (h, w) and buckets.ratio_index(h, w) == k


def test_layout_carries_the_release_ratio_token():
    """The row's `<img_ratio_k>` is the release's k (the issue's examples: 1280x768 -> 20,
    1024x512 -> 21, 720x1280 -> 12, as height x width)."""
    cfg = HunyuanImage3Config.tiny()
    for (h, w), k in (((160, 96), 20), ((128, 64), 21), ((72, 128), 12), ((64, 64), 16)):  # the same ratios, tiny sizes
        lay = build_request_layout(cfg, ByteTokenizer(), "x", h, w, 1.0)
        ids = lay.rows[0].token_ids.tolist()
        assert ids[lay.rows[0].timestep_index - 1] == cfg.img_ratio_token_id + k


def test_base_size_and_ratio_token_count_are_checked():
    from ditkv.errors import ConfigError

    with pytest.raises(ConfigError, match="num_ratio_tokens"):
        HunyuanImage3Config.tiny().__class__(**{**HunyuanImage3Config.tiny().to_dict(), "num_ratio_tokens": 32})
    with pytest.raises(ConfigError, match="image_base_size"):
        HunyuanImage3Config(**{**HunyuanImage3Config.tiny().to_dict(), "image_base_size": 1000})


@pytest.mark.parametrize("base", [None, 64])
def test_engine_generates_at_the_snapped_size_only_for_a_bucketed_model(base):
    """A model with `image_base_size` (the release: 1024) generates a requested size at its nearest
    resolution bucket, which the output image shows; without it (the tiny model) the size is kept."""
    import torch

    from ditkv.config import EngineConfig
    from ditkv.engine.engine import Engine
    from ditkv.engine.types import GenerationRequest
    from ditkv.models.loader import load_model

    model, tok, codec = load_model("tiny", torch.device("cpu"), torch.float32)
    model.config.image_base_size = base
    e = Engine(EngineConfig(profile_memory=False), model_bundle=(model, tok, codec))
    try:
        out = e.generate(GenerationRequest(prompt="a red circle", height=40, width=100, steps=1))
    finally:
        e.shutdown()
    assert out.ok, out.error
    want = (40, 100) if base is None else buckets.snap(40, 100, base)
    assert out.image.shape[:2] == want
    if base is not None:
        assert want != (40, 100) and want in buckets.bucket_table(base)


@pytest.mark.parametrize("key, bad", [("use_qk_norm", False), ("attention_bias", True), ("mlp_bias", True),
                                      ("use_cla", True), ("use_mixed_mlp_moe", False),
                                      ("moe_drop_tokens", True), ("moe_layer_num_skipped", 1),
                                      ("norm_topk_prob", False), ("group_limited_greedy", True)])
def test_release_behaviour_flags_are_honoured_or_refused_by_name(key, bad):
    """A config flag that changes the computation is accepted at the value ditkv implements and is a
    ConfigError naming it otherwise, never silently ignored."""
    from ditkv.errors import ConfigError
    from ditkv.models.hunyuan.config import BEHAVIOUR_FLAGS

    base = HunyuanImage3Config.tiny().to_dict()
    ok = HunyuanImage3Config.from_dict({**base, key: BEHAVIOUR_FLAGS[key][0]})
    assert ok.extra[key] == BEHAVIOUR_FLAGS[key][0]  # kept, so to_dict() round-trips it
    with pytest.raises(ConfigError, match=rf"invalid {key}="):
        HunyuanImage3Config.from_dict({**base, key: bad})


@pytest.mark.parametrize("key", ["cla_share_factor", "routed_scaling_factor"])
@pytest.mark.parametrize("value", [1, 2, 1.0, 2.5, False, True, None])
def test_keys_the_release_never_reads_here_take_any_value(key, value):
    """The official config has cla_share_factor 2 (read only with use_cla, refused) and
    routed_scaling_factor false (read only without top-k renormalisation: norm_topk_prob false or
    moe_topk 1, both refused): any value loads, is kept, and changes nothing."""
    from ditkv.errors import ConfigError
    from ditkv.models.hunyuan.config import RELEASE_UNUSED

    base = HunyuanImage3Config.tiny().to_dict()
    cfg = HunyuanImage3Config.from_dict({**base, key: value})
    assert cfg.extra[key] == value and key in RELEASE_UNUSED
    assert dataclasses.replace(cfg, extra={}) == HunyuanImage3Config.from_dict(base).replace(extra={})
    with pytest.raises(ConfigError, match="invalid use_cla="):  # where the factor would be read: refused
        HunyuanImage3Config.from_dict({**base, key: value, "use_cla": True})
    with pytest.raises(ConfigError, match="invalid moe_topk=1"):
        HunyuanImage3Config.from_dict({**base, key: value, "moe_topk": 1})
