"""`ditkv serve` over real HTTP: a server process on loopback, real clients.

Covers the round trip, concurrency, validation (named fields, never 5xx), seeds, client
disconnect -> cancellation -> pool full again, metrics, the OpenAI client (images and models),
`bench serve` and graceful shutdown. The tiny model at 32x32/64x64 keeps each request in the
10-100 ms range. Body limits and timeouts: test_serve_http.py; schema fuzzing: test_openapi_fuzz.py.
"""

import base64
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from PIL import Image  # noqa: E402

GEN = "/v1/images/generations"
MAX_SEED = 2**63 - 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`ditkv serve --host 127.0.0.1 --port P [args]` as a child process; log in a temp file."""

    def __init__(self, tmp_path, *args):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / f"serve-{self.port}.log"
        self._log = open(self.log_path, "w")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "ditkv.entrypoints.cli", "serve", "--host", "127.0.0.1",
                                      "--port", str(self.port), *args], stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env)
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, f"server exited early:\n{self.log()}"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"server not healthy:\n{self.log()}"
            time.sleep(0.1)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text

    def stop(self, sig=signal.SIGTERM, timeout=60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self._log.close()


def metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape('{' + labels + '}') if labels else ''} (\S+)$", text, re.M)
    assert m, f"{name}{{{labels}}} not in /metrics"
    return float(m.group(1))


def post(url, body, timeout=60):
    return httpx.post(url + GEN, json=body, timeout=timeout)


def wait_for(pred, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def png_size(b64: str) -> tuple[int, int]:
    img = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert img.format == "PNG" and img.mode == "RGB"
    return img.size


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("serve"))  # no other argument: the tiny default model
    yield srv
    assert srv.stop() == 0, srv.log()


# ---- round trip ----------------------------------------------------------------------------
def test_generation_round_trip_returns_png_of_requested_size(server):
    r = post(server.url, {"prompt": "a large blue square", "size": "64x64", "response_format": "b64_json"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert png_size(body["data"][0]["b64_json"]) == (64, 64)
    assert body["size"] == "64x64"  # the size made (a release model would report its bucket)
    assert body["ditkv"][0]["steps"] == 8  # the tiny model's default
    r = post(server.url, {"prompt": "a red circle", "size": "64x32", "n": 2, "steps": 2, "seed": 5})
    assert r.status_code == 200, r.text
    data, extra = r.json()["data"], r.json()["ditkv"]
    assert [png_size(d["b64_json"]) for d in data] == [(64, 32), (64, 32)]
    assert [e["seed"] for e in extra] == [5, 6] and data[0]["b64_json"] != data[1]["b64_json"]


def test_same_seed_gives_same_image(server):
    body = {"prompt": "a green triangle", "size": "32x32", "steps": 2, "seed": 11}
    a, b = post(server.url, body).json(), post(server.url, body).json()
    assert a["data"][0]["b64_json"] == b["data"][0]["b64_json"]


def test_models_and_health(server):
    models = httpx.get(server.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    assert httpx.get(server.url + "/v1/models/tiny").json() == models["data"][0]
    r = httpx.get(server.url + "/v1/models/dall-e-3")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert r.json()["error"]["param"] == "model"
    assert httpx.get(server.url + "/metrics").headers["content-type"].startswith("text/plain; version=0.0.4")
    h = server.health()
    assert h["status"] == "ok" and h["mode"] == "paged_scheduler"
    assert h["kv_used_blocks"] == 0 and h["kv_free_blocks"] == h["kv_num_blocks"] > 0


def test_concurrent_requests(server):
    bodies = [{"prompt": f"a red circle {i}", "size": "32x32", "steps": 2, "seed": i} for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        rs = list(pool.map(lambda b: post(server.url, b), bodies))
    assert [r.status_code for r in rs] == [200] * 6
    assert len({r.json()["data"][0]["b64_json"] for r in rs}) == 6
    h = server.health()
    assert h["in_flight"] == 0 and h["kv_used_blocks"] == 0


# ---- validation ------------------------------------------------------------------------------
@pytest.mark.parametrize("body, param, status", [
    ({}, "prompt", 400),
    ({"prompt": ""}, "prompt", 400),
    ({"prompt": "   "}, "prompt", 400),
    ({"prompt": 5}, "prompt", 400),
    ({"prompt": "x" * 9000, "size": "64x64"}, "prompt", 400),  # longer than the model allows
    ({"prompt": "x", "size": "64"}, "size", 400),
    ({"prompt": "x", "size": "64x30"}, "size", 400),  # not a multiple of the latent cell
    ({"prompt": "x", "size": "4096x4096"}, "size", 400),  # above --max-image-size
    ({"prompt": "x", "size": "1024x1024"}, "size", 400),  # above the model/pool limits
    ({"prompt": "x", "steps": 0}, "steps", 400),
    ({"prompt": "x", "steps": 201}, "steps", 400),
    ({"prompt": "x", "steps": "3"}, "steps", 400),
    ({"prompt": "x", "steps": 2.5}, "steps", 400),
    ({"prompt": "x", "n": 5}, "n", 400),
    ({"prompt": "x", "n": 0}, "n", 400),
    ({"prompt": "x", "guidance_scale": -1}, "guidance_scale", 400),
    ({"prompt": "x", "guidance_scale": True}, "guidance_scale", 400),
    ({"prompt": "x", "seed": -1}, "seed", 400),
    ({"prompt": "x", "seed": 2**70}, "seed", 400),
    ({"prompt": "x", "seed": MAX_SEED, "n": 2}, "seed", 400),  # image 1 would need seed 2^63
    ({"prompt": "x", "steps": 1, "seed": 1.5}, "seed", 400),
    ({"prompt": "x", "negative_prompt": 3}, "negative_prompt", 400),
    ({"prompt": "x", "response_format": "url"}, "response_format", 400),
    ({"prompt": "x", "output_format": "jpeg"}, "output_format", 400),
    ({"prompt": "x", "quality": "hd"}, "quality", 400),  # unknown field: strict
    ({"prompt": "x", "model": "dall-e-3"}, "model", 404),
])
def test_invalid_fields_get_4xx_naming_the_field(server, body, param, status):
    r = post(server.url, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param), err


def test_seeds_are_never_clamped(server):
    r = post(server.url, {"prompt": "a red circle", "size": "32x32", "steps": 1, "n": 2, "seed": MAX_SEED - 1})
    assert r.status_code == 200, r.text
    assert [e["seed"] for e in r.json()["ditkv"]] == [MAX_SEED - 1, MAX_SEED]
    r = post(server.url, {"prompt": "a red circle", "size": "32x32", "steps": 1, "n": 2, "seed": MAX_SEED})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "seed" and str(MAX_SEED - 1) in err["message"], err


def test_server_accepts_what_the_engine_accepts(server):
    # an integral JSON number is an integer (JSON Schema), and guidance_scale has no upper bound
    for extra in ({"steps": 1.0, "seed": 3.0, "n": 1.0}, {"steps": 1, "guidance_scale": 150.0}):
        r = post(server.url, {"prompt": "a red circle", "size": "32x32", **extra})
        assert r.status_code == 200, (extra, r.text)


def test_engine_errors_report_their_field():
    from ditkv.entrypoints.http_validation import _describe_engine_error
    from ditkv.errors import AdmissionError, DitkvError, LayoutError

    assert _describe_engine_error(LayoutError("steps: 9 must be in 1..8", field="steps")) == \
        ("steps", "steps: 9 must be in 1..8")
    assert _describe_engine_error(AdmissionError("size 512x512 exceeds the envelope", field="size")) == \
        ("size", "size 512x512 exceeds the envelope")
    assert _describe_engine_error(AdmissionError("row 0 has seq_len=900", field="size")) == \
        ("size", "size: row 0 has seq_len=900")
    assert _describe_engine_error(DitkvError("too long")) == ("prompt", "prompt: too long")  # no field


@pytest.mark.parametrize("raw", [b"not json", b"[1, 2]", b'"prompt"', b'{"prompt": "\\ud800"}', b"", b"{"])
def test_malformed_bodies_get_400(server, raw):
    r = httpx.post(server.url + GEN, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] in ("body", "prompt")


def test_non_utf8_body_gets_400_naming_the_body(server):
    r = httpx.post(server.url + GEN, content=b'{"prompt": "\xff"}', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body", r.text


def test_oversized_body_gets_413(server):
    r = httpx.post(server.url + GEN, content=b"{" + b" " * (2 << 20) + b"}",
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"


# ---- disconnect -> cancellation ----------------------------------------------------------------
def _open_request(url: str, body: dict) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(f"POST {GEN} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def test_client_disconnect_cancels_request_and_frees_pages(server):
    before = server.metrics()
    long = {"prompt": "a blue square", "size": "64x64", "steps": 200}
    socks = [_open_request(server.url, long), _open_request(server.url, dict(long, seed=1))]
    wait_for(lambda: (lambda h: h["running"] == 1 and h["waiting"] == 1)(server.health()), what="1 running + 1 waiting")
    assert server.health()["kv_used_blocks"] > 0
    for s in socks:
        s.close()
    wait_for(lambda: (lambda h: h["in_flight"] == 0 and h["running"] == 0 and h["kv_used_blocks"] == 0)(
        server.health()), timeout=10, what="pool full again")
    h = server.health()
    assert h["kv_free_blocks"] == h["kv_num_blocks"] and h["waiting"] == 0
    after = server.metrics()
    assert metric(after, "ditkv_requests_total", 'status="disconnected"') - \
        metric(before, "ditkv_requests_total", 'status="disconnected"') == 2
    assert metric(after, "ditkv_kv_blocks_used") == 0
    assert post(server.url, {"prompt": "still serving", "size": "32x32", "steps": 1}).status_code == 200


def test_queue_limit_429_and_draining_503_in_process():
    import asyncio

    from ditkv.config import EngineConfig
    from ditkv.engine.async_engine import AsyncEngine
    from ditkv.entrypoints.serve import ServeLimits, create_app

    eng = AsyncEngine(EngineConfig(diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2,
                                   num_kv_blocks=32))
    app = create_app(eng, ServeLimits(max_queue=1), "tiny")

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as c:
            long = asyncio.ensure_future(c.post(GEN, json={"prompt": "x", "size": "64x64", "steps": 200}))
            while eng.stats()["running"] != 1:
                await asyncio.sleep(0.01)
            busy = await c.post(GEN, json={"prompt": "y", "steps": 1})
            await app.state.drain(0.0)  # what SIGTERM does first, with no time left: cancel in-flight
            cancelled = await long
            late = await c.post(GEN, json={"prompt": "z", "steps": 1})
            health = await c.get("/health")
            return busy, cancelled, late, health

    try:
        busy, cancelled, late, health = asyncio.run(go())
    finally:
        final = eng.shutdown()
    assert busy.status_code == 429 and "max_queue" in busy.json()["error"]["message"]
    assert cancelled.status_code == 503 and "cancelled" in cancelled.json()["error"]["message"]
    assert late.status_code == 503 and health.status_code == 503 and health.json()["status"] == "draining"
    assert final["used_blocks"] == 0 and final["free_blocks"] == 32


# ---- metrics ---------------------------------------------------------------------------------
def test_metrics_reflect_traffic(server):
    before = server.metrics()
    for n in (1, 2, 1):
        assert post(server.url, {"prompt": "a red circle", "size": "32x32", "steps": 2, "n": n}).status_code == 200
    assert post(server.url, {"prompt": "x", "steps": 0}).status_code == 400
    after = server.metrics()

    def delta(name, labels=""):
        return metric(after, name, labels) - metric(before, name, labels)

    assert delta("ditkv_requests_total", 'status="ok"') == 3
    assert delta("ditkv_requests_total", 'status="invalid"') == 1
    assert delta("ditkv_images_generated_total") == 4
    assert delta("ditkv_request_latency_seconds_count") == 3
    assert delta("ditkv_request_run_seconds_count") == 4
    assert delta("ditkv_request_latency_seconds_sum") > 0
    assert metric(after, "ditkv_request_latency_seconds_bucket", 'le="+Inf"') == \
        metric(after, "ditkv_request_latency_seconds_count")
    for name in ("ditkv_requests_waiting", "ditkv_requests_running", "ditkv_kv_blocks_used", "ditkv_requests_ar",
                 "ditkv_ar_preemptions_total"):
        assert metric(after, name) == 0  # the AR gauges are exported by a single engine, at 0 without AR text
    assert metric(after, "ditkv_kv_blocks_free") == metric(after, "ditkv_kv_blocks_total") > 0
    assert metric(after, "ditkv_engine_alive") == 1
    for name in ("ditkv_kv_transfers_total", "ditkv_kv_transfer_failures_total", "ditkv_kv_transfer_bytes_total"):
        assert metric(after, name) == 0  # no transfer layer yet: exported at 0


def test_transfer_hook_counts():
    from ditkv.entrypoints.metrics import ServerMetrics, TransferCounters

    counters = TransferCounters()
    m = ServerMetrics(lambda: {"alive": True, "waiting": 2}, counters)
    counters.record(ok=True, nbytes=4096)
    counters.record(ok=False, nbytes=4096)
    text = m.render()[0].decode()
    assert metric(text, "ditkv_kv_transfers_total") == 2
    assert metric(text, "ditkv_kv_transfer_failures_total") == 1
    assert metric(text, "ditkv_kv_transfer_bytes_total") == 4096
    assert metric(text, "ditkv_kv_transfer_skipped_bytes_total") == 0
    counters.add_skipped(8192)  # a native import's pages the DiT stage's prefix cache held
    assert metric(m.render()[0].decode(), "ditkv_kv_transfer_skipped_bytes_total") == 8192
    assert metric(text, "ditkv_requests_waiting") == 2


# ---- clients -----------------------------------------------------------------------------------
def test_openai_python_client(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    res = client.images.generate(model="tiny", prompt="a large blue square", size="64x64", n=1,
                                 response_format="b64_json", extra_body={"steps": 2, "seed": 1})
    assert png_size(res.data[0].b64_json) == (64, 64)
    with pytest.raises(openai.BadRequestError, match="steps"):
        client.images.generate(model="tiny", prompt="x", extra_body={"steps": 10_000})


def test_openai_client_retrieves_models(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.retrieve("tiny")
    assert (model.id, model.object, model.owned_by) == ("tiny", "model", "ditkv")
    assert [m.id for m in client.models.list()] == ["tiny"]
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("dall-e-3")
    assert e.value.code == "model_not_found" and e.value.param == "model"


def test_bench_serve_against_server(server):
    res = subprocess.run([sys.executable, "-m", "ditkv.entrypoints.cli", "bench", "serve", "--url", server.url,
                          "--concurrency", "2", "--num-requests", "4", "--size", "32x32", "--steps", "1", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["ok"] == 4 and out["errors"] == 0 and out["req_per_s"] > 0
    assert 0 < out["p50_s"] <= out["p95_s"] <= out["p99_s"] <= out["max_s"]


def test_percentile():
    from ditkv.bench.serve import percentile

    xs = [float(i) for i in range(1, 101)]
    assert (percentile(xs, 50), percentile(xs, 95), percentile(xs, 99), percentile([], 50)) == (50, 95, 99, None)


def _bench(*args):
    return subprocess.run([sys.executable, "-m", "ditkv.entrypoints.cli", "bench", "serve", *args],
                          capture_output=True, text=True, timeout=120)


def test_bench_serve_fails_when_nothing_succeeds(server):
    res = _bench("--url", f"http://127.0.0.1:{_free_port()}", "--num-requests", "3", "--json")  # nobody listens
    assert res.returncode != 0 and "all 3 requests failed (3x ConnectError)" in res.stderr, res.stderr
    out = json.loads(res.stdout)
    assert out["ok"] == 0 and out["errors"] == 3
    assert all(out[k] is None for k in ("p50_s", "p95_s", "p99_s", "mean_s", "max_s"))
    # a server that refuses every request (steps above its max_steps): 400s, no latency, exit 2
    res = _bench("--url", server.url, "--num-requests", "2", "--steps", "1000")
    assert res.returncode == 2 and "2x 400" in res.stderr, res.stderr
    table = res.stdout.splitlines()[2].split()
    assert table[-5:] == ["-"] * 5 and "0.000" not in table[-5:], res.stdout


# ---- graceful shutdown -------------------------------------------------------------------------
def _in_background(fn):
    box = {}
    t = threading.Thread(target=lambda: box.update(r=fn()), daemon=True)
    t.start()
    return t, box


@pytest.mark.slow
def test_shutdown_finishes_short_requests_then_exits(tmp_path):
    srv = Server(tmp_path, "--shutdown-timeout", "60")
    t, box = _in_background(lambda: post(srv.url, {"prompt": "a red circle", "size": "64x64", "steps": 40}))
    wait_for(lambda: srv.health()["running"] == 1, what="request running")
    t0 = time.monotonic()
    assert srv.stop(signal.SIGTERM) == 0, srv.log()
    t.join(30)
    assert box["r"].status_code == 200  # in-flight work finished ...
    assert time.monotonic() - t0 < 45  # ... and the server did not wait out the timeout
    with pytest.raises(httpx.ConnectError):  # stopped accepting
        httpx.get(srv.url + "/health", timeout=2)
    assert re.search(r"KV pool: (\d+)/\1 blocks free", srv.log()), srv.log()


@pytest.mark.slow
def test_shutdown_cancels_long_requests_after_timeout(tmp_path):
    srv = Server(tmp_path, "--shutdown-timeout", "0.5")
    long = {"prompt": "a red circle", "size": "64x64", "steps": 200}
    t1, box1 = _in_background(lambda: post(srv.url, long))
    t2, box2 = _in_background(lambda: post(srv.url, dict(long, seed=3)))
    wait_for(lambda: (lambda h: h["running"] == 1 and h["waiting"] == 1)(srv.health()), what="running + waiting")
    assert srv.stop(signal.SIGINT, timeout=30) == 0, srv.log()
    t1.join(10)
    t2.join(10)
    for box in (box1, box2):  # cancelled requests get a clear 503, not a dropped connection
        r = box["r"]
        assert r.status_code == 503 and "cancel" in r.json()["error"]["message"], r.text
    assert re.search(r"KV pool: (\d+)/\1 blocks free", srv.log()), srv.log()
