"""Image-conditioned generation (issue 16 item 1): input images in the DiT prefix.

The first part checks the layout rules read from the release Instruct code, the limits and refusals, the
vision encoder's key names, and that a paged request with images computes its prefix once and reuses it.
The second part compares a whole edit request against upstream's numbers (tests/fixtures/release_edit_tiny.*,
made by tools/make_edit_fixture.py from the fork suryatmodulus/HunyuanImage-3.0@1ea1526): one and two input
images, cond + uncond rows, through a release-format folder and `load_model`: token ids, 2D positions,
full-attention spans and slots exactly; the VAE crop bit for bit; each image's VAE posterior sample (the
request seed's generator, images in order, then the initial noise), vision encoder + aligner features and
the first-step velocity (dense and paged) at fp32 rel <= 1e-5; and mis-mapped conditions that must miss.
"""

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_release_transformer import _write_release_folder, seeded_weights

from ditkv.attention.torch_backend import TorchBackend
from ditkv.core.metadata import DiffusionKVMetadata, RowMetadata
from ditkv.errors import LayoutError
from ditkv.models.hunyuan import HunyuanImage3Config, HunyuanImage3Model, build_request_layout
from ditkv.models.hunyuan.codec import PixelCodec
from ditkv.models.hunyuan.layout import build_ar_head
from ditkv.models.hunyuan.template import TemplateSettings
from ditkv.models.hunyuan.tokenizer import BYTE_VOCAB_SIZE, ByteTokenizer
from ditkv.models.hunyuan.vision import vit_grid
from ditkv.models.loader import load_model
from ditkv.worker.conditioning import CondEmbeds
from ditkv.worker.dit_runner import Denoising, DiTRunner
from ditkv.worker.page_pool import PagePool
from ditkv.worker.rows import PREFILL, WorkerRows
from ditkv.worker.denoising import denoise
from ditkv.worker.step_inputs import embed

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
    with pytest.raises(LayoutError, match=r"reads at most 2 \(max_input_images\)") as e:
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
    # an AR stage's head (issue 16 item 4) is the cond row before the output image's <boi>: ids,
    # positions, spans and image slots alike
    head = build_ar_head(cfg, ByteTokenizer(), "a cat", 64, 48, images=imgs)
    n = cond.prefix_len - 3
    assert head.token_ids == lay.cond_text_ids() == ids[:n]
    assert torch.equal(head.pos_y, cond.pos_y[:n]) and torch.equal(head.pos_x, cond.pos_x[:n])
    assert head.spans == tuple(s for s in cond.full_attn_spans if s[1] <= n) and len(head.spans) == len(spans) - 1  # not the output image
    assert [(i.timestep_index, i.vae_start, i.vit_start) for i in head.images] == \
        [(i.timestep_index, i.vae_start, i.vit_start) for i in lay.images]


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
    x_p, st_p = denoise(paged, "r", lay, steps=3, guidance=5.0, seed=7)
    dense = DiTRunner(model, paged=False, codec=codec)
    x_d, st_d = denoise(dense, "r", lay, steps=3, guidance=5.0, seed=7)
    assert ((x_p - x_d).abs().max() / x_d.abs().max()).item() <= 1e-5
    prefix = sum(r.prefix_len for r in lay.rows)
    assert st_p.prefix_tokens_reused == 2 * prefix  # steps 1 and 2 read the prefix (images included)
    assert st_p.tokens_computed == sum(r.seq_len for r in lay.rows) + 2 * sum(r.target_len for r in lay.rows)
    # the images reach the prediction; the same seed gives the same result
    base = build_request_layout(cfg, ByteTokenizer(), "a cat", 32, 32, 5.0, images=[_img(40, 56, 3), _img(20, 20, 2)])
    x_o, _ = denoise(DiTRunner(model, paged=False, codec=codec), "r", base, steps=3, guidance=5.0, seed=7)
    assert (x_o - x_d).abs().max().item() > 1e-4
    x_again, _ = denoise(DiTRunner(model, paged=False, codec=codec), "r", lay, steps=3, guidance=5.0, seed=7)
    assert torch.equal(x_again, x_d)


