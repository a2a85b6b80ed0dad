"""The DiT runner's encoder cache (issue 36, docs/prefix-cache.md "Encoder cache"): edits of one image with
one seed and new prompts take the image's embeddings from the cache instead of encoding it again (their
prefix-cache hit ends inside the image block, so its rest needs them). CPU fp32, the tiny-edit model
allowed two images, with a codec whose samples draw from the request generator (as the release VAE's
posterior sample does): a reused image must advance the generator exactly as encoding it would, and its
key must name the seed and its index, or the later images, the noise and so the output would differ from
an engine without any cache."""

import numpy as np
import pytest
import torch

from ditkv.config import EngineConfig
from ditkv.engine.engine import Engine
from ditkv.engine.types import GenerationRequest
from ditkv.errors import ConfigError
from ditkv.models.loader import load_model
from ditkv.worker.encoder_cache import EncoderCache
from test_prefix_cache_images import Counting
from test_stage_images import image

# prompts that differ in their first characters: a later edit's hit ends inside the last image's block
PROMPTS = ["make it blue", "paint it red", "move it left", "turn it over"]
A, B, C = image(3), image(4), image(5)


@pytest.fixture(scope="module")
def weights():
    model, tok, _ = load_model("tiny-edit", torch.device("cpu"), torch.float32)
    model.config.max_input_images = 2
    return model, tok


def edit(rid: str, prompt: str, images, seed: int = 5, guidance: float = 2.0) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, request_id=rid, height=32, width=32, steps=2, guidance_scale=guidance,
                             seed=seed, images=list(images))


def engine(weights, codec, prefix: bool | None = True, images: int = 8, mode: str = "paged_scheduler") -> Engine:
    return Engine(EngineConfig(model="tiny-edit", device="cpu", dtype="float32", block_size=16, num_kv_blocks=1024,
                               diffusion_kv_max_rows_per_request=2, diffusion_kv_mode=mode,
                               enable_prefix_caching=prefix, encoder_cache_images=images),
                  model_bundle=(*weights, codec))


def run(weights, reqs, prefix: bool, images: int = 8, can_skip: bool = True):
    """The requests one after another -> ({rid: (output, images encoded, images skipped)}, the runner's
    encoder cache after them, or None)."""
    codec = Counting(can_skip)
    eng = engine(weights, codec, prefix, images)
    out = {}
    try:
        for r in reqs:
            before = codec.encoded, codec.skipped
            o = eng.generate(r)
            out[o.request_id] = (o, codec.encoded - before[0], codec.skipped - before[1])
        return out, eng.worker.runner.encoder_cache
    finally:
        eng.shutdown()


@pytest.mark.parametrize("guidance", [2.0, 1.0], ids=["cfg", "one-row"])
def test_later_edits_of_the_same_images_and_seed_are_not_encoded_again(weights, guidance):
    reqs = [edit(f"e{i}", p, [A, B], guidance=guidance) for i, p in enumerate(PROMPTS)]
    outs, cache = run(weights, reqs, True)
    assert outs["e0"][1:] == (2, 0)  # the first edit encodes both images and stores them
    for i in range(1, len(PROMPTS)):
        # image 0 lies before the hit's end (skipped by the prefix cache), image 1 comes from the encoder
        # cache: neither is encoded, the generator advances past both samples
        assert outs[f"e{i}"][1:] == (0, 2), i
    assert (cache.hits, cache.misses, len(cache)) == (len(PROMPTS) - 1, 2, 2)
    ref, _ = run(weights, reqs, False)
    for rid, (o, _, _) in outs.items():
        assert o.ok and np.array_equal(o.image, ref[rid][0].image), rid  # bit for bit, the noise included
        assert ref[rid][1:] == (2, 0)  # no cache: every edit encodes both


def test_another_seed_image_or_index_is_encoded(weights):
    reqs = [edit("e0", PROMPTS[0], [A, B]),
            edit("seed", PROMPTS[1], [A, B], seed=6),  # the same images drawn from another seed
            edit("swap", PROMPTS[1], [B, A]),  # the same images at each other's index
            edit("new", PROMPTS[2], [A, C]),  # image 0 as before, image 1 new
            edit("again", PROMPTS[3], [A, B])]  # all as the first: a hit for image 1
    outs, cache = run(weights, reqs, True)
    assert {rid: o[1] for rid, o in outs.items()} == {"e0": 2, "seed": 2, "swap": 2, "new": 1, "again": 0}
    assert outs["new"][2] == 1 and outs["again"][2] == 2  # "new": image 0 from the encoder cache
    ref, _ = run(weights, reqs, False)
    for rid, (o, _, _) in outs.items():  # a key without the seed or the index would reuse a wrong sample
        assert o.ok and np.array_equal(o.image, ref[rid][0].image), rid


@pytest.mark.parametrize("images,encoded", [(1, 1), (2, 0)])
def test_the_least_recently_used_image_goes_past_the_bound(weights, images, encoded):
    reqs = [edit("a", PROMPTS[0], [A]), edit("b", PROMPTS[0], [B]), edit("a2", PROMPTS[1], [A])]
    outs, cache = run(weights, reqs, True, images=images)
    assert [outs[r][1] for r in ("a", "b")] == [1, 1]
    assert outs["a2"][1] == encoded  # bound 1: b's image pushed a's out; bound 2: both kept
    assert len(cache) == images


def test_encoder_cache_lru_order():
    cache = EncoderCache(2)
    t = {k: (torch.full((2, 3), float(i)), None) for i, k in enumerate([b"a", b"b", b"c"])}
    cache.put(b"a", *t[b"a"])
    cache.put(b"b", *t[b"b"])
    assert cache.get(b"a")[0] is t[b"a"][0]  # the very tensor stored; a is now the most recent
    cache.put(b"c", *t[b"c"])
    assert b"b" not in cache and b"a" in cache and b"c" in cache and len(cache) == 2
    assert cache.get(b"b") is None
    with pytest.raises(ValueError, match="at least 1 image"):
        EncoderCache(0)


def test_a_codec_that_cannot_skip_encodes_every_image(weights):
    """No skip function: a cached image could not advance the generator past its sample, so the cache is
    not used and every image is encoded, as without it."""
    reqs = [edit(f"e{i}", p, [A, B]) for i, p in enumerate(PROMPTS[:3])]
    outs, cache = run(weights, reqs, True, can_skip=False)
    ref, _ = run(weights, reqs, False, can_skip=False)
    for rid, (o, encoded, skipped) in outs.items():
        assert o.ok and np.array_equal(o.image, ref[rid][0].image), rid
        assert (encoded, skipped) == (2, 0), rid
    assert cache.hits == 0


@pytest.mark.parametrize("bad", [-1, 1.5, "8", True, None])
def test_encoder_cache_images_must_be_a_count(bad):
    with pytest.raises(ConfigError, match="encoder_cache_images.*integer >= 0"):
        EngineConfig(model="tiny-edit", device="cpu", encoder_cache_images=bad)


@pytest.mark.parametrize("prefix,images,mode", [(False, 8, "paged_scheduler"), (True, 0, "paged_scheduler"),
                                                (None, 8, "dense_legacy")])
def test_no_encoder_cache_without_the_prefix_cache_or_a_bound(weights, prefix, images, mode):
    eng = engine(weights, Counting(True), prefix, images, mode)
    try:
        assert eng.worker.runner.encoder_cache is None
    finally:
        eng.shutdown()
    eng = engine(weights, Counting(True), None, 3)  # the default: prefix caching on in paged mode
    try:
        assert eng.worker.runner.encoder_cache.capacity == 3
    finally:
        eng.shutdown()
