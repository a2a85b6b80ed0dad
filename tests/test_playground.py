"""The playground page of `ditkv serve` (issue 37), without a browser: GET / returns the one static
page (small, no external URL or resource), the page calls only routes the app has, the options
it reads agree with what /openapi.json publishes, `--no-playground` turns both routes off (404 as
any unknown path), and a stage graph serves the page too. The browser drives it in
test_playground_browser.py.
"""

import asyncio
import re

import pytest

httpx = pytest.importorskip("httpx")
from test_serve import Server  # noqa: E402

from ditkv.config import EngineConfig  # noqa: E402
from ditkv.engine.async_engine import AsyncEngine  # noqa: E402
from ditkv.entrypoints.routes_playground import OPTIONS, page_html  # noqa: E402
from ditkv.entrypoints.serve import ServeLimits, create_app  # noqa: E402

MAX_PAGE_BYTES = 50 * 1024
OPTION_KEYS = {"model", "sizes", "size_auto", "size_auto_default", "size_cell", "size_snaps", "max_side",
               "max_steps", "max_n", "max_input_images"}


def _get_all(app, paths):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as c:
            return [await c.get(p) for p in paths]

    return asyncio.run(go())


@pytest.fixture(scope="module", params=["tiny", "tiny-edit"])
def served(request):
    """(app, model name) for an in-process engine on the bundled tiny model or tiny-edit."""
    eng = AsyncEngine(EngineConfig(model=request.param, num_kv_blocks=32))
    try:
        yield create_app(eng, ServeLimits(max_image_size=200), request.param), request.param
    finally:
        eng.shutdown()


def test_root_returns_the_page(served):
    app, _ = served
    page, = _get_all(app, ["/"])
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert len(page.content) <= MAX_PAGE_BYTES, f"{len(page.content)} bytes"
    assert page.text == page_html() and "<script>" in page.text and "<style>" in page.text


def test_page_makes_no_external_requests():
    html = page_html()
    assert not re.search(r"https?://", html), "an absolute URL: the page must work offline, same origin only"
    assert not re.search(r"""src\s*=\s*["'](?!#)[^"']""", html), "a src= attribute loads something"
    style = re.search(r"<style>(.*?)</style>", html, re.S).group(1)
    assert not re.search(r"<link\b", html, re.I) and not re.search(r"@import|url\(", style, re.I), \
        "a stylesheet, font or picture from elsewhere"
    assert "//" not in re.sub(r"(^|\s)//[^\n]*", "", html), "a protocol-relative URL"


def test_page_calls_only_routes_the_app_has(served):
    app, _ = served
    api = re.search(r"const API = \{(.*?)\};", page_html(), re.S).group(1)
    called = dict(re.findall(r"(\w+):\s*\"(/[^\"]*)\"", api))
    assert set(called) == {"options", "health", "metrics", "generations", "edits"}
    # asked, not looked up: the app answers each as the page calls it (an empty POST body is a 400
    # naming a field; a path or method the app lacks would be a 404 or 405)
    gets = _get_all(app, [called[k] for k in ("options", "health", "metrics")])
    assert [r.status_code for r in gets] == [200, 200, 200]

    async def posts():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as c:
            return (await c.post(called["generations"], json={}),
                    await c.post(called["edits"], files={"prompt": (None, "x")}))

    for r in asyncio.run(posts()):
        assert r.status_code == 400 and r.json()["error"]["param"] in ("prompt", "image"), r.text
    # no other same-origin path in the page: every call goes through API
    quoted = set(re.findall(r"""["'](/[\w/.-]*)["']""", page_html()))
    assert quoted == set(called.values()), quoted - set(called.values())


def test_options_agree_with_the_published_schema(served):
    app, model = served
    opts, schema = (r.json() for r in _get_all(app, [OPTIONS, "/openapi.json"]))
    assert set(opts) == OPTION_KEYS and opts["model"] == model
    gen = schema["components"]["schemas"]["ImageGenerationRequest"]["properties"]
    size = re.compile(next(a["pattern"] for a in gen["size"]["anyOf"] if "pattern" in a))
    assert opts["sizes"] and all(size.fullmatch(s) for s in opts["sizes"]), (opts["sizes"], size.pattern)
    # within --max-image-size (200 here) and the tiny engine's profiled envelope (128x128): no listed size is a 400
    assert opts["sizes"] == [f"{k}x{k}" for k in (16, 32, 48, 64, 80, 96, 112, 128)]
    steps = next(a for a in gen["steps"]["anyOf"] if "maximum" in a)
    assert opts["max_steps"] == steps["maximum"] and opts["size_auto"] is False
    edit = schema["components"]["schemas"]["ImageEditRequest"]["properties"]
    # the server's --max-input-images (published) and the model's own count (an edit's 400 names it)
    assert opts["max_input_images"] == min(edit["image"]["maxItems"], {"tiny": 0, "tiny-edit": 1}[model])


def test_page_routes_stay_out_of_the_schema(served):
    app, _ = served
    schema, = _get_all(app, ["/openapi.json"])
    assert "/" not in schema.json()["paths"] and OPTIONS not in schema.json()["paths"]


def test_create_app_without_playground_answers_404():
    eng = AsyncEngine(EngineConfig(num_kv_blocks=32))
    try:
        root, opts, health = _get_all(create_app(eng, None, "tiny", playground=False), ["/", OPTIONS, "/health"])
    finally:
        eng.shutdown()
    assert root.status_code == 404 and root.json()["error"]["type"] == "not_found"
    assert opts.status_code == 404 and health.status_code == 200


def test_serve_flag_no_playground(tmp_path):
    srv = Server(tmp_path, "--no-playground")
    try:
        root = httpx.get(srv.url + "/", timeout=10)
        assert root.status_code == 404 and "error" in root.json(), root.text
        assert httpx.get(srv.url + OPTIONS, timeout=10).status_code == 404
        assert "listening on" in srv.log() and "playground at /" not in srv.log()
    finally:
        assert srv.stop() == 0, srv.log()


def test_stage_graph_serves_the_page(tmp_path):
    from test_serve_stages import NATIVE

    srv = Server(tmp_path, "--config", NATIVE)
    try:
        page = httpx.get(srv.url + "/", timeout=10)
        opts = httpx.get(srv.url + OPTIONS, timeout=10).json()
        assert page.status_code == 200 and page.text == page_html()
        assert set(opts) == OPTION_KEYS and "64x64" in opts["sizes"] and opts["max_input_images"] == 0
        assert re.search(r"listening on http://127\.0\.0\.1:\d+ .*\| playground at /", srv.log()), srv.log()
    finally:
        assert srv.stop() == 0, srv.log()
