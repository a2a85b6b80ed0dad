"""`ditkv bench step --preset release` with FP8 (`--quantization fp8`, `--compare-bf16`), the layer-by-layer
random builder, the kernel-profile buckets and `--e2e-request`: the code paths on the CPU at toy widths
(`--shrink`); the H200 runs the real geometry."""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ditkv.bench import step_release
from ditkv.bench.step_parts import _Ranges, kernel_buckets
from ditkv.bench.step_e2e import RELEASE_VAE, random_vae_on_device, vae_config
from ditkv.bench.step_release import model_bytes, random_model_on_device, release_config
from ditkv.entrypoints.cli import build_parser
from ditkv.models import fp8
from ditkv.models.hunyuan import HunyuanImage3Model
from ditkv.models.hunyuan.model import INIT_STD, _is_norm_weight
from ditkv.models.hunyuan.quantize import fp8_bytes, quantization_of, quantize_model
from ditkv.models.hunyuan.vae import VAEConfig

FIXTURE = Path(__file__).parent / "fixtures" / "release_config_base.json"
SHRUNK = ["--preset", "release", "--shrink", "--layers", "2", "--prefix", "32", "--repeats", "1", "--device", "cpu"]


def _bench(argv: list[str]):
    args = build_parser().parse_args(["bench", "step", *argv])
    return args.func(args)


def _whole_model(cfg, device, dtype, seed: int = 0):
    """The builder before it went layer by layer (the whole model made on the device, then drawn):
    the reference the layer-by-layer one must reproduce."""
    with torch.device("meta"):
        model = HunyuanImage3Model(cfg).to(dtype)
    for layer in model.model.layers:
        layer.mlp.gate.float()
    model = model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
            elif _is_norm_weight(name, p):
                p.fill_(1.0)
            else:
                g = torch.Generator(device=device).manual_seed((seed * 0x9E3779B1 + zlib.crc32(name.encode())) % 2**63)
                p.normal_(0.0, INIT_STD, generator=g)
    return model.requires_grad_(False).eval()


def _assert_bit_equal(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        x, y = sa[k], sb[k]
        assert (x.dtype, x.shape) == (y.dtype, y.shape), k
        assert torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)), k


# ------------------------------------------------------------------------------------ builder
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layerwise_builder_makes_the_whole_model_builders_weights(dtype):
    cfg = release_config(2, shrink=True)
    new, old = random_model_on_device(cfg, "cpu", dtype, seed=3), _whole_model(cfg, "cpu", dtype, seed=3)
    _assert_bit_equal(new, old)
    assert new.model.layers[0].mlp.gate.wg.weight.dtype == torch.float32  # the router stays fp32
    assert quantization_of(new) is None


@pytest.mark.parametrize("ignored", [(), ("model.layers.0.*", "*.shared_mlp")])
def test_fp8_builder_equals_quantize_model_of_the_bf16_model(ignored):
    cfg = release_config(2, shrink=True)
    new = random_model_on_device(cfg, "cpu", torch.bfloat16, quantization="fp8", ignored=ignored)
    old = _whole_model(cfg, "cpu", torch.bfloat16)
    n = quantize_model(old, ignored)
    _assert_bit_equal(new, old)
    assert quantization_of(new) == "fp8" and n > 0
    assert fp8.is_fp8(new.model.layers[1].self_attn.o_proj.weight)
    assert fp8.is_fp8(new.model.layers[0].self_attn.o_proj.weight) == (not ignored)
    assert new.model.layers[0].mlp.gate.wg.weight.dtype == torch.float32  # never quantized, never cast


