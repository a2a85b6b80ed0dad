"""Issue 34 item 2: a request's own `bot_task` (`GenerationRequest.bot_task`, `ditkv generate --bot-task`, the
HTTP extra field). The request's template is the checkpoint's with that task, and everything after intake
follows it: the layout, the AR head, tail and stop ids, whether the request writes text (and how much: the
request's max_new_tokens, else the checkpoint's), the handover and size=auto. So a think request on a
checkpoint whose template says image draws what an engine whose checkpoint says think draws, bit for bit on
CPU fp32; requests with different tasks share a batch; a task the engine cannot run is refused by field.

"auto" is the release generate_image's auto (Tencent-Hunyuan/HunyuanImage-3.0@1d011c8 hunyuan.py:2624-2651,
the Instruct fork suryatmodulus/HunyuanImage-3.0@1ea1526 modeling_hunyuan_image_3.py:3249-3373): no rewrite;
under use_system_prompt dynamic the custom system prompt (system_prompt.py get_system_prompt). Its free text
mode is refused with text (docs/ar-phase.md "bot_task per request")."""

import numpy as np
import pytest
import torch

from test_auto_size import fixture_folders  # noqa: F401 - a fixture
from test_rewrite import CASES, PROMPT, Forced, bundle_for, release_tok, req  # noqa: F401 - release_tok: a fixture
from ditkv.config import EngineConfig
from ditkv.engine.engine import Engine
from ditkv.engine.types import GenerationRequest
from ditkv.errors import LayoutError
from ditkv.models.hunyuan import HunyuanImage3Config
from ditkv.models.hunyuan.layout import build_request_layout
from ditkv.models.hunyuan.template import BOT_TASKS, TemplateSettings, request_settings, system_prompt_text


def engine(bundle, **kw):
    return Engine(EngineConfig(device="cpu", block_size=16, num_kv_blocks=512, **kw), model_bundle=bundle)


def generate(bundle, r, seq=None):
    """One request alone in a fresh engine; `seq`: the AR's text, forced (the DiT keeps the model)."""
    eng = engine(bundle)
    if seq is not None:
        eng.worker.model = Forced(eng.worker.model, seq)
    try:
        out = eng.generate(r)
        assert eng.manager.pool.num_free == eng.manager.pool.num_blocks
        return out
    finally:
        eng.shutdown()


def same(a, b):
    assert a.ok and b.ok, (a.error, b.error)
    assert a.revised_prompt == b.revised_prompt
    assert (a.stats.ar_prompt_tokens, a.stats.ar_generated_tokens) == (b.stats.ar_prompt_tokens,
                                                                       b.stats.ar_generated_tokens)
    assert np.array_equal(a.image, b.image)


def without_task(settings: dict) -> dict:
    return {k: v for k, v in settings.items() if k != "bot_task"}


# ---- the template ----------------------------------------------------------------------------------------
def test_the_request_template_is_the_checkpoint_s_with_its_task():
    cfg = HunyuanImage3Config.tiny().replace(extra={"use_system_prompt": "dynamic", "sequence_template": "instruct",
                                                    "system_prompt": "Draw it."})
    assert request_settings(cfg) == TemplateSettings.from_config(cfg)
    think = request_settings(cfg, "think")
    assert think == TemplateSettings(use_system_prompt="dynamic", sequence_template="instruct", bot_task="think",
                                     system_prompt="Draw it.")
    # dynamic follows the request's task, as the release's get_system_prompt(use_system_prompt, bot_task, ...)
    assert system_prompt_text(think).startswith("\nYou will act as a top-tier Text-to-Image AI")
    assert system_prompt_text(request_settings(cfg, "auto")) == "Draw it."  # auto: the custom text
    with pytest.raises(LayoutError, match="'paint' is not one of 'image', 'auto', 'think', 'recaption'") as e:
        request_settings(cfg, "paint")
    assert e.value.field == "bot_task"