def test_prefix_slots_without_embeddings_are_an_error():
    cfg = _tiny(max_input_images=1, cond_image_type="vae", num_hidden_layers=1)
    model = HunyuanImage3Model.from_config(cfg, seed=0)
    lay = build_request_layout(cfg, ByteTokenizer(), "a", 32, 32, 5.0, images=[_img(16, 16)])
    runner = DiTRunner(model, paged=False)
    spans = [(0, r.seq_len) for r in lay.rows]
    inp = runner._inputs([(lay, spans, None, None)])  # the slots are known, their embeddings missing
    with pytest.raises(ValueError, match="encode_images"):
        embed(model, inp, [torch.zeros(1, cfg.latent_channels, lay.h, lay.w)], [torch.ones(1)])


# ------------------------------------------------------------------ golden: a whole edit request
# tests/fixtures/release_edit_tiny.{safetensors,json}: upstream's Instruct code (the fork
# suryatmodulus/HunyuanImage-3.0@1ea1526) with seeded weights (tiny transformer, VAE, SigLIP2 encoder, aligner),
# run for the first step of an edit request with one input image (pretrain template) and with two (instruct
# template), cond + uncond rows, on CPU in float32; `tools/make_edit_fixture.py --reference CHECKOUT`
# regenerates them. Here the same weights are written as a release-format folder (config.json, shards,
# tokenizer.json), loaded by ditkv's loader, and ditkv's request must give the fork's numbers.

FIXTURES = Path(__file__).parent / "fixtures"  # tracked in git: a missing fixture fails, never skips
TOL = 1e-5  # fp32, relative to the largest value of the quantity
CASES = ("one", "two")


