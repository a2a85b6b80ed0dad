"""Image-conditioned generation (issue 16 item 1): input images in the DiT prefix.

Not yet here: the golden fixture from the release Instruct code (tools/make_edit_fixture.py, to be
written); these tests check the layout rules read from that code, the limits and refusals, the vision
encoder's key names, and that a paged request with images computes its prefix once and reuses it.
"""

import numpy as np
import pytest
import torch

from ditkv.attention.torch_backend import TorchBackend
from ditkv.core.metadata import DiffusionKVMetadata, RowMetadata
from ditkv.errors import LayoutError
from ditkv.models.hunyuan import HunyuanImage3Config, HunyuanImage3Model, build_request_layout
from ditkv.models.hunyuan.codec import PixelCodec
from ditkv.models.hunyuan.tokenizer import BYTE_VOCAB_SIZE, ByteTokenizer
from ditkv.models.hunyuan.vision import vit_grid
from ditkv.worker.dit_runner import DiTRunner
from ditkv.worker.page_pool import PagePool
from ditkv.worker.rows import WorkerRows

BS = 16
VIT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
       "num_patches": 16, "patch_size": 8, "num_channels": 3, "layer_norm_eps": 1e-6,
       "hidden_act": "gelu_pytorch_tanh"}


def _img(h, w, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _tiny(**kw):
    return HunyuanImage3Config.tiny().replace(**kw)


def _vit_cfg(n=2):
    extra = {"vit": VIT, "vit_aligner": {"projector_type": "mlp_gelu", "input_dim": 32, "n_embed": 128, "depth": 2},
             "vit_processor": {"patch_size": 8, "max_num_patches": 12}}
    return _tiny(max_input_images=n, cond_image_type="vae_vit", joint_img_sep_token_id=BYTE_VOCAB_SIZE - 1,
                 extra=extra)


def test_a_model_without_input_images_refuses_them():
    cfg = HunyuanImage3Config.tiny()
    assert cfg.max_input_images == 0
    with pytest.raises(LayoutError, match="takes no input images") as e:
        build_request_layout(cfg, ByteTokenizer(), "x", 64, 64, 5.0, images=[_img(32, 32)])
    assert e.value.field == "image"
    # no images, or an empty list: the text-to-image row, unchanged
    a = build_request_layout(cfg, ByteTokenizer(), "x", 64, 64, 5.0)
    b = build_request_layout(cfg, ByteTokenizer(), "x", 64, 64, 5.0, images=[])
    assert a.rows[0].token_ids.tolist() == b.rows[0].token_ids.tolist() and not b.images


def test_the_image_count_limit_is_named():
    cfg = _tiny(max_input_images=2, cond_image_type="vae")
    with pytest.raises(LayoutError, match="max_input_images=2") as e:
        build_request_layout(cfg, ByteTokenizer(), "x", 64, 64, 5.0, images=[_img(32, 32)] * 3)
    assert e.value.field == "image"
    with pytest.raises(LayoutError, match=r"images\[1\] must be a uint8 RGB array"):
        build_request_layout(cfg, ByteTokenizer(), "x", 64, 64, 5.0, images=[_img(32, 32), np.zeros((4, 4))])


def test_release_default_limit_follows_the_vision_encoder():
    base = HunyuanImage3Config.tiny().to_dict()
    assert HunyuanImage3Config.from_dict(base).max_input_images == 0
    with_vit = dict(base, vit=VIT)
    del with_vit["max_input_images"]
    assert HunyuanImage3Config.from_dict(with_vit).max_input_images == 3  # release README: up to 3 inputs


@pytest.mark.parametrize("vit", [False, True], ids=["vae", "vae_vit"])
def test_layout_places_each_image_before_the_prompt(vit):
    cfg = _vit_cfg() if vit else _tiny(max_input_images=2, cond_image_type="vae")
    imgs = [_img(40, 56, 1), _img(64, 32, 2)]
    lay = build_request_layout(cfg, ByteTokenizer(), "a cat", 64, 48, 5.0, images=imgs)
    cond, uncond = lay.rows
    assert len(lay.images) == 2
    ids = cond.token_ids.tolist()
    at = 1  # pretrain template: <bos> then the images
    for im in lay.images:
        assert im.timestep_index == at + 3
        assert ids[at:at + 4] == [cfg.boi_token_id, cfg.img_size_token_id, ids[at + 2], cfg.timestep_token_id]
        assert im.vae_start == at + 4 and (im.h, im.w) == (16, 12)  # the tiny model: the generated size
        end = im.vae_start + im.h * im.w
        if vit:
            assert ids[end] == cfg.joint_img_sep_token_id and im.vit_start == end + 1 and im.vit_len == 12
            end = im.vit_start + im.vit_len
        assert ids[end] == cfg.eoi_token_id
        at = end + 1
    assert ids[at:at + 5] == list(b"a cat")
    # the uncond row keeps the images, replaces only the prompt
    u = uncond.token_ids.tolist()
    assert u[:at] == ids[:at] and u[at:at + 5] == [cfg.cfg_token_id] * 5
    spans = [s for im in lay.images for s in im.spans()] + [(cond.image_start, cond.image_start + 16 * 12)]
    assert cond.full_attn_spans == tuple(sorted(spans)) == uncond.full_attn_spans
    assert cond.prefix_len == cond.timestep_index > lay.images[-1].vae_start
    # 2D positions of an image block: centred on its index range (as the generated image)
    im = lay.images[0]
    n = im.h * im.w
    assert cond.pos_y[im.vae_start].item() == im.vae_start + (n - im.h) // 2
    assert cond.pos_x[im.vae_start + 1].item() == im.vae_start + (n - im.w) // 2 + 1
    if vit:  # the vision block: its patch grid, its padding tokens keep their index
        gh, gw = im.vit_shape
        assert gh * gw <= im.vit_len
        pad = im.vit_start + gh * gw
        assert cond.pos_y[pad:im.vit_start + im.vit_len].tolist() == list(range(pad, im.vit_start + im.vit_len))
    with pytest.raises(LayoutError, match="AR stage"):
        lay.cond_text_ids()


def test_vit_grid_fits_the_patch_budget():
    """Values of transformers 4.56.2 `get_image_size_for_max_num_patches` (the release's processor; 0 of 420
    size/patch/budget combinations differ, checked when this was written)."""
    assert vit_grid(200, 176, 16, 16) == (64, 64)
    assert vit_grid(1000, 3000, 16, 1024) == (288, 864)
    assert vit_grid(40, 56, 8, 12) == (24, 32)


def test_vision_keys_are_the_release_names():
    model = HunyuanImage3Model.from_config(_vit_cfg(), seed=0)
    keys = [k for k in model.state_dict() if k.startswith(("vision_model.", "vision_aligner."))]
    for want in ("vision_model.embeddings.patch_embedding.weight", "vision_model.embeddings.position_embedding.weight",
                 "vision_model.encoder.layers.1.self_attn.out_proj.bias", "vision_model.encoder.layers.0.mlp.fc2.weight",
                 "vision_model.encoder.layers.0.layer_norm2.weight", "vision_model.post_layernorm.weight",
                 "vision_model.head.probe", "vision_model.head.attention.in_proj_weight",
                 "vision_aligner.layers.0.weight", "vision_aligner.layers.2.bias"):
        assert want in keys, want
    assert HunyuanImage3Model.from_config(_tiny(max_input_images=2, cond_image_type="vae")).vision_model is None


def _paged_runner(model, layout, codec):
    c = model.config
    blocks = sum(-(-r.seq_len // BS) for r in layout.rows) + 2
    pool = PagePool(blocks, c.num_hidden_layers, c.num_key_value_heads, BS, c.attention_head_dim)
    rows, metas, nxt = WorkerRows(blocks, BS, 2), [], 2
    for i, r in enumerate(layout.rows):
        nb = -(-r.seq_len // BS)
        metas.append(RowMetadata(i, r.prefix_len, r.target_len, r.seq_len, r.full_attn_spans,
                                 tuple(range(nxt, nxt + nb))))
        nxt += nb
    rows.install(DiffusionKVMetadata("r", 1, BS, tuple(metas)))
    return DiTRunner(model, TorchBackend(), pool, rows, codec=codec)


@pytest.mark.parametrize("vit", [False, True], ids=["vae", "vae_vit"])
def test_paged_request_with_images_reuses_its_prefix_and_equals_dense(vit):
    cfg = _vit_cfg() if vit else _tiny(max_input_images=2, cond_image_type="vae")
    cfg = cfg.replace(num_hidden_layers=2)
    model = HunyuanImage3Model.from_config(cfg, seed=0, zero_init_resblocks=False)
    codec = PixelCodec(cfg.image_token_downsample)
    lay = build_request_layout(cfg, ByteTokenizer(), "a cat", 32, 32, 5.0, images=[_img(40, 56, 1), _img(20, 20, 2)])
    paged = _paged_runner(model, lay, codec)
    x_p, st_p = paged.generate("r", lay, steps=3, guidance=5.0, seed=7)
    dense = DiTRunner(model, paged=False, codec=codec)
    x_d, st_d = dense.generate("r", lay, steps=3, guidance=5.0, seed=7)
    assert ((x_p - x_d).abs().max() / x_d.abs().max()).item() <= 1e-5
    prefix = sum(r.prefix_len for r in lay.rows)
    assert st_p.prefix_tokens_reused == 2 * prefix  # steps 1 and 2 read the prefix (images included)
    assert st_p.tokens_computed == sum(r.seq_len for r in lay.rows) + 2 * sum(r.target_len for r in lay.rows)
    # the images reach the prediction; the same seed gives the same result
    base = build_request_layout(cfg, ByteTokenizer(), "a cat", 32, 32, 5.0, images=[_img(40, 56, 3), _img(20, 20, 2)])
    x_o, _ = DiTRunner(model, paged=False, codec=codec).generate("r", base, steps=3, guidance=5.0, seed=7)
    assert (x_o - x_d).abs().max().item() > 1e-4
    x_again, _ = DiTRunner(model, paged=False, codec=codec).generate("r", lay, steps=3, guidance=5.0, seed=7)
    assert torch.equal(x_again, x_d)


def test_prefix_slots_without_embeddings_are_an_error():
    cfg = _tiny(max_input_images=1, cond_image_type="vae", num_hidden_layers=1)
    model = HunyuanImage3Model.from_config(cfg, seed=0)
    lay = build_request_layout(cfg, ByteTokenizer(), "a", 32, 32, 5.0, images=[_img(16, 16)])
    runner = DiTRunner(model, paged=False)
    spans = [(0, r.seq_len) for r in lay.rows]
    with pytest.raises(ValueError, match="DiTRunner.condition"):
        runner._step_inputs(lay, spans, torch.zeros(1, cfg.latent_channels, lay.h, lay.w), torch.ones(1))
