"""AR heads with input images in the prefix cache (issue 36, docs/prefix-cache-ar.md): an AR row whose
head holds an input image looks up and commits its full pages, every page touching the image naming it
(content, geometry, index) and the seed its VAE sample is drawn from. A hit may end inside the image's
block (the rest of the block is computed against the cached keys) or after it (the image is not encoded;
the rank's generator skips its sample). CPU fp32, the tiny model with latent-only input images: texts
and images with the cache on equal the cache off bit for bit, and the later requests' AR rows really hit."""

import msgspec
import numpy as np
import pytest
import torch

from test_image_inputs import rgb, tiny_bundle
from test_prefix_cache_ar import forced_serial
from test_rewrite import CASES, bundle_for, release_tok  # noqa: F401 (release_tok: a fixture)
from ditkv.config import EngineConfig
from ditkv.engine.engine import Engine
from ditkv.engine.messages import ARWork, HeadImages, pack_images
from ditkv.engine.types import GenerationRequest
from ditkv.errors import MetadataError
from ditkv.models.family import family_of
from ditkv.models.hunyuan import PixelCodec
from ditkv.models.hunyuan.prefix_keys import image_head_keys, prefix_block_keys
from ditkv.worker import ar_batch
from ditkv.worker.ar_batch import fed_part

BS = 16
HEAD = 82  # <bos> <boi> <img_size> <img_ratio> <timestep> [8x8 latent block (5, 69)] <eoi> "a red circle"...: 82 ids


class Sampled(PixelCodec):
    """A posterior sample, as the release VAE draws one: each image's latents move with the generator, so
    the seed, the images' order and a skipped image's draws all show in the result."""

    def encode_sample(self, img, generator=None):
        z = self.encode(img)
        return z + 0.1 * torch.randn(z.shape, generator=generator).to(z)

    def skip_sample(self, img, generator) -> bool:
        torch.randn(self.encode(img).shape, generator=generator)
        return True


def sampled_bundle(images: int):
    model, tok, codec = tiny_bundle(max_input_images=images)
    return model, tok, Sampled(codec.downsample)


@pytest.fixture(scope="module")
def bundle():
    return sampled_bundle(1)


@pytest.fixture
def encodes(monkeypatch) -> list:
    """(images skipped, images encoded) of each AR work that encodes input images on the rank."""
    seen, encode = [], ar_batch.encode_images

    def counted(*a, **kw):
        cond = encode(*a, **kw)
        seen.append((cond.skipped, cond.encoded))
        return cond

    monkeypatch.setattr(ar_batch, "encode_images", counted)
    return seen


def engine(bundle, cache: bool) -> Engine:
    return Engine(EngineConfig(device="cpu", block_size=BS, num_kv_blocks=256, max_num_seqs=4, max_image_height=32,
                               max_image_width=32, max_prompt_tokens=300, enable_prefix_caching=cache),
                  model_bundle=bundle)


def edit(prompt: str, seed: int = 4, image: int = 0, max_new: int = 3, images=None) -> GenerationRequest:
    """An edit whose AR text extends the prompt: its AR head is the cond row's text with the image(s)."""
    text = dict(max_new_tokens=max_new, temperature=1.0, top_k=0, top_p=1.0, ignore_eos=True)
    return GenerationRequest(prompt=prompt, height=32, width=32, steps=2, guidance_scale=2.0, seed=seed,
                             images=images or [rgb(16, 16, image)], **text)


def recorded(eng: Engine) -> dict:
    """Per request, the (start, cached, whole head sent) of each AR work with input images."""
    seen, works = {}, eng.ar.works

    def spy(out):
        ws = works(out)
        for w in ws:
            if w.images is not None:
                seen.setdefault(w.request_id, []).append((w.start, w.cached, len(w.token_ids)))
        return ws

    eng.ar.works = spy
    return seen


def serial(bundle, cache: bool, reqs):
    eng = engine(bundle, cache)
    seen = recorded(eng)
    try:
        outs = [eng.generate(msgspec.structs.replace(r, request_id=f"r{i}")) for i, r in enumerate(reqs)]
        m = eng.manager
        assert m.pool.num_free == m.pool.num_blocks and m.num_requests == 0 and m.num_ar_rows == 0
        return outs, seen, eng.ar.head_tokens_fed
    finally:
        eng.shutdown()