def make_image(h: int, w: int, seed: int) -> np.ndarray:
    """The fixture's input images (tools/make_edit_fixture.py `make_image`, its JSON's `image_rule`)."""
    small = np.random.default_rng(seed).integers(0, 256, (-(-h // 2), -(-w // 2), 3), dtype=np.uint8)
    return np.ascontiguousarray(small.repeat(2, 0).repeat(2, 1)[:h, :w])


def _rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


class _Recording:
    """The codec, recording every posterior sample it draws (what `DiTRunner.condition` embeds)."""

    def __init__(self, codec):
        self.codec, self.samples = codec, []

    def encode_sample(self, img, generator=None):
        z = self.codec.encode_sample(img, generator)
        self.samples.append(z.detach().clone())
        return z


# "full" (the fork's class default: two blocks per input image) and "joint_full" (the official base
# config: one block over latent tokens, <joint_img_sep> and vision tokens), `--cond-attn` of the tool
EDIT_FIXTURES = {"full": "release_edit_tiny", "joint_full": "release_edit_joint_tiny"}


@pytest.fixture(scope="module", params=list(EDIT_FIXTURES))
def edit_release(request):
    name = EDIT_FIXTURES[request.param]
    data = load_file(FIXTURES / f"{name}.safetensors")
    meta = json.loads((FIXTURES / f"{name}.json").read_text())
    assert meta["config"]["cond_token_attn_type"] == request.param
    return data, meta


@pytest.fixture(scope="module")
def edit_loaded(edit_release, tmp_path_factory):
    """The folder through `load_model`; per case its layout, and the request's start as `Denoising` makes it
    (the images' posterior samples and embeddings, then the initial noise, from the request seed)."""
    meta = edit_release[1]
    state = seeded_weights({k: tuple(v) for k, v in meta["weight_shapes"].items()})
    folder = _write_release_folder(tmp_path_factory.mktemp("edit_ckpt"), meta["config"], state)
    (folder / "tokenizer.json").write_text(meta["tokenizer_json"])
    named = {f"{k}_token": v for k, v in meta["named_specials"].items()}
    (folder / "tokenizer_config.json").write_text(json.dumps(named))
    model, tok, codec = load_model(str(folder), torch.device("cpu"), torch.float32)
    out = {}
    for name in CASES:
        req = meta["cases"][name]
        images = [make_image(*im["size_hw"], im["seed"]) for im in req["images"]]
        tpl = TemplateSettings(sequence_template=req["sequence_template"])
        layout = build_request_layout(model.config, tok, req["prompt"], req["height"], req["width"], 5.0,
                                      images=images, template=tpl)
        rec = _Recording(codec)
        runner = DiTRunner(model, paged=False, codec=rec)
        st = Denoising(runner, "r", layout, steps=4, guidance=5.0, seed=req["seed"])
        out[name] = {"layout": layout, "cond": st.cond, "x": st.x, "samples": rec.samples, "images": images}
    return model, tok, codec, out


def test_edit_config_loads_the_vision_encoder_and_vae(edit_loaded, edit_release):
    model, _, codec, _ = edit_loaded
    meta = edit_release[1]
    cfg = model.config
    got = (cfg.max_input_images, cfg.cond_image_type, cfg.image_base_size, cfg.image_token_downsample)
    assert got == (3, "vae_vit", 256, 16)
    assert model.vision_model is not None and model.vision_aligner is not None
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert shapes == {k: v for k, v in meta["weight_shapes"].items() if not k.startswith("vae.")}
    vae = {"vae." + k: list(v.shape) for k, v in codec._sample.__self__.state_dict().items()}
    assert vae == {k: v for k, v in meta["weight_shapes"].items() if k.startswith("vae.")}


@pytest.mark.parametrize("name", CASES)
def test_edit_layout_equals_upstream(edit_loaded, edit_release, name):
    """Token ids and 2D positions of both rows, the full-attention spans and every slot: exact."""
    data, meta = edit_release
    req = meta["cases"][name]
    lay = edit_loaded[3][name]["layout"]
    assert len(lay.rows) == 2 and len(lay.images) == len(req["images"])
    for r, row in enumerate(lay.rows):
        assert row.token_ids.tolist() == data[f"{name}.token_ids"][r].tolist(), (name, row.role)
        assert row.pos_y.tolist() == data[f"{name}.pos"][r, :, 0].tolist(), (name, row.role)
        assert row.pos_x.tolist() == data[f"{name}.pos"][r, :, 1].tolist(), (name, row.role)
        assert [list(s) for s in row.full_attn_spans] == req["full_attn_spans"]
        assert row.timestep_index == req["timestep_index"]
        assert [row.image_start, row.image_start + lay.num_image_tokens] == req["image_span"]
    assert (lay.h, lay.w) == (req["token_height"], req["token_width"])
    for im, want in zip(lay.images, req["images"]):
        assert [im.vae_start, im.vae_start + im.h * im.w] == want["vae_slice"]
        assert [im.vit_start, im.vit_start + im.vit_len] == want["vit_slice"]
        assert im.timestep_index == want["timestep_index"] and list(im.vit_shape) == want["vit_grid_hw"]
        # the VAE input: the image resized (LANCZOS) and centre-cropped to its bucket, bit for bit
        u8 = ((im.vae_pixels[0] * 0.5 + 0.5) * 255).round().clamp(0, 255).to(torch.uint8)
        assert list(u8.shape[1:]) == want["vae_crop_uint8"]["size"] == want["vae_bucket_hw"]
        assert hashlib.sha256(u8.permute(1, 2, 0).contiguous().numpy().tobytes()).hexdigest() == \
            want["vae_crop_uint8"]["sha256"]


@pytest.mark.parametrize("name", CASES)
def test_edit_vae_samples_vision_features_and_noise_equal_upstream(edit_loaded, edit_release, name):
    """The seed rule: one CPU generator per request, each image's posterior sample in order, then the noise."""
    model, _, _, cases = edit_loaded
    data, meta = edit_release
    case = cases[name]
    lay = case["layout"]
    assert len(case["samples"]) == len(lay.images)
    for j, (im, z) in enumerate(zip(lay.images, case["samples"])):
        want = data[f"{name}.vae_sample.{j}"]
        assert z.shape == want.shape and _rel(z, want) <= TOL, (j, _rel(z, want))
        assert _rel(z, data[f"{name}.vae_mean.{j}"]) > 100 * TOL  # a posterior sample, not the mean
        with torch.inference_mode():
            feats = model.vision_tokens(im.vit_patches, im.vit_mask, im.vit_shape)
        assert feats.shape == data[f"{name}.vit.{j}"].shape
        assert _rel(feats, data[f"{name}.vit.{j}"]) <= TOL, (j, _rel(feats, data[f"{name}.vit.{j}"]))
        assert torch.equal(case["cond"].vit[j], feats)
    # the initial noise: the same draw, in bfloat16 as the fork's pipeline draws it, bit for bit (fp32 tensor)
    assert case["x"].dtype == torch.float32 and torch.equal(case["x"], data[f"{name}.noise"])
    # drawn from a fresh generator (not after the images' samples), the noise would differ
    fresh = torch.randn(case["x"].shape, generator=torch.Generator().manual_seed(meta["cases"][name]["seed"]))
    assert _rel(fresh, data[f"{name}.noise"]) > 100 * TOL


def _edit_step(model, layout, x, t, cond, paged: bool, *, runner_hook=None) -> torch.Tensor:
    if paged:
        runner = _paged_runner(model, layout, None)
        cache = None
    else:
        runner = DiTRunner(model, paged=False)
        cache = runner.new_dense_cache(layout)
    if runner_hook is not None:
        runner_hook(runner)
    with torch.inference_mode():
        v, n = runner.forward_step("r", layout, x, t, PREFILL, True, cache, cond=cond)
    assert n == sum(r.seq_len for r in layout.rows)
    return v


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("name", CASES)
def test_edit_first_step_velocity_equals_upstream(edit_loaded, edit_release, name, paged):
    model, _, _, cases = edit_loaded
    data, meta = edit_release
    c = cases[name]
    v = _edit_step(model, c["layout"], data[f"{name}.noise"], torch.tensor([meta["cases"][name]["timestep"]]),
                   c["cond"], paged)
    want = data[f"{name}.velocity"]
    assert v.shape == want.shape and v.dtype == torch.float32
    assert _rel(v, want) <= TOL, f"max abs {(v - want).abs().max().item():.3g}, rel {_rel(v, want):.3g}"
    assert _rel(want[1:], want[:1]) > 100 * TOL  # the two rows differ (the prompt reaches the image)


def _wrong_cond_timestep(model, c):
    """The images embedded at the step's timestep (1000) instead of 0."""
    t = torch.full((1,), 1000.0)
    with torch.inference_mode():
        return CondEmbeds(model.timestep_token(t)[0], [model.embed_image(z, t)[0] for z in c["samples"]], c["cond"].vit)


def _posterior_mean(model, c):
    """The images' posterior means (the fork's numbers) instead of samples."""
    with torch.inference_mode():
        return CondEmbeds(c["cond"].ts, [model.cond_image_tokens(z) for z in c["means"]], c["cond"].vit)


def _vision_swapped(model, c):
    """Image 0's vision tokens in image 1's slots and back."""
    return CondEmbeds(c["cond"].ts, c["cond"].vae, c["cond"].vit[::-1])


def _vision_in_latent_slots(model, c):
    """Each image's vision tokens where its first latent tokens go, and its latents' head in the vision slots."""
    vae, vit = [], []
    for a, b in zip(c["cond"].vae, c["cond"].vit):
        n = b.shape[0]
        vae.append(torch.cat([b, a[n:]]))
        vit.append(a[:n].clone())
    return CondEmbeds(c["cond"].ts, vae, vit)


MISMAPPED = {"cond timestep 1000, not 0": ("one", _wrong_cond_timestep),
             "posterior mean, not a sample": ("one", _posterior_mean),
             "vision tokens of the two images swapped": ("two", _vision_swapped),
             "vision tokens swapped with latents": ("one", _vision_in_latent_slots)}


@pytest.mark.parametrize("what", list(MISMAPPED))
def test_a_mismapped_condition_misses_upstream_by_far(edit_loaded, edit_release, what):
    model, _, _, cases = edit_loaded
    data, _ = edit_release
    name, wrong = MISMAPPED[what]
    c = dict(cases[name], means=[data[f"{name}.vae_mean.{j}"] for j in range(len(cases[name]["layout"].images))])
    v = _edit_step(model, c["layout"], data[f"{name}.noise"], torch.tensor([1000.0]), wrong(model, c), False)
    assert _rel(v, data[f"{name}.velocity"]) > 100 * TOL, what


def test_an_uncond_row_without_the_images_misses_upstream(edit_loaded, edit_release, monkeypatch):
    """The fork's uncond row keeps the input images; one whose image slots hold plain `<img>` / `<timestep>`
    embeddings (the images dropped) gives another uncond velocity."""
    import ditkv.worker.dit_runner as dit_runner

    model, _, _, cases = edit_loaded
    data, _ = edit_release
    c = cases["one"]
    lay = c["layout"]

    def drop_images_in_uncond(runner):
        inner = dit_runner.embed

        def embed(m, inp, xs, ts):
            hidden = inner(m, inp, xs, ts)
            off, lo = inp.fills[1][:2]  # the uncond row's packed offset and range start
            row = lay.rows[1]
            for im in lay.images:
                for start, n in ((im.timestep_index, 1), (im.vae_start, im.h * im.w), (im.vit_start, im.vit_len)):
                    at = off + start - lo
                    hidden[at:at + n] = m.embed_tokens(row.token_ids[start:start + n])
            return hidden

        monkeypatch.setattr(dit_runner, "embed", embed)

    v = _edit_step(model, lay, data["one.noise"], torch.tensor([1000.0]), c["cond"], False,
                   runner_hook=drop_images_in_uncond)
    want = data["one.velocity"]
    assert _rel(v[0], want[0]) <= TOL  # the cond row is untouched
    assert _rel(v[1], want[1]) > 100 * TOL


def test_causal_input_image_blocks_miss_upstream(edit_loaded, edit_release):
    """Each input image's latent block is (inside) a full-attention span (its vision block too, checked by
    the layout test); attending the latent blocks causally misses."""
    model, _, _, cases = edit_loaded
    data, _ = edit_release
    lay = cases["two"]["layout"]
    starts = {im.vae_start for im in lay.images}
    rows = [dataclasses.replace(r, full_attn_spans=tuple(s for s in r.full_attn_spans if s[0] not in starts))
            for r in lay.rows]
    v = _edit_step(model, dataclasses.replace(lay, rows=rows), data["two.noise"], torch.tensor([1000.0]),
                   cases["two"]["cond"], False)
    assert _rel(v, data["two.velocity"]) > 100 * TOL


def test_the_other_cond_attention_type_misses_upstream(edit_loaded, edit_release):
    """The two fixtures tell "full" and "joint_full" apart: each image's spans of the other type (two
    blocks, the separator causal; or one block) give another velocity."""
    model, _, _, cases = edit_loaded
    data, meta = edit_release
    lay = cases["two"]["layout"]
    joint = meta["config"]["cond_token_attn_type"] == "joint_full"
    images = tuple(dataclasses.replace(im, joint=not joint) for im in lay.images)
    other = sorted({s for im in images for s in im.spans()} | {(lay.rows[0].image_start,
                                                                lay.rows[0].image_start + lay.num_image_tokens)})
    assert tuple(other) != lay.rows[0].full_attn_spans
    rows = [dataclasses.replace(r, full_attn_spans=tuple(other)) for r in lay.rows]
    v = _edit_step(model, dataclasses.replace(lay, rows=rows, images=images), data["two.noise"],
                   torch.tensor([1000.0]), cases["two"]["cond"], False)
    assert _rel(v, data["two.velocity"]) > 20 * TOL  # measured 3.7e-4 (ditkv's own type: <= 1e-5)
