"""The Instruct code's output sizes and `<img_ratio_k>` against its numbers.

tests/fixtures/release_instruct_buckets.json holds, at base sizes 1024 (the release) and 256, the Instruct
code's 37-size table and the (size, ratio index) it makes of a sweep of requested sizes;
`tools/make_instruct_bucket_fixture.py --reference CHECKOUT` regenerates it from the fork's image processor.
The base family keeps the 33 (tests/test_buckets.py)."""

import json
from pathlib import Path

import pytest

from ditkv.models.hunyuan import HunyuanImage3Config, buckets

FIXTURES = Path(__file__).parent / "fixtures"
INSTRUCT = json.loads((FIXTURES / "release_instruct_buckets.json").read_text())
BASE = json.loads((FIXTURES / "release_buckets.json").read_text())
REQUESTS = [(g["base_size"], r) for g in INSTRUCT["groups"] for r in g["requests"]]


def _cfg(model_version, base=1024):
    return HunyuanImage3Config.tiny().replace(image_base_size=base, extra={"model_version": model_version})


@pytest.mark.parametrize("group", INSTRUCT["groups"], ids=lambda g: f"base{g['base_size']}")
def test_instruct_table_equals_the_instruct_code(group):
    table = [list(b) for b in buckets.bucket_table(group["base_size"], instruct=True)]
    assert table == group["buckets"] and len(table) == 37
    assert table[:33] == [list(b) for b in buckets.bucket_table(group["base_size"])]
    assert table[33:] == [[1024, 768], [1280, 720], [768, 1024], [720, 1280]]  # fixed sizes, whatever the base


@pytest.mark.parametrize("base, case", REQUESTS, ids=lambda v: f"{v['height']}x{v['width']}" if isinstance(v, dict)
                         else f"base{v}")
def test_snap_and_ratio_index_equal_the_instruct_code(base, case):
    h, w = case["height"], case["width"]
    want = (case["bucket_height"], case["bucket_width"], case["ratio_index"])
    assert buckets.ratio_index(h, w, base, instruct=True) == case["ratio_index"]
    assert buckets.snap(h, w, base, instruct=True) == want[:2]
    assert buckets.output_bucket(_cfg(INSTRUCT["model_version"], base), h, w) == want
    assert buckets.output_bucket(_cfg("HunyuanImage-3.0-Instruct-Distil", base), h, w) == want


@pytest.mark.parametrize("case", BASE["requests"], ids=lambda c: f"{c['height']}x{c['width']}")
def test_a_base_family_config_keeps_the_33(case):
    h, w = case["height"], case["width"]
    want = (case["bucket_height"], case["bucket_width"], case["ratio_index"])
    assert buckets.output_bucket(_cfg("HunyuanImage-3.0"), h, w) == want
    assert buckets.output_bucket(HunyuanImage3Config.tiny().replace(image_base_size=1024), h, w) == want


def test_720x1280_is_generated_as_asked_only_by_the_instruct_family():
    """The brief's example: the Instruct code makes 720x1280 (k 36), the base code 768x1280 (k 12)."""
    assert buckets.output_bucket(_cfg("HunyuanImage-3.0-Instruct"), 720, 1280) == (720, 1280, 36)
    assert buckets.output_bucket(_cfg("HunyuanImage-3.0"), 720, 1280) == (768, 1280, 12)


def test_output_bucket_without_a_base_keeps_the_size():
    """A model without image_base_size (the tiny one) generates the size asked; k still follows the family,
    and a model with one ratio token always has k 0."""
    tiny = HunyuanImage3Config.tiny()
    assert buckets.output_bucket(tiny, 72, 128) == (72, 128, 12)
    instruct = tiny.replace(extra={"model_version": "HunyuanImage-3.0-Instruct"})
    assert buckets.output_bucket(instruct, 72, 128) == (72, 128, 36)
    one = tiny.replace(num_ratio_tokens=1, image_base_size=1024)
    assert buckets.output_bucket(one, 720, 1280) == (768, 1280, 0)


def test_ratio_token_ids_of_the_extra_sizes_are_looked_up_apart():
    """The Instruct tokenizer's <img_ratio_33..36> do not follow <img_ratio_32>: their ids start at the id of
    <img_ratio_33>, which a caller must pass."""
    assert [buckets.ratio_token_id(k, 100) for k in (0, 12, 32)] == [100, 112, 132]
    assert [buckets.ratio_token_id(k, 100, 500) for k in (32, 33, 36)] == [132, 500, 503]
    with pytest.raises(ValueError, match="<img_ratio_33>"):
        buckets.ratio_token_id(33, 100)
    with pytest.raises(ValueError):
        buckets.ratio_token_id(37, 100, 500)


def test_the_engine_snaps_an_instruct_request_as_the_instruct_code():
    from ditkv.engine.request_check import snap_request
    from ditkv.engine.types import GenerationRequest

    req = snap_request(GenerationRequest(prompt="x", height=720, width=1280), _cfg("HunyuanImage-3.0-Instruct"))
    assert (req.height, req.width) == (720, 1280)


def test_an_instruct_row_carries_the_extra_ratio_token_of_its_tokenizer():
    """720 x 1280 is <img_ratio_36> for the Instruct code, at the id its tokenizer gives <img_ratio_36>
    (consecutive from <img_ratio_33>, not after <img_ratio_32>); the AR head's tail says the same, and
    a text step may never emit it. The base code snaps the size to 768 x 1280, ratio 12."""
    from ditkv.errors import LayoutError
    from ditkv.models.hunyuan.layout import ratio_token
    from ditkv.models.hunyuan.layout import image_tail_ids
    from ditkv.models.hunyuan.tokenizer import banned_generation_ids

    cfg = _cfg("HunyuanImage-3.0-Instruct")
    with pytest.raises(LayoutError, match="tokenizer.json"):
        ratio_token(cfg, 720, 1280)  # no tokenizer: the extra ids are unknown
    cfg = cfg.replace(img_ratio_extra_token_id=cfg.vocab_size - 4)
    assert ratio_token(cfg, 720, 1280) == cfg.vocab_size - 1
    assert image_tail_ids(cfg, 720, 1280)[-1] == cfg.vocab_size - 1
    assert ratio_token(cfg, 1024, 1024) == cfg.img_ratio_token_id + buckets.ratio_index(1024, 1024)
    assert set(range(cfg.vocab_size - 4, cfg.vocab_size)) <= banned_generation_ids(cfg)
    base = _cfg("HunyuanImage-3.0")
    assert buckets.output_bucket(base, 720, 1280) == (768, 1280, 12)
    assert ratio_token(base, 768, 1280) == base.img_ratio_token_id + 12