# ---- a request's task equals a checkpoint with that task ----------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_a_request_s_rewrite_equals_a_checkpoint_with_that_task(release_tok, case):
    """think / recaption asked by the request on a checkpoint whose template says image (same system-prompt
    mode, sequence template and drop_think): the same AR head and text, the same rebuilt image row and image as
    the engine whose checkpoint says that task."""
    tok, base = release_tok
    settings, text, max_new, _ = CASES[case]
    seq = tok.encode(text)
    want = generate(bundle_for(base.replace(extra=settings), tok), req(7, max_new_tokens=max_new), seq)
    got = generate(bundle_for(base.replace(extra=without_task(settings)), tok),
                   req(7, max_new_tokens=max_new, bot_task=settings["bot_task"]), seq)
    same(got, want)
    assert got.revised_prompt.startswith(f"<{settings['bot_task']}>")


@pytest.mark.parametrize("task,settings", [
    ("image", {"bot_task": "recaption", "use_system_prompt": "dynamic", "sequence_template": "instruct",
               "max_new_tokens": 40}),
    ("auto", {"bot_task": "think", "use_system_prompt": "dynamic", "system_prompt": "Draw it.", "max_new_tokens": 40}),
    ("image", {"bot_task": "auto", "use_system_prompt": "dynamic"}),
])
def test_a_request_without_a_rewrite_on_a_rewrite_checkpoint(release_tok, task, settings):
    """image (or auto) on a think/recaption checkpoint: no AR phase (the checkpoint's max_new_tokens is its
    rewrite's), and the row of a checkpoint with that task (under dynamic, that task's system prompt)."""
    tok, base = release_tok
    want = generate(bundle_for(base.replace(extra={**settings, "bot_task": task}), tok), req(5))
    got = generate(bundle_for(base.replace(extra=settings), tok), req(5, bot_task=task))
    same(got, want)
    assert got.revised_prompt is None and got.stats.ar_prompt_tokens == 0


def test_a_rewrite_takes_the_checkpoint_s_max_new_tokens(release_tok):
    """On an image checkpoint whose generation_config.json sets max_new_tokens, a recaption request without
    its own writes up to that many tokens; a request without bot_task still writes none."""
    tok, base = release_tok
    bundle = bundle_for(base.replace(extra={"max_new_tokens": 3}), tok)
    seq = tok.encode(" a red fox in white snow</recaption>")
    out = generate(bundle, req(2, bot_task="recaption"), seq)
    assert out.ok and out.stats.ar_generated_tokens == 3 and out.revised_prompt == "<recaption>" + tok.decode(seq[:3])
    plain = generate(bundle, req(2))
    assert plain.ok and plain.revised_prompt is None and plain.stats.ar_prompt_tokens == 0


# ---- batched ---------------------------------------------------------------------------------------------
def _mixed():
    sampled = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    return [req(0, bot_task="think", max_new_tokens=5, **sampled),
            req(1, bot_task="recaption", max_new_tokens=4, **sampled),
            req(2),  # the checkpoint's: image, no text
            req(3, bot_task="auto"),
            req(4, bot_task="image", max_new_tokens=3, **sampled),  # ditkv's prompt extension
            req(5, prompt="a red fox", bot_task="recaption", max_new_tokens=6, **sampled)]


def test_batched_requests_with_different_tasks_equal_each_alone(release_tok):
    """Six requests, four tasks, on one engine whose checkpoint says image with a dynamic system prompt (so
    each task has its own system prompt): each gets its solo text and image, bit for bit, and every page
    returns."""
    tok, base = release_tok
    bundle = bundle_for(base.replace(extra={"use_system_prompt": "dynamic", "system_prompt": "Draw."}), tok)
    solo = [generate(bundle, r) for r in _mixed()]
    eng = engine(bundle, max_num_seqs=6)
    try:
        ids = [eng.add_request(r) for r in _mixed()]
        outs = {o.request_id: o for o in eng.run_until_complete()}
        m = eng.manager
        assert m.pool.num_free == m.pool.num_blocks and m.num_ar_rows == 0
        assert max(eng.batch_sizes) > 1
    finally:
        eng.shutdown()
    for rid, want in zip(ids, solo):
        same(outs[rid], want)
    texts = [o.revised_prompt for o in solo]
    assert texts[0].startswith("<think>") and texts[1].startswith("<recaption>") and texts[5].startswith("<rec")
    assert texts[2] is None and texts[3] is None and texts[4].startswith(PROMPT)
    assert solo[0].stats.ar_prompt_tokens > solo[1].stats.ar_prompt_tokens  # the think system prompt is longer


