"""FP8 W8A8 on CUDA (skipped without a GPU): the Triton activation kernels and torch's FP8 GEMMs
against the CPU reference formula, the grouped experts against the per-expert loop, CUDA-graph
replay, the engine's refusals and images."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from ditkv.models import fp8  # noqa: E402

needs_fp8 = pytest.mark.skipif(not torch.cuda.is_available() or fp8.unusable(torch.device("cuda")) is not None,
                               reason="needs an sm89+ GPU with triton")


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@needs_fp8
@pytest.mark.parametrize("m,k", [(1, 4096), (37, 3072), (1000, 200)])
def test_triton_row_quantization_matches_the_reference(m, k):
    from ditkv.models import fp8_kernels

    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g) * 3
    q, s = fp8_kernels.quantize_rows(x)
    rq, rs = fp8.quantize_rows_ref(x)
    torch.testing.assert_close(s, rs, rtol=1e-6, atol=0)
    # the kernel divides the elements approximately (fp8_kernels.py): a value on an e4m3 rounding boundary
    # (bf16 inputs land on ties now and then) may land one step over; the scales are exact
    off = (q.float() != rq.float())
    assert torch.equal(s, rs) and off.float().mean().item() < 1e-2
    assert ((q.float() - rq.float()).abs() <= rq.float().abs() * 2.0**-3 + 2.0**-9).all()


@needs_fp8
def test_fused_swiglu_quantization_matches_the_reference():
    from ditkv.models import fp8_kernels

    x12 = torch.randn(300, 2 * 3072, device="cuda", dtype=torch.bfloat16)
    q, s = fp8_kernels.silu_mul_quant(x12)
    x1, x2 = x12.float().chunk(2, dim=-1)
    rq, rs = fp8.quantize_rows_ref(x1 * torch.nn.functional.silu(x2))  # fp32 gate, as the kernel
    torch.testing.assert_close(s, rs, rtol=1e-5, atol=0)
    assert _rel(q.float() * s, rq.float() * rs) < 1e-3


@needs_fp8
@pytest.mark.parametrize("m", [1, 7, 513])
def test_scaled_mm_linear_matches_the_cpu_reference(m):
    w = torch.randn(768, 512, device="cuda") * 0.02
    x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
    w8, ws = fp8.quantize_weight(w)
    got = fp8.linear(x, w8, ws)
    want = fp8.reference_linear(x.float().cpu(), w8.cpu(), ws.cpu())
    assert got.dtype == torch.bfloat16
    assert _rel(got.cpu(), want) < 1e-2  # bf16 output rounding on top of identical fp8 operands


@needs_fp8
def test_grouped_fp8_experts_match_the_per_expert_loop():
    from ditkv.models.hunyuan.layers import MoE
    from ditkv.models.hunyuan.quantize import quantize_linear_

    torch.manual_seed(0)
    moe = MoE(256, 128, num_experts=8, topk=2).to("cuda", torch.bfloat16).eval()
    for e in list(moe.experts) + [moe.shared_mlp]:
        quantize_linear_(e.gate_and_up_proj)
        quantize_linear_(e.down_proj)
    x = torch.randn(333, 256, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        moe.moe_impl = "loop"
        loop = moe(x)
        moe.moe_impl = "grouped"
        assert moe.resolved_impl(x.device, x.dtype) == "grouped"
        grouped = moe(x)
    assert moe.expert_stack.scales is not None and moe.expert_stack.w13.dtype == fp8.FP8
    assert _rel(grouped, loop) < 2e-2


def _bundle(quant: bool):
    from ditkv.models.hunyuan import ByteTokenizer, HunyuanImage3Config, HunyuanImage3Model, PixelCodec
    from ditkv.models.hunyuan.quantize import quantize_model

    cfg = HunyuanImage3Config.tiny()
    model = HunyuanImage3Model.from_config(cfg, seed=1, zero_init_resblocks=False).to("cuda", torch.bfloat16).eval()
    if quant:
        quantize_model(model)
    return model, ByteTokenizer(), PixelCodec(cfg.image_token_downsample)


def _engine(bundle, graphs="off", seqs=1, **kw):
    from ditkv.config import EngineConfig
    from ditkv.engine.engine import Engine

    cfg = EngineConfig(diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2, block_size=64,
                       num_kv_blocks=64, attention_backend="triton", device="cuda", profile_memory=False,
                       cuda_graphs=graphs, max_num_seqs=seqs, quantization="fp8", **kw)
    return Engine(cfg, model_bundle=bundle)


@needs_fp8
def test_fp8_engine_cuda_graphs_match_eager_and_track_bf16():
    from ditkv.engine.types import GenerationRequest

    reqs = [GenerationRequest(prompt=p, height=64, width=64, steps=4, guidance_scale=4.0, seed=i)
            for i, p in enumerate(["a large blue square", "a small red circle in the top left"])]
    images = {}
    bundle = _bundle(quant=False)
    for graphs in ("on", "off"):
        e = _engine(bundle, graphs=graphs)
        outs = [e.generate(r) for r in reqs]
        assert all(o.ok for o in outs), [o.error for o in outs]
        images[graphs] = [o.image.astype(int) for o in outs]
        if graphs == "on":
            assert e.worker.runner.step_graphs.replays > 0
        assert e.scheduler.manager.pool.num_free == 64
        e.shutdown()
    for a, b in zip(images["on"], images["off"]):
        assert np.abs(a - b).max() <= 1


@needs_fp8
def test_fp8_step_batching_runs_and_stays_close_to_solo():
    from ditkv.engine.types import GenerationRequest

    bundle = _bundle(quant=True)
    reqs = [GenerationRequest(prompt=p, height=64, width=64, steps=4, guidance_scale=4.0, seed=i, request_id=f"r{i}")
            for i, p in enumerate(["a large blue square", "a small red circle", "a green cross"])]
    solo = {}
    for r in reqs:
        e = _engine(bundle)
        solo[r.request_id] = e.generate(r).image.astype(int)
        e.shutdown()
    e = _engine(bundle, seqs=3, graphs="on")
    for r in reqs:
        e.add_request(r)
    outs = {o.request_id: o for o in e.run_until_complete()}
    e.shutdown()
    for rid, img in solo.items():
        assert outs[rid].ok
        # no batch-invariant FP8 kernels: batching changes GEMM tiling, a few levels at most
        assert np.abs(outs[rid].image.astype(int) - img).mean() < 2.0


@needs_fp8
def test_fp8_refuses_batch_invariant_and_non_bf16_on_cuda():
    from ditkv.errors import ConfigError

    bundle = _bundle(quant=False)
    with pytest.raises(ConfigError, match="batch-invariant"):
        _engine(bundle, batch_invariant=True)
    with pytest.raises(ConfigError, match="bfloat16"):
        _engine(bundle, dtype="float32")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("k", [1, 2, 8])
def test_combine_through_the_slot_map_equals_gather_then_weighted_sum(k):
    """The grouped MoE's combine (one Triton pass reading expert-ordered outputs through `inv`) equals
    the un-permuting gather followed by `combine_slots`, up to fp32 summation rounding."""
    from ditkv.models.hunyuan.combine_kernel import combine_gathered
    from ditkv.models.hunyuan.layers import combine_slots

    n, h = 517, 3000
    y = torch.randn(n * k, h, device="cuda", dtype=torch.bfloat16)
    inv = torch.randperm(n * k, device="cuda")
    w = torch.rand(n, k, device="cuda").softmax(-1)
    got = combine_gathered(w, y, inv, torch.bfloat16)
    want = combine_slots(w, y.index_select(0, inv), torch.bfloat16)
    assert (got.float() - want.float()).abs().max().item() <= 2e-2 * want.float().abs().max().item()
    assert _rel(got, want) < 4e-3


@needs_fp8
@pytest.mark.parametrize("m,k", [(300, 4096), (37, 3072)])
def test_add_rms_norm_quant_matches_the_unfused_ops(m, k):
    """The fused residual add + RMSNorm + quantization (`fp8_kernels.add_rms_norm_quant`): the sum
    bit-equal to torch's bf16 add, the norm within one bf16 step of the unfused norm, and the codes
    and scales of that output exactly the reference formula's (IEEE divisions)."""
    from ditkv.models import fp8_kernels
    from ditkv.models.hunyuan.layers import _rms_norm

    g = torch.Generator(device="cuda").manual_seed(m + k)
    h = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g) * 4
    d = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = (1 + 0.1 * torch.randn(k, device="cuda", generator=g)).to(torch.bfloat16)
    hout, y, q, s = fp8_kernels.add_rms_norm_quant(h, d, w, 1e-5)
    assert torch.equal(hout, h + d)
    want = _rms_norm(h + d, w, 1e-5)
    diff = (y.float() - want.float()).abs()
    # rsqrt and the sum of squares round differently from torch's: y may move by a bf16 step or two
    assert (diff <= want.float().abs() * 2.0**-6 + 1e-6).all() and (diff > 0).float().mean().item() < 2e-2
    rq, rs = fp8.quantize_rows_ref(y)
    assert torch.equal(s, rs) and (q.float() != rq.float()).float().mean().item() < 1e-2
    _, none, q2, s2 = fp8_kernels.add_rms_norm_quant(h, None, w, 1e-5, write_y=False)
    rq2, rs2 = fp8.quantize_rows_ref(_rms_norm(h, w, 1e-5))
    # against torch's norm, whose output may sit a bf16 step away, so a few codes move (1.2e-3 measured)
    assert none is None and _rel(q2.float() * s2, rq2.float() * rs2) < 5e-3


