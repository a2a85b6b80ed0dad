"""cache_config (issue 35): where it is set (EngineConfig, --config YAML, a DiT stage's engine section,
--cache-config JSON, a request's own) and every refusal, naming the key and the fix. The step cache's
pure parts too: the TaylorSeer extrapolation on known sequences and the decision rule."""

import argparse
import math

import pytest
import torch

from ditkv.config import EngineConfig
from ditkv.entrypoints.engine_args import add_engine_arguments, config_from_args
from ditkv.errors import ConfigError
from ditkv.stages.graph import load_stage_graph
from ditkv.step_cache_config import StepCacheConfig, parse
from ditkv.worker.step_cache import Extrapolator, RequestCache


# ---- parsing ----------------------------------------------------------------------------------
def test_defaults_and_types():
    assert not parse(None).active and parse(None).type == "none"
    fb = parse({"type": "fbcache"})
    assert (fb.Fn, fb.Bn, fb.residual_threshold, fb.warmup_steps) == (1, 0, 0.08, 8)
    db = parse({"type": "dbcache", "Fn": 2, "Bn": 1, "taylorseer": 2, "steps_mask": [5, 0, 5],
                "max_cached_steps": -1, "max_continuous_cached_steps": 3, "residual_threshold": "inf"})
    assert (db.Fn, db.Bn, db.taylorseer, db.steps_mask) == (2, 1, 2, (0, 5))
    assert db.max_cached_steps is None and db.max_continuous_cached_steps == 3 and math.isinf(db.residual_threshold)
    assert parse(db.to_wire()) == db  # the wire form (SamplingParams.cache) round-trips, inf included
    assert parse(parse({"type": "none"}).to_wire()) == StepCacheConfig()  # a request turning the engine's off
    assert parse('{"type": "dbcache", "Fn": 3}').Fn == 3  # a JSON string (the CLI)
    assert parse({"type": "dbcache"}).Fn == 8  # cache-dit's F8B0


@pytest.mark.parametrize("value, field, fix", [
    ({"type": "teacache"}, "cache_config.type", "choose one of none, fbcache, dbcache"),
    ({"type": "fbcache", "threshold": 0.1}, "cache_config.threshold", "unknown key; valid keys"),
    ({"type": "fbcache", "residual_threshold": -0.1}, "cache_config.residual_threshold", "must be >= 0"),
    ({"type": "fbcache", "residual_threshold": float("nan")}, "cache_config.residual_threshold", "a number >= 0"),
    ({"type": "fbcache", "residual_threshold": "0.1"}, "cache_config.residual_threshold", "a number >= 0"),
    ({"type": "fbcache", "steps_mask": [0, -2]}, "cache_config.steps_mask", "negative"),
    ({"type": "fbcache", "steps_mask": "0,1"}, "cache_config.steps_mask", "list of step indices"),
    ({"type": "fbcache", "taylorseer": 3}, "cache_config.taylorseer", "must be 1 or 2"),
    ({"type": "fbcache", "Fn": 2}, "cache_config.type", "use type dbcache"),
    ({"type": "dbcache", "Fn": 0}, "cache_config.Fn", "integer in 1.."),
    ({"type": "dbcache", "Bn": True}, "cache_config.Bn", "integer in 0.."),
    ({"type": "fbcache", "warmup_steps": -1}, "cache_config.warmup_steps", "integer in 0.."),
    ({"type": "fbcache", "warmup_steps": 10**30}, "cache_config.warmup_steps", "integer in 0.."),
    ({"type": "fbcache", "residual_threshold": 10**400}, "cache_config.residual_threshold", "a number >= 0"),
    ({"type": "fbcache", "steps_mask": [2**70]}, "cache_config.steps_mask", "list of step indices"),
    ({"type": "fbcache", "max_cached_steps": -2}, "cache_config.max_cached_steps", "-1 / null for no bound"),
    ({"type": "none", "Fn": 1}, "cache_config.Fn", "means nothing with type none"),
    ([1, 2], "cache_config", "must be a mapping"),
    ("{not json", "cache_config", "not valid JSON"),
])
def test_bad_values_name_the_key_and_the_fix(value, field, fix):
    with pytest.raises(ConfigError) as e:
        parse(value)
    assert e.value.field == field and fix in e.value.fix


def test_model_and_step_checks():
    c = parse({"type": "dbcache", "Fn": 2, "Bn": 1, "steps_mask": [0, 9], "warmup_steps": 3})
    c.check_model(4)  # one middle layer left: fine
    with pytest.raises(ConfigError, match=r"Fn \+ Bn = 2 \+ 1 leaves no middle block .* at most 2") as e:
        c.check_model(3)
    assert e.value.field == "cache_config.Fn"
    assert c.check_steps(10) is None
    with pytest.raises(ConfigError, match=r"step 9 is outside the request's steps \[0, 8\)") as e:
        c.check_steps(8)
    assert e.value.field == "cache_config.steps_mask"
    note = parse({"type": "fbcache", "warmup_steps": 8}).check_steps(8)  # said, not refused
    assert "no step of this request is cached" in note


