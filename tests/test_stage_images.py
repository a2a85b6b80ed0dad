"""Input images through a stage graph (issue 16 item 4): the AR stage encodes the images and prefills
the image-conditioned prefix (full-attention image blocks, 2D positions, VAE samples from the request
seed), the transfer moves those pages, and the DiT never recomputes them. The bundled editing model
(`tiny-edit`) runs on every topology: in-process native and legacy, a single engine, AR TP=2 -> DiT
TP=2 rank processes (with AR-generated text, so the DiT ranks rebuild the row from ids + images) and
a separately deployed AR stage. Pools return to full after each run."""

import copy

import numpy as np
import pytest
import torch

from ditkv.config import EngineConfig
from ditkv.engine.engine import Engine
from ditkv.engine.messages import HeadImages, pack_images
from ditkv.engine.types import GenerationRequest
from ditkv.errors import LayoutError
from ditkv.models.hunyuan.layout import RowInputs
from ditkv.stages.graph import load_stage_graph
from ditkv.stages.kv_import import importable_prefix
from ditkv.stages.orchestrator import Orchestrator
from ditkv.stages.remote_messages import Submit, decode, encode
from stage_helpers import full, rank_opts, wait_for

MODEL = "tiny-edit"


def image(seed=0, h=32, w=32):
    """A shape on a plain background, as the editing model was trained on (any RGB array would do)."""
    a = np.full((h, w, 3), 240, dtype=np.uint8)
    r = np.random.default_rng(seed)
    y, x = r.integers(4, h - 12), r.integers(4, w - 12)
    a[y:y + 8, x:x + 8] = r.integers(0, 256, 3, dtype=np.uint8)
    return a


def req(i=0, prompt="make it blue", g=2.0):
    return GenerationRequest(prompt=prompt, height=32, width=32, steps=2, guidance_scale=g, seed=i,
                             images=[image(i)])


REQS = [req(0), req(1, "move it to the top left", 3.0), req(2, "make it a square", 1.0)]


def stages(mode="native", ar_tp=1, dit_tp=1, max_new=0, model=MODEL):
    key = "kv_transfer_config" if mode == "native" else "legacy_kv_transfer"
    dit = {"model": model, "device": "cpu", "block_size": 16, "num_kv_blocks": 256, "tensor_parallel_size": dit_tp,
           "diffusion_kv_mode": "paged_scheduler" if mode == "native" else "dense_legacy",
           "diffusion_kv_max_rows_per_request": 2}
    extra = {} if mode == "native" else {"legacy_slots": 4, "legacy_max_tokens": 512}
    return {"stages": [
        {"stage_id": 0, "kind": "ar", "max_new_tokens": max_new,
         "engine": {"model": model, "device": "cpu", "block_size": 16, "num_kv_blocks": 64,
                    "tensor_parallel_size": ar_tp},
         key: {"kv_connector": "shm", "engine_id": "ar", "kv_role": "kv_producer", **extra}},
        {"stage_id": 1, "kind": "dit", "inputs": [0], "engine": dit,
         key: {"kv_connector": "shm", "engine_id": "dit", "kv_role": "kv_consumer", "transfer_timeout": 30.0,
               **extra}}]}


def run(data, reqs=REQS, **kw):
    orch = Orchestrator(load_stage_graph(data), **kw).start()
    try:
        outs = orch.run(list(reqs), concurrency=2)
        assert wait_for(lambda: full(orch))
        snap = orch.transfers.snapshot()
    finally:
        orch.shutdown()
    assert [o.status for o in outs] == ["ok"] * len(reqs), [o.error for o in outs]
    assert full(orch)
    return outs, snap


@pytest.fixture(scope="module")
def single():
    """The same requests on one engine (no AR stage): the images and the rows' layouts."""
    e = Engine(EngineConfig(model=MODEL, device="cpu", block_size=16, num_kv_blocks=256,
                            diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2))
    try:
        outs = [e.generate(r) for r in REQS]
        layouts = [e.worker.layout(r.prompt, r.height, r.width, r.guidance_scale, images=r.images) for r in REQS]
    finally:
        e.shutdown()
    assert all(o.ok for o in outs), [o.error for o in outs]
    return outs, layouts


@pytest.fixture(scope="module")
def native():
    return run(stages("native"))


