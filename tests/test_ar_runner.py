"""AR stage runner: causal prefill over its own pages equals the DiT's prefix K/V; generation."""

import pytest
import torch

from ditkv.attention.torch_backend import TorchBackend
from ditkv.core.metadata import DiffusionKVMetadata, RowMetadata
from ditkv.models.hunyuan import HunyuanImage3Config, HunyuanImage3Model, build_request_layout
from ditkv.models.hunyuan.tokenizer import ByteTokenizer
from ditkv.models.hunyuan.layout import image_tail_ids
from ditkv.models.hunyuan.tokenizer import banned_generation_ids
from ditkv.worker.ar_runner import ARRunner
from ditkv.worker.dit_runner import DiTRunner
from ditkv.worker.page_pool import PagePool
from ditkv.models.text_settings import TextSampling
from ditkv.worker.rows import PREFILL, WorkerRows

BS = 16


@pytest.fixture(scope="module")
def model():
    return HunyuanImage3Model.from_config(HunyuanImage3Config.tiny(), seed=3, zero_init_resblocks=False).eval()


def ar_runner(model, blocks=32):
    c = model.config
    pool = PagePool(blocks, c.num_hidden_layers, c.num_key_value_heads, BS, c.attention_head_dim)
    return ARRunner(model, TorchBackend(), pool), pool


