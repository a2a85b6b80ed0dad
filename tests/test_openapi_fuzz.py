"""/openapi.json matches the server: schemathesis generates requests from the published schema
(valid and invalid ones) and sends them to the app in-process (ASGI); every response must be
documented (status code, content type, body schema) and none may be a 5xx.

Tiny limits (64x64 at most, 2 steps, n <= 2) keep a valid generation at ~0.1 s on the tiny
model, so 500+ requests stay well under a minute on 2 cores.
"""

import collections
import io

import pytest
from PIL import Image

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("fastapi")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

MIN_REQUESTS = 500
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection]


def _app_and_engine():
    from ditkv.config import EngineConfig
    from ditkv.engine.async_engine import AsyncEngine
    from ditkv.entrypoints.serve import ServeLimits, create_app

    import torch

    from ditkv.models.loader import load_model

    # 2 steps by default and at most (max_steps may not be below the default): fast generated requests
    model, tok, codec = load_model("tiny", torch.device("cpu"), torch.float32)
    model.config.default_steps = 2
    eng = AsyncEngine(EngineConfig(diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2,
                                   max_steps=2, num_kv_blocks=64), model_bundle=(model, tok, codec))
    try:
        yield create_app(eng, ServeLimits(max_n=2, max_image_size=64), "tiny"), eng
    finally:
        eng.shutdown()


app_and_engine = pytest.fixture(scope="module", name="app_and_engine")(_app_and_engine)
# the probes' own: the fuzz run ends the app's lifespan, which shuts its engine down
probe_app = pytest.fixture(scope="module", name="probe_app")(_app_and_engine)


def test_schema_documents_the_real_responses(app_and_engine):
    schema = app_and_engine[0].openapi()
    ops = {(m.upper(), p): op for p, item in schema["paths"].items() for m, op in item.items()}
    assert set(ops) == {("POST", "/v1/images/generations"), ("GET", "/health"), ("GET", "/v1/models"),
                        ("GET", "/v1/models/{model}"), ("GET", "/metrics"), ("POST", "/v1/images/edits"),
                        ("POST", "/v1/chat/completions")}
    assert set(ops["POST", "/v1/images/generations"]["responses"]) == {
        "200", "400", "404", "408", "413", "429", "500", "503"}
    assert "422" not in str(schema) and "HTTPValidationError" not in str(schema)
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for (method, path), op in ops.items():
        for code, resp in op["responses"].items():
            if code.startswith(("4", "5")) and path != "/health":  # /health's 503 is its own body
                assert resp["content"] == {"application/json": {"schema": error_ref}}, (method, path, code)
    assert list(ops["GET", "/metrics"]["responses"]["200"]["content"]) == ["text/plain; version=0.0.4"]
    seed = schema["components"]["schemas"]["ImageGenerationRequest"]["properties"]["seed"]["anyOf"][0]
    assert seed["maximum"] == 2**63 - 1  # exact, not a float rounded up to 2^63


def test_fuzzed_requests_conform_to_the_schema(app_and_engine):
    app, eng = app_and_engine
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    ops = [op.ok() for op in schema.get_all_operations()]
    assert len(ops) == 7
    strategy = st.one_of(*(op.as_strategy(mode) for op in ops for mode in schemathesis.GenerationMode))
    seen = collections.Counter()

    @settings(max_examples=MIN_REQUESTS + 20, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def check(case):
        response = case.call()
        case.validate_response(response, checks=CHECKS)
        seen[case.method, case.operation.path, response.status_code] += 1

    check()
    print("fuzz (method, path, status) counts:", dict(seen))
    assert sum(seen.values()) >= MIN_REQUESTS
    gen = collections.Counter({code: n for (m, p, code), n in seen.items() if p == "/v1/images/generations"})
    assert gen[200] > 0 and gen[400] > 0, gen  # both real generations and refusals were exercised
    stats = eng.stats()
    assert stats["in_flight"] == 0 and stats["used_blocks"] == 0  # every request gave its pages back


# ---- probes: what the schema accepts, the server accepts (and the other way round) ------------------
CHAT_TEXT = [{"role": "user", "content": "a red circle"}]
JSON_PROBES = [  # (path, body, accepted by both); the fixture's limits: sides <= 64, steps <= 2, n <= 2
    ("/v1/images/generations", {"prompt": "a red circle", "size": "1x1", "steps": 1}, False),  # not whole cells
    ("/v1/images/generations", {"prompt": "a red circle", "size": "6x8", "steps": 1}, False),
    ("/v1/images/generations", {"prompt": "a red circle", "size": "8x12", "steps": 1}, True),
    ("/v1/chat/completions", {"messages": CHAT_TEXT, "modalities": [], "size": "8x8", "steps": 1}, False),
    ("/v1/chat/completions", {"messages": CHAT_TEXT, "modalities": ["image", "image"], "steps": 1}, False),
    ("/v1/chat/completions", {"messages": CHAT_TEXT, "modalities": ["text"], "steps": 1}, False),
    ("/v1/chat/completions", {"messages": CHAT_TEXT, "modalities": ["image"], "size": "8x8", "steps": 1}, True),
    ("/v1/chat/completions", {"messages": CHAT_TEXT, "size": "1x1", "steps": 1}, False),
    ("/v1/chat/completions", {"messages": CHAT_TEXT, "width": 6, "height": 8, "steps": 1}, False),
    ("/v1/chat/completions", {"messages": CHAT_TEXT, "width": 8, "height": 8, "steps": 1}, True),
    # issue 33: the schema says what the server refuses
    ("/v1/images/generations", {"prompt": "a red circle", "size": "68x64", "steps": 1}, False),  # > max_image_size
    ("/v1/images/generations", {"prompt": "a red circle", "size": "64x64", "steps": 1}, True),
    ("/v1/chat/completions", {"messages": CHAT_TEXT, "size": "64x68", "steps": 1}, False),
    ("/v1/chat/completions", {"messages": [{"role": "", "content": "a red circle"}], "steps": 1}, False),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}, *CHAT_TEXT], "steps": 1}, False),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "x"}, *CHAT_TEXT], "steps": 1}, True),
]


