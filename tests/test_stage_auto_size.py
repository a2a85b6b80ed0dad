"""Issue 34 item 4 in stage graphs: a request without height and width (size=auto) is planned by the
orchestrator's intake as the single engine plans it (the AR tail ends at `<img_size>`, the job carries the
ratio ids its DiT stage's envelope allows), the AR stage draws `<img_ratio_k>` greedily and exports the row,
and the DiT rows are built at bucket k. Same bucket, text and image as the single engine, bit for bit on CPU
fp32: on the release-like tiny checkpoints of tests/test_auto_size.py (its fixture's cases, and a recaption
rewrite), batched on the tiny model with a bucket table, and through a remote AR stage.
"""

import numpy as np
import pytest
import torch
from test_release_edit import make_image
from test_auto_size import (FIXTURE, Recorder, _engine, _fed, auto_req, bundle,  # noqa: F401 (fixtures)
                            fixture_folders, tiny_engine)

from ditkv.engine.types import GenerationRequest
from ditkv.errors import LayoutError
from ditkv.models.hunyuan.buckets import auto_sizes
from ditkv.models.loader import load_model
from ditkv.stages.graph import load_stage_graph
from ditkv.stages.orchestrator import Orchestrator
from ditkv.stages.remote_messages import ARDone, Submit, decode, encode


def stage_data(model="tiny", max_new=0, ar_blocks=600, dit_blocks=600, **dit_extra):
    """The AR(0) -> DiT(1) graph of tests/test_rewrite.py over `model`, the DiT envelope of `_engine`."""
    t = {"kv_connector": "shm", "kv_role": "kv_producer", "engine_id": "ar"}
    dit = {"max_image_height": 1280, "max_image_width": 1280, **dit_extra}
    return {"stages": [
        {"stage_id": 0, "kind": "ar", "max_new_tokens": max_new,
         "engine": {"model": str(model), "device": "cpu", "block_size": 16, "num_kv_blocks": ar_blocks},
         "kv_transfer_config": t},
        {"stage_id": 1, "kind": "dit", "inputs": [0],
         "engine": {"model": str(model), "device": "cpu", "block_size": 16, "num_kv_blocks": dit_blocks,
                    "diffusion_kv_mode": "paged_scheduler", "diffusion_kv_max_rows_per_request": 2, **dit},
         "kv_transfer_config": {**t, "kv_role": "kv_consumer", "engine_id": "dit"}}]}


def graph(**kw):
    return load_stage_graph(stage_data(**kw))


def idle(orch) -> bool:
    """Every page of both stages is back."""
    return orch.pools_full() and all(a.num_leases == 0 for a in orch.ar)


def graph_run(folder, bundle, r, wrap=None, **graph_kw):
    """(output, the AR works fed) of request `r` through a stage graph over `folder` (`wrap`: around the AR
    stage's model); every page of both stages back at the end."""
    orch = Orchestrator(graph(model=folder, **graph_kw), bundle)
    if wrap is not None:
        orch.ar[0].engine.worker.model = wrap(orch.ar[0].engine.worker.model)
    works = _fed(orch.ar[0].engine)
    try:
        out = orch.generate(r)
        assert idle(orch)
    finally:
        orch.shutdown()
    return out, works


def same(a, b) -> None:
    assert a.ok and b.ok, (a.error, b.error)
    assert a.stats.auto_size == b.stats.auto_size and a.revised_prompt == b.revised_prompt
    assert np.array_equal(a.image, b.image)


@pytest.mark.parametrize("case", FIXTURE["cases"] + FIXTURE["image_cases"],
                         ids=lambda c: f"{c['template']}-{len(c['images'])}-{c['prompt'][:12]}")