@needs_fp8
def test_row_quantization_scales_are_bit_equal_to_the_reference_formula():
    from ditkv.models import fp8_kernels

    x = torch.randn(2000, 3072, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3)) * 5
    x = x.to(torch.bfloat16)
    q, s = fp8_kernels.quantize_rows(x)
    rq, rs = fp8.quantize_rows_ref(x)
    assert torch.equal(s, rs) and (q.float() != rq.float()).float().mean().item() < 1e-2


@needs_fp8
def test_combine_adds_the_shared_expert_and_the_residual():
    from ditkv.models.hunyuan.combine_kernel import combine_gathered

    n, k, h = 333, 8, 4096
    g = torch.Generator(device="cuda").manual_seed(1)
    y = torch.randn(n * k, h, device="cuda", dtype=torch.bfloat16, generator=g)
    inv = torch.randperm(n * k, device="cuda", generator=g)
    w = torch.rand(n, k, device="cuda", generator=g).softmax(-1)
    shared, res = (torch.randn(n, h, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    got = combine_gathered(w, y, inv, torch.bfloat16, shared=shared, residual=res)
    want = (torch.einsum("nk,nkh->nh", w, y.index_select(0, inv).view(n, k, h).float()) + shared.float()
            + res.float())
    assert _rel(got, want) < 4e-3
    with pytest.raises(ValueError, match="contiguous"):
        combine_gathered(w, y, inv, torch.bfloat16, shared=shared.t().contiguous().t())


@needs_fp8
def test_fused_fp8_decoder_layer_is_as_close_to_the_reference_as_the_unfused_layer(monkeypatch):
    """`fp8_layer`: the norms, quantizations and adds fused around the same FP8 GEMMs. Fused and unfused
    differ by bf16 rounding steps (the compiled unfused norm skips a rounding the fused kernel keeps),
    which a random layer amplifies (a step can move an e4m3 code, then attention): so both are held
    to the fp32 CPU reference of the same quantized layer, and the fused one must be no further."""
    import copy

    from ditkv.models.hunyuan import HunyuanImage3Config, fp8_layer
    from ditkv.models.hunyuan.layers import rope_cos_sin
    from ditkv.models.hunyuan.model import DecoderLayer
    from ditkv.models.hunyuan.quantize import move_model, quantize_model

    cfg = HunyuanImage3Config.tiny()
    torch.manual_seed(0)
    layer = DecoderLayer(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.05)
    layer = layer.to("cuda", torch.bfloat16).eval()
    quantize_model(layer, names=[n for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)
                                 and "gate.wg" not in n] + ["self_attn.qkv_proj"])
    ref_layer = move_model(copy.deepcopy(layer), torch.device("cpu"), torch.float32)
    n = 700
    h = torch.randn(n, cfg.hidden_size, device="cuda", dtype=torch.bfloat16) * 0.05
    pos = torch.arange(n)
    cos, sin = rope_cos_sin(pos // 32, pos % 32, cfg.attention_head_dim, 10000.0)
    groups = cfg.num_attention_heads // cfg.num_key_value_heads

    def attn(_, q, k, v):
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k.repeat_interleave(groups, 1),
                                                              v.repeat_interleave(groups, 1)))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)[0].transpose(0, 1).contiguous()

    with torch.inference_mode():
        ref = ref_layer(h.float().cpu(), cos, sin, attn, 0)
        route = ref_layer.mlp.gate(ref_layer.post_attention_layernorm(
            h.float().cpu() + ref_layer.self_attn(ref_layer.input_layernorm(h.float().cpu()), cos, sin, attn, 0)),
            cfg.moe_topk)
        # one routing for all three: a flipped near-tie would compare different experts
        monkeypatch.setattr(layer.mlp.gate, "forward", lambda x, k: tuple(t.cuda() for t in route))
        cc, sc = cos.cuda(), sin.cuda()
        assert fp8_layer.applies(layer, h)
        fused = layer(h, cc, sc, attn, 0)
        monkeypatch.setattr(fp8_layer, "applies", lambda *a: False)
        plain = layer(h, cc, sc, attn, 0)
    update = lambda out: out.float().cpu() - h.float().cpu()
    err_fused, err_plain = _rel(update(fused), ref - h.float().cpu()), _rel(update(plain), ref - h.float().cpu())
    assert err_fused <= 1.1 * err_plain + 1e-3, (err_fused, err_plain)
    assert _rel(fused.cpu(), ref) < 2e-2