def _body_validator(schema: dict, path: str, media_type: str):
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    body = schema["paths"][path]["post"]["requestBody"]["content"][media_type]["schema"]
    return jsonschema_rs.validator_for({**body, "components": schema["components"]})


@pytest.mark.parametrize("path, body, accepted", JSON_PROBES)
def test_schema_and_server_agree_on_json_probes(probe_app, path, body, accepted):
    from starlette.testclient import TestClient

    app = probe_app[0]
    assert _body_validator(app.openapi(), path, "application/json").is_valid(body) is accepted
    r = TestClient(app).post(path, json=body)  # no `with`: the shared engine's lifespan is not run
    assert (r.status_code == 200) is accepted, r.text


@pytest.mark.parametrize("fields, param", [
    ({"mask": "m.png"}, "mask"),  # refused by the server: not a property, and no other field is allowed
    ({"size": "1x1"}, "size"),
    ({"size": "6x8"}, "size"),
    ({"size": "8x8"}, "image"),  # a size the model makes: refused only because the tiny model reads no image
    ({"size": "68x68"}, "size"),  # above the server's --max-image-size (64 here)
])
def test_schema_and_server_agree_on_edit_form_probes(probe_app, fields, param):
    from starlette.testclient import TestClient

    app = probe_app[0]
    schema_ok = _body_validator(app.openapi(), "/v1/images/edits", "multipart/form-data").is_valid(
        {"prompt": "x", "image": ["in.png"], **fields})
    assert schema_ok is (param == "image")
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="PNG")
    files = [("image", ("in.png", buf.getvalue(), "image/png"))]
    files += [(k, (v, buf.getvalue(), "image/png")) for k, v in fields.items() if k == "mask"]
    data = {k: v for k, v in fields.items() if k != "mask"}
    r = TestClient(app).post("/v1/images/edits", files=files, data={"prompt": "x", **data})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_published_bounds_are_the_servers_exactly(probe_app):
    """/openapi.json as a client reads it: every integer bound of the hand-written edit form and of
    the JSON bodies is an exact integer (FastAPI turned the form's 2^63-1 into the float
    9.223372036854776e18), the chat roles are an enum, and the size pattern stops at
    --max-image-size (64 here)."""
    import json
    import re

    from starlette.testclient import TestClient

    schema = json.loads(TestClient(probe_app[0]).get("/openapi.json").text)
    components = schema["components"]["schemas"]
    ref = schema["paths"]["/v1/images/edits"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    form = components[ref["$ref"].rsplit("/", 1)[1]]

    def integer_bounds(node, number=False):
        """(key, value) of every bound in `node`, except a `number`'s minimum and maximum."""
        if isinstance(node, dict):
            number = node.get("type", "number" if number else None) == "number"
            for k, v in node.items():
                if k in ("minItems", "maxItems", "minLength", "maxLength", "multipleOf") or \
                        (k in ("minimum", "maximum") and not number):
                    yield k, v
                yield from integer_bounds(v, number)
        elif isinstance(node, list):
            for v in node:
                yield from integer_bounds(v, number)

    for name, node in components.items():
        for key, v in integer_bounds(node):
            assert type(v) is int, (name, key, v)
    assert form["properties"]["seed"]["maximum"] == 2**63 - 1 and form["properties"]["n"]["maximum"] == 2
    chat = components["ChatImageRequest"]["properties"]
    assert chat["seed"]["anyOf"][0]["maximum"] == 2**63 - 1
    assert components["ChatMessage"]["properties"]["role"]["enum"] == ["system", "developer", "user", "assistant"]
    for pattern in (form["properties"]["size"]["pattern"],
                    components["ImageGenerationRequest"]["properties"]["size"]["anyOf"][0]["pattern"],
                    chat["size"]["anyOf"][0]["pattern"]):
        sides = [v for v in range(1, 200) if re.fullmatch(pattern, f"{v}x4")]
        assert sides == list(range(4, 65, 4)), pattern