def test_builder_quantizes_each_layer_before_making_the_next(monkeypatch):
    """Peak ~ one unquantized layer + the FP8 model: when layer i is drawn, the layers before it are
    FP8 already and the ones after it not made yet (meta)."""
    seen = []
    real = step_release._init_random_

    def spy(named, device, seed):
        named = list(named)
        if named[0][0].startswith("model.layers."):
            model_layers = spy.model.model.layers
            i = int(named[0][0].split(".")[2])
            seen.append(i)
            assert all(fp8.is_fp8(model_layers[j].mlp.experts[0].down_proj.weight) for j in range(i))
            assert all(model_layers[j].mlp.experts[0].down_proj.weight.is_meta for j in range(i + 1, len(model_layers)))
        real(named, device, seed)

    cfg = release_config(3, shrink=True)
    orig_to_empty = torch.nn.Module.to_empty

    def capture(self, *a, **k):  # the top-level model is materialised first: remember it for the spy
        if isinstance(self, HunyuanImage3Model):
            spy.model = self
        return orig_to_empty(self, *a, **k)

    monkeypatch.setattr(step_release, "_init_random_", spy)
    monkeypatch.setattr(torch.nn.Module, "to_empty", capture)
    random_model_on_device(cfg, "cpu", torch.bfloat16, quantization="fp8")
    assert seen == [0, 1, 2]


def test_model_bytes_predicts_the_built_weights():
    cfg = release_config(2, shrink=True)
    with torch.device("meta"):
        meta = HunyuanImage3Model(cfg).to(torch.bfloat16)
    for layer in meta.model.layers:
        layer.mlp.gate.float()
    for quant in (None, "fp8"):
        built = random_model_on_device(cfg, "cpu", torch.bfloat16, quantization=quant)
        assert model_bytes(meta, quant) == sum(fp8_bytes(built).values())