def test_a_stage_graph_draws_the_single_engine_s_size(fixture_folders, case):  # noqa: F811
    """bot_task image: the AR stage is fed the release img_ratio step's input (with input images, the image
    blocks too: its ranks rebuild the head from the images), draws the release's bucket (greedily, among the
    ratio ids whose rows fit), and the size and image equal the single engine's."""
    folder = fixture_folders[case["template"]]
    bundle = load_model(str(folder), torch.device("cpu"), torch.float32)
    r = GenerationRequest(prompt=case["prompt"], height=None, width=None, steps=1, guidance_scale=1.0,
                          seed=FIXTURE["seed"], images=[make_image(*spec) for spec in case["images"]] or None)
    eng = _engine(folder, bundle)
    try:
        single = eng.generate(r)
    finally:
        eng.shutdown()
    out, works = graph_run(folder, bundle, r)
    same(out, single)
    assert [t for w in works for t in w.token_ids] == case["input_ids"]
    assert set(works[-1].allowed) <= set(FIXTURE["ratio_token_ids"]) and works[-1].sampling["do_sample"] is False
    assert case["images"] or works[-1].allowed == FIXTURE["ratio_token_ids"]
    h, w = case["size"]
    assert out.image.shape[:2] == (h, w) and out.stats.auto_size == f"{w}x{h}"
    n = len(case["input_ids"])  # the DiT imports the exported row up to <img_size> (a row under one page: none)
    assert out.stats.imported_tokens == (n if n >= 16 else 0)


@pytest.mark.parametrize("case", FIXTURE["rewrites"], ids=lambda c: c["template"])
def test_recaption_then_auto_in_a_stage_graph(fixture_folders, case):  # noqa: F811
    """A request's recaption rewrite, then the ratio drawn in the rewrite's context: the AR stage writes the
    text, prefills `[<answer>] <boi> <img_size>` and draws the release's bucket, as the single engine does."""
    folder = fixture_folders[case["template"]]
    bundle = load_model(str(folder), torch.device("cpu"), torch.float32)
    r = GenerationRequest(prompt=case["prompt"], height=None, width=None, steps=1, guidance_scale=1.0,
                          seed=FIXTURE["seed"], max_new_tokens=64, bot_task="recaption")
    eng = _engine(folder, bundle)
    eng.worker.model = Recorder(eng.worker.model, (case["text_ids"], case["ratio_logits"]))
    try:
        single = eng.generate(r)
    finally:
        eng.worker.model = eng.worker.model._m
        eng.shutdown()
    out, works = graph_run(folder, bundle, r, lambda m: Recorder(m, (case["text_ids"], case["ratio_logits"])),
                           max_new=64)
    same(out, single)
    assert [t for w in works for t in w.token_ids] == case["input_ids"] + case["written"][:-1]
    h, w = case["size"]
    assert out.image.shape[:2] == (h, w) and out.stats.auto_size == f"{w}x{h}"


# ---- the tiny model with a bucket table (tests/test_auto_size.py's `bundle`) -------------------------------
TINY = {"max_image_height": 128, "max_image_width": 128, "max_prompt_tokens": 96}


def _mix():
    """The single-engine test's mix, each with its own max_new_tokens: a stage graph's pretrain image task
    would otherwise write up to the AR stage's max_new_tokens (the single engine: none)."""
    return [auto_req(0, max_new_tokens=0), auto_req(1, max_new_tokens=5, temperature=1.0),
            auto_req(2, max_new_tokens=0),
            GenerationRequest(prompt="blue", height=64, width=64, steps=2, seed=3, max_new_tokens=0)]


def test_batched_in_the_ar_stage_equals_the_single_engine(bundle):  # noqa: F811
    """Three size=auto requests (one writing text) and a sized one, run batched in the AR stage: each gets the
    single engine's size, text and image, bit for bit; one size draw per auto request; every page returns."""
    singles = []
    for r in _mix():
        eng = tiny_engine(bundle)
        try:
            singles.append(eng.generate(r))
        finally:
            eng.shutdown()
    orch = Orchestrator(graph(max_new=5, ar_blocks=400, dit_blocks=400, **TINY), bundle)
    works = _fed(orch.ar[0].engine)
    try:
        outs = orch.run(_mix(), concurrency=4)
        assert idle(orch)
    finally:
        orch.shutdown()
    for a, b in zip(outs, singles):
        same(a, b)
    assert [o.stats.auto_size is None for o in outs] == [False, False, False, True]
    assert len([w for w in works if w.allowed is not None]) == 3
    assert max(len({w.request_id for w in works[i:i + 4]}) for i in range(len(works))) > 1  # batched


