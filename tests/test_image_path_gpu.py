"""The channels-last CUDA image path (`image_layers.fast_path`): ResBlocks, patch embed, final layer and
the VAE decoder with Triton GroupNorms give the eager NCHW path's results (bf16 rounding level), keep
their layouts, and capture in a CUDA graph. GPU only; skipped elsewhere."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = cuda


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _eager(fn):
    with torch.enable_grad():  # nothing requires grad: the plain NCHW path, as on the CPU
        return fn()


def _randomize(module, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, device="cuda", generator=g) * (0.3 if p.dim() == 1 else 0.05)
                    + (1.0 if name.endswith("weight") and p.dim() == 1 else 0.0))
    return module.requires_grad_(False).eval()


def test_group_norm_kernel_in_bf16_is_as_close_to_fp64_as_torch():
    """GroupNorm + modulation + SiLU in bf16 against the same ops in fp64 on the same inputs: the
    kernel rounds at least as well as the eager bf16 ops (which round after every op too)."""
    from ditkv.models.hunyuan import image_kernels as K

    g = torch.Generator(device="cuda").manual_seed(0)
    for c, s, mod in ((512, (16, 16), True), (4096, (64, 64), True), (128, (4, 256, 256), False)):
        x = (torch.randn(2, c, *s, device="cuda", generator=g) * 2 + 1).to(torch.bfloat16)
        w = torch.randn(c, device="cuda", generator=g).to(torch.bfloat16)
        b = torch.randn(c, device="cuda", generator=g).to(torch.bfloat16)
        m = (torch.randn(2, 2 * c, device="cuda", generator=g) * 0.2).to(torch.bfloat16) if mod else None
        fmt = torch.channels_last if len(s) == 2 else torch.channels_last_3d
        got = K.group_norm_cl(x.contiguous(memory_format=fmt), 32, w, b, 1e-5, m, True)
        assert got.is_contiguous(memory_format=fmt)
        pad = (None,) * len(s)

        def ops(x, w, b, m):
            y = F.group_norm(x, 32, w, b, 1e-5)
            if m is not None:
                y = y * (1 + m[(slice(None), slice(None), *pad)][:, :c]) + m[(slice(None), slice(None), *pad)][:, c:]
            return F.silu(y)

        exact = ops(*(t.double() if t is not None else None for t in (x, w, b, m)))
        eager = ops(x, w, b, m)
        assert _rel(got, exact) <= 1.1 * _rel(eager, exact) + 1e-4, (c, s, _rel(got, exact), _rel(eager, exact))


def _resblock_cfg():
    from ditkv.models.hunyuan import HunyuanImage3Config

    base = HunyuanImage3Config.tiny().to_dict()
    base.update(hidden_size=256, patch_embed_hidden_dim=128, num_attention_heads=2, num_key_value_heads=1,
                attention_head_dim=128)
    return HunyuanImage3Config.from_dict(base)


def test_patch_embed_and_final_layer_fast_path_match_eager():
    from ditkv.models.hunyuan.model import FinalLayer, PatchEmbed

    cfg = _resblock_cfg()
    pe = _randomize(PatchEmbed(cfg).cuda().to(torch.bfloat16), 1)
    fl = _randomize(FinalLayer(cfg).cuda().to(torch.bfloat16), 2)
    pe_old, fl_old = copy.deepcopy(pe), copy.deepcopy(fl)
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(1, cfg.latent_channels, 16, 12, device="cuda", generator=g).to(torch.bfloat16)
    emb = (torch.randn(2, cfg.hidden_size, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
    tok = torch.randn(2, 16 * 12, cfg.hidden_size, device="cuda", generator=g).to(torch.bfloat16)
    with torch.inference_mode():
        got_pe, got_fl = pe(x, emb[:1]), fl(tok, emb, 16, 12)
    want_pe, want_fl = _eager(lambda: pe_old(x, emb[:1])), _eager(lambda: fl_old(tok, emb, 16, 12))
    assert pe.model[1].in_layers[2].weight.is_contiguous(memory_format=torch.channels_last)
    assert got_pe.shape == want_pe.shape and got_pe.is_contiguous()  # tokens [R, h*w, C]
    assert got_fl.shape == want_fl.shape and got_fl.is_contiguous()  # velocity NCHW, as before
    assert _rel(got_pe, want_pe) < 1e-2 and _rel(got_fl, want_fl) < 1e-2
    assert pe.state_dict()["model.1.in_layers.2.weight"].contiguous().equal(
        pe_old.state_dict()["model.1.in_layers.2.weight"])  # same values, re-laid storage


def test_fast_image_path_captures_in_a_cuda_graph():
    from ditkv.models.hunyuan.model import FinalLayer

    cfg = _resblock_cfg()
    fl = _randomize(FinalLayer(cfg).cuda().to(torch.bfloat16), 4)
    tok = torch.randn(2, 64, cfg.hidden_size, device="cuda").to(torch.bfloat16)
    emb = torch.randn(2, cfg.hidden_size, device="cuda").to(torch.bfloat16)
    with torch.inference_mode():
        eager = fl(tok, emb, 8, 8)  # warm-up: compiles the kernels, re-lays the weights
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fl(tok, emb, 8, 8)
        tok.copy_(torch.randn_like(tok))
        graph.replay()
        assert torch.equal(out, fl(tok, emb, 8, 8))
        assert not torch.equal(out, eager)


def test_vae_decoder_channels_last_matches_eager_whole_and_tiled():
    """The channels-last decoder against the eager NCDHW one, both bf16, each against the eager fp32
    decode of the same weights: the fast path is no further from fp32 than the eager bf16 path."""
    from ditkv.models.hunyuan.vae import ReleaseVAE, VAEConfig

    vcfg = VAEConfig(block_out_channels=(128, 128, 256, 256, 256), layers_per_block=1, sample_size=64)
    ref = _randomize(ReleaseVAE(vcfg).cuda(), 5)
    vae, old = copy.deepcopy(ref).to(torch.bfloat16), copy.deepcopy(ref).to(torch.bfloat16)
    lat = torch.randn(1, vcfg.latent_channels, 8, 8, device="cuda")
    for tile in (None, 4):
        vae.tile_latent = old.tile_latent = ref.tile_latent = tile
        with torch.inference_mode():
            got = vae.decode(lat)
        want, exact = _eager(lambda: old.decode(lat)), _eager(lambda: ref.decode(lat))
        assert got.shape == want.shape == (1, 3, 128, 128) and got.is_contiguous()
        assert _rel(got, exact) <= 1.2 * _rel(want, exact) + 1e-3, (tile, _rel(got, exact), _rel(want, exact))
    assert vae.decoder.conv_in.weight.is_contiguous(memory_format=torch.channels_last_3d)