# ---- stage graphs ----------------------------------------------------------------------------------------
def staged(bundle, r, max_new, seq=None):
    from test_rewrite import force, graph
    from ditkv.stages.orchestrator import Orchestrator

    orch = Orchestrator(graph(max_new=max_new), bundle)
    if seq is not None:
        force(orch, seq)
    try:
        return orch.generate(r)
    finally:
        orch.shutdown()


@pytest.mark.parametrize("case", list(CASES))
def test_a_stage_graph_runs_a_request_s_rewrite_as_a_checkpoint_with_that_task(release_tok, case):
    """The orchestrator plans each request with its task's `ARPlanner` (AR input, stop ids in `ARJob`, the image
    row after the text): the same text and image as the graph whose checkpoint says that task."""
    tok, base = release_tok
    settings, text, max_new, _ = CASES[case]
    seq = tok.encode(text)
    want = staged(bundle_for(base.replace(extra=settings), tok), req(7), max_new, seq)
    got = staged(bundle_for(base.replace(extra=without_task(settings)), tok), req(7, bot_task=settings["bot_task"]),
                 max_new, seq)
    assert got.ok and want.ok, (got.error, want.error)
    assert got.revised_prompt == want.revised_prompt and np.array_equal(got.image, want.image)
    assert got.stats.imported_tokens == want.stats.imported_tokens


def test_a_stage_graph_s_image_request_on_a_rewrite_checkpoint_writes_no_text(release_tok):
    """The stage's max_new_tokens is the checkpoint task's: a request's own image task writes none unless it
    asks (as in a single engine), and draws the image checkpoint's image."""
    tok, base = release_tok
    settings = {"use_system_prompt": "dynamic", "sequence_template": "instruct"}
    want = staged(bundle_for(base.replace(extra=settings), tok), req(3), 0)
    got = staged(bundle_for(base.replace(extra={**settings, "bot_task": "think"}), tok), req(3, bot_task="image"), 8)
    assert got.ok and want.ok, (got.error, want.error)
    assert got.revised_prompt is None and np.array_equal(got.image, want.image)


def test_a_stage_graph_refuses_by_field(release_tok):
    from test_rewrite import graph
    from ditkv.stages.orchestrator import Orchestrator

    tok, base = release_tok
    for max_new in (0, 4):
        orch = Orchestrator(graph(max_new=max_new), bundle_for(base.replace(extra={"sequence_template": "instruct"}),
                                                                tok))
        try:
            if max_new == 0:  # the AR stage sizes its pages for no text
                with pytest.raises(LayoutError, match="raise stages\\[0\\].max_new_tokens") as e:
                    orch.submit(req(bot_task="think"))
                assert e.value.field == "bot_task"
            else:  # the stage's max_new_tokens is the rewrites' cap: an instruct image request asks for none
                assert orch.generate(req()).revised_prompt is None
                with pytest.raises(LayoutError, match="generate_image") as e:
                    orch.submit(req(bot_task="auto", max_new_tokens=2))
                assert e.value.field == "bot_task"
                with pytest.raises(LayoutError, match="instruct template") as e:
                    orch.submit(req(max_new_tokens=2))
                assert e.value.field == "max_new_tokens"
                with pytest.raises(LayoutError, match="would be unused") as e:  # as in a single engine
                    orch.submit(req(temperature=0.5))
                assert e.value.field == "temperature"
            with pytest.raises(LayoutError) as e:
                orch.submit(req(bot_task="paint"))
            assert e.value.field == "bot_task"
        finally:
            orch.shutdown()


