"""`ditkv bench step --e2e-request` with step caching: `--cache-config`, `--cached-fraction` and
`--cache-none-ab` (bench/step_cache_e2e.py), on the CPU at toy widths (`--shrink`)."""

from __future__ import annotations

import json

import pytest

from ditkv.bench.step_cache_e2e import computed_steps, forced_cache, parse_fractions
from ditkv.entrypoints.cli import build_parser
from ditkv.step_cache_config import parse

SHRUNK = ["--preset", "release", "--shrink", "--layers", "2", "--prefix", "32", "--repeats", "2", "--device", "cpu",
          "--image", "32", "--e2e-request"]


def _bench(argv: list[str]):
    args = build_parser().parse_args(["bench", "step", *argv])
    return args.func(args)


@pytest.mark.parametrize("steps", [2, 8, 28, 50])
@pytest.mark.parametrize("fraction", [0.1, 0.3, 0.5, 0.7, 0.9, 0.99])
def test_a_forced_fraction_computes_evenly_spread_steps_from_step_0(steps, fraction):
    comp = computed_steps(steps, fraction)
    cached = min(int(fraction * steps + 0.5), steps - 1)
    assert len(comp) == len(set(comp)) == steps - cached and comp[0] == 0 and comp == sorted(comp)
    assert all(0 <= s < steps for s in comp)
    gaps = [b - a for a, b in zip(comp, comp[1:] + [steps])]
    assert max(gaps) - min(gaps) <= 1  # evenly spread
    cache = parse(forced_cache({"type": "dbcache", "Fn": 2, "Bn": 1, "taylorseer": 1, "warmup_steps": 8}, steps,
                               fraction))
    assert cache.steps_mask == tuple(comp) and cache.warmup_steps == 0 and cache.residual_threshold == float("inf")
    assert (cache.Fn, cache.Bn, cache.taylorseer) == (2, 1, 1) and cache.check_steps(steps) is None


def test_fractions_parse_and_zero_is_the_baseline():
    assert parse_fractions("0.5,0.3,0,0.5") == [0.3, 0.5]
    assert forced_cache({"type": "fbcache"}, 10, 0.0) == {"type": "none"}
    # 28 x 0.7 = 19.6: 20 cached, 8 computed, 28/8 = 3.5 apart
    assert computed_steps(50, 0.5) == list(range(0, 50, 2)) and computed_steps(28, 0.7) == [0, 3, 7, 10, 14, 17, 21, 24]
    for bad in ("1", "-0.1", "x", ""):
        with pytest.raises(SystemExit, match="fractions in"):
            parse_fractions(bad)


def test_forced_fractions_and_the_none_ab_run_and_report(capsys):
    res = _bench([*SHRUNK, "--e2e-steps", "10", "--cached-fraction", "0.5,0.7", "--cache-none-ab",
                  "--quantization", "fp8", "--cache-config", '{"type": "fbcache", "taylorseer": 1}', "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["quantization"] == "fp8" and out["steps"] == 10 and out["cache_config"]["taylorseer"] == 1
    fr = out["fractions"]
    assert set(fr) == {"0", "0.5", "0.7"} and res["fractions"]["0.5"]["steps_mask"] == [0, 2, 4, 6, 8]
    assert (fr["0"]["computed_steps"], fr["0"]["cached_steps"]) == (10, 0) and fr["0"]["cached_step_s"] is None
    for f, cached in (("0.5", 5), ("0.7", 7)):
        s = fr[f]
        assert (s["computed_steps"], s["cached_steps"]) == (10 - cached, cached) and len(s["runs"]) == 2
        assert s["total_s"] > 0 and s["speedup"] == pytest.approx(fr["0"]["total_s"] / s["total_s"])
        assert s["cached_step_s"] > 0 and s["computed_step_s"] > 0 and s["cached_step_cost"] > 0
        assert s["fastest_cached_step_s"] <= s["cached_step_s"] and s["fastest_cached_step_cost"] == \
            pytest.approx(s["fastest_cached_step_s"] / fr["0"]["fastest_computed_step_s"])
    ab = out["none_ab"]
    assert ab["unset"]["cached_steps"] == ab["none"]["cached_steps"] == 0 and ab["step_time_unset_over_none"] > 0
    assert ab["fastest_step_unset_over_none"] == pytest.approx(ab["unset"]["fastest_computed_step_s"] /
                                                               ab["none"]["fastest_computed_step_s"])


def test_cache_config_passes_through_the_plain_e2e_run(capsys):
    res = _bench([*SHRUNK, "--e2e-steps", "3", "--repeats", "1", "--json", "--cache-config",
                  '{"type": "fbcache", "residual_threshold": "inf", "warmup_steps": 1}'])
    assert res["cache_config"]["residual_threshold"] == "inf"
    assert res["request_runs"][0]["cached_steps"] == 2 and res["request"]["cached_steps"] == 2


def test_step_cache_flags_are_checked():
    with pytest.raises(SystemExit, match="add --preset release --e2e-request"):
        _bench(["--preset", "tiny", "--cached-fraction", "0.5"])
    with pytest.raises(SystemExit, match="add --preset release --e2e-request"):
        _bench([*SHRUNK[:-1], "--cache-none-ab"])
    with pytest.raises(SystemExit, match="--cache-config: .*not valid JSON"):
        _bench([*SHRUNK, "--cache-config", "{oops"])
    with pytest.raises(SystemExit, match="needs a cache type"):
        _bench([*SHRUNK, "--cache-config", "none", "--cached-fraction", "0.5"])
    with pytest.raises(SystemExit, match="drop --compare-bf16 and --max-num-seqs"):
        _bench([*SHRUNK, "--cached-fraction", "0.5", "--max-num-seqs", "2"])
    with pytest.raises(SystemExit, match="fractions in"):
        _bench([*SHRUNK, "--cached-fraction", "1.0"])
    with pytest.raises(SystemExit, match="--e2e-steps 4 or more"):
        _bench([*SHRUNK, "--cache-none-ab", "--e2e-steps", "3"])