def expected_imports(layout) -> int:
    """cond imports its whole prefix; uncond the tokens it shares with cond (<bos> and the image: the
    prompt, where `<cfg>` starts, comes after it)."""
    rows = layout.rows
    if len(rows) == 1:
        return rows[0].prefix_len
    a, b = rows[0].token_ids, rows[1].token_ids
    shared = int((a[:rows[0].prefix_len] != b[:rows[0].prefix_len]).nonzero()[0])
    assert shared > layout.images[0].vae_start + layout.images[0].h * layout.images[0].w  # past the image block
    return rows[0].prefix_len + shared


def test_native_and_legacy_equal_a_single_engine(single, native):
    ref, layouts = single
    outs, snap = native
    legacy, lsnap = run(stages("legacy"))
    for o, l, r, lay in zip(outs, legacy, ref, layouts):
        assert np.array_equal(o.image, l.image)  # the same imported K/V, page by page or as one tensor
        # AR prefill vs DiT prefill: the same bits on any x86-64 CPU (fixed-shape CPU products, test_cpu_tiles)
        assert np.array_equal(o.image, r.image)
        assert o.stats.imported_tokens == l.stats.imported_tokens == expected_imports(lay)
        # the DiT computed only what it did not import: the target rows on every step
        seq = sum(row.seq_len for row in lay.rows)
        tgt = sum(row.target_len for row in lay.rows)
        assert o.stats.tokens_computed == seq - o.stats.imported_tokens + tgt
    assert snap["ok"] == lsnap["ok"] == len(REQS) and snap["failures"] == 0 and snap["bytes"] > 0


def test_the_image_changes_the_result(native):
    """The AR's image K/V reach the DiT: another input image (same prompt and seed) gives another image."""
    outs, _ = native
    other = GenerationRequest(prompt=REQS[0].prompt, height=32, width=32, steps=2, guidance_scale=2.0, seed=0,
                              images=[image(7)])
    (o,), _ = run(stages("native"), [other])
    assert np.abs(o.image.astype(int) - outs[0].image.astype(int)).max() > 8


@pytest.mark.slow
def test_ar_tp2_and_dit_tp2_rank_processes_with_generated_text(single):
    """AR TP=2 generates text after the image-conditioned head; the DiT TP=2 ranks rebuild the row from
    the generated ids plus the images. The in-process graph with the same settings is the reference."""
    want, _ = run(stages("native", max_new=2))
    got, snap = run(stages("native", ar_tp=2, dit_tp=2, max_new=2), executor_options=rank_opts())
    for o, w in zip(got, want):
        assert o.revised_prompt == w.revised_prompt
        assert o.stats.imported_tokens == w.stats.imported_tokens
        assert np.abs(o.image.astype(int) - w.image.astype(int)).max() <= 1  # TP sums in another order
    assert snap["failures"] == 0


@pytest.mark.slow
def test_remote_ar_stage_takes_images(tmp_path, native):
    from test_remote_ar import FAST, Server, free_port

    port = free_port()
    data = stages("native")
    data["stages"][0]["remote"] = {"address": f"tcp://127.0.0.1:{port}", **FAST}
    server = Server(tmp_path, port=port, data=data)
    try:
        outs, snap = run(copy.deepcopy(data))
    finally:
        server.kill()
    for o, w in zip(outs, native[0]):
        assert np.array_equal(o.image, w.image)
        assert o.stats.imported_tokens == w.stats.imported_tokens
    assert snap["failures"] == 0


def test_a_model_without_image_input_refuses_them_at_intake():
    orch = Orchestrator(load_stage_graph(stages("native", model="tiny")))
    try:
        with pytest.raises(LayoutError, match="max_input_images") as err:
            orch.submit(req())
        assert err.value.field == "image"
        assert full(orch)
    finally:
        orch.shutdown()


@pytest.mark.parametrize("model, limit", [("tiny", 0), (MODEL, 1)])
def test_too_many_input_images_read_the_same_from_a_single_engine_and_a_stage_graph(model, limit):
    """One refusal (`models.family.check_input_image_count`) whichever path finds it: the stage
    graph's layout said "takes at most max_input_images=1: send fewer images" (issue 33)."""
    from ditkv.models.family import check_input_image_count

    r = GenerationRequest(prompt="make it blue", height=32, width=32, steps=2, seed=0,
                          images=[image(i) for i in range(limit + 1)])
    with pytest.raises(LayoutError) as want:
        check_input_image_count(limit + 1, limit)
    e = Engine(EngineConfig(model=model, device="cpu", block_size=16, num_kv_blocks=64,
                            diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2))
    try:
        with pytest.raises(LayoutError) as engine_err:
            e.add_request(r)
    finally:
        e.shutdown()
    orch = Orchestrator(load_stage_graph(stages("native", model=model)))
    try:
        with pytest.raises(LayoutError) as graph_err:
            orch.submit(r)
        assert full(orch)
    finally:
        orch.shutdown()
    assert str(engine_err.value) == str(graph_err.value) == str(want.value)
    assert engine_err.value.field == graph_err.value.field == "image"