def test_a_stage_default_task(release_tok):
    """`stages[0].bot_task` in the stage YAML: the task of the graph's requests without their own."""
    from test_rewrite import force, graph
    from ditkv.errors import ConfigError
    from ditkv.stages.graph import load_stage_graph
    from ditkv.stages.orchestrator import Orchestrator

    tok, base = release_tok
    settings, text, max_new, rewrite = CASES["recaption-instruct"]
    bundle = bundle_for(base.replace(extra=without_task(settings)), tok)
    g = graph(max_new=max_new)
    g.ar.bot_task = "recaption"
    orch = Orchestrator(g, bundle)
    force(orch, tok.encode(text))
    try:
        got = orch.generate(req(7))
        plain = orch.generate(req(7, bot_task="image"))  # the request's own wins
    finally:
        orch.shutdown()
    assert got.revised_prompt == rewrite and np.array_equal(got.image, staged(
        bundle_for(base.replace(extra=settings), tok), req(7), max_new, tok.encode(text)).image)
    assert plain.ok and plain.revised_prompt is None
    for task, max_new, field in (("paint", 4, "stages[0].bot_task"), ("think", 0, "stages[0].max_new_tokens")):
        g = graph(max_new=max_new)
        g.ar.bot_task = task
        with pytest.raises(ConfigError) as e:
            Orchestrator(g, bundle)
        assert e.value.field == field, e.value
    spec = {"stages": [{"stage_id": 0, "kind": "ar", "bot_task": "think", "engine": {"model": "tiny"},
                        "kv_transfer_config": {"kv_connector": "shm", "kv_role": "kv_producer", "engine_id": "ar"}},
                       {"stage_id": 1, "kind": "dit", "inputs": [0], "engine": {"model": "tiny"},
                        "kv_transfer_config": {"kv_connector": "shm", "kv_role": "kv_consumer", "engine_id": "dit"}}]}
    assert load_stage_graph(spec).ar.bot_task == "think"
    spec["stages"][1]["bot_task"] = "think"
    with pytest.raises(ConfigError) as e:
        load_stage_graph(spec)
    assert e.value.field == "stages[1].bot_task"


# ---- size=auto -------------------------------------------------------------------------------------------
def test_a_request_s_recaption_with_size_auto_feeds_the_release_transition(fixture_folders):
    """size=auto with bot_task recaption asked by the request on the fixture's checkpoints (their template says
    image): the AR row and the bucket drawn are the release recaption path's (tests/test_auto_size.py's case,
    whose checkpoint says recaption)."""
    from test_auto_size import FIXTURE, Recorder, _engine, _fed

    from ditkv.models.loader import load_model

    for case in FIXTURE["rewrites"]:
        folder = fixture_folders[case["template"]]
        eng = _engine(folder, load_model(str(folder), torch.device("cpu"), torch.float32))
        eng.worker.model = Recorder(eng.worker.model, (case["text_ids"], case["ratio_logits"]))
        works = _fed(eng)
        try:
            out = eng.generate(GenerationRequest(prompt=case["prompt"], height=None, width=None, steps=1,
                                                 guidance_scale=1.0, seed=FIXTURE["seed"], max_new_tokens=64,
                                                 bot_task="recaption"))
        finally:
            eng.shutdown()
        assert out.ok, out.error
        assert [t for w in works for t in w.token_ids] == case["input_ids"] + case["written"][:-1]
        h, w = case["size"]
        assert out.image.shape[:2] == (h, w) and out.stats.auto_size == f"{w}x{h}"


# ---- refusals --------------------------------------------------------------------------------------------
def refused(eng, r) -> LayoutError:
    with pytest.raises(LayoutError) as e:
        eng.add_request(r)
    return e.value


def test_refusals_name_the_field(release_tok):
    tok, base = release_tok
    eng = engine(bundle_for(base.replace(extra={"sequence_template": "instruct"}), tok))
    try:
        e = refused(eng, req(bot_task="paint"))
        assert e.field == "bot_task" and "'image', 'auto', 'think', 'recaption'" in str(e)
        assert refused(eng, req(bot_task=3)).field == "bot_task"
        e = refused(eng, req(bot_task="think"))  # no max_new_tokens here or in the checkpoint
        assert e.field == "max_new_tokens" and "bot_task='think' (the request's)" in str(e)
        e = refused(eng, req(bot_task="auto", max_new_tokens=4))  # the release's auto writes no text
        assert e.field == "bot_task" and "generate_image" in str(e)
        e = refused(eng, req(bot_task="image", max_new_tokens=4))  # instruct: text cannot extend the prompt
        assert e.field == "max_new_tokens" and "instruct template" in str(e)
        assert eng.manager.pool.num_free == eng.manager.pool.num_blocks
    finally:
        eng.shutdown()


def test_a_tokenizer_without_the_tags_refuses_a_request_s_rewrite():
    from stage_helpers import tiny_bundle

    eng = engine(tiny_bundle())
    try:
        e = refused(eng, GenerationRequest(prompt="a red circle", height=32, width=32, steps=1, max_new_tokens=4,
                                           bot_task="recaption"))
        assert e.field == "bot_task" and "</recaption>" in str(e) and "leave bot_task out" in str(e)
        assert eng.generate(GenerationRequest(prompt="a red circle", height=32, width=32, steps=1,
                                              bot_task="auto")).ok  # the tiny default template: auto is image
    finally:
        eng.shutdown()


