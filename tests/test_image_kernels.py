"""The channels-last GroupNorm kernels of the image path (`models/hunyuan/image_kernels.py`).

CPU: the kernels run under the Triton interpreter (`TRITON_INTERPRET=1`, set before triton is
imported) in fp32, against torch's GroupNorm (+ modulation, SiLU). The interpreter truncates
fp32 -> bf16 instead of rounding, so the bf16 rounding points are checked on the GPU
(tests/test_image_path_gpu.py). CPU modules never take the kernel path (`image_layers.fast_path`)."""

from __future__ import annotations

import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import torch.nn.functional as F

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
pytestmark = pytest.mark.skipif(not INTERPRET, reason="interpreter tests (CPU); the GPU file checks compiled kernels")


def _ref(x, groups, w, b, eps, mod, silu):
    y = F.group_norm(x.float(), groups, w.float(), b.float(), eps)
    if mod is not None:
        pad = (None,) * (x.dim() - 2)
        scale, shift = mod.float()[(slice(None), slice(None), *pad)].chunk(2, dim=1)
        y = y * (1 + scale) + shift
    return F.silu(y) if silu else y


@pytest.mark.parametrize("n,c,spatial,mod,silu", [
    (1, 256, (5, 7), False, True),      # 8 channels per group, 4 groups per tile... 2 tiles
    (2, 128, (3, 4, 5), True, True),    # 3D (the VAE), 4 channels per group, modulation
    (1, 4096, (3, 3), True, False),     # 128 channels per group: one group per tile
    (1, 128, (70, 3), False, False),    # several position tiles, a masked tail
    (3, 8192, (1, 2), False, True),     # 256 channels per group: a tile wider than 128
])
def test_group_norm_cl_matches_torch_in_fp32(n, c, spatial, mod, silu):
    from ditkv.models.hunyuan import image_kernels as K

    g = torch.Generator().manual_seed(c + n)
    x = torch.randn(n, c, *spatial, generator=g) * 3 + 1.5  # a mean far from 0: no cancellation allowed
    fmt = torch.channels_last if len(spatial) == 2 else torch.channels_last_3d
    xc = x.contiguous(memory_format=fmt)
    w, b = torch.randn(c, generator=g), torch.randn(c, generator=g)
    m = torch.randn(n, 2 * c, generator=g) * 0.1 if mod else None
    assert K.supports(xc, 32)
    y = K.group_norm_cl(xc, 32, w, b, 1e-5, m, silu)
    assert y.shape == x.shape and y.stride() == xc.stride() and y.dtype == x.dtype
    torch.testing.assert_close(y, _ref(x, 32, w, b, 1e-5, m, silu), rtol=1e-5, atol=2e-5)


def test_group_norm_cl_merges_many_tiles_per_program(monkeypatch):
    """Few partial-statistics programs, so each merges several position tiles (Chan's formula)."""
    from ditkv.models.hunyuan import image_kernels as K

    monkeypatch.setattr(K, "TARGET_PROGRAMS", 3)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 128, 37, 11, generator=g) * 5 + 20  # 407 positions: 7 tiles in 3 splits
    w, b = torch.randn(128, generator=g), torch.randn(128, generator=g)
    y = K.group_norm_cl(x.contiguous(memory_format=torch.channels_last), 32, w, b, 1e-5, None, True)
    torch.testing.assert_close(y, _ref(x, 32, w, b, 1e-5, None, True), rtol=1e-5, atol=2e-5)


def test_group_norm_cl_broadcast_modulation_row():
    from ditkv.models.hunyuan import image_kernels as K

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 128, 4, 4, generator=g).contiguous(memory_format=torch.channels_last)
    w, b = torch.ones(128), torch.zeros(128)
    m = torch.randn(1, 256, generator=g)
    y = K.group_norm_cl(x, 32, w, b, 1e-5, m.expand(2, -1), True)
    torch.testing.assert_close(y, _ref(x, 32, w, b, 1e-5, m.expand(2, -1), True), rtol=1e-5, atol=2e-5)


def test_supports_only_channels_last_whole_tiles():
    from ditkv.models.hunyuan import image_kernels as K

    cl = torch.randn(1, 256, 4, 4).contiguous(memory_format=torch.channels_last)
    assert K.supports(cl, 32)
    assert not K.supports(torch.randn(1, 256, 4, 4), 32)  # NCHW
    assert not K.supports(torch.randn(1, 96, 4, 4).contiguous(memory_format=torch.channels_last), 32)  # 3/group
    assert not K.supports(torch.randn(1, 64, 4, 4).contiguous(memory_format=torch.channels_last), 32)  # < a tile
    with pytest.raises(ValueError, match="channels-last"):
        K.group_norm_cl(torch.randn(1, 256, 4, 4), 32, torch.ones(256), torch.zeros(256), 1e-5)