def test_submit_carries_the_images_on_the_wire():
    r = req(3)
    wire = HeadImages(r.prompt, r.height, r.width, False, pack_images(r.images))
    m = decode(encode(Submit(replica=0, ticket_id="t", request_id="r", mode="native", head_ids=[1, 2], tail_ids=[3],
                             max_new_tokens=0, temperature=0.0, seed=3, images=wire)))
    assert m.images.prompt == r.prompt and (m.images.height, m.images.width) == (32, 32)
    assert np.array_equal(np.frombuffer(m.images.images[0].data, np.uint8).reshape(m.images.images[0].shape),
                          r.images[0])


def test_an_import_never_ends_inside_an_image_block_nor_buys_a_page_for_a_few_tokens():
    ids = torch.arange(20)
    row = RowInputs(token_ids=ids, pos_y=ids, pos_x=ids, prefix_len=16, target_len=4, seq_len=20, timestep_index=16,
                    image_start=17, full_attn_spans=((4, 10), (17, 20)))
    assert importable_prefix(ids, row) == importable_prefix(ids, row, page=32) == 16  # the whole prefix
    for cut, want, paged in ((1, 1, 0), (3, 3, 0), (4, 4, 4), (7, 4, 4), (10, 10, 10), (12, 12, 12)):
        ar = ids.clone()
        ar[cut:] = -1  # the AR's tokens diverge at `cut`
        assert importable_prefix(ar, row) == want, cut
        assert importable_prefix(ar, row, page=4) == paged, cut  # under one page (4 tokens): nothing


def test_the_dit_stage_never_encodes_imported_images(single):
    """Every row imported the image block, so the DiT skips the encoders (the AR ran them) and only
    advances the generator past the samples: same image as the single engine, which encodes."""
    _, layouts = single
    orch = Orchestrator(load_stage_graph(stages("native")))
    calls = {"dit": 0}
    runner = orch.dit[0].worker.runner
    real = runner.condition

    def condition(*a, **kw):
        calls["dit"] += 1
        return real(*a, **kw)
    runner.condition = condition
    try:
        out = orch.generate(REQS[0])
    finally:
        orch.shutdown()
    assert out.ok and calls["dit"] == 0
    assert np.array_equal(out.image, single[0][0].image)


def test_partly_imported_images_are_encoded():
    from ditkv.models.hunyuan import PixelCodec
    from ditkv.worker.denoising import _condition, covered_images

    class Codec(PixelCodec):
        def skip_sample(self, img, generator):
            torch.randn(3, generator=generator)
            return True

    lay = single_layout()
    end = lay.images[0].vae_start + lay.images[0].h * lay.images[0].w
    skips = []  # what `DiTRunner.condition` was asked to skip (it encodes the rest)
    runner = type("R", (), {"codec": Codec(4),
                            "condition": lambda self, layout, g, skip=0, seed=None: skips.append(skip) or "cond"})()
    g = torch.Generator().manual_seed(0)
    assert covered_images(lay, [end, end - 1]) == 0 and _condition(runner, lay, [end, end - 1], g) == "cond"
    assert skips == [0]
    assert torch.equal(torch.randn(4, generator=g), torch.randn(4, generator=torch.Generator().manual_seed(0)))
    assert _condition(runner, lay, [end, end], g) is None and skips == [0]  # covered: only g advanced
    assert _condition(runner, lay, None, g) == "cond" and skips == [0, 0]  # the prefix recomputed: encoded
    runner.codec = None  # nothing can skip: encoded (where a missing codec is reported)
    assert _condition(runner, lay, [end, end], g) == "cond" and skips == [0, 0, 1]


def single_layout():
    from ditkv.models.loader import load_model
    from ditkv.models.hunyuan import build_request_layout

    model, tok, _ = load_model(MODEL, torch.device("cpu"), torch.float32)
    r = REQS[0]
    return build_request_layout(model.config, tok, r.prompt, r.height, r.width, r.guidance_scale, images=r.images)


