"""Issue 34 item 4: size=auto for text-to-image (height and width None): the AR phase prefills the row up to
`<boi> <img_size>`, draws `<img_ratio_k>` greedily among the model's buckets (on the device, the draw confined
to those ids) and the DiT draws at bucket k.

The first part checks ditkv against tests/fixtures/release_auto_size.json, made with the Instruct release code
(suryatmodulus/HunyuanImage-3.0@1ea1526) by tools/make_auto_size_fixture.py: the img_ratio step on a tiny model
(its input ids, its ratio logits, the size it picks), its confining logits processors on set logits, and the
recaption path's one text call (the tokens forced after `</recaption>`, the ratio drawn). The second part runs
the engine on the tiny model with a bucket table (batched equals solo, bit for bit on CPU fp32) and its
refusals.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_release_edit import make_image
from test_release_transformer import _write_release_folder, seeded_weights

from ditkv.config import EngineConfig
from ditkv.core.ar_text import ARText
from ditkv.engine.engine import Engine
from ditkv.engine.request_check import check_request
from ditkv.engine.types import GenerationRequest
from ditkv.errors import LayoutError
from ditkv.models.hunyuan import HunyuanImage3Config, HunyuanImage3Model
from ditkv.models.hunyuan.buckets import auto_sizes, bucket_table
from ditkv.models.hunyuan.codec import PixelCodec
from ditkv.models.hunyuan.tokenizer import ByteTokenizer
from ditkv.models.loader import load_model
from ditkv.models.text_settings import TextSampling
from ditkv.worker.sampling import sample

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "release_auto_size.json").read_text())
GREEDY = TextSampling(do_sample=False)


def _draw(logits: torch.Tensor, allowed: list[int]) -> int:
    """ditkv's size draw over one row of logits (what the rank does with an ARWork's `allowed`)."""
    return int(sample(logits[None].float(), [GREEDY], [None], None, [torch.tensor(allowed)])[0])


# ---- the release's rule --------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", FIXTURE["processors"], ids=lambda c: f"{c['ratio_ids']}-{c['case']}")
def test_the_confined_draw_equals_the_release_img_ratio_step(case):
    """The img_ratio step (SliceVocabLogitsProcessor, then greedy argmax over the sliced vocabulary): ditkv draws
    the same k, ties to the first k, whatever text token is above. The recaption path (mask to the ratio ids,
    force greedy, argmax over the whole vocabulary) agrees except on a tie where the extra buckets' ids sit below
    `<img_ratio_0>`: it then takes the lower id (documented in docs/ar-phase.md)."""
    ids = case["ratio_token_ids"]
    k = ids.index(_draw(torch.tensor(case["logits"]), ids))
    assert k == case["img_ratio_step_index"]
    tie_below = case["ratio_ids"] == "extras_below" and case["case"] in ("tie_5_34", "all_equal")
    assert (k == case["rewrite_path_index"]) != tie_below


def test_the_table_and_ids_are_the_release_s():
    cfg = _fixture_cfg()
    sizes = auto_sizes(cfg)
    assert [[h, w] for h, w, _ in sizes] == FIXTURE["buckets"]
    assert [i for _, _, i in sizes] == FIXTURE["ratio_token_ids"]


@pytest.fixture(scope="module")
def fixture_folders(tmp_path_factory):
    """The fixture's tiny model as a release folder, one per sequence template."""
    state = seeded_weights({k: tuple(v) for k, v in FIXTURE["weight_shapes"].items()})
    out = {}
    for template in ("pretrain", "instruct"):
        folder = _write_release_folder(tmp_path_factory.mktemp(f"auto_{template}"), FIXTURE["config"], state)
        (folder / "tokenizer.json").write_text(FIXTURE["tokenizer_json"])
        named = {f"{k}_token": v for k, v in FIXTURE["named_specials"].items()}
        (folder / "tokenizer_config.json").write_text(json.dumps(named))
        (folder / "generation_config.json").write_text(json.dumps({"sequence_template": template}))
        out[template] = folder
    return out


def _fixture_cfg():
    from ditkv.models.family import family_for_folder
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(FIXTURE["config"]))
        (Path(d) / "tokenizer.json").write_text(FIXTURE["tokenizer_json"])
        (Path(d) / "tokenizer_config.json").write_text(json.dumps(
            {f"{k}_token": v for k, v in FIXTURE["named_specials"].items()}))
        return family_for_folder(d).load_frontend(d)[0]