def test_ar_prefix_kv_equals_dit_prefix_kv(model):
    c, tok = model.config, ByteTokenizer()
    prompt = "a small green triangle above a red square"
    layout = build_request_layout(c, tok, prompt, 32, 32, 3.0)
    cond = layout.rows[0]
    runner, pool = ar_runner(model)
    head = [c.bos_token_id] + tok.encode(prompt)
    res = runner.run("r", head, image_tail_ids(c, 32, 32), list(range(4)))
    assert res.token_ids == cond.token_ids[:cond.prefix_len].tolist()
    # the DiT computes the same row from scratch (step 0, no import) into its own pool
    dpool = PagePool(32, c.num_hidden_layers, c.num_key_value_heads, BS, c.attention_head_dim)
    rows = WorkerRows(32, BS, 2)
    nb = -(-cond.seq_len // BS)
    rows.install(DiffusionKVMetadata("r", 1, BS, (RowMetadata(0, cond.prefix_len, cond.target_len, cond.seq_len,
                                                              cond.full_attn_spans, tuple(range(10, 10 + nb))),)))
    dit = DiTRunner(model, TorchBackend(), dpool, rows)
    one_row = type(layout)(rows=[cond], h=layout.h, w=layout.w, cfg_factor=1)
    with torch.inference_mode():
        x = torch.randn(1, c.latent_channels, layout.h, layout.w)
        dit.forward_step("r", one_row, x, torch.tensor([900.0]), PREFILL, True)
    p = cond.prefix_len
    ar_kv = pool.kv[:4].permute(1, 2, 3, 0, 4, 5).reshape(c.num_hidden_layers, 2, -1, 4 * BS, 32)[..., :p, :]
    dit_kv = dpool.kv[10:14].permute(1, 2, 3, 0, 4, 5).reshape(c.num_hidden_layers, 2, -1, 4 * BS, 32)[..., :p, :]
    assert ar_kv.abs().sum() > 0
    assert torch.equal(ar_kv, dit_kv)  # bit for bit: fixed-shape CPU products (docs/batching.md)


def test_generation_greedy_and_seeded_sampling(model):
    c, tok = model.config, ByteTokenizer()
    head = [c.bos_token_id] + tok.encode("draw")
    tail = image_tail_ids(c, 32, 32)
    banned = banned_generation_ids(c)
    runs = []
    for temp, seed, top_k in ((0.0, 0, 0), (0.0, 1, 0), (1.0, 5, 0), (1.0, 5, 0), (1.0, 7, 1)):
        runner, _ = ar_runner(model)
        runs.append(runner.run("r", head, tail, list(range(8)),
                               TextSampling(temperature=temp, top_k=top_k, max_new_tokens=6, seed=seed),
                               eos_id=c.eos_token_id, banned=banned))
    assert runs[0].generated_ids == runs[1].generated_ids  # greedy ignores the seed
    assert runs[2].generated_ids == runs[3].generated_ids  # sampling is reproducible per seed
    assert runs[4].generated_ids == runs[0].generated_ids  # top_k 1 is greedy
    for r in runs:
        assert not set(r.generated_ids) & banned
        assert r.token_ids == head + r.generated_ids + tail
        assert r.tokens_computed == len(r.token_ids)


def test_generated_tokens_kv_matches_a_one_shot_prefill(model):
    """Decoding token by token writes the same K/V as prefilling the final sequence at once."""
    c = model.config
    head = [c.bos_token_id, 97, 98]
    r1, p1 = ar_runner(model)
    res = r1.run("r", head, [c.boi_token_id], list(range(4)), TextSampling(max_new_tokens=5), eos_id=None,
                 banned=banned_generation_ids(c))
    r2, p2 = ar_runner(model)
    r2.run("r", res.token_ids, [], list(range(4)))
    n = len(res.token_ids)
    a = p1.kv[:4].permute(1, 2, 3, 0, 4, 5).reshape(c.num_hidden_layers, 2, -1, 4 * BS, 32)[..., :n, :]
    b = p2.kv[:4].permute(1, 2, 3, 0, 4, 5).reshape(c.num_hidden_layers, 2, -1, 4 * BS, 32)[..., :n, :]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_too_few_pages_is_an_error(model):
    runner, _ = ar_runner(model)
    with pytest.raises(ValueError, match="need more than"):
        runner.run("r", list(range(40)), [], [0, 1])


# ---- input images in the AR head (issue 16 item 4) ------------------------------------------------
def _edit_model(vit: bool):
    import sys
    import os
    sys.path.insert(0, os.path.dirname(__file__))
    from test_release_edit import _tiny, _vit_cfg

    cfg = _vit_cfg() if vit else _tiny(max_input_images=2, cond_image_type="vae")
    return HunyuanImage3Model.from_config(cfg, seed=4, zero_init_resblocks=False).eval()


def _pages_kv(pool, first: int, n_blocks: int, n: int):
    c = pool.kv.shape
    return pool.kv[first:first + n_blocks].permute(1, 2, 3, 0, 4, 5).reshape(c[1], 2, c[3], n_blocks * BS, c[5])[..., :n, :]


@pytest.mark.parametrize("vit", [False, True], ids=["vae", "vae_vit"])
def test_ar_head_with_input_images_writes_the_dits_prefix_kv(vit):
    """The AR prefills `<bos> <images> prompt` with the images' blocks bidirectional, 2D positions and
    embeddings (VAE samples from the request seed): K/V equal the DiT's own prefix K/V. Wrong variants
    (no spans, images swapped, another seed) miss by far more than the tolerance."""
    import dataclasses

    import numpy as np

    from ditkv.models.hunyuan import PixelCodec
    from ditkv.models.hunyuan.layout import build_ar_head
    from ditkv.worker.conditioning import encode_images

    class SampledCodec(PixelCodec):  # a posterior sample, as the release VAE draws one: the seed matters
        def encode_sample(self, img, generator=None):
            z = self.encode(img)
            return z + 0.1 * torch.randn(z.shape, generator=generator).to(z)

    model = _edit_model(vit)
    c, tok, codec = model.config, ByteTokenizer(), SampledCodec(model.config.image_token_downsample)
    rng = np.random.default_rng(0)
    imgs = [rng.integers(0, 256, (40, 56, 3), dtype=np.uint8), rng.integers(0, 256, (64, 32, 3), dtype=np.uint8)]
    layout = build_request_layout(c, tok, "make it blue", 32, 32, 1.0, images=imgs)
    cond = layout.rows[0]
    head = build_ar_head(c, tok, "make it blue", 32, 32, images=imgs)
    p, seed = cond.prefix_len, 11
    nb_ar = -(-p // BS)

    def ar_kv(h, s=seed):
        pool = PagePool(64, c.num_hidden_layers, c.num_key_value_heads, BS, c.attention_head_dim)
        runner = ARRunner(model, TorchBackend(), pool, codec=codec)
        res = runner.run("r", h.token_ids, image_tail_ids(c, 32, 32), list(range(nb_ar)), TextSampling(seed=s), head=h)
        assert res.token_ids == cond.token_ids[:p].tolist()
        return _pages_kv(pool, 0, nb_ar, p)

    dpool = PagePool(64, c.num_hidden_layers, c.num_key_value_heads, BS, c.attention_head_dim)
    rows = WorkerRows(64, BS, 1)
    nb = -(-cond.seq_len // BS)
    rows.install(DiffusionKVMetadata("r", 1, BS, (RowMetadata(0, cond.prefix_len, cond.target_len, cond.seq_len,
                                                              cond.full_attn_spans, tuple(range(nb))),)))
    dit = DiTRunner(model, TorchBackend(), dpool, rows, codec=codec)
    with torch.inference_mode():
        g = torch.Generator().manual_seed(seed)
        emb = encode_images(model, codec, layout.images, g)
        x = torch.randn(1, c.latent_channels, layout.h, layout.w, generator=g)
        dit.forward_step("r", layout, x, torch.tensor([900.0]), PREFILL, True, cond=emb)
    want = _pages_kv(dpool, 0, nb, p)
    got = ar_kv(head)
    assert want.abs().sum() > 0
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    wrong = {"no spans": ar_kv(dataclasses.replace(head, spans=())),
             "pixels swapped": ar_kv(dataclasses.replace(head, images=(
                 dataclasses.replace(head.images[0], vae_pixels=head.images[1].vae_pixels),
                 dataclasses.replace(head.images[1], vae_pixels=head.images[0].vae_pixels)))),
             "other seed": ar_kv(head, seed + 1)}
    for name, kv in wrong.items():
        assert (kv - want).abs().max() > 1e-3, name


def test_ar_head_must_match_its_ids():
    from ditkv.models.hunyuan.layout import build_ar_head
    import numpy as np

    model = _edit_model(False)
    c = model.config
    img = np.zeros((32, 32, 3), dtype=np.uint8)
    head = build_ar_head(c, ByteTokenizer(), "x", 32, 32, images=[img])
    pool = PagePool(16, c.num_hidden_layers, c.num_key_value_heads, BS, c.attention_head_dim)
    runner = ARRunner(model, TorchBackend(), pool)  # no codec
    with pytest.raises(ValueError, match="does not match"):
        runner.run("r", head.token_ids[:-1], [], list(range(16)), head=head)
    with pytest.raises(Exception, match="codec"):
        runner.run("r", head.token_ids, [], list(range(16)), head=head)