def test_cli_edits_through_the_example_stage_file(tmp_path):
    """`ditkv generate --config examples/stages-native-edit.yaml --image in.png`: a red circle made blue."""
    import os

    from PIL import Image

    from ditkv.entrypoints.cli import main

    src, out = tmp_path / "in.png", tmp_path / "out.png"
    assert main(["generate", "--model", "tiny", "--prompt", "a large red circle", "--out", str(src),
                 "--no-progress"]) == 0
    cfg = os.path.join(os.path.dirname(__file__), "..", "examples", "stages-native-edit.yaml")
    assert main(["generate", "--config", cfg, "--image", str(src), "--prompt", "make it blue", "--out", str(out),
                 "--no-progress"]) == 0
    a, b = (np.asarray(Image.open(p).convert("RGB")).astype(int) for p in (src, out))
    red, blue = a[..., 0] - a[..., 2] > 100, b[..., 2] - b[..., 0] > 100
    assert red.sum() > 100 and blue.sum() > 0.5 * red.sum()  # the shape kept its size, now blue


def test_an_ar_stage_that_rebuilds_another_head_refuses_it_naming_the_fix():
    """The AR side rebuilds the head's image slots from the wire form; if its ids differ from the
    orchestrator's (other tokenizer, config or template), it refuses instead of writing wrong K/V."""
    from ditkv.engine.messages import ar_head_of
    from ditkv.models.loader import load_model

    model, tok, _ = load_model(MODEL, torch.device("cpu"), torch.float32)
    r = req(4)
    wire = HeadImages(r.prompt, r.height, r.width, False, pack_images(r.images))
    head = ar_head_of(model.config, tok, wire, single_layout_ids(model, tok, r))
    assert head is not None and len(head.images) == 1
    assert ar_head_of(model.config, tok, None, [1, 2]) is None  # text only: nothing to rebuild
    with pytest.raises(LayoutError, match="same model folder") as err:
        ar_head_of(model.config, tok, wire, single_layout_ids(model, tok, r)[:-1])
    assert err.value.field == "image"


def single_layout_ids(model, tok, r):
    from ditkv.models.hunyuan import build_request_layout

    return build_request_layout(model.config, tok, r.prompt, r.height, r.width, r.guidance_scale,
                                images=r.images).cond_text_ids()


def test_a_refused_head_fails_only_that_request_and_leaks_no_page(monkeypatch):
    import ditkv.engine.rank_steps as rank_steps  # the AR stage's engine rebuilds heads on its rank

    real = rank_steps.ar_head_of

    def refuse(cfg, tok, wire, ids):
        if wire is not None and wire.prompt == "refuse me":
            raise LayoutError("the AR stage rebuilt a different prompt", field="image")
        return real(cfg, tok, wire, ids)
    monkeypatch.setattr(rank_steps, "ar_head_of", refuse)
    orch = Orchestrator(load_stage_graph(stages("native"))).start()
    try:
        bad, good = orch.run([req(5, "refuse me"), req(6)], concurrency=2)
        assert bad.status == "error" and "different prompt" in bad.error
        assert good.ok, good.error
        assert wait_for(lambda: full(orch))
    finally:
        orch.shutdown()


def test_fp8_stage_graph_equals_a_single_fp8_engine():
    """`quantization: fp8` in both stages' engine sections: the AR stage prefills with the quantized
    model and the DiT imports those pages; the image equals one fp8 engine's bit for bit on the CPU
    (per-token scales and fixed row tiles: the AR prefill's K/V are the DiT prefill's)."""
    data = stages("native")
    for s in data["stages"]:
        s["engine"]["quantization"] = "fp8"
    outs, snap = run(data, REQS[:2])
    e = Engine(EngineConfig(model=MODEL, device="cpu", block_size=16, num_kv_blocks=256, quantization="fp8",
                            diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2))
    try:
        ref = [e.generate(r) for r in REQS[:2]]
        plain = Engine(EngineConfig(model=MODEL, device="cpu", block_size=16, num_kv_blocks=256,
                                    diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2))
        unq = plain.generate(REQS[0])
        plain.shutdown()
    finally:
        e.shutdown()
    for o, r in zip(outs, ref):
        assert np.array_equal(o.image, r.image)
        assert o.stats.imported_tokens > 0
    assert not np.array_equal(outs[0].image, unq.image)  # the stages really ran quantized
    assert snap["ok"] == 2 and snap["failures"] == 0