def same(a, b):
    assert a.ok and b.ok, (a.error, b.error)
    assert a.revised_prompt == b.revised_prompt and a.stats.ar_generated_tokens == b.stats.ar_generated_tokens
    assert np.array_equal(a.image, b.image)  # bit for bit, CPU fp32


def ar_hits(seen: dict, n: int) -> list[int]:
    """Each request's AR row hit: the `cached` positions of its head's (only) work."""
    out = []
    for i in range(n):
        (start, cached, sent), = seen[f"r{i}"]  # one head work: the whole head, from 0
        assert start == 0 and sent >= HEAD > cached
        out.append(cached)
    return out


def test_ar_heads_with_an_image_hit_after_and_inside_the_block_and_equal_the_cache_off(bundle, encodes):
    """The AR row's image is encoded unless its whole block is cached: a hit after it skips it (the generator
    advanced past its sample), a hit inside it encodes it and computes the block's rest."""
    reqs = [edit("a red circle"),  # writes the head's pages
            edit("a red circle"),  # the head's pages but the last (its end draws): after the image
            edit("a blue square"),  # differs at 71, in the page [64, 80): the hit ends inside the block (5, 69)
            edit("a red circle", seed=5),  # another VAE sample: no page touching the image is the same
            edit("a red circle", image=1)]  # another image: likewise
    off, seen_off, fed_off = serial(bundle, False, reqs)
    on, seen_on, fed_on = serial(bundle, True, reqs)
    for a, b in zip(on, off):
        same(a, b)
    assert encodes == [(0, 1)] * 5 + [(0, 1), (1, 0), (0, 1), (0, 1), (0, 1)]  # off, then on
    assert ar_hits(seen_off, 5) == [0] * 5
    assert ar_hits(seen_on, 5) == [0, 80, 64, 0, 0]
    assert fed_off - fed_on == 80 + 64
    # the first edit's uncond row opens with the same image: it reads the AR row's 4 image pages (DiT and AR
    # keys agree, and so do the bytes: its image equals the cache off above)
    assert on[0].stats.prefix_cache_hit_tokens == 64 and off[0].stats.prefix_cache_hit_tokens == 0
    assert on[1].stats.prefix_cache_hit_tokens > on[3].stats.prefix_cache_hit_tokens


def test_a_hit_past_the_first_of_two_images_skips_it_and_draws_the_second_s_sample_as_the_cache_off(encodes):
    """Two input images; a system text puts the page boundary 80 between the first image's block (13, 77) and
    the second's `<timestep>` (81). A request with the same first image and another second one hits the
    first 80 tokens: the rank skips the first image (its generator advanced past that sample) and encodes the
    second, whose sample must be the one the cache off draws."""
    two = sampled_bundle(2)
    two[0].config.extra = {"use_system_prompt": "custom", "system_prompt": "Draw it."}
    reqs = [edit("a red circle", images=[rgb(16, 16, 0), rgb(8, 8, 1)]),
            edit("a red circle", images=[rgb(16, 16, 0), rgb(8, 8, 2)])]
    off, seen_off, _ = serial(two, False, reqs)
    on, seen_on, _ = serial(two, True, reqs)
    for a, b in zip(on, off):
        same(a, b)
    assert [w[0][1] for w in seen_on.values()] == [0, 80] and [w[0][1] for w in seen_off.values()] == [0, 0]
    assert encodes == [(0, 2), (0, 2), (0, 2), (1, 1)]


def test_an_ar_request_joining_a_batch_hits_the_image_pages_of_an_earlier_one(bundle):
    """Requests added together run their AR heads in one pass (no hit between them); a later one hits the
    committed pages while the earlier ones decode or denoise, and nothing differs from the cache off."""
    reqs = [edit("a red circle"), edit("a blue square", seed=5), edit("a red circle", max_new=5)]
    outs = {}
    for cache in (False, True):
        eng = engine(bundle, cache)
        seen = recorded(eng)
        try:
            for i, r in enumerate(reqs[:2]):
                eng.add_request(msgspec.structs.replace(r, request_id=f"j{i}"))
            done = eng.step()  # the first two heads are written (and committed) in this step
            eng.add_request(msgspec.structs.replace(reqs[2], request_id="j2"))
            done += eng.run_until_complete()
            outs[cache] = sorted(done, key=lambda o: o.request_id)
            hits = {rid: w[0][1] for rid, w in seen.items()}
        finally:
            eng.shutdown()
        assert hits == ({"j0": 0, "j1": 0, "j2": 80} if cache else {"j0": 0, "j1": 0, "j2": 0})
    for a, b in zip(outs[True], outs[False]):
        same(a, b)


