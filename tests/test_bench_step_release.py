"""`ditkv bench step --preset release`: the release code path at toy widths on the CPU (`--shrink`),
and the FLOP count of the real release geometry (built on the meta device, no memory)."""

from __future__ import annotations

import json

import pytest
import torch

from ditkv.bench.step_parts import flop_model
from ditkv.bench.step_release import release_config
from ditkv.entrypoints.cli import build_parser
from ditkv.models.hunyuan import ByteTokenizer, HunyuanImage3Model, build_request_layout


def _bench(argv: list[str]):
    args = build_parser().parse_args(["bench", "step", *argv])
    return args.func(args)


def test_shrunk_release_preset_measures_each_moe_impl(capsys):
    res = _bench(["--preset", "release", "--shrink", "--layers", "2", "--prefix", "32", "--repeats", "1",
                  "--moe-impl", "loop,grouped", "--device", "cpu", "--json"])
    out = json.loads(capsys.readouterr().out)  # --json: exactly one object on stdout
    assert out["moe_impls"].keys() == res["moe_impls"].keys() == {"loop", "grouped"}
    geo = out["geometry"]  # the release structure, toy widths
    assert (geo["num_experts"], geo["moe_topk"], geo["num_shared_expert"]) == (64, 8, 1)
    assert geo["num_attention_heads"] == 4 * geo["num_key_value_heads"]
    assert (geo["latent_channels"], geo["image_token_downsample"]) == (32, 16)
    assert (out["prefix_tokens"], out["target_tokens"], out["rows"]) == (32, 17, 2)  # 4x4 latents + timestep
    # 2 rows x 1 block of 64 slots x 2 layers x K,V x 1 head x 16 dims x fp32
    assert out["kv_bytes_per_request"] == 2 * 64 * 2 * 2 * 16 * 4
    assert out["kv_bytes_per_request_32_layers"] == 16 * out["kv_bytes_per_request"]
    for impl, phases in out["moe_impls"].items():
        assert phases["resolved"] == impl
        for ph in ("denoise", "recompute"):
            r = phases[ph]
            assert len(r["per_layer_ms"]) == 2 and r["step_ms"] > 0 and r["moe_ms"] > 0
            assert r["step_ms_32_layers"] == pytest.approx(r["rest_ms"] + 32 * r["layer_ms"])
            assert r["mfu"] > 0 and r["mfu_nominal"] == pytest.approx(r["mfu"] * 788 / 989.4)
            assert r["peak_gib"] is None  # CPU: no device memory counter
    assert set(out["grouped_speedup"]) == {"denoise", "recompute"}
    # unquantized: no FP8 bytes or rates; CPU: no device memory figures, no graph, no kernel profile
    assert out["quantization"] is None and "compare_bf16" not in out
    assert out["weights_bytes_by_kind"]["fp8_weights"] == 0 and out["weights_bytes"] == out["build"]["weights_bytes"]
    assert out["memory_left_for_kv"] is None and out["graph"] is None
    assert all("mfu_fp8_rate" not in r[ph] for r in out["moe_impls"].values() for ph in ("denoise", "recompute"))
    assert all(r["denoise"]["kernels"] is None for r in out["moe_impls"].values())
    for impl, r in out["reuse"].items():  # prefix reuse = recompute / denoise, at L and at 32 layers
        ph = out["moe_impls"][impl]
        assert r["speedup"] == pytest.approx(ph["recompute"]["step_ms"] / ph["denoise"]["step_ms"])
        assert r["speedup_32_layers"] == pytest.approx(ph["recompute"]["step_ms_32_layers"]
                                                       / ph["denoise"]["step_ms_32_layers"])
        assert r["ideal"] == pytest.approx((32 + 17) / 17) and r["goal"] == pytest.approx(0.9 * r["ideal"])


def test_other_presets_take_one_moe_impl():
    with pytest.raises(SystemExit, match="comma list only"):
        _bench(["--preset", "tiny", "--moe-impl", "loop,grouped"])
    with pytest.raises(SystemExit, match="choose one of"):
        _bench(["--preset", "release", "--shrink", "--moe-impl", "fastest"])


def test_release_flops_follow_the_formula():
    cfg = release_config(32)
    with torch.device("meta"):
        model = HunyuanImage3Model(cfg)
    layout = build_request_layout(cfg, ByteTokenizer(), "a" * 1020, 1024, 1024, 4.0)
    P, T = layout.rows[0].prefix_len, layout.rows[0].target_len
    assert (P, T, len(layout.rows)) == (1024, 4097, 2)
    f = flop_model(model, layout, "denoise")
    h, i = 4096, 3072
    active = h * (32 + 2 * 8) * 128 + 32 * 128 * h + h * 64 + (8 + 1) * 3 * h * i  # qkv, o, router, 8+1 experts
    assert f["active_params_per_token_per_layer"] == active
    # the timestep token is causal (P + 1 keys); image tokens see prefix + target
    keys = 2 * ((P + 1) + (T - 1) * (P + T))
    assert (f["tokens"], f["attended_keys"]) == (2 * T, keys)
    assert f["layer"] == 2 * active * 2 * T + 4 * 32 * 128 * keys
    assert f["image"] > 0 and flop_model(model, layout, "recompute")["tokens"] == 2 * layout.rows[0].seq_len


def test_compare_backend_times_both_backends_on_the_same_weights_in_alternation(capsys):
    res = _bench(["--preset", "release", "--shrink", "--layers", "1", "--prefix", "32", "--repeats", "1",
                  "--device", "cpu", "--attention-backend", "torch", "--compare-backend", "torch-segments", "--json"])
    c = json.loads(capsys.readouterr().out)["compare_backend"]
    assert c == res["compare_backend"] and (c["main"], c["other"], c["rounds"]) == ("torch", "torch-segments", 3)
    e = c["eager"]
    assert len(e["main_ms"]) == len(e["other_ms"]) == len(e["ratios"]) == 3
    assert e["ratios"] == pytest.approx([a / b for a, b in zip(e["main_ms"], e["other_ms"])])
    assert c["graph"] is None  # CPU: no CUDA graph


def test_compare_backend_is_refused_where_it_means_nothing():
    with pytest.raises(SystemExit, match="need --preset release"):
        _bench(["--compare-backend", "triton"])
    with pytest.raises(SystemExit, match="drop --e2e-request"):
        _bench(["--preset", "release", "--shrink", "--e2e-request", "--compare-backend", "triton"])
