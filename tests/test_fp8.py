"""FP8 W8A8 on the CPU: the quantization formula, the reference linear, which layers are quantized,
the ignore list, the config fields, and the engine running the tiny model in fp8.

The Triton activation kernels run under the interpreter here (`TRITON_INTERPRET=1`, set before
triton is imported); on a GPU tests/test_fp8_gpu.py checks them compiled."""

from __future__ import annotations

import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's import; CPU-only machines

import numpy as np
import pytest
import torch

from ditkv.config import EngineConfig
from ditkv.errors import ConfigError
from ditkv.models import fp8
from ditkv.models.hunyuan import ByteTokenizer, HunyuanImage3Config, HunyuanImage3Model, PixelCodec
from ditkv.models.hunyuan.invariant import linear
from ditkv.models.hunyuan.quantize import QUANTIZED, fp8_bytes, quantization_of, quantize_model, target_names

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _tiny(seed=1):
    cfg = HunyuanImage3Config.tiny()
    return HunyuanImage3Model.from_config(cfg, seed=seed, zero_init_resblocks=False)


# ----------------------------------------------------------------------------- the formula
def test_row_quantization_maps_each_rows_amax_to_448_and_stays_within_e4m3_rounding():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=g) * torch.logspace(-3, 2, 64).unsqueeze(1)  # rows of very different size
    q, s = fp8.quantize_rows_ref(x)
    assert q.dtype == fp8.FP8 and s.shape == (64, 1) and s.dtype == torch.float32
    assert torch.equal(q.float().abs().amax(-1), torch.full((64,), 448.0))  # every row uses the full range
    back = q.float() * s
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 in the normal range, absolute <= 2^-10 * s below
    err = (back - x).abs()
    assert torch.all(err <= torch.maximum(x.abs() * 2.0**-4, s * 2.0**-9) * (1 + 1e-6))


def test_zero_rows_quantize_to_zeros_and_reference_linear_gives_zeros():
    x = torch.zeros(3, 32)
    q, s = fp8.quantize_rows_ref(x)
    assert torch.equal(q.float(), x) and torch.all(s > 0)
    w8, ws = fp8.quantize_weight(torch.randn(16, 32))
    assert torch.equal(fp8.reference_linear(x, w8, ws), torch.zeros(3, 16))


def test_reference_linear_is_the_dequantized_product_of_both_operands():
    """Not a weight-only simulation: the tokens are quantized per row too."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(10, 64, generator=g), torch.randn(48, 64, generator=g)
    w8, ws = fp8.quantize_weight(w)
    xq, xs = fp8.quantize_rows_ref(x)
    want = (xq.float() * xs) @ (w8.float() * ws.unsqueeze(1)).t()
    torch.testing.assert_close(linear(x, w8, scale=ws), want, rtol=1e-4, atol=1e-5)  # another summation order
    weight_only = x @ (w8.float() * ws.unsqueeze(1)).t()
    assert (weight_only - want).abs().max() > 1e-3  # the activation error is really there


def test_cpu_fp8_linear_is_row_invariant():
    """A token's result does not depend on the batch it is in (per-token scales, one product per row)."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(77, 64, generator=g), torch.randn(32, 64, generator=g)
    w8, ws = fp8.quantize_weight(w)
    full = linear(x, w8, scale=ws)
    for lo, hi in ((0, 1), (5, 6), (3, 40), (40, 77)):
        assert torch.equal(linear(x[lo:hi], w8, scale=ws), full[lo:hi])


@pytest.mark.skipif(not INTERPRET, reason="interpreter check (CPU); the GPU file checks the compiled kernels")
def test_triton_activation_kernels_give_the_reference_scales_under_the_interpreter():
    """The row scales (the amax pass, masked tails included) are checked here. The e4m3 values are
    not: the interpreter's fp32 -> e4m3 cast is wrong (-124.3 -> -64), so tests/test_fp8_gpu.py
    compares the quantized values on the GPU."""
    from ditkv.models import fp8_kernels

    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 200, generator=g)  # not a power of two: masked tail
    _, s = fp8_kernels.quantize_rows(x)
    assert torch.equal(s, fp8.quantize_rows_ref(x)[1])
    x12 = torch.randn(9, 2 * 100, generator=g)
    _, s = fp8_kernels.silu_mul_quant(x12)
    x1, x2 = x12.chunk(2, dim=-1)
    assert torch.allclose(s, fp8.quantize_rows_ref(x1 * torch.nn.functional.silu(x2))[1], rtol=1e-5, atol=0)


# ----------------------------------------------------------------------------- which layers
def test_every_decoder_linear_is_quantized_and_everything_else_kept():
    model = _tiny()
    cfg = model.config
    assert quantize_model(model) == cfg.num_hidden_layers * (2 + 2 * cfg.num_experts + 2 * (cfg.num_shared_expert > 0))
    for name, p in model.named_parameters():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and QUANTIZED.search(module):
            assert p.dtype == fp8.FP8, name
            scale = model.get_parameter(module + ".weight_scale")
            assert scale.dtype == torch.float32 and scale.shape == (p.shape[0],)
        elif not name.endswith(".weight_scale"):
            assert p.dtype != fp8.FP8, f"{name} must stay in the model dtype"
    assert model.model.layers[0].mlp.gate.wg.weight.dtype == torch.float32
    assert quantization_of(model) == "fp8"
    b = fp8_bytes(model)
    assert b["fp8_weights"] > 0 and b["scales"] > 0