class Recorder:
    """The model as the AR pass sees it: records each call's logits; `force` (token ids, then one logits row
    per further call) replaces them, so a text and the ratio logits can be set."""

    def __init__(self, model, force=None):
        self._m, self.calls, self.force = model, [], force

    def __getattr__(self, name):
        return getattr(self._m, name)

    def logits(self, h):
        out = self._m.logits(h)
        n = len(self.calls)
        if self.force is not None:
            text, last = self.force
            out = torch.full_like(out, -1e4)
            if n < len(text):
                out[:, text[n]] = 0.0
            else:
                out[:, FIXTURE["ratio_token_ids"]] = torch.tensor(last)
        self.calls.append(out.detach().clone())
        return out


def _engine(folder, bundle=None, **kw):
    cfg = dict(model=str(folder), device="cpu", block_size=16, num_kv_blocks=600, max_image_height=1280,
               max_image_width=1280, **kw)
    return Engine(EngineConfig(**cfg), model_bundle=bundle)


def _fed(eng) -> list[list[int]]:
    """Every AR work the engine sends: its token ids, and its allowed ids when it draws the size."""
    works, queue = [], eng.executor.queue_ar

    def record(ws):
        works.extend(ws)
        queue(ws)
    eng.executor.queue_ar = record
    return works


@pytest.mark.parametrize("case", FIXTURE["cases"] + FIXTURE["image_cases"],
                         ids=lambda c: f"{c['template']}-{len(c['images'])}-{c['prompt'][:12]}")
def test_size_auto_picks_the_release_size_end_to_end(fixture_folders, case):
    """bot_task image: the engine's AR row is the release img_ratio step's input, its ratio logits are the
    release's (fp32), and it draws the release's bucket; the image has that size. With input images (the
    release's meaning of auto there: the img_ratio step sees them, their VAE latents from the seed's
    generator and their ViT tokens) the AR row holds the image slots too, and the AR may draw only the
    buckets whose rows fit the model's positions next to the images."""
    bundle = load_model(str(fixture_folders[case["template"]]), torch.device("cpu"), torch.float32)
    eng = _engine(fixture_folders[case["template"]], bundle)
    rec = Recorder(eng.worker.model)
    eng.worker.model = rec
    works = _fed(eng)
    images = [make_image(*spec) for spec in case["images"]] or None
    try:
        out = eng.generate(GenerationRequest(prompt=case["prompt"], height=None, width=None, steps=1,
                                             guidance_scale=1.0, seed=FIXTURE["seed"], images=images))
        m = eng.manager
        assert m.pool.num_free == m.pool.num_blocks and m.num_ar_rows == 0
    finally:
        eng.shutdown()
    assert out.ok, out.error
    assert [t for w in works for t in w.token_ids] == case["input_ids"]
    assert works[-1].allowed == [i for h, w, i in auto_sizes(bundle[0].config)
                                 if _rows_fit(bundle, case, images, h, w)]
    assert case["images"] or works[-1].allowed == FIXTURE["ratio_token_ids"]
    assert works[-1].sampling["do_sample"] is False
    got = rec.calls[-1][0, FIXTURE["ratio_token_ids"]]
    torch.testing.assert_close(got, torch.tensor(case["ratio_logits"]), rtol=1e-4, atol=1e-5)
    h, w = case["size"]
    assert out.image.shape[:2] == (h, w) and out.stats.auto_size == f"{w}x{h}"
    assert out.stats.ar_generated_tokens == 0 and out.revised_prompt is None


def _rows_fit(bundle, case, images, h, w) -> bool:
    from ditkv.models.family import family_of

    cfg, tok = bundle[0].config, bundle[1]
    try:
        family_of(cfg).request_layout(cfg, tok, case["prompt"], h, w, 1.0, images=images)
    except LayoutError:
        return False
    return True