def _image_request(**kw):
    from test_image_inputs import rgb

    text = dict(max_new_tokens=3, temperature=1.0, top_k=0, top_p=1.0, ignore_eos=True)
    return GenerationRequest(prompt="a red circle", height=32, width=32, steps=2, seed=4, images=[rgb(16, 16)],
                             **{**text, **kw})


def _image_bundle(extra: dict):
    from test_image_inputs import tiny_bundle as edit_bundle

    bundle = edit_bundle(max_input_images=1)
    bundle[0].config.extra = extra
    return bundle


def test_a_request_s_task_with_input_images_and_text_equals_a_checkpoint_with_that_task():
    """The AR head of an image request is rebuilt by the ranks (`ar_head_of`) with the request's own template
    (`HeadImages.bot_task`): bot_task image on an auto checkpoint under dynamic system prompts (each task has its
    own) writes the text and draws the image of the checkpoint whose task is image."""
    dyn = {"use_system_prompt": "dynamic", "system_prompt": "Draw it."}
    want = generate(_image_bundle({**dyn, "bot_task": "image"}), _image_request())
    got = generate(_image_bundle({**dyn, "bot_task": "auto"}), _image_request(bot_task="image"))
    same(got, want)
    plain = generate(_image_bundle({**dyn, "bot_task": "auto"}), _image_request(bot_task=None, max_new_tokens=0,
                                                                                temperature=None, top_k=None,
                                                                                top_p=None, ignore_eos=False))
    assert plain.ok and plain.revised_prompt is None  # the auto checkpoint's own row: no text


def test_a_stage_graph_s_request_task_with_input_images_and_text():
    """The same in a stage graph: the AR stage's ranks rebuild the head with the request's template."""
    dyn = {"use_system_prompt": "dynamic", "system_prompt": "Draw it."}
    want = staged(_image_bundle({**dyn, "bot_task": "image"}), _image_request(), 3)
    got = staged(_image_bundle({**dyn, "bot_task": "auto"}), _image_request(bot_task="image"), 3)
    same(got, want)
    single = generate(_image_bundle({**dyn, "bot_task": "auto"}), _image_request(bot_task="image"))
    assert got.revised_prompt == single.revised_prompt and np.array_equal(got.image, single.image)
    # the AR stage's ar_* stats reach the output, as a single engine's do
    assert (got.stats.ar_prompt_tokens, got.stats.ar_generated_tokens) == (single.stats.ar_prompt_tokens, 3)
    assert got.stats.ar_seconds > 0 and 0 < got.stats.ar_time_to_first_token_s <= got.stats.ar_seconds + 1


def test_the_layout_follows_the_request_s_task(release_tok):
    """No text (bot_task auto on a dynamic image checkpoint): the engine's rows are the auto template's."""
    tok, base = release_tok
    cfg = base.replace(extra={"use_system_prompt": "dynamic"})
    eng = engine(bundle_for(cfg, tok))
    try:
        auto = eng.processor.process(req(bot_task="auto")).layout
        image = eng.processor.process(req()).layout
    finally:
        eng.shutdown()
    want = build_request_layout(cfg.replace(extra={"use_system_prompt": "dynamic", "bot_task": "auto"}), tok,
                                PROMPT, 32, 32, 2.0)
    assert torch.equal(auto.rows[0].token_ids, want.rows[0].token_ids)
    assert len(image.rows[0].token_ids) > len(auto.rows[0].token_ids)  # en_vanilla vs no system prompt


# ---- front ends ------------------------------------------------------------------------------------------
def test_the_cli_flag_reaches_the_request():
    from ditkv.entrypoints import generate
    from ditkv.entrypoints.cli import build_parser

    assert generate.BOT_TASKS == BOT_TASKS
    p = build_parser()
    for task in BOT_TASKS:
        assert generate._request(p.parse_args(["generate", "--prompt", "p", "--bot-task", task])).bot_task == task
    assert generate._request(p.parse_args(["generate", "--prompt", "p"])).bot_task is None
    with pytest.raises(SystemExit):
        p.parse_args(["generate", "--prompt", "p", "--bot-task", "paint"])
    sub = next(a for a in p._subparsers._group_actions[0].choices["generate"]._actions if a.dest == "bot_task")
    assert "default: the checkpoint's" in sub.help