def test_ignored_layers_stay_unquantized():
    model = _tiny()
    targets = target_names(model)
    kept = [t for t in targets if t.startswith("model.layers.0.") or ".shared_mlp." in t]
    assert 0 < len(kept) < len(targets)
    assert quantize_model(model, ["model.layers.0.*", "*.shared_mlp"]) == len(targets) - len(kept)
    for name in targets:
        assert (model.get_submodule(name).weight.dtype == fp8.FP8) == (name not in kept), name
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
    assert model.model.layers[1].mlp.shared_mlp.down_proj.weight.dtype == torch.float32
    assert model.model.layers[1].self_attn.o_proj.weight.dtype == fp8.FP8


def test_quantized_state_dict_round_trips_in_the_release_layout():
    model = _tiny()
    quantize_model(model)
    sd = model.state_dict()
    assert sd["model.layers.0.self_attn.qkv_proj.weight"].dtype == fp8.FP8
    twin = _tiny(seed=9)
    quantize_model(twin)
    twin.load_state_dict(sd)
    assert all(torch.equal(a.view(torch.uint8) if a.dtype == fp8.FP8 else a,
                           b.view(torch.uint8) if b.dtype == fp8.FP8 else b)
               for a, b in zip(sd.values(), twin.state_dict().values()))


def test_quantized_model_tracks_the_bf16_one_within_fp8_error():
    model = _tiny()
    q = _tiny()
    quantize_model(q)
    x = torch.randn(20, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    for a, b in ((model.model.layers[0].mlp, q.model.layers[0].mlp),
                 (model.model.layers[0].self_attn.qkv_proj, q.model.layers[0].self_attn.qkv_proj)):
        ya, yb = a(x), b(x)
        ya, yb = (ya[0], yb[0]) if isinstance(ya, tuple) else (ya, yb)
        rel = ((ya - yb).norm() / ya.norm()).item()
        assert 1e-3 < rel < 0.1, rel  # e4m3: a few percent on random weights, never zero


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize("kw,field", [
    (dict(quantization="int4"), "quantization"),
    (dict(quantization="fp8", quantization_ignored_layers="model.layers.0.*"), "quantization_ignored_layers"),
    (dict(quantization="fp8", quantization_ignored_layers=[""]), "quantization_ignored_layers"),
    (dict(quantization_ignored_layers=["model.layers.0.*"]), "quantization_ignored_layers"),
])
def test_bad_quantization_settings_are_refused_by_name(kw, field):
    with pytest.raises(ConfigError) as e:
        EngineConfig(**kw)
    assert e.value.field == field


# ----------------------------------------------------------------------------- the engine
def _engine_image(quant, mode="paged_scheduler", **kw):
    from ditkv.engine.engine import Engine
    from ditkv.engine.types import GenerationRequest

    model = _tiny()
    bundle = (model, ByteTokenizer(), PixelCodec(model.config.image_token_downsample))
    cfg = EngineConfig(device="cpu", dtype="float32", diffusion_kv_mode=mode, attention_backend="torch",
                       diffusion_kv_max_rows_per_request=2 if mode == "paged_scheduler" else None,
                       num_kv_blocks=64 if mode == "paged_scheduler" else None, block_size=16,
                       profile_memory=False, quantization=quant, **kw)
    e = Engine(cfg, model_bundle=bundle)
    try:
        out = e.generate(GenerationRequest(prompt="a large red circle", height=32, width=32, steps=3,
                                           guidance_scale=4.0, seed=7))
    finally:
        e.shutdown()
    assert quantization_of(model) is None  # the caller's model is never quantized in place
    return np.asarray(out.image).astype(int), e


def test_fp8_engine_paged_equals_dense_and_differs_from_fp32():
    paged, e = _engine_image("fp8")
    assert quantization_of(e.worker.model) == "fp8"
    dense, _ = _engine_image("fp8", mode="dense_legacy")
    ref, _ = _engine_image(None)
    assert np.abs(paged - dense).max() <= 1
    assert np.abs(paged - ref).max() > 0


def test_fp8_leaves_more_of_the_memory_budget_to_the_kv_pool():
    """The pool is sized from what the model leaves (its parameter bytes; with the profile on, plus the
    measured transient, which on the CPU is a noisy RSS high-water mark, so it is off here): e4m3
    weights leave more, by about the bytes they save."""
    from ditkv.engine.engine import Engine
    from ditkv.models.loader import param_bytes

    blocks, weights = {}, {}
    for q in (None, "fp8"):
        e = Engine(EngineConfig(device="cpu", diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2,
                                block_size=16, quantization=q, profile_memory=False))
        blocks[q], weights[q] = e.num_blocks, param_bytes(e.worker.model)
        per_block = e.worker.bytes_per_block()
        e.shutdown()
    saved = weights[None] - weights["fp8"]
    assert saved > 0.5 * weights[None] * 0.5  # most parameters are decoder linears, 4 -> 1 byte each
    assert blocks["fp8"] - blocks[None] == pytest.approx(saved / per_block, abs=1), (blocks, saved)