# ---- where it is set --------------------------------------------------------------------------
def test_engine_config_field():
    cfg = EngineConfig.from_dict({"cache_config": {"type": "fbcache", "residual_threshold": 0.1}})
    assert cfg.step_cache.type == "fbcache" and cfg.step_cache.residual_threshold == 0.1
    assert not EngineConfig().step_cache.active
    with pytest.raises(ConfigError, match="cache_config.residual_threshold"):
        EngineConfig(cache_config={"type": "fbcache", "residual_threshold": -1})
    with pytest.raises(ConfigError, match="must be a mapping"):
        EngineConfig(cache_config="fbcache")


def test_dense_legacy_is_refused_and_graphs_on_is_not():
    with pytest.raises(ConfigError, match="dense_legacy has none") as e:
        EngineConfig(diffusion_kv_mode="dense_legacy", diffusion_kv_max_rows_per_request=None,
                     cache_config={"type": "fbcache"})
    assert e.value.field == "cache_config"
    EngineConfig(cuda_graphs="on", cache_config={"type": "fbcache"})  # captured in parts (step_cache_graph.py)


def _args(argv):
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    return p.parse_args(argv)


def test_cli_flag_and_yaml(tmp_path):
    cfg = config_from_args(_args(["--cache-config", '{"type": "dbcache", "Fn": 2, "taylorseer": 1}']))
    assert cfg.step_cache.Fn == 2 and cfg.step_cache.taylorseer == 1
    y = tmp_path / "engine.yaml"
    y.write_text("device: cpu\ncache_config:\n  type: fbcache\n  residual_threshold: .inf\n  steps_mask: [0, 4]\n")
    cfg = config_from_args(_args(["--config", str(y)]))
    assert math.isinf(cfg.step_cache.residual_threshold) and cfg.step_cache.steps_mask == (0, 4)
    cfg = config_from_args(_args(["--config", str(y), "--cache-config", "none"]))  # the flag wins over the file
    assert not cfg.step_cache.active
    with pytest.raises(SystemExit):  # not a JSON object: argparse says so
        _args(["--cache-config", "[1]"])


def test_stage_yaml_engine_section():
    ar = {"stage_id": 0, "kind": "ar", "engine": {"model": "tiny", "device": "cpu", "block_size": 16},
          "kv_transfer_config": {"engine_id": "ar", "kv_role": "kv_producer"}}
    dit = {"stage_id": 1, "kind": "dit", "inputs": [0],
           "engine": {"model": "tiny", "device": "cpu", "block_size": 16, "num_kv_blocks": 64,
                      "cache_config": {"type": "fbcache", "warmup_steps": 2}},
           "kv_transfer_config": {"engine_id": "dit", "kv_role": "kv_consumer"}}
    g = load_stage_graph({"stages": [ar, dit]})
    assert g.dit.engine.step_cache.warmup_steps == 2
    dit["engine"]["cache_config"] = {"type": "fbcache", "nope": 1}
    with pytest.raises(ConfigError, match="nope"):
        load_stage_graph({"stages": [ar, dit]})


# ---- TaylorSeer: Newton extrapolation over computed steps ---------------------------------------
def _seq(f, steps):
    return {s: torch.full((2, 3), float(f(s)), dtype=torch.float64) for s in steps}


@pytest.mark.parametrize("order, f, exact", [
    (1, lambda s: 3.0 - 2.0 * s, True),
    (2, lambda s: 1.0 + 0.5 * s - 0.25 * s * s, True),
    (1, lambda s: s * s, False),  # a line cannot follow a parabola
])
def test_taylor_known_sequences(order, f, exact):
    ex = Extrapolator(order)
    for s, r in _seq(f, [0, 1, 3, 4, 7]).items():  # unevenly spaced computed steps
        ex.add(s, r)
    for t in (8, 9, 12):
        got = ex.at(t)
        assert torch.allclose(got, torch.full_like(got, f(t)), atol=1e-9) == exact


def test_taylor_lower_order_until_enough_points_and_plain_reuse():
    ex = Extrapolator(2)
    ex.add(2, torch.tensor([1.0], dtype=torch.float64))
    assert ex.at(5).item() == 1.0  # one point: reuse
    ex.add(4, torch.tensor([2.0], dtype=torch.float64))
    assert ex.at(6).item() == 3.0  # two points: the line
    plain = Extrapolator(0)
    for s in range(4):
        plain.add(s, torch.tensor([float(s * s)]))
    assert plain.at(10).item() == 9.0 and len(plain.coefs) == 1  # order 0 keeps one tensor


# ---- the decision rule -------------------------------------------------------------------------
def test_decision_rule_and_forced_steps():
    c = RequestCache(StepCacheConfig(type="fbcache", residual_threshold=0.1, warmup_steps=2, steps_mask=(5,),
                                     max_continuous_cached_steps=2), steps=10, num_layers=4)
    prev = torch.ones(2, 3, 4)
    assert c.forced(3, prefill=False)  # nothing stored yet
    c.computed(1, prev, torch.zeros(6, 4))
    assert c.forced(1, prefill=False) and c.forced(3, prefill=True) and c.forced(5, prefill=False)
    assert not c.forced(3, prefill=False)
    num, den = c.sums(prev * 1.05).tolist()  # 5 % relative L1 change
    assert den == 24 and abs(num - 1.2) < 1e-5 and c.decide(num, den)
    num, den = c.sums(prev * 1.2).tolist()
    assert not c.decide(num, den)
    c.cached(), c.cached()
    assert c.forced(4, prefill=False)  # two cached steps in a row: the next one computes
    c.release()
    assert c.released and c.nbytes() == 0
