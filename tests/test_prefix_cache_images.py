"""Edits with two input images through the prefix cache (issue 36, docs/prefix-cache.md): a hit that
covers the first image whole and ends inside the second skips the first image's encoders only, and
draws the request generator exactly as encoding it would. CPU fp32, the tiny-edit model allowed two
images, with a codec whose samples draw from the generator (the release VAE's posterior sample): a
skipped image that drew one sample too few or too many would change the second image and the noise."""

import numpy as np
import pytest
import torch

from ditkv.config import EngineConfig
from ditkv.engine.engine import Engine
from ditkv.engine.types import GenerationRequest
from ditkv.models.hunyuan.codec import PixelCodec, VAECodec
from ditkv.models.loader import load_model
from ditkv.worker.conditioning import CondEmbeds, fill_image_slots
from ditkv.worker.denoising import covered_images
from test_stage_images import image

# tiny-edit rows with two 32x32 images: <bos>, image 0 (<boi> <img_size> <img_ratio> <timestep> [5, 69) <eoi>),
# image 1 (<boi> ... <timestep> 73, [74, 138) <eoi>), the prompt. With 16-token pages, prompts that differ in
# their first characters end the hit at 128: past image 0, inside image 1's block
PROMPTS = ["make it blue", "paint it red", "move it left"]


class Counting:
    """A latent codec whose input-image samples draw noise from the request generator (as the release
    VAE's posterior sample does), counting the images it encodes and the ones it skips."""

    def __init__(self, can_skip: bool):
        self.pixel, self.encoded, self.skipped = PixelCodec(4), 0, 0
        self.inner = VAECodec(48, 4, encode_fn=self.pixel.encode, decode_fn=self.pixel.decode,
                              sample_fn=self._sample, skip_fn=self._skip if can_skip else None)

    def _sample(self, img, g):
        self.encoded += 1
        z = self.pixel.encode(img)
        return z + 0.1 * torch.randn(z.shape, generator=g, dtype=torch.float32).to(z.dtype)

    def _skip(self, img, g):
        self.skipped += 1
        torch.randn(self.pixel.encode(img).shape, generator=g, dtype=torch.float32)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def weights():
    model, tok, _ = load_model("tiny-edit", torch.device("cpu"), torch.float32)
    model.config.max_input_images = 2
    return model, tok


def edit(rid: str, prompt: str, guidance: float) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, request_id=rid, height=32, width=32, steps=2, guidance_scale=guidance,
                             seed=5, images=[image(3), image(4)])


def engine(weights, codec, cache: bool) -> Engine:
    # the encoder cache off: these tests count what the prefix cache alone skips (with it on, an image
    # encoded by an earlier edit is not encoded again: tests/test_encoder_cache.py)
    return Engine(EngineConfig(model="tiny-edit", device="cpu", dtype="float32", block_size=16, num_kv_blocks=1024,
                               diffusion_kv_max_rows_per_request=2, enable_prefix_caching=cache,
                               encoder_cache_images=0),
                  model_bundle=(*weights, codec))


def run(weights, cache: bool, guidance: float, can_skip: bool = True):
    """The edits one after another -> per request (output, images encoded, images skipped, first computed
    token per row)."""
    codec = Counting(can_skip)
    eng = engine(weights, codec, cache)
    starts, reserve = {}, eng.manager.reserve_request

    def wrapped(rid, rows, *a, **k):
        meta = reserve(rid, rows, *a, **k)
        if meta is not None:
            starts[rid] = [r.num_computed_tokens for r in meta.rows]
        return meta

    eng.manager.reserve_request = wrapped
    out = {}
    try:
        layout = eng.processor.process(edit("probe", PROMPTS[0], guidance))[1]
        for i, p in enumerate(PROMPTS):
            before = codec.encoded, codec.skipped
            o = eng.generate(edit(f"e{i}", p, guidance))
            out[o.request_id] = (o, codec.encoded - before[0], codec.skipped - before[1], starts[o.request_id])
    finally:
        eng.shutdown()
    return out, layout