def test_the_dit_envelope_bounds_the_choice(bundle):  # noqa: F811
    """The AR stage draws only among the buckets the DiT stage can draw; none fits: refused at once, by field."""
    orch = Orchestrator(graph(ar_blocks=400, dit_blocks=400, **{**TINY, "max_image_height": 64,
                                                                "max_image_width": 96}), bundle)
    works = _fed(orch.ar[0].engine)
    try:
        out = orch.generate(auto_req(1))
    finally:
        orch.shutdown()
    fits = [i for h, w, i in auto_sizes(bundle[0].config) if h <= 64 and w <= 96]
    assert works[-1].allowed == fits and 0 < len(fits) < 33
    assert out.ok and out.image.shape[0] <= 64 and out.image.shape[1] <= 96
    orch = Orchestrator(graph(ar_blocks=400, dit_blocks=400, **{**TINY, "max_image_height": 16,
                                                                "max_image_width": 16}), bundle)
    try:
        with pytest.raises(LayoutError, match="none fits this engine.*max_image_height") as e:
            orch.submit(auto_req(0))
        assert e.value.field == "size"
    finally:
        orch.shutdown()


def test_refusals_that_remain_name_the_size(bundle):  # noqa: F811
    """A model without a bucket table cannot pick: refused at the orchestrator's intake, naming `size`."""
    from ditkv.models.hunyuan import HunyuanImage3Config, HunyuanImage3Model

    model, tok, codec = bundle
    plain = HunyuanImage3Model.from_config(HunyuanImage3Config.tiny(), seed=1).eval()
    orch = Orchestrator(graph(ar_blocks=64, dit_blocks=64), (plain, tok, codec))
    try:
        with pytest.raises(LayoutError, match="no image_base_size") as e:
            orch.submit(auto_req(0))
        assert e.value.field == "size"
    finally:
        orch.shutdown()