def test_the_cli_runs_a_request_s_task(tmp_path, capsys):
    """`ditkv generate --bot-task auto` on the tiny model runs (auto is image there); think is refused naming
    the fix before any image."""
    from ditkv.entrypoints.cli import main

    out = tmp_path / "o.png"
    assert main(["generate", "--prompt", "a red circle", "--steps", "1", "--bot-task", "auto", "--out", str(out),
                 "--no-progress", "--device", "cpu"]) in (0, None)
    assert out.exists()
    assert main(["generate", "--prompt", "a red circle", "--steps", "1", "--bot-task", "recaption",
                 "--max-new-tokens", "2", "--out", str(tmp_path / "p.png"), "--no-progress", "--device", "cpu"]) == 2
    assert "bot_task" in capsys.readouterr().err and not (tmp_path / "p.png").exists()


@pytest.mark.parametrize("route", ["generations", "chat", "edits"])
def test_the_http_field_reaches_the_request(http, route):
    """Each image route (chat in vllm-omni's nested extra_body form, edits as a form part) takes bot_task: a
    value outside the model's tasks is a 400 naming it; a task the tiny model cannot run reaches the engine,
    whose 400 names it; auto runs (the tiny default template: auto draws as image does)."""
    from test_http_text_settings import post

    r = post(http, route, {"bot_task": "paint"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bot_task", r.text
    assert r.json()["error"]["message"].startswith("bot_task")
    r = post(http, route, {"bot_task": "recaption", "max_new_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bot_task", r.text
    assert "</recaption>" in r.json()["error"]["message"]
    r = post(http, route, {"bot_task": "auto", "max_new_tokens": 2})
    assert r.status_code == 400 and "generate_image" in r.json()["error"]["message"], r.text
    if route != "edits":  # the tiny model takes no input images
        r = post(http, route, {"bot_task": "auto"})
        assert r.status_code == 200, r.text


def test_the_schema_publishes_the_model_s_tasks(http):
    schema = http.get("/openapi.json").json()["components"]["schemas"]
    for name in ("ImageGenerationRequest", "ChatImageRequest"):
        prop = schema[name]["properties"]["bot_task"]
        assert prop["anyOf"][0]["enum"] == list(BOT_TASKS) and "checkpoint" in prop["description"], prop
    assert schema["ImageEditRequest"]["properties"]["bot_task"]["enum"] == list(BOT_TASKS)


@pytest.fixture(scope="module")
def http():
    pytest.importorskip("fastapi")
    from starlette.testclient import TestClient

    from stage_helpers import tiny_bundle
    from ditkv.engine.async_engine import AsyncEngine
    from ditkv.entrypoints.serve import ServeLimits, create_app

    eng = AsyncEngine(EngineConfig(num_kv_blocks=64), model_bundle=tiny_bundle())
    try:
        yield TestClient(create_app(eng, ServeLimits(), "tiny"))
    finally:
        eng.shutdown()


def test_the_profiled_shape_covers_every_task(release_tok):
    """Under `use_system_prompt: dynamic` each task has its own system prompt, and any request may ask
    for any task: the startup profile's largest request is the largest row over every task (here the
    think request's en_think_recaption prompt on an image checkpoint), not the checkpoint's task's."""
    from ditkv.engine.ar_plan import ARPlanner
    from ditkv.engine.profiling import Envelope, max_shape_layout

    tok, base = release_tok
    cfg = base.replace(extra={"use_system_prompt": "dynamic", "bot_task": "image"})
    env = Envelope(32, 32, 16)
    prompt = tok.decode(tok.encode("a" * 16)[:16])

    def total(task):
        plan = ARPlanner(cfg, tok, task)
        lay = build_request_layout(cfg, tok, prompt, 32, 32, 2.0, template=plan.template,
                                   **({"rewrite": ""} if plan.rewrites else {}))
        return sum(r.seq_len for r in lay.rows)
    profiled = sum(r.seq_len for r in max_shape_layout(cfg, tok, env).rows)
    assert profiled == max(total(t) for t in BOT_TASKS) > total("image")