@pytest.mark.parametrize("guidance", [2.0, 1.0], ids=["cfg", "one-row"])
def test_a_hit_ending_in_the_second_image_encodes_only_the_second(weights, guidance):
    ref, layout = run(weights, False, guidance)
    outs, _ = run(weights, True, guidance)
    im0, im1 = layout.images
    (_, end0), = im0.spans()
    (a1, b1), = im1.spans()
    for rid, (o, encoded, skipped, starts) in outs.items():
        r = ref[rid][0]
        assert o.ok and r.ok and np.array_equal(o.image, r.image), rid  # bit for bit, the noise included
        assert ref[rid][1:3] == (2, 0)  # the cache off encodes both images
        if rid == "e0":
            assert (encoded, skipped) == (2, 0)
            continue
        # every row past image 0; the cond row's hit ends inside image 1's block (the uncond row's, the same
        # `<cfg>` text, may reach past it)
        assert min(starts) >= end0 and a1 < starts[0] < b1, starts
        assert (encoded, skipped) == (1, 1), rid  # image 0 skipped, image 1 encoded


def test_a_codec_that_cannot_skip_encodes_every_image(weights):
    """No skip function (a VAE codec built without one): the generator cannot be advanced without the
    sample, so every image is encoded, and the images still equal the cache off."""
    ref, _ = run(weights, False, 2.0, can_skip=False)
    outs, _ = run(weights, True, 2.0, can_skip=False)
    for rid, (o, encoded, skipped, starts) in outs.items():
        assert o.ok and np.array_equal(o.image, ref[rid][0].image), rid
        assert (encoded, skipped) == (2, 0)
    assert outs["e1"][3][0] > 0  # it did hit


def test_every_hit_end_skips_exactly_the_images_it_covers(weights):
    """The second edit's hit cut to k pages per row, for every k up to its natural hit: the images wholly
    before every row's cut are skipped, the rest encoded, and the image equals the cache off."""
    ref, _ = run(weights, False, 2.0)
    codec = Counting(True)
    eng = engine(weights, codec, True)
    pool, seen = eng.manager.pool, set()
    lookup = pool.lookup
    try:
        assert eng.generate(edit("w", PROMPTS[0], 2.0)).ok
        layout = eng.processor.process(edit("e1", PROMPTS[1], 2.0))[1]
        keys = eng.processor.family.prefix_block_keys(eng.executor.model_config, layout, 5, 16)
        n = min(len(lookup(k)) for k in keys)
        for k in range(n + 1):
            pool.lookup = lambda keys, k=k: lookup(keys)[:k]
            before = codec.encoded, codec.skipped
            o = eng.generate(edit(f"k{k}", PROMPTS[1], 2.0))
            assert o.ok and np.array_equal(o.image, ref["e1"][0].image), k
            # row 1 may take more pages from row 0 past the cut, never fewer: row 0's cut bounds the cover
            covered = covered_images(layout, [k * 16] * len(layout.rows))
            assert (codec.encoded - before[0], codec.skipped - before[1]) == (2 - covered, covered), k
            seen.add(covered)
    finally:
        eng.shutdown()
    assert seen == {0, 1}


def test_a_skipped_image_slot_is_refused_not_filled():
    """`fill_image_slots` reads only the slots inside the range; a skipped image's slot inside it is an
    error naming the cause, never zeros."""
    from types import SimpleNamespace
    ims = [SimpleNamespace(timestep_index=4, vae_start=5, h=2, w=2, vit_start=None),
           SimpleNamespace(timestep_index=10, vae_start=11, h=2, w=2, vit_start=None)]
    cond = CondEmbeds(torch.ones(8), [None, torch.full((4, 8), 2.0)], [None, None], skipped=1)
    h = torch.zeros(20, 8)
    fill_image_slots(h[9:], ims, 9, 20, cond)  # image 0's slots lie before the range: not read
    assert torch.equal(h[10], torch.ones(8)) and torch.equal(h[11:15], torch.full((4, 8), 2.0))
    with pytest.raises(ValueError, match="input image 0 was not encoded"):
        fill_image_slots(h[8:], ims, 8, 20, cond)  # image 0's last latent token (8) is in range
