"""AR text sampling on the device (issue 34 item 1): settings validation, and a batched sampler whose
rows depend only on their own logits, settings and seed."""

import pytest
import torch

from ditkv.errors import ConfigError
from ditkv.models.text_settings import TextSampling, from_wire, to_wire
from ditkv.worker.sampling import row_generator, sample

V = 64


def logits(rows, seed=0):
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def draw(x, settings, seeds, steps=20, banned=None):
    """`steps` draws per row, each row from its own generator (one stream per request)."""
    gens = [row_generator(s, x.device) for s in seeds]
    return torch.stack([sample(x, settings, gens, banned) for _ in range(steps)], dim=1)


@pytest.mark.parametrize("field,value,words", [
    ("temperature", -0.1, ">= 0"), ("temperature", float("nan"), ">= 0"), ("temperature", 10**400, ">= 0"),
    ("top_k", -2, "0 / -1"),
    ("top_k", 2.5, "integer"), ("top_p", 0.0, "(0, 1]"), ("top_p", 1.5, "(0, 1]"),
    ("max_new_tokens", -1, ">= 0"), ("do_sample", "yes", "true or false"), ("max_new_tokens", True, "integer"),
])
def test_bad_settings_name_the_field_and_the_range(field, value, words):
    with pytest.raises(ConfigError) as e:
        TextSampling(**{field: value})
    assert e.value.field == field and words in str(e.value)


def test_off_values_and_greedy():
    assert TextSampling(top_k=-1).top_k == -1 and TextSampling(top_k=0, top_p=1).top_p == 1
    assert TextSampling().greedy and TextSampling(temperature=0.7, do_sample=False).greedy
    assert not TextSampling(temperature=0.7).greedy
    s = TextSampling(temperature=0.5, top_k=3, top_p=0.9, max_new_tokens=7, seed=11)
    assert from_wire(type("M", (), to_wire(s))) == s
    assert s.override(temperature=None, top_k=5) == TextSampling(temperature=0.5, top_k=5, top_p=0.9,
                                                                  max_new_tokens=7, seed=11)


def test_repetition_penalty_other_than_one_is_refused():
    assert TextSampling.from_release({"repetition_penalty": 1.0, "temperature": 0.6}).temperature == 0.6
    assert TextSampling.from_release({"repetition_penalty": 1}) == TextSampling()
    with pytest.raises(ConfigError) as e:
        TextSampling.from_release({"repetition_penalty": 1.1})
    assert e.value.field == "repetition_penalty" and "does not implement" in str(e.value)
    with pytest.raises(ConfigError) as e:
        TextSampling.from_release({"top_p": 0}, where="x/generation_config.json")
    assert e.value.field == "top_p" and "x/generation_config.json" in str(e.value)


def test_greedy_rows_are_the_argmax():
    x = logits(4)
    ids = sample(x, [TextSampling()] * 4, [None] * 4)
    assert torch.equal(ids, torch.argmax(x, dim=-1)) and ids.dtype == torch.long


def test_top_k_one_and_a_tiny_top_p_are_greedy():
    x = logits(3, seed=1)
    best = torch.argmax(x, dim=-1)[:, None].expand(3, 20)
    assert torch.equal(draw(x, [TextSampling(temperature=1.5, top_k=1)] * 3, [1, 2, 3]), best)
    assert torch.equal(draw(x, [TextSampling(temperature=1.5, top_p=1e-6)] * 3, [1, 2, 3]), best)


def test_sampling_really_samples_and_respects_the_cuts():
    x = torch.zeros(1, V)  # uniform: a sampler that fell back to argmax would draw id 0 only
    got = draw(x, [TextSampling(temperature=1.0)], [0], steps=200)
    assert len(set(got.tolist()[0])) > 20
    x = torch.arange(V, dtype=torch.float32)[None] * 0.01  # near-uniform, id V-1 the most likely
    got = set(draw(x, [TextSampling(temperature=1.0, top_k=5)], [0], steps=200).tolist()[0])
    assert got <= set(range(V - 5, V)) and len(got) > 1
    # top_p 0.5 over a near-uniform row keeps about half the ids: never the least likely ones
    got = set(draw(x, [TextSampling(temperature=1.0, top_p=0.5)], [0], steps=300).tolist()[0])
    assert min(got) >= V // 2 - 2 and len(got) > 5


def test_a_banned_id_is_never_drawn():
    x = logits(2, seed=2)
    top = torch.argmax(x, dim=-1)
    banned = torch.unique(top)
    for s in (TextSampling(), TextSampling(temperature=5.0), TextSampling(temperature=1.0, top_k=1)):
        got = draw(x, [s] * 2, [3, 4], steps=50, banned=banned)
        assert not set(got.flatten().tolist()) & set(banned.tolist())


def test_a_row_draws_the_same_alone_as_inside_a_batch():
    """A request's ids depend only on its own seed and logits (CPU fp32), not on its neighbours."""
    x = logits(3, seed=4)
    mine = TextSampling(temperature=0.8, top_k=20, top_p=0.9)
    others = [TextSampling(temperature=1.3), TextSampling()]
    for pos in range(3):
        settings = others[:pos] + [mine] + others[pos:]
        seeds = [9, 9, 9]
        seeds[pos] = 123
        rows = torch.cat([x[1:][:pos], x[:1], x[1:][pos:]])
        batched = draw(rows, settings, seeds, steps=30)[pos]
        alone = draw(x[:1], [mine], [123], steps=30)[0]
        assert torch.equal(batched, alone)
    assert not torch.equal(draw(x[:1], [mine], [124], steps=30)[0], alone)  # the seed matters


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match=r"\[R, V\]"):
        sample(logits(2), [TextSampling()], [None])
    with pytest.raises(ValueError, match="no generator"):
        sample(logits(1), [TextSampling(temperature=1.0)], [None])
