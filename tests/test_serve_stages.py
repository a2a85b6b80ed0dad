"""`ditkv serve --config STAGES.yaml`: the AR -> DiT stage graph behind the same HTTP API.

A real server process on loopback (helpers from test_serve.py), the bundled tiny model, 64x64,
2 steps. Covers the round trip through both stages, transfer counters in /metrics, per-stage
pools in /health, client disconnect -> cancellation -> both pools full again, 4xx validation,
and graceful shutdown.
"""

import re
import signal
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
from test_serve import Server, _in_background, _open_request, metric, png_size, post, wait_for  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NATIVE = str(EXAMPLES / "stages-native.yaml")
LEGACY = str(EXAMPLES / "stages-legacy.yaml")


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("serve-stages"), "--config", NATIVE)
    yield srv
    assert srv.stop() == 0, srv.log()


def pools_full(h: dict) -> bool:
    ar, dit = h["stages"]["ar"], h["stages"]["dit"]
    return (h["pools_full"] and h["in_flight"] == 0 and ar["kv_used_blocks"] == 0 and ar["leases"] == 0
            and dit["kv_used_blocks"] == 0 and dit["quarantined"] == 0)


def test_round_trip_through_the_stage_graph(staged):
    before = staged.metrics()
    r = post(staged.url, {"prompt": "a large blue square", "size": "64x64", "steps": 2, "seed": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert png_size(body["data"][0]["b64_json"]) == (64, 64)
    extra = body["ditkv"][0]
    assert extra["steps"] == 2 and extra["seed"] == 3
    assert extra["imported_tokens"] > 0  # the prefix KV came from the AR stage, not recomputed
    r = post(staged.url, {"prompt": "a red circle", "size": "64x32", "n": 2, "steps": 2, "seed": 5})
    assert r.status_code == 200, r.text
    assert [png_size(d["b64_json"]) for d in r.json()["data"]] == [(64, 32), (64, 32)]
    # bytes are counted when the producer's write returns, which may trail the response a little
    wait_for(lambda: metric(staged.metrics(), "ditkv_kv_transfer_bytes_total") > metric(
        before, "ditkv_kv_transfer_bytes_total"), timeout=10, what="transfer bytes counted")
    after = staged.metrics()

    def delta(name, labels=""):
        return metric(after, name, labels) - metric(before, name, labels)

    assert delta("ditkv_kv_transfers_total") == 3  # one ticket per image
    assert delta("ditkv_kv_transfer_failures_total") == 0
    assert delta("ditkv_requests_total", 'status="ok"') == 2 and delta("ditkv_images_generated_total") == 3
    for stage in ("ar", "dit"):
        lab = f'stage="{stage}"'
        assert metric(after, "ditkv_kv_blocks_used", lab) == 0
        assert metric(after, "ditkv_kv_blocks_free", lab) == metric(after, "ditkv_kv_blocks_total", lab) > 0
        assert metric(after, "ditkv_stage_requests_running", lab) == 0
    assert metric(after, "ditkv_kv_transfer_quarantined", 'stage="dit"') == 0
    assert metric(after, "ditkv_engine_alive") == 1


def test_health_reports_both_stages(staged):
    h = staged.health()
    assert h["status"] == "ok" and h["graph"] == "ar->dit"
    assert h["mode"] == "paged_scheduler" and h["transfer"] == "native/shm"
    assert set(h["stages"]) == {"ar", "dit"} and pools_full(h)
    assert h["stages"]["ar"]["kv_num_blocks"] == 512 and h["stages"]["dit"]["kv_num_blocks"] == 1024
    assert {"transfers", "failures", "cancelled", "bytes"} <= set(h["transfers"])
    assert httpx.get(staged.url + "/v1/models").json()["data"][0]["id"] == "tiny"


def test_client_disconnect_cancels_requests_and_both_pools_refill(staged):
    before = staged.metrics()
    long = {"prompt": "a blue square", "size": "64x64", "steps": 200}
    socks = [_open_request(staged.url, long), _open_request(staged.url, dict(long, seed=1))]

    seen = {}

    def one_running_one_queued():  # judged on one snapshot: the first request may end any time
        seen["h"] = h = staged.health()
        dit = h["stages"]["dit"]
        return dit["running"] == 1 and dit["waiting"] + dit["waiting_for_kv"] == 1

    wait_for(one_running_one_queued, what="one request denoising, one queued at the DiT")
    # pages held: the DiT's for both requests; the queued one's AR export only until its write returned
    # (the AR stage runs both jobs in one batch, so that write may be done already)
    h = seen["h"]
    assert h["stages"]["dit"]["kv_used_blocks"] > 0 and h["stages"]["ar"]["leases"] <= 1 and not h["pools_full"]
    for s in socks:
        s.close()
    wait_for(lambda: pools_full(staged.health()), timeout=15, what="both pools full again")
    after = staged.metrics()
    assert metric(after, "ditkv_requests_total", 'status="disconnected"') - \
        metric(before, "ditkv_requests_total", 'status="disconnected"') == 2
    # both transfers had landed before the clients left: cancelling is not a transfer failure
    assert metric(after, "ditkv_kv_transfer_failures_total") == metric(before, "ditkv_kv_transfer_failures_total")
    r = post(staged.url, {"prompt": "still serving", "size": "64x64", "steps": 1})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body, param, status", [
    ({"prompt": "   "}, "prompt", 400),
    ({"prompt": "x" * 9000, "size": "64x64"}, "prompt", 400),  # longer than the model allows
    ({"prompt": "x", "size": "64x30"}, "size", 400),  # not a multiple of the latent cell
    ({"prompt": "x", "size": "1024x1024"}, "size", 400),  # above the model/pool limits
    ({"prompt": "x", "steps": 0}, "steps", 400),
    ({"prompt": "x", "steps": "3"}, "steps", 400),
    ({"prompt": "x", "guidance_scale": -1}, "guidance_scale", 400),
    ({"prompt": "x", "quality": "hd"}, "quality", 400),
    ({"prompt": "x", "model": "dall-e-3"}, "model", 404),
])
def test_invalid_fields_still_get_4xx(staged, body, param, status):
    r = post(staged.url, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err


def test_per_stage_engine_flags_are_refused_with_a_stage_file():
    from ditkv.entrypoints.cli import main

    with pytest.raises(SystemExit, match="--num-kv-blocks cannot override a stage file"):
        main(["serve", "--config", NATIVE, "--num-kv-blocks", "8"])


@pytest.mark.slow
def test_legacy_stage_file_round_trip(tmp_path):
    srv = Server(tmp_path, "--config", LEGACY)
    try:
        r = post(srv.url, {"prompt": "a red circle", "size": "64x64", "steps": 2, "seed": 1})
        assert r.status_code == 200, r.text
        assert png_size(r.json()["data"][0]["b64_json"]) == (64, 64)
        h = srv.health()
        assert h["transfer"] == "legacy/shm" and h["mode"] == "dense_legacy" and h["pools_full"]
        assert h["stages"]["dit"]["legacy_free_slots"] == h["stages"]["dit"]["legacy_slots"]
        assert h["transfers"]["transfers"] == 1 and h["transfers"]["failures"] == 0
    finally:
        assert srv.stop() == 0, srv.log()


@pytest.mark.slow
def test_graceful_shutdown_finishes_in_flight_then_frees_both_pools(tmp_path):
    srv = Server(tmp_path, "--config", NATIVE, "--shutdown-timeout", "60")
    t, box = _in_background(lambda: post(srv.url, {"prompt": "a red circle", "size": "64x64", "steps": 40}))
    wait_for(lambda: srv.health()["stages"]["dit"]["running"] == 1, what="request running")
    t0 = time.monotonic()
    assert srv.stop(signal.SIGTERM) == 0, srv.log()
    t.join(30)
    assert box["r"].status_code == 200  # in-flight work finished ...
    assert time.monotonic() - t0 < 45  # ... without waiting out the timeout
    log = srv.log()
    for stage in ("ar", "dit"):
        assert re.search(rf"{stage} stage stopped; KV pool: (\d+)/\1 blocks free", log), log


@pytest.mark.slow
def test_shutdown_timeout_cancels_in_flight_stage_requests(tmp_path):
    srv = Server(tmp_path, "--config", NATIVE, "--shutdown-timeout", "0.5")
    long = {"prompt": "a red circle", "size": "64x64", "steps": 200}
    t1, box1 = _in_background(lambda: post(srv.url, long))
    t2, box2 = _in_background(lambda: post(srv.url, dict(long, seed=3)))
    wait_for(lambda: srv.health()["in_flight"] == 2 and srv.health()["stages"]["dit"]["running"] == 1,
             what="two requests in flight")
    assert srv.stop(signal.SIGINT, timeout=30) == 0, srv.log()
    t1.join(10)
    t2.join(10)
    for box in (box1, box2):  # cancelled requests get a clear 503, not a dropped connection
        r = box["r"]
        assert r.status_code == 503 and "cancel" in r.json()["error"]["message"], r.text
    log = srv.log()
    for stage in ("ar", "dit"):
        assert re.search(rf"{stage} stage stopped; KV pool: (\d+)/\1 blocks free", log), log


def test_batch_invariant_flag_reaches_only_the_dit_stage():
    """`--batch-invariant` with a stage file: the DiT stage's engine gets it, the AR stage (no batches of
    denoising steps) keeps its own settings."""
    import argparse

    from ditkv.entrypoints.engine_args import add_engine_arguments
    from ditkv.stages.graph import stage_graph_from_args

    p = argparse.ArgumentParser()
    add_engine_arguments(p)  # --config is one of them
    g = stage_graph_from_args(p.parse_args(["--config", NATIVE, "--batch-invariant"]), "ditkv")
    assert g.dit.engine.batch_invariant is True and g.ar.engine.batch_invariant is False
    g = stage_graph_from_args(p.parse_args(["--config", NATIVE]), "ditkv")
    assert g.dit.engine.batch_invariant is False