def test_cpu_modules_never_take_the_kernel_path():
    """The CPU (and autograd) run the released ops: the fast path is CUDA inference only."""
    from ditkv.models.hunyuan.image_layers import fast_path

    x = torch.randn(1, 256, 4, 4).contiguous(memory_format=torch.channels_last)
    with torch.inference_mode():
        assert not fast_path(x)


def test_vae_rearrangements_keep_channels_last_and_values():
    from ditkv.models.hunyuan.vae import _channels_last, _from_depth, _repeat_channels

    x = torch.randn(1, 32, 2, 3, 5)
    xc = x.contiguous(memory_format=torch.channels_last_3d)
    for rt in (1, 2):
        got = _from_depth(xc, rt)
        assert _channels_last(got) and torch.equal(got, _from_depth(x, rt))
    got = _repeat_channels(xc, 4)
    assert _channels_last(got) and torch.equal(got, x.repeat_interleave(4, dim=1))


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """The fast path's wiring on CPU tensors: `fast_path` true at inference, the kernels interpreted,
    and Conv3d answering a channels-last input channels-last as cuDNN does (the CPU's returns NCDHW).
    Yields the kernel-call counter."""
    from ditkv.models.hunyuan import image_kernels, image_layers, model, vae

    on = lambda x: not torch.is_grad_enabled()  # noqa: E731
    for mod in (image_layers, model, vae):
        monkeypatch.setattr(mod, "fast_path", on)
    conv3d = torch.nn.Conv3d.forward
    monkeypatch.setattr(torch.nn.Conv3d, "forward", lambda self, x: (
        conv3d(self, x).contiguous(memory_format=torch.channels_last_3d) if vae._channels_last(x) else conv3d(self, x)))
    calls = {"n": 0}
    kernel = image_kernels.group_norm_cl

    def counted(*a, **k):
        calls["n"] += 1
        return kernel(*a, **k)

    monkeypatch.setattr(image_kernels, "group_norm_cl", counted)
    yield calls


def test_fast_path_wiring_matches_the_released_ops_in_fp32(kernels_on_cpu):
    """ResBlock / patch embed / final layer / VAE decoder through the kernels and the channels-last
    rearrangements (fp32, interpreter) against the same modules run eagerly (autograd on)."""
    from ditkv.models.hunyuan import HunyuanImage3Config
    from ditkv.models.hunyuan.model import FinalLayer, PatchEmbed
    from ditkv.models.hunyuan.vae import ReleaseVAE, VAEConfig

    torch.manual_seed(0)
    base = HunyuanImage3Config.tiny().to_dict()
    base.update(hidden_size=256, patch_embed_hidden_dim=128, num_attention_heads=2, num_key_value_heads=1,
                attention_head_dim=128)
    cfg = HunyuanImage3Config.from_dict(base)
    pe, fl = PatchEmbed(cfg).eval(), FinalLayer(cfg).eval()
    for m in (pe, fl):
        for p in m.parameters():
            p.requires_grad_(False)
    x = torch.randn(1, cfg.latent_channels, 6, 5)
    emb = torch.randn(2, cfg.hidden_size)
    tok = torch.randn(2, 30, cfg.hidden_size)
    with torch.inference_mode():
        got = pe(x, emb[:1]), fl(tok, emb, 6, 5)
    assert kernels_on_cpu["n"] == 5  # 2 per ResBlock, the final layer's last norm
    with torch.enable_grad():
        want = pe(x, emb[:1]), fl(tok, emb, 6, 5)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    vae = ReleaseVAE(VAEConfig(block_out_channels=(128, 128, 128, 128, 128), layers_per_block=1)).eval()
    vae.requires_grad_(False)
    lat = torch.randn(1, 32, 2, 2)
    kernels_on_cpu["n"] = 0
    with torch.inference_mode():
        got = vae.decode(lat)
    assert kernels_on_cpu["n"] == 26  # every decoder norm: 2 in each of the 12 ResnetBlocks, attention, norm_out
    with torch.enable_grad():
        want = vae.decode(lat)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
