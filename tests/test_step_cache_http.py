"""Step caching where users see it: the HTTP extra field `cache_config` on /v1/images/generations (a
request's own, replacing the engine's), its 400s, the per-image cached/computed steps, the /metrics
counter and ratio histogram, and `ditkv generate --cache-config` printing the ratio."""

import os
import subprocess
import sys

import pytest

httpx = pytest.importorskip("httpx")
from test_serve import Server, post  # noqa: E402

INF_CACHE = {"type": "fbcache", "residual_threshold": "inf", "warmup_steps": 1, "steps_mask": [3]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("serve-cache"), "--device", "cpu")
    yield srv
    assert srv.stop() == 0, srv.log()


def _metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
               or line.startswith(name + "{"))


def test_request_cache_config_over_http(server):
    r = post(server.url, {"prompt": "a cached square", "size": "32x32", "steps": 6, "seed": 1,
                          "cache_config": INF_CACHE})
    assert r.status_code == 200, r.text
    info = r.json()["ditkv"][0]
    assert (info["cached_steps"], info["computed_steps"]) == (4, 2)  # steps 1..5 but 3
    plain = post(server.url, {"prompt": "a cached square", "size": "32x32", "steps": 6, "seed": 1})
    assert plain.status_code == 200 and "cached_steps" not in plain.json()["ditkv"][0]
    m = server.metrics()
    assert _metric(m, "ditkv_cached_steps_total") == 4
    assert _metric(m, "ditkv_request_cache_ratio_count") == 2
    bucket = 'ditkv_request_cache_ratio_bucket{le="%s"} %s'
    assert bucket % ("0.0", "1.0") in m and bucket % ("0.6", "1.0") in m and bucket % ("0.7", "2.0") in m


@pytest.mark.parametrize("cache, fix", [
    ({"type": "dbcache", "Fn": 4}, "leaves no middle block"),
    ({"type": "fbcache", "steps_mask": [9]}, "outside the request's steps"),
    ({"type": "fbcache", "bogus": 1}, "unknown key"),
    ("fbcache", "must be a JSON object"),
])
def test_bad_cache_config_is_a_400_naming_it(server, cache, fix):
    r = post(server.url, {"prompt": "x", "size": "32x32", "steps": 4, "cache_config": cache})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "cache_config" in (err.get("param") or "") + err["message"] and fix in err["message"], err


def test_generate_prints_the_cache_ratio(tmp_path):
    out = tmp_path / "img.png"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "ditkv.entrypoints.cli", "generate", "--prompt", "a square", "--size",
                        "32x32", "--steps", "6", "--device", "cpu", "--out", str(out), "--cache-config",
                        '{"type": "fbcache", "residual_threshold": "inf", "warmup_steps": 2}'],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "step cache fbcache: cached 4 of 6 steps, ratio 0.67" in p.stdout, p.stdout