def test_the_buckets_are_those_whose_rows_fit(fixture_folders):
    """Two input images leave the fixture's model (4096 positions) no room for its largest buckets: the AR
    chooses among the rest, and admission sizes the request at the largest of those."""
    case = next(c for c in FIXTURE["image_cases"] if len(c["images"]) == 2)
    bundle = load_model(str(fixture_folders[case["template"]]), torch.device("cpu"), torch.float32)
    images = [make_image(*spec) for spec in case["images"]]
    fit = [s for s in auto_sizes(bundle[0].config) if _rows_fit(bundle, case, images, s[0], s[1])]
    assert 0 < len(fit) < len(FIXTURE["ratio_token_ids"])
    eng = _engine(fixture_folders[case["template"]], bundle)
    try:
        p = eng.processor.process(GenerationRequest(prompt=case["prompt"], height=None, width=None, steps=1,
                                                    guidance_scale=1.0, images=images))
    finally:
        eng.shutdown()
    assert p.ar.sizes == tuple(fit)
    d = bundle[0].config.image_token_downsample
    assert p.ar.size == max(((h, w) for h, w, _ in fit), key=lambda s: (s[0] // d) * (s[1] // d))


@pytest.mark.parametrize("case", FIXTURE["rewrites"], ids=lambda c: c["template"])
def test_recaption_then_auto_feeds_the_release_transition(fixture_folders, case):
    """bot_task recaption: after the text's `</recaption>` the release forces `[<answer>] <boi> <img_size>` and
    draws the ratio among the ratio ids; ditkv's AR row holds the same tokens and draws the same bucket (the
    text and the ratio logits are set, as the fixture's scripted decoder set them)."""
    folder = fixture_folders[case["template"]]
    gen = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**gen, "bot_task": "recaption"}))
    try:
        bundle = load_model(str(folder), torch.device("cpu"), torch.float32)
        eng = _engine(folder, bundle)
    finally:
        (folder / "generation_config.json").write_text(json.dumps(gen))
    eng.worker.model = Recorder(eng.worker.model, (case["text_ids"], case["ratio_logits"]))
    works = _fed(eng)
    try:
        out = eng.generate(GenerationRequest(prompt=case["prompt"], height=None, width=None, steps=1,
                                             guidance_scale=1.0, seed=FIXTURE["seed"], max_new_tokens=64))
    finally:
        eng.shutdown()
    assert out.ok, out.error
    fed = [t for w in works for t in w.token_ids]
    assert fed == case["input_ids"] + case["written"][:-1]  # everything but the drawn ratio token
    stop, forced = case["stage_transitions"][-1]
    assert fed[len(case["input_ids"]) + len(case["text_ids"]):] == forced and case["text_ids"][-1] == stop
    h, w = case["size"]
    assert out.image.shape[:2] == (h, w) and out.stats.auto_size == f"{w}x{h}"


# ---- the engine on the tiny model with a bucket table --------------------------------------------------------
BASE = 64  # the tiny model's cell is 4 px: buckets from 32 to 128 px a side (256 image tokens)


@pytest.fixture(scope="module")
def bundle():
    cfg = HunyuanImage3Config.tiny().replace(image_base_size=BASE)
    model = HunyuanImage3Model.from_config(cfg, seed=1, zero_init_resblocks=False).eval()
    return model, ByteTokenizer(), PixelCodec(cfg.image_token_downsample)


def tiny_engine(bundle, **kw):
    cfg = {"device": "cpu", "block_size": 16, "num_kv_blocks": 400, "max_num_seqs": 4, "max_image_height": 128,
           "max_image_width": 128, "max_prompt_tokens": 96, **kw}
    return Engine(EngineConfig(**cfg), model_bundle=bundle)


PROMPTS = ["a red fox in the snow", "a tall tower", "wide sea"]


def auto_req(i, **kw):
    return GenerationRequest(prompt=PROMPTS[i % 3], height=None, width=None, steps=2, guidance_scale=2.0,
                             seed=20 + i, **kw)


def run(eng, reqs):
    ids = [eng.add_request(r) for r in reqs]
    outs = {o.request_id: o for o in eng.run_until_complete()}
    return [outs[i] for i in ids]


def _mix():
    return [auto_req(0), auto_req(1, max_new_tokens=5, temperature=1.0), auto_req(2),
            GenerationRequest(prompt="blue", height=64, width=64, steps=2, seed=3)]


@pytest.fixture(scope="module")
def solo(bundle):
    outs = []
    for r in _mix():
        eng = tiny_engine(bundle)
        try:
            outs.append(run(eng, [r])[0])
        finally:
            eng.shutdown()
    return outs