# ------------------------------------------------------------------------------ fp8 in the bench
def test_fp8_and_bf16_in_one_run(capsys):
    res = _bench([*SHRUNK, "--quantization", "fp8", "--compare-bf16", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["quantization"] == res["quantization"] == "fp8"
    assert out["fp8_grouped_gemm"] == "torch"  # the CPU reference has no grouped kernel to swap
    cmp = out["compare_bf16"]
    base = cmp["baseline"]
    assert base["quantization"] is None and cmp["baseline_dtype"] == base["dtype"] == "float32"  # CPU: fp32
    assert base["flops"] == out["flops"]  # same geometry
    kinds, base_kinds = out["weights_bytes_by_kind"], base["weights_bytes_by_kind"]
    assert kinds["fp8_weights"] > 0 and kinds["scales"] > 0 and base_kinds["fp8_weights"] == base_kinds["scales"] == 0
    assert out["weights_bytes"] == sum(kinds.values()) < base["weights_bytes"] == sum(base_kinds.values())
    assert cmp["fp8_over_bf16"]["weights_bytes"] == pytest.approx(out["weights_bytes"] / base["weights_bytes"])
    for res_ in (out, base):
        b = res_["build"]
        assert b["peak_kind"] == "cpu_peak_rss" and b["peak_bytes"] > 0 and b["build_s"] > 0
        assert res_["memory_left_for_kv"] is None and res_["graph"] is None  # CPU: no device memory, no graph
        assert res_["peak_flops"]["measured_fp8"] == 1391e12
    eager = cmp["fp8_over_bf16"]["eager"]
    assert eager.keys() == out["moe_impls"].keys() == {"auto"}
    for ph in ("denoise", "recompute"):
        r, rb = out["moe_impls"]["auto"][ph], base["moe_impls"]["auto"][ph]
        assert r["mfu_fp8_rate"] == pytest.approx(r["mfu"] * 788 / 1391)
        assert r["mfu_32_layers_fp8_rate"] == pytest.approx(r["mfu_32_layers"] * 788 / 1391)
        assert r["moe_mfu_fp8_rate"] > 0 and r["layer_mfu_fp8_rate"] > 0 and "mfu_fp8_rate" not in rb
        assert eager["auto"][ph]["step_ms"] == pytest.approx(r["step_ms"] / rb["step_ms"])
        assert eager["auto"][ph]["moe_ms"] == pytest.approx(r["moe_ms"] / rb["moe_ms"])
    assert out["moe_impls"]["auto"]["denoise"]["kernels"] is None  # CPU: no kernels to profile
    assert cmp["fp8_over_bf16"]["graph"] is None


def test_fp8_flags_are_checked():
    with pytest.raises(SystemExit, match="--compare-bf16 compares against --quantization fp8"):
        _bench([*SHRUNK, "--compare-bf16"])
    with pytest.raises(SystemExit, match="need --preset release"):
        _bench(["--preset", "tiny", "--quantization", "fp8"])
    with pytest.raises(SystemExit, match="need --preset release"):
        _bench(["--preset", "tiny", "--e2e-request"])
    with pytest.raises(SystemExit, match="grouped"):  # the FP8 grouped GEMM is CUDA-only
        _bench([*SHRUNK, "--quantization", "fp8", "--moe-impl", "grouped"])
    with pytest.raises(SystemExit, match="add --e2e-request"):
        _bench([*SHRUNK, "--max-num-seqs", "2"])
    with pytest.raises(SystemExit, match="one --moe-impl"):
        _bench([*SHRUNK, "--e2e-request", "--moe-impl", "loop,grouped"])
    with pytest.raises(SystemExit, match="--fp8-grouped-gemm needs --preset release --quantization fp8"):
        _bench([*SHRUNK, "--fp8-grouped-gemm", "torch"])


# ----------------------------------------------------------------------------- kernel buckets
def _ev(name, parent=None, us=0.0, kernel=False):
    from torch.autograd import DeviceType

    return SimpleNamespace(name=name, cpu_parent=parent, device_time_total=us, is_user_annotation=False,
                           device_type=DeviceType.CUDA if kernel else DeviceType.CPU)


def test_kernel_buckets_split_the_moe():
    moe = _ev("ditkv.moe", us=100.0)
    router = _ev("ditkv.router", moe, us=10.0)
    shared = _ev("ditkv.shared_mlp", moe, us=20.0)
    attn = _ev("ditkv.attn_block", us=50.0)
    linear = _ev("aten::linear", attn)
    events = [moe, router, shared, attn, linear,
              _ev("aten::_scaled_grouped_mm", moe, us=55.0), _ev("aten::_scaled_mm", shared, us=15.0),
              _ev("aten::mm", router, us=4.0), _ev("aten::mm", linear, us=30.0), _ev("aten::addmm", us=7.0),
              _ev("_quant_rows_kernel_0d1d", us=6.0, kernel=True), _ev("_silu_mul_quant_kernel", us=4.0, kernel=True),
              _ev("nvjet_gemm", us=90.0, kernel=True),
              SimpleNamespace(**{**vars(_ev("ditkv.moe", us=100.0, kernel=True)), "is_user_annotation": True})]
    b = kernel_buckets(events)
    assert b["total_kernel_us"] == 100.0 and b["act_quant_us"] == 10.0 and b["act_quant_share"] == 0.1
    assert (b["moe_us"], b["router_us"], b["shared_mlp_us"], b["attn_block_us"]) == (100.0, 10.0, 20.0, 50.0)
    assert (b["moe_gemm_us"], b["shared_mlp_gemm_us"], b["router_gemm_us"]) == (55.0, 15.0, 4.0)
    assert (b["attn_block_gemm_us"], b["outside_gemm_us"]) == (30.0, 7.0)
    assert b["routed_us"] == 70.0 and b["routed_other_us"] == 15.0
    assert b["moe_split"] == {"routed_gemm_us": 55.0, "router_sort_gather_combine_us": 25.0, "shared_mlp_us": 20.0}
    assert b["top_kernels"][0] == {"name": "nvjet_gemm", "us": 90.0, "calls": 1}


def test_kernel_buckets_count_quack_kernels_the_profiler_left_outside_the_ranges():
    moe = _ev("ditkv.moe", us=40.0)  # its device time misses the driver-launched quack kernels
    events = [moe, _ev("ditkv::fp8_grouped_mm_quack", moe, us=0.0), _ev("ditkv.shared_mlp", moe, us=20.0),
              _ev("kernel_cutlass_kernel_quackepiloguefrontendGemmMod_rowwise_scaled_x", us=60.0, kernel=True),
              _ev("other", us=40.0, kernel=True)]
    b = kernel_buckets(events)
    assert b["quack_unranged_us"] == 60.0 and b["moe_us"] == 100.0 and b["moe_gemm_us"] == 60.0
    assert b["moe_split"]["routed_gemm_us"] == 60.0 and b["routed_other_us"] == 20.0
    ranged = _ev("ditkv::fp8_grouped_mm_quack", moe, us=60.0)  # a profiler that does tie them: nothing added
    b = kernel_buckets([moe, ranged, events[3]])
    assert b["quack_unranged_us"] == 0.0 and b["moe_gemm_us"] == 60.0


def test_kernel_ranges_nest_in_a_real_profile():
    """The record_function ranges (forward hooks) and the GEMM ops inside them, in a CPU profile
    timed by CPU time (the GPU run uses device time, same tree)."""
    from ditkv.bench.step_release import _release_engine
    from ditkv.worker.rows import DENOISE, PREFILL

    cfg = release_config(1, shrink=True)
    model = random_model_on_device(cfg, "cpu", torch.float32)
    args = SimpleNamespace(prefix=32, block_size=64, backend="auto", guidance=4.0)
    e, rid, layout = _release_engine(args, model, cfg, torch.device("cpu"), 64)
    x, t = torch.randn(1, cfg.latent_channels, layout.h, layout.w), torch.tensor([500.0])
    with torch.inference_mode():
        e.worker.runner.forward_step(rid, layout, x, t, PREFILL, True, None)
        ranges = _Ranges(model)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            e.worker.runner.forward_step(rid, layout, x, t, DENOISE, False, None)
        ranges.close()
    b = kernel_buckets(prof.events(), time_of=lambda ev: ev.cpu_time_total)
    assert b["moe_us"] > b["router_us"] + b["shared_mlp_us"] and b["attn_block_us"] > 0
    for r in ("moe", "router", "shared_mlp", "attn_block"):
        assert 0 < b[f"{r}_gemm_us"] <= b[f"{r}_us"], r
    assert b["total_kernel_us"] == 0 and b["act_quant_share"] is None  # no CUDA kernels on a CPU
    assert not ranges.open


# --------------------------------------------------------------------------------- e2e request
def test_release_vae_config_is_the_checkpoints():
    section = json.loads(FIXTURE.read_text())["vae"]
    cfg = release_config(1)
    assert vae_config(cfg) == VAEConfig.from_dict(section) == VAEConfig.from_dict(RELEASE_VAE)
    assert vae_config(cfg).scaling_factor == cfg.vae_scaling_factor
    small = vae_config(cfg, shrink=True)
    assert (small.latent_channels, small.ffactor_spatial) == (cfg.latent_channels, cfg.image_token_downsample)
    vae = random_vae_on_device(small, "cpu", torch.float32)
    img = vae.decode(torch.randn(1, 32, 2, 2))
    assert img.shape == (1, 3, 32, 32) and torch.isfinite(img).all()


def test_e2e_request_reports_every_timing_field(capsys):
    # 3 steps: step 1 decodes nothing and prices the denoise (with 2, denoise_s = one step less a VAE
    # decode timed apart, which noise on a loaded host drove below zero)
    res = _bench([*SHRUNK, "--e2e-request", "--e2e-steps", "3", "--image", "32", "--quantization", "fp8",
                  "--compare-bf16", "--max-num-seqs", "1", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["e2e_request"] and out["quantization"] == res["quantization"] == "fp8"
    assert (out["steps"], out["rows"], out["prefix_tokens"], out["target_tokens"]) == (3, 2, 32, 5)  # 2x2 latents
    base = out["compare_bf16"]["baseline"]
    for r in (out, base):
        req = r["request"]
        for k in ("prefill_s", "denoise_s", "decode_s", "total_s"):
            assert req[k] > 0, k
        assert req["prefill_s"] + req["denoise_s"] + req["decode_s"] == pytest.approx(req["total_s"])
        assert req["images_per_min"] == pytest.approx(60 / req["total_s"])
        assert r["request_runs"][0]["image_shape"] == [32, 32, 3] and r["warmup_s"] > 0
        assert set(r["throughput"]) == {"1", "2"}
        two = r["throughput"]["2"]
        assert two["requests"] == 2 and len(two["latency_s"]) == 2
        assert two["images_per_min"] == pytest.approx(120 / two["total_s"])
        assert two["steps_at_batch_size"] == {"2": 3}  # both requests ran every step together
        assert r["vae"]["weights_bytes"] > 0 and r["build"]["weights_bytes"] > 0
    assert set(out["compare_bf16"]["fp8_over_bf16"]) == {"prefill_s", "denoise_s", "decode_s", "total_s"}