def test_image_head_keys_equal_the_cond_row_s_and_name_the_image_and_seed(bundle):
    """The AR head of an edit whose text extends the prompt is the cond row's text with the image: its keys are
    the cond row's (the same positions, digests and root: docs/prefix-cache-ar.md). Another seed or image
    changes every page touching the image (here all five: the image starts at slot 4). The same ids as a text
    head (1D positions, no digest) share no key with it."""
    model, tok, _ = bundle
    cfg, fam = model.config, family_of(model.config)
    eng = engine(bundle, True)
    try:
        layout = eng.processor.process(edit("a red circle"))[1]
    finally:
        eng.shutdown()
    head = fam.ar_head(cfg, tok, "a red circle", 32, 32, images=[rgb(16, 16, 0)])
    keys = fam.ar_head_block_keys(cfg, head.token_ids, BS, head=head, seed=4)
    assert len(keys) == len(head.token_ids) // BS == 5
    assert keys == prefix_block_keys(cfg, layout, 4, BS)[0][:5]
    assert keys == image_head_keys(cfg, head, 4, BS)
    other_seed = fam.ar_head_block_keys(cfg, head.token_ids, BS, head=head, seed=5)
    other = fam.ar_head(cfg, tok, "a red circle", 32, 32, images=[rgb(16, 16, 1)])
    other_image = fam.ar_head_block_keys(cfg, other.token_ids, BS, head=other, seed=4)
    assert all(a != b for a, b in zip(keys, other_seed)) and all(a != b for a, b in zip(keys, other_image))
    text = fam.ar_head_block_keys(cfg, head.token_ids, BS)
    assert not set(text) & set(keys)
    with pytest.raises(ValueError, match="does not match its token ids"):
        fam.ar_head_block_keys(cfg, head.token_ids[:-1], BS, head=head, seed=4)


def test_the_engine_takes_an_unrewritten_image_heads_keys_from_its_layout(bundle, monkeypatch):
    """Intake prepares the images once: an edit whose AR head is its cond row's text takes the head's keys
    from the DiT layout's cond row (equal, above) and never rebuilds the head (`ar_head_of`)."""
    from ditkv.core.ar_text import ARText
    from ditkv.engine import messages

    eng = engine(bundle, True)
    try:
        _, layout, _, intake, text = eng.processor.process(edit("a red circle"))
        ar = ARText(intake.head, intake.tail, 3, None)
        rebuilt = ARText(intake.head, intake.tail, 3, None)
        eng._ar_keys(rebuilt, intake.images, text.seed)  # no layout: the head is rebuilt, as an AR stage does
        monkeypatch.setattr(messages, "ar_head_of", lambda *a: pytest.fail("the image head was built again"))
        eng._ar_keys(ar, intake.images, text.seed, layout)
    finally:
        eng.shutdown()
    assert len(ar.keys) == len(intake.head) // BS == 5 and ar.keys == rebuilt.keys


def test_the_rank_feeds_an_image_head_from_its_cached_positions():
    """`fed_part`: the head's work keeps `images` at start 0 with the whole head (the rank rebuilds and checks
    it) and is fed from `cached`; the head's last token is always fed."""
    wire = HeadImages("p", 32, 32, False, pack_images([np.zeros((4, 4, 3), np.uint8)]))
    ids = list(range(40))
    wk = ARWork(request_id="a", generation=1, block_ids=[1, 2, 3], token_ids=ids, start=0, images=wire, cached=32)
    fed, whole = fed_part(wk)
    assert (fed.start, fed.token_ids, whole) == (32, ids[32:], ids) and fed.images is wire
    assert fed_part(ARWork(request_id="a", generation=1, block_ids=[1], token_ids=[5], start=0))[1] is None
    with pytest.raises(MetadataError, match="last token is always fed"):
        fed_part(ARWork(request_id="a", generation=1, block_ids=[1, 2], token_ids=ids[:32], start=0, images=wire,
                        cached=32))
    with pytest.raises(MetadataError, match="come with the head only"):
        fed_part(ARWork(request_id="a", generation=1, block_ids=[1, 2], token_ids=[3], start=32, images=wire,
                        cached=32))


LONG = "a red fox sitting in deep white snow under a pale winter sky, drawn with thick black lines"