def test_batched_equals_solo(bundle, solo):
    """size=auto requests (one writing text first) with a sized one, batched: each gets its solo size, text and
    image, bit for bit (CPU fp32); every page returns."""
    eng = tiny_engine(bundle)
    try:
        works = _fed(eng)
        outs = run(eng, _mix())
        m = eng.manager
        assert m.pool.num_free == m.pool.num_blocks and m.num_ar_rows == 0
        assert max(eng.batch_sizes) > 1  # DiT phases overlapped
        assert len([w for w in works if w.allowed is not None]) == 3  # one size draw per auto request
    finally:
        eng.shutdown()
    for a, b in zip(outs, solo):
        assert a.ok and b.ok, (a.error, b.error)
        assert a.stats.auto_size == b.stats.auto_size and a.revised_prompt == b.revised_prompt
        assert np.array_equal(a.image, b.image)
    assert [o.stats.auto_size is None for o in outs] == [False, False, False, True]
    assert outs[1].stats.ar_generated_tokens > 0 and outs[0].stats.ar_generated_tokens == 0


def test_an_abort_in_the_size_phase_returns_every_page(bundle):
    eng = tiny_engine(bundle)
    try:
        rid = eng.add_request(auto_req(0))
        eng.step()  # the head's prefill: the size is not drawn yet
        assert eng.scheduler.get(rid).ar.chosen is None and eng.abort(rid)
        outs = eng.run_until_complete()
        assert [o.status for o in outs] == ["cancelled"]
        m = eng.manager
        assert m.pool.num_free == m.pool.num_blocks and m.num_ar_rows == 0
        assert eng.generate(auto_req(0)).ok  # the engine goes on
    finally:
        eng.shutdown()


def test_the_choice_is_the_first_largest_ratio_logit(bundle):
    eng = tiny_engine(bundle)
    rec = Recorder(eng.worker.model)
    eng.worker.model = rec
    try:
        out = eng.generate(auto_req(0))
    finally:
        eng.shutdown()
    sizes = auto_sizes(bundle[0].config)
    k = int(torch.argmax(rec.calls[-1][0, [i for _, _, i in sizes]]))
    h, w, _ = sizes[k]
    assert out.image.shape[:2] == (h, w) and out.stats.auto_size == f"{w}x{h}"


def test_the_envelope_bounds_the_choice(bundle):
    """A bucket this engine cannot draw (a side above max_image_height/width) is never chosen: the draw is
    confined to the others; no bucket fits: refused at once, naming the settings."""
    eng = tiny_engine(bundle, max_image_height=64, max_image_width=96)
    works = _fed(eng)
    try:
        out = eng.generate(auto_req(1))
        allowed = works[-1].allowed
    finally:
        eng.shutdown()
    fits = [i for h, w, i in auto_sizes(bundle[0].config) if h <= 64 and w <= 96]
    assert allowed == fits and 0 < len(fits) < 33
    assert out.ok and out.image.shape[0] <= 64 and out.image.shape[1] <= 96
    eng = tiny_engine(bundle, max_image_height=16, max_image_width=16)
    try:
        with pytest.raises(LayoutError, match="none fits this engine.*max_image_height") as e:
            eng.add_request(auto_req(0))
        assert e.value.field == "size"
    finally:
        eng.shutdown()


def test_refusals_name_the_size(bundle):
    model, tok, codec = bundle
    plain = HunyuanImage3Model.from_config(HunyuanImage3Config.tiny(), seed=1).eval()  # no bucket table
    one_ratio = HunyuanImage3Model.from_config(HunyuanImage3Config.tiny().replace(
        image_base_size=BASE, num_ratio_tokens=1), seed=1).eval()
    for m, words in ((plain, "no image_base_size"), (one_ratio, "one ratio token")):
        eng = Engine(EngineConfig(device="cpu", num_kv_blocks=64), model_bundle=(m, tok, codec))
        try:
            with pytest.raises(LayoutError, match=words) as e:
                eng.add_request(auto_req(0))
            assert e.value.field == "size"
        finally:
            eng.shutdown()
    eng = tiny_engine(bundle, diffusion_kv_mode="dense_legacy", diffusion_kv_max_rows_per_request=None,
                      num_kv_blocks=None, max_num_seqs=1)
    try:
        with pytest.raises(LayoutError, match="paged_scheduler") as e:
            eng.add_request(auto_req(0))
        assert e.value.field == "size"
    finally:
        eng.shutdown()
    with pytest.raises(LayoutError, match="give both"):
        check_request(GenerationRequest(prompt="x", height=None, width=64), 50)


