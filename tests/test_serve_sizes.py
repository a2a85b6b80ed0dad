"""Which sizes `ditkv serve` takes (`entrypoints/sizes.py`): the `WIDTHxHEIGHT` pattern that the
server checks and /openapi.json publishes is exactly "each side a positive multiple of the model's
latent cell" (any positive size for a model that snaps to resolution buckets), it agrees with
the model's own check, and `size=auto` rounds to sizes the model can make.
"""

import re
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ditkv.entrypoints.images import auto_size
from ditkv.entrypoints.sizes import SizeRule, size_rule
from ditkv.errors import LayoutError
from ditkv.models.hunyuan.layout import image_grid

CELLS = [1, 2, 4, 8, 16, 32]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(cell=st.sampled_from(CELLS), w=st.integers(0, 99_999), h=st.integers(0, 99_999))
def test_pattern_is_exactly_positive_multiples_of_the_cell(cell, w, h):
    pattern = re.compile(SizeRule(cell=cell).pattern())
    want = all(0 < v and v % cell == 0 for v in (w, h))
    assert bool(pattern.fullmatch(f"{w}x{h}")) == want
    assert not pattern.fullmatch(f"0{w}x{h}") and not pattern.fullmatch(f"{w}x{h} ")  # no leading zero, no spaces


@pytest.mark.parametrize("cell", CELLS)
def test_pattern_checks_every_side_value(cell):
    pattern = re.compile(SizeRule(cell=cell).pattern(auto=True))
    assert pattern.fullmatch("auto") and not re.fullmatch(SizeRule(cell=cell).pattern(), "auto")
    accepted = [v for v in range(0, 5000) if pattern.fullmatch(f"{v}x{cell}")]
    assert accepted == list(range(cell, 5000, cell))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(w=st.integers(1, 512), h=st.integers(1, 512))
def test_the_tiny_models_pattern_agrees_with_its_layout(w, h):
    """The server's pattern (hence the schema's) accepts a size iff the model's grid check does."""
    from ditkv.models.hunyuan import HunyuanImage3Config

    cfg = HunyuanImage3Config.tiny()
    rule = size_rule(SimpleNamespace(_engine=SimpleNamespace(executor=SimpleNamespace(model_config=cfg))))
    assert rule == SizeRule(cell=cfg.image_token_downsample)
    try:
        image_grid(h, w, cfg.image_token_downsample)
        model_ok = True
    except LayoutError:
        model_ok = False
    assert bool(re.fullmatch(rule.pattern(), f"{w}x{h}")) == model_ok


def test_size_rule_of_each_backend():
    from ditkv.models.hunyuan import HunyuanImage3Config

    release = HunyuanImage3Config.release()
    orchestrator = SimpleNamespace(orch=SimpleNamespace(model_config=release))
    assert size_rule(orchestrator) == SizeRule(snaps=True)  # buckets: any positive size is made
    assert re.fullmatch(size_rule(orchestrator).pattern(), "1x1")
    assert size_rule(SimpleNamespace()) == SizeRule()  # a stand-in: the engine judges


@settings(max_examples=200, deadline=None, derandomize=True)
@given(cell=st.sampled_from(CELLS), w=st.integers(1, 8000), h=st.integers(1, 8000), max_side=st.integers(64, 4096))
def test_auto_size_is_a_size_the_pattern_takes(cell, w, h, max_side):
    rule = SizeRule(cell=cell)
    aw, ah = auto_size(w, h, max_side, rule.auto_multiple())
    assert re.fullmatch(rule.pattern(), f"{aw}x{ah}"), (aw, ah)
    assert max(aw, ah) <= max(max_side, rule.auto_multiple())
