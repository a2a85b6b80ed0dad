"""The AR text settings as HTTP extra fields (issue 34 item 2): every image route takes
`max_new_tokens`, `temperature`, `top_k`, `top_p` and `do_sample`, publishes TextSampling's bounds
in /openapi.json, refuses bad values by field, runs the text on a single engine (its AR phase) or
refuses a setting for text a request does not write, and hands them to a stage graph's AR stage."""

import io

import pytest
from PIL import Image

pytest.importorskip("fastapi")
from starlette.testclient import TestClient  # noqa: E402

from ditkv.entrypoints import generate  # noqa: E402
from ditkv.entrypoints.cli import build_parser  # noqa: E402
from test_orchestrator import bundle, graph  # noqa: E402,F401 - bundle is a fixture

TEXT = {"max_new_tokens": 2, "temperature": 0}
FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "do_sample")


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="PNG")
    return buf.getvalue()


def post(client, route: str, extra: dict):
    """One request on `route` with the extra fields (the edit form sends them as text parts)."""
    if route == "generations":
        return client.post("/v1/images/generations", json={"prompt": "a red circle", "size": "32x32", "steps": 2,
                                                           "seed": 4, **extra})
    if route == "chat":  # vllm-omni's nested form
        nested = {"size": "32x32", "steps": 2, "seed": 4, **extra}
        return client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a red circle"}],
                                                         "extra_body": nested})
    data = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in extra.items()}
    return client.post("/v1/images/edits", files=[("image", ("in.png", _png(), "image/png"))],
                       data={"prompt": "a red circle", "size": "32x32", "steps": "2", "seed": "4", **data})


@pytest.fixture(scope="module")
def single(bundle):  # noqa: F811
    from ditkv.config import EngineConfig
    from ditkv.engine.async_engine import AsyncEngine
    from ditkv.entrypoints.serve import ServeLimits, create_app

    eng = AsyncEngine(EngineConfig(diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2,
                                   num_kv_blocks=64), model_bundle=bundle)
    try:
        yield TestClient(create_app(eng, ServeLimits(), "tiny"))  # no `with`: the fixture shuts the engine down
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def staged(bundle):  # noqa: F811
    from ditkv.entrypoints.serve import ServeLimits, create_app
    from ditkv.stages.async_orchestrator import AsyncOrchestrator

    orch = AsyncOrchestrator(graph(max_new=4), bundle)  # the AR stage writes up to 4 text tokens
    try:
        yield TestClient(create_app(orch, ServeLimits(), "tiny"))
    finally:
        orch.shutdown()


@pytest.mark.parametrize("route", ["generations", "chat", "edits"])
@pytest.mark.parametrize("field,value", [("temperature", 0.5), ("top_k", 5), ("top_p", 0.9), ("do_sample", False)])
def test_a_single_engine_refuses_settings_for_text_it_does_not_write(single, route, field, value):
    r = post(single, route, {field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and "writes no AR text" in err["message"], err


@pytest.mark.parametrize("route", ["generations", "chat"])
def test_a_single_engine_writes_the_text_in_its_own_step_loop(single, route):
    first, again = post(single, route, TEXT), post(single, route, TEXT)
    assert first.status_code == 200 and again.status_code == 200, (first.text, again.text)
    info = first.json()["ditkv"][0]
    assert info["ar_generated_tokens"] <= 2 and info["ar_seconds"] > 0
    if route == "generations":
        assert first.json()["data"][0]["revised_prompt"].startswith("a red circle")
        assert first.json()["data"][0]["b64_json"] == again.json()["data"][0]["b64_json"]  # greedy, same seed


@pytest.mark.parametrize("route", ["generations", "chat", "edits"])
@pytest.mark.parametrize("field,value", [("top_p", 0), ("top_p", 1.5), ("temperature", -1), ("top_k", -2),
                                         ("max_new_tokens", -1), ("top_k", 2.5), ("do_sample", "yes")])
def test_bad_values_are_refused_by_field(single, route, field, value):
    r = post(single, route, {field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["message"].startswith(field), err
    assert "unknown field" not in err["message"]  # a known field, out of its bounds


def test_the_schema_publishes_their_bounds(single):
    schema = single.get("/openapi.json").json()["components"]["schemas"]
    expected = {"max_new_tokens": ("integer", {"minimum": 0, "maximum": 2**63 - 1}),
                "temperature": ("number", {"minimum": 0}),
                "top_k": ("integer", {"minimum": -1, "maximum": 2**63 - 1}),
                "top_p": ("number", {"exclusiveMinimum": 0, "maximum": 1}),
                "do_sample": ("boolean", {})}
    for name in ("ImageGenerationRequest", "ChatImageRequest"):
        props = schema[name]["properties"]
        for field, (kind, bounds) in expected.items():
            got = props[field]["anyOf"][0]
            assert got["type"] == kind and {k: got.get(k) for k in bounds} == bounds, (name, field, got)
            assert "AR text" in props[field]["description"]
    form = schema["ImageEditRequest"]["properties"]
    for field, (kind, bounds) in expected.items():
        if field == "do_sample":  # form parts are text
            assert form[field]["enum"] == ["true", "false"]
        else:
            assert form[field]["type"] == kind and {k: form[field].get(k) for k in bounds} == bounds, field


@pytest.mark.parametrize("route", ["generations", "chat"])
def test_a_stage_graph_draws_the_text_with_them(staged, route):
    first, again = post(staged, route, TEXT), post(staged, route, TEXT)
    assert first.status_code == 200 and again.status_code == 200, (first.text, again.text)
    image = (lambda r: r.json()["data"][0]["b64_json"]) if route == "generations" else (
        lambda r: r.json()["choices"][0]["message"]["content"][0]["image_url"]["url"])
    assert image(first) == image(again)  # greedy text, same seed: the same image
    none = post(staged, route, {"max_new_tokens": 0})
    assert none.status_code == 200, none.text
    # the AR stage wrote the 2 text tokens asked for, whose KV the DiT imported with the prompt's
    assert first.json()["ditkv"][0]["imported_tokens"] == none.json()["ditkv"][0]["imported_tokens"] + 2
    r = post(staged, route, {"max_new_tokens": 5})  # above the AR stage's 4
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_new_tokens", r.text


def test_the_edit_form_reaches_the_stage_graph(staged):
    r = post(staged, "edits", {"temperature": 0, "do_sample": True, "max_new_tokens": 5})
    # past the form and into the engine: the AR stage's cap is checked before the images
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_new_tokens", r.text


def test_do_sample_flag_reaches_the_request():
    p = build_parser()
    assert generate._request(p.parse_args(["generate", "--prompt", "p", "--do-sample", "false"])).do_sample is False
    assert generate._request(p.parse_args(["generate", "--prompt", "p", "--do-sample", "TRUE"])).do_sample is True
    assert generate._request(p.parse_args(["generate", "--prompt", "p"])).do_sample is None
    with pytest.raises(SystemExit):
        p.parse_args(["generate", "--prompt", "p", "--do-sample", "yes"])