@pytest.mark.parametrize("case", ["think-dynamic-drop", "recaption-instruct"])
def test_rewrites_with_an_input_image_hit_its_pages_and_equal_the_cache_off(release_tok, case, encodes):
    """think / recaption with an input image (the release template fixture, forced text): the AR head holds
    the system prompt, the image, then the prompt. With the same image and seed, a prompt that differs at
    once hits up to a page inside the image's block, and one that shares a long start hits past the block.
    Texts and images equal the cache off bit for bit."""
    tok, base = release_tok
    settings_, text, max_new, _ = CASES[case]
    cfg = base.replace(extra=settings_, max_input_images=1, cond_image_type="vae")
    model, tok, codec = bundle_for(cfg, tok)
    bundle = (model, tok, Sampled(codec.downsample))
    reqs = [GenerationRequest(prompt=p, height=32, width=32, steps=2, guidance_scale=2.0, seed=7,
                              max_new_tokens=max_new, images=[rgb(16, 16, 0)], request_id=f"r{i}")
            for i, p in enumerate((LONG + " and flat colours", "a fox in the rain", LONG + " and soft shading"))]

    def go(cache):
        outs, seen = forced_serial(bundle, tok.encode(text), cache, reqs, recorded)
        return outs, [w[0][1] for w in seen.values()]

    (off, hits_off), (on, hits_on) = go(False), go(True)
    for a, b in zip(on, off):
        assert a.ok and b.ok, (a.error, b.error)
        assert a.revised_prompt == b.revised_prompt and np.array_equal(a.image, b.image)
    fam = family_of(cfg)
    (_, end), = fam.ar_head(cfg, tok, reqs[1].prompt, 32, 32, rewrite_input=True, images=reqs[1].images,
                            template=fam.template.request_settings(cfg, None)).spans
    assert hits_off == [0, 0, 0] and hits_on[0] == 0
    assert 0 < hits_on[1] < end < hits_on[2]  # (think: 1456 < 1464 < 1504; recaption: 64 < 74 < 112)
    assert encodes == [(0, 1)] * 3 + [(0, 1), (0, 1), (1, 0)]  # off, then on: the last one skips its image


def test_an_ar_stage_hits_an_image_head_and_equals_the_single_engine(bundle):
    """A stage graph's AR stage (`Engine.add_ar_export`) keys an image head too: the second request with the
    same image, seed and prompt hits the head's pages there, and both images equal the single engine's with
    the cache off."""
    from test_rewrite import graph
    from ditkv.stages.orchestrator import Orchestrator

    reqs = [msgspec.structs.replace(edit("a red circle"), request_id=f"r{i}") for i in range(2)]
    single, _, _ = serial(bundle, False, reqs)
    orch = Orchestrator(graph(max_new=3), bundle)
    seen = recorded(orch.ar[0].engine)
    try:
        staged = [orch.generate(r) for r in reqs]
    finally:
        orch.shutdown()
    for a, b in zip(staged, single):
        assert a.ok and b.ok, (a.error, b.error)
        assert a.revised_prompt == b.revised_prompt and np.array_equal(a.image, b.image)
    assert [w[0][1] for w in seen.values()] == [0, 80]


def sampled_one():
    """A zero-argument bundle factory: each spawned rank builds its own."""
    return sampled_bundle(1)


@pytest.mark.slow
def test_cfg_parallel_image_heads_hit_on_every_rank_and_equal_the_cache_off():
    """Under CFG parallel every rank runs every AR work, so an image head's pages are in every pool under
    untagged keys: later heads hit them on both ranks (after the image and inside its block), and texts and
    images equal the cache off bit for bit (two spawned CPU ranks, gloo)."""
    from test_step_cache_multirank import mp_engine, mp_run, sequential

    reqs = [msgspec.structs.replace(edit(p), request_id=f"r{i}")
            for i, p in enumerate(["a red circle", "a red circle", "a blue square"])]
    kw = dict(max_image_height=32, max_image_width=32, max_prompt_tokens=300)
    off = mp_run(sampled_one, reqs, enable_prefix_caching=False, **kw)
    eng = mp_engine(sampled_one, **kw)
    seen = recorded(eng)
    try:
        on = sequential(eng, reqs)
        assert eng.manager.pool.num_free == eng.manager.pool.num_blocks
    finally:
        eng.shutdown()
    for a, b in zip(on, off):
        same(a, b)
    assert ar_hits(seen, 3) == [0, 80, 64]