def test_a_stage_intake_plans_auto_with_and_without_images():
    """A stage graph's intake (`Processor(stage=...)`) plans size=auto whatever its DiT stage's kv mode (the AR
    stage is always paged): tail up to `<img_size>`, the ratio ids; with input images too (the
    head then carries them to the AR stage's ranks)."""
    import types

    from ditkv.engine.processor import Processor, StageText
    from ditkv.models.hunyuan import HunyuanImage3Config
    from ditkv.models.hunyuan.tokenizer import ByteTokenizer
    from ditkv.models.text_settings import TextSampling

    cfg = HunyuanImage3Config.tiny().replace(image_base_size=64, max_input_images=1, cond_image_type="vae")
    conf = types.SimpleNamespace(max_steps=50, cfg_parallel_size=1, diffusion_kv_mode="dense_legacy")
    proc = Processor(conf, cfg, ByteTokenizer(), stage=StageText(0, TextSampling()))
    assert proc.auto_size_error() is None
    got = proc.process(auto_req(0))
    assert [i for _, _, i in got.ar.sizes] == [i for _, _, i in auto_sizes(cfg)]
    assert got.request.height is None and got.ar.size == max(
        ((h, w) for h, w, _ in auto_sizes(cfg)), key=lambda s: (s[0] // 4) * (s[1] // 4))
    img = np.zeros((32, 32, 3), dtype=np.uint8)
    got = proc.process(auto_req(0, images=[img]))
    assert got.ar.sizes and got.ar.images is not None and got.ar.tail == got.ar.tail[:-2] + [cfg.boi_token_id,
                                                                                           cfg.img_size_token_id]


def test_the_remote_messages_carry_the_choice():
    """Protocol 5: Submit.choice and ARDone.chosen round-trip; a message without them (a sized request) decodes
    with the defaults: no choice, nothing drawn."""
    kw = dict(replica=0, ticket_id="t", request_id="r", mode="native", head_ids=[1], tail_ids=[2],
              max_new_tokens=0, temperature=1.0, seed=0)
    assert decode(encode(Submit(**kw, choice=[7, 8]))).choice == [7, 8]
    assert decode(encode(Submit(**kw))).choice == []
    assert decode(encode(ARDone(ticket_id="t", request_id="r", chosen=8))).chosen == 8
    assert decode(encode(ARDone(ticket_id="t", request_id="r"))).chosen is None
    assert decode(encode(ARDone(ticket_id="t", request_id="r", stats={"ar_seconds": 1.5}))).stats == {"ar_seconds": 1.5}


def test_a_remote_ar_stage_draws_the_same_size(fixture_folders, tmp_path):  # noqa: F811
    """`ditkv stage` serving the AR stage: Submit carries the ratio ids, ARDone the drawn one; the output is the
    in-process graph's, bit for bit."""
    from test_remote_ar import FAST, Server, free_port

    case = FIXTURE["cases"][-1]
    folder = fixture_folders[case["template"]]
    r = GenerationRequest(prompt=case["prompt"], height=None, width=None, steps=1, guidance_scale=1.0,
                          seed=FIXTURE["seed"])
    port = free_port()
    data = stage_data(model=folder)
    data["stages"][0]["remote"] = {"address": f"tcp://127.0.0.1:{port}", **FAST}
    local = Orchestrator(graph(model=folder))
    try:
        want = local.generate(r)
    finally:
        local.shutdown()
    server = Server(tmp_path, port=port, data=data)
    try:
        orch = Orchestrator(load_stage_graph(data)).start()
        try:
            out = orch.generate(r, timeout=120)
        finally:
            orch.shutdown()
    finally:
        server.kill()
    same(out, want)
    h, w = case["size"]
    assert out.stats.auto_size == f"{w}x{h}" and out.stats.imported_tokens == want.stats.imported_tokens > 0
    # the server's ar_* stats travel in ARDone.stats (prompt tokens: the head and tail it prefilled)
    assert out.stats.ar_prompt_tokens == want.stats.ar_prompt_tokens > 0 and out.stats.ar_seconds > 0


def test_http_on_a_stage_graph_publishes_and_serves_auto(bundle):  # noqa: F811
    """/v1/images/generations over a stage graph: `auto` in the size pattern, and `size: auto` gives the single
    engine's size and image (`ditkv[0].auto_size`, the response's `size`)."""
    pytest.importorskip("fastapi")
    from starlette.testclient import TestClient
    from test_auto_size_fronts import _client

    from ditkv.entrypoints.serve import ServeLimits, create_app
    from ditkv.stages.async_orchestrator import AsyncOrchestrator

    body = {"prompt": "a red fox", "size": "auto", "steps": 2, "seed": 4}
    eng, single = _client(bundle)
    try:
        want = single.post("/v1/images/generations", json=body)
    finally:
        eng.shutdown()
    orch = AsyncOrchestrator(graph(ar_blocks=400, dit_blocks=400, **TINY), bundle)
    try:
        client = TestClient(create_app(orch, ServeLimits(), "tiny"))
        spec = client.get("/openapi.json").json()["components"]["schemas"]
        size = next(v for k, v in spec.items() if k.startswith("ImageGenerationRequest"))["properties"]["size"]
        pattern = size.get("pattern") or next(x["pattern"] for x in size["anyOf"] if "pattern" in x)
        got = client.post("/v1/images/generations", json=body)
    finally:
        orch.shutdown()
    assert pattern.startswith("^(auto|")
    assert got.status_code == 200 and want.status_code == 200, (got.text, want.text)
    assert got.json()["size"] == want.json()["size"] == got.json()["ditkv"][0]["auto_size"]
    assert got.json()["data"] == want.json()["data"]


def test_cli_generate_on_a_stage_graph_takes_size_auto(fixture_folders, tmp_path, capsys):  # noqa: F811
    """`ditkv generate --config STAGES.yaml --size auto` draws the release's size; the checkpoint's
    `image_size: auto` is the default without a size there too, and a size given wins."""
    import json

    import yaml

    from ditkv.entrypoints.cli import main

    case = FIXTURE["cases"][0]
    folder = fixture_folders[case["template"]]
    stages = tmp_path / "stages.yaml"
    stages.write_text(yaml.safe_dump(stage_data(model=folder)))

    def cli(out, *extra):
        return main(["generate", "--config", str(stages), "--prompt", case["prompt"], "--steps", "1", "--guidance",
                     "1", "--seed", str(FIXTURE["seed"]), "--no-progress", "--out", str(tmp_path / out), *extra])
    h, w = case["size"]
    assert cli("a.png", "--size", "auto") == 0
    assert f"size=auto: the model chose {w}x{h}" in capsys.readouterr().out
    gen = (folder / "generation_config.json").read_text()
    try:
        (folder / "generation_config.json").write_text(json.dumps({**json.loads(gen), "image_size": "auto"}))
        assert cli("b.png") == 0
        assert f"the model chose {w}x{h}" in capsys.readouterr().out
        assert cli("c.png", "--size", "256x256") == 0
        assert "chose" not in capsys.readouterr().out
    finally:
        (folder / "generation_config.json").write_text(gen)
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()


@pytest.mark.slow
def test_a_tensor_parallel_ar_stage_draws_the_same_size(fixture_folders):  # noqa: F811
    """TP=2 AR stage (rank processes, gloo): every rank draws the ratio among the same ids, the release's bucket;
    the image is the one-rank stage's within one level (the TP all-reduce sums in another order)."""
    from ditkv.engine.options import ExecutorOptions

    case = FIXTURE["cases"][-1]
    folder = fixture_folders[case["template"]]
    r = GenerationRequest(prompt=case["prompt"], height=None, width=None, steps=1, guidance_scale=1.0,
                          seed=FIXTURE["seed"])
    opts = ExecutorOptions(heartbeat_interval_s=0.1, startup_timeout_s=120.0, drain_timeout_s=20.0)
    outs = []
    for tp in (1, 2):
        data = stage_data(model=folder)
        data["stages"][0]["engine"]["tensor_parallel_size"] = tp
        orch = Orchestrator(load_stage_graph(data), executor_options=opts)
        try:
            outs.append(orch.generate(r, timeout=300))
        finally:
            orch.shutdown()
    assert outs[0].ok and outs[1].ok, (outs[0].error, outs[1].error)
    h, w = case["size"]
    assert outs[0].stats.auto_size == outs[1].stats.auto_size == f"{w}x{h}"
    assert outs[1].stats.imported_tokens == outs[0].stats.imported_tokens > 0
    assert np.abs(outs[0].image.astype(int) - outs[1].image.astype(int)).max() <= 1


def test_the_legacy_transfer_draws_the_same_size(fixture_folders):  # noqa: F811
    """A legacy-transfer graph (its DiT stage dense_legacy: the AR stage still pages and draws): the native
    graph's size and image, bit for bit."""
    case = FIXTURE["cases"][-1]
    folder = fixture_folders[case["template"]]
    bundle = load_model(str(folder), torch.device("cpu"), torch.float32)
    r = GenerationRequest(prompt=case["prompt"], height=None, width=None, steps=1, guidance_scale=1.0,
                          seed=FIXTURE["seed"])
    data = stage_data(model=folder)
    extra = {"legacy_slots": 2, "legacy_max_tokens": 256}
    for st in data["stages"]:
        st["legacy_kv_transfer"] = {**st.pop("kv_transfer_config"), **extra}
    dit = data["stages"][1]["engine"]
    dit.update(diffusion_kv_mode="dense_legacy")
    for k in ("num_kv_blocks", "diffusion_kv_max_rows_per_request"):
        dit.pop(k)
    outs = []
    for g in (graph(model=folder), load_stage_graph(data)):
        orch = Orchestrator(g, bundle)
        try:
            outs.append(orch.generate(r))
        finally:
            orch.shutdown()
    same(outs[1], outs[0])
    h, w = case["size"]
    assert outs[1].stats.auto_size == f"{w}x{h}" and outs[1].stats.imported_tokens == outs[0].stats.imported_tokens
