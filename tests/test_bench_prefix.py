"""`ditkv bench prefix` at tiny sizes (docs/prefix-cache.md): the CLI runs both cases, the images with the
cache on equal the cache off, the hits are real and the release-geometry run holds more requests with the
cache than without for the edits of one image."""

import json

from ditkv.bench import prefix
from ditkv.entrypoints.cli import build_parser


def test_bench_prefix_runs_both_cases(capsys):
    args = build_parser().parse_args(["bench", "prefix", "--requests", "3", "--steps", "1", "--size", "32",
                                      "--system-tokens", "160", "--budget-gib", "4", "--max-num-seqs", "6", "--json",
                                      "--cases", "edits,system"])
    assert args.func is prefix.run and args.cases == ["edits", "system"]
    args.func(args)
    out = json.loads(capsys.readouterr().out)  # --json: one object on stdout
    assert set(out["cases"]) == {"edits", "system"}
    for name, res in out["cases"].items():
        eng, rel = res["engine"], res["release"]
        assert eng["bit_identical"] is True, name
        per = eng["per_request"]
        assert len(per) == eng["requests"] == 3 and per[0]["hit_tokens"] == 0
        assert all(r["hit_tokens"] > 0 and r["tokens_computed_on"] == r["tokens_computed_off"] - r["hit_tokens"]
                   for r in per[1:]), name
        assert all(r["ttfs_off_s"] > 0 and r["ttfs_on_s"] > 0 for r in per)
        assert 0 < eng["hit_share_of_first_step"] < 1
        assert rel["pool_blocks"] == (4 << 30) // (64 * prefix.KV_BYTES_PER_TOKEN) and rel["max_num_seqs"] == 6
        assert rel["hit_tokens_off"] == 0 and rel["hit_tokens_on"] > 0
        assert 0 < rel["held_off"] <= rel["held_on"] <= 6
        assert rel["blocks_for_requests_on"] < rel["blocks_for_requests_off"]
    edits = out["cases"]["edits"]["release"]
    assert edits["held_off"] == 1 and edits["held_on"] >= 2  # 4 GiB: one edit's rows, or one and another's own pages


def test_unknown_case_is_refused(capsys):
    import pytest

    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "prefix", "--cases", "edits,dream"])
    assert "unknown case(s) ['dream']" in capsys.readouterr().err


def test_the_think_case_runs_through_the_cli(capsys):
    """`think` (an engine run of requests with an AR phase): the table prints, texts and images equal."""
    args = build_parser().parse_args(["bench", "prefix", "--cases", "think", "--requests", "2", "--steps", "1",
                                      "--size", "32"])
    args.func(args)
    out = capsys.readouterr().out
    assert "AR prefill tokens off" in out.splitlines()[0]
    res = json.loads(out[out.index("{"):])["cases"]["think"]["engine"]
    assert res["bit_identical"] is True and res["ar_prefill_tokens_saved"] > 0


def test_the_think_edits_case_hits_the_image_pages_and_equals_the_cache_off(capsys):
    """`think-edits`: AR requests editing one image with one seed behind a shared text (tiny-edit). The AR
    head holds the image before the text, so a later request's AR row hits past the image's block: more
    AR prefill is saved than the text alone could give, texts and images equal the cache off."""
    args = build_parser().parse_args(["bench", "prefix", "--cases", "think-edits", "--requests", "2", "--steps",
                                      "1", "--size", "32"])
    args.func(args)
    out = capsys.readouterr().out
    res = json.loads(out[out.index("{"):])["cases"]["think-edits"]["engine"]
    assert res["case"] == "think-edits" and res["bit_identical"] is True
    off, on = res["cache_off"], res["cache_on"]
    # 32x32 at the tiny-edit's 4 px cells: an 8x8 = 64-token latent block; both AR heads are fed nearly whole
    # without the cache, and all but their last page with it
    assert off["hit_tokens"] == 0 and res["ar_prefill_tokens_saved"] >= 2 * 64
    assert on["ar_prefill_tokens"] < off["ar_prefill_tokens"] / 4


def test_a_budget_below_one_request_names_the_fix():
    import pytest

    from ditkv.errors import ConfigError

    args = build_parser().parse_args(["bench", "prefix", "--cases", "edits", "--budget-gib", "1", "--skip-engine"])
    with pytest.raises(ConfigError, match="budget_gib.*give at least 2.27"):
        args.func(args)


def test_release_geometry_engine_run_on_the_shrunk_release_structure(capsys):
    """`--geometry release --shrink`: the release architecture (random weights, 64-token pages) through the
    engine: the system case hits in every later request (both rows: the uncond row keeps the system text)
    with equal images, the nohit case never hits, and one model serves both cases."""
    args = build_parser().parse_args(["bench", "prefix", "--geometry", "release", "--shrink", "--layers", "1",
                                      "--cases", "system,nohit", "--requests", "3", "--size", "64",
                                      "--system-tokens", "300", "--max-num-seqs", "4", "--json"])
    args.func(args)
    out = json.loads(capsys.readouterr().out)
    system, nohit = out["cases"]["system"]["engine"], out["cases"]["nohit"]["engine"]
    assert system["geometry"] == "release" and system["layers"] == 1 and system["size"] == 64
    assert system["bit_identical"] is True and nohit["bit_identical"] is True
    per = system["per_request"]
    assert per[0]["hit_tokens"] == 0 and all(r["hit_tokens"] >= 2 * 256 for r in per[1:])  # 4 pages of 64 per row
    assert all(r["tokens_computed_on"] == r["tokens_computed_off"] - r["hit_tokens"] - r["shared_rows_tokens"]
               for r in per)
    assert all(r["hit_tokens"] == 0 == r["shared_rows_tokens"] for r in nohit["per_request"])
    assert nohit["time_saved_over_share"] is None and nohit["total_ratio"] > 0
    # 3 steps by default here: the second step is timed as a denoise step, for the prefix-prefill measure
    assert system["steps"] == 3 and all(r["denoise_step_off_s"] > 0 and r["denoise_step_on_s"] > 0 for r in per)
    assert system["prefix_prefill_off_s"] == system["first_step_median_off_s"] - system["denoise_step_median_off_s"]
    assert 0.5 < system["shared_share_of_prefix"] < 1  # whole 64-token pages of 300 system tokens + the prompt
    assert system["prefix_prefill_saved_over_share"] is not None and nohit["prefix_prefill_saved_over_share"] is None
    assert "nohit" not in out["cases"] or "release" not in out["cases"]["nohit"]  # no control-plane run of its own


def test_release_geometry_refuses_the_cases_it_cannot_build():
    import pytest

    args = build_parser().parse_args(["bench", "prefix", "--geometry", "release", "--cases", "edits"])
    with pytest.raises(SystemExit, match="--geometry release runs the cases system, nohit"):
        args.func(args)


def test_release_geometry_at_full_width_on_a_cpu_names_the_fix():
    import pytest

    args = build_parser().parse_args(["bench", "prefix", "--geometry", "release", "--device", "cpu",
                                      "--cases", "system"])
    with pytest.raises(SystemExit, match="needs a GPU.*add --shrink"):
        args.func(args)