def test_input_images_with_size_auto_draw_where_the_model_has_buckets():
    """With input images the model picks the size as without (the release's img_ratio step sees the images); a
    model without a bucket table (the tiny edit model) is refused by name, as without images."""
    import types

    from ditkv.engine.processor import Processor

    ns = types.SimpleNamespace(max_steps=50, cfg_parallel_size=1, diffusion_kv_mode="paged_scheduler")
    img = np.zeros((32, 32, 3), dtype=np.uint8)
    cfg = HunyuanImage3Config.tiny().replace(image_base_size=BASE, max_input_images=1, cond_image_type="vae")
    p = Processor(ns, cfg, ByteTokenizer()).process(auto_req(0, images=[img]))
    assert p.ar.sizes and p.ar.images is not None and p.ar.image_spans  # the head holds the image block
    cfg = HunyuanImage3Config.tiny().replace(max_input_images=1, cond_image_type="vae")
    with pytest.raises(LayoutError, match="no image_base_size") as e:
        Processor(ns, cfg, ByteTokenizer()).process(auto_req(0, images=[img]))
    assert e.value.field == "size"


# ---- the host state and the rank's checks ------------------------------------------------------------------
def test_ar_text_draws_the_choice_after_the_tail():
    ar = ARText([1, 2, 3], [7, 8], max_new_tokens=0, choice=(20, 21, 22))
    p = ar.work(None)
    assert p.token_ids == [1, 2, 3] and not p.sample
    ar.fed(p)
    p = ar.work(None)
    assert p.token_ids == [7, 8] and p.sample and p.allowed == (20, 21, 22)
    ar.fed(p)
    assert not ar.done and ar.work(None) is None
    with pytest.raises(ValueError, match="not one of"):
        ar.accept(9)
    ar.awaiting = True
    ar.accept(21)
    assert ar.done and ar.chosen == 21 and ar.tokens == [1, 2, 3, 7, 8]
    ar.restart()
    assert ar.chosen is None and not ar.done
    # with text: the last token, the tail and the draw in one work
    ar = ARText([1], [7, 8], max_new_tokens=1, choice=(20,))
    ar.fed(ar.work(None))
    ar.accept(5)
    p = ar.work(None)
    assert p.token_ids == [5, 7, 8] and p.allowed == (20,)


def test_sample_confines_a_row_and_keeps_the_others():
    logits = torch.tensor([[0.0, 5.0, 1.0, 1.0, 0.5], [0.0, 5.0, 1.0, 1.0, 0.5]])
    banned = torch.tensor([2, 3])
    got = sample(logits, [GREEDY, GREEDY], [None, None], banned, [torch.tensor([3, 2, 4]), None])
    assert got.tolist() == [3, 1]  # a tie goes to the first allowed id; banned ids do not apply to it
    g = torch.Generator().manual_seed(0)
    hot = TextSampling(temperature=1.0)
    draws = {int(sample(logits[:1], [hot], [g], None, [torch.tensor([0, 4])])[0]) for _ in range(40)}
    assert draws == {0, 4}


def test_the_rank_refuses_a_bad_allowed_list():
    from types import SimpleNamespace

    from ditkv.errors import MetadataError
    from ditkv.worker.ar_batch import check_allowed

    def wk(allowed, sample=True):
        return SimpleNamespace(request_id="r", allowed=allowed, sample=sample)

    check_allowed(wk(None), 10)
    check_allowed(wk([3, 1]), 10)
    for bad, words in (([1], "draws nothing"), ([], "empty"), ([10], "not ints"), ([1, 1], "twice")):
        with pytest.raises(MetadataError, match=words):
            check_allowed(wk(bad, sample=bad != [1]), 10)


def test_bucket_tables_of_both_families():
    base = HunyuanImage3Config.tiny().replace(image_base_size=BASE)
    assert len(auto_sizes(base)) == 33 == len(bucket_table(BASE))
    inst = base.replace(extra={"model_version": "HunyuanImage-3.0-Instruct"}, img_ratio_extra_token_id=200)
    sizes = auto_sizes(inst)
    assert len(sizes) == 37 and [i for _, _, i in sizes[33:]] == [200, 201, 202, 203]
