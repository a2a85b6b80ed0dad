"""A separately deployed AR stage (`ditkv stage`, a real server subprocess on loopback) behind the
orchestrator: bit-identical images and equal stats vs the all-in-process graph (shm, Mooncake TCP),
the server killed mid-run (dead replicas naming the address, failed requests, quarantined pages,
no hang), an unreachable server, a mismatched stage file, malformed messages, clean SIGTERM, and
reconnecting after the server comes back (a new instance, the same instance, a mismatched one, behind
`ditkv serve`)."""

import copy
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import yaml

from ditkv.stages.orchestrator import Orchestrator
from ditkv.stages.graph import load_stage_graph
from ditkv.engine.types import GenerationRequest
from ditkv.errors import ConfigError, DitkvError

os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = {"connect_timeout": 20.0, "heartbeat_interval": 0.2, "heartbeat_timeout": 2.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stage_file(port=None, kind="shm", block_size=16, remote=None, threads=None):
    """The two-stage graph of the tests; `port` adds `remote:` on the AR stage; `threads` sets
    torch_threads on both stages (unset: the default)."""
    def transfer(eid, role, **kw):
        return {"kv_connector": kind, "engine_id": eid, "kv_role": role, **kw}
    data = {"stages": [
        {"stage_id": 0, "kind": "ar", "engine": {"model": "tiny", "device": "cpu", "block_size": block_size,
                                                 "num_kv_blocks": 64},
         "kv_transfer_config": transfer("ar", "kv_producer")},
        {"stage_id": 1, "kind": "dit", "inputs": [0],
         "engine": {"model": "tiny", "device": "cpu", "block_size": block_size, "num_kv_blocks": 256,
                    "diffusion_kv_mode": "paged_scheduler", "diffusion_kv_max_rows_per_request": 2},
         "kv_transfer_config": transfer("dit", "kv_consumer", transfer_timeout=30.0)}]}
    if threads is not None:
        for st in data["stages"]:
            st["engine"]["torch_threads"] = threads
    if port is not None:
        data["stages"][0]["remote"] = {"address": f"tcp://127.0.0.1:{port}", **FAST, **(remote or {})}
    return data


class Server:
    """`python -m ditkv stage` on a free loopback port; waits for its ready line."""

    def __init__(self, tmp_path, kind="shm", gate=None, port=None, block_size=16, threads=None, omp=None, data=None):
        """`threads`: torch_threads in the stage file; `omp`: the server's OMP_NUM_THREADS (None: unset,
        so its torch starts at the host's default thread count); `data`: another stage file (its AR
        stage's `remote.address` must be on `port`)."""
        self.port = port or free_port()  # `port`: a restart on the address of an earlier server
        self.data = data if data is not None else stage_file(self.port, kind, block_size, threads=threads)
        self.path = tmp_path / f"stages-{kind}-{self.port}-{block_size}-{time.monotonic_ns()}.yaml"
        self.path.write_text(yaml.safe_dump(self.data))
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("OMP_NUM_THREADS", None)
        if omp is not None:
            env["OMP_NUM_THREADS"] = str(omp)
        # `gate`: the server's writes wait until that file exists (tests/gated_stage.py)
        cmd = [os.path.join(ROOT, "tests", "gated_stage.py"), str(gate)] if gate else ["-m", "ditkv"]
        self.proc = subprocess.Popen([sys.executable, *cmd, "stage", "--config", str(self.path), "--stage",
                                      "0", "--bind", f"tcp://127.0.0.1:{self.port}", "--log-level", "warning"],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        end = time.monotonic() + 90
        while not self._ready.wait(0.2) and time.monotonic() < end and self.proc.poll() is None:
            pass
        if not self._ready.is_set():
            self.kill()
            raise RuntimeError("the stage server did not start:\n" + "".join(self.lines))

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            if "AR stage serving" in line:
                self._ready.set()

    def graph(self, **kw):
        d = copy.deepcopy(self.data)
        for k, v in kw.items():
            d["stages"][0]["remote"][k] = v
        return load_stage_graph(d)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def servers():
    """Servers a test starts; every one is killed in teardown."""
    started: list[Server] = []
    yield started
    for s in started:
        s.kill()


@pytest.fixture(scope="module")
def shm_server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("remote"))
    try:
        yield s
    finally:
        s.kill()


def req(i=0, prompt="a large red circle", g=2.0):
    return GenerationRequest(prompt=prompt, height=32, width=32, steps=2, guidance_scale=g, seed=i)


REQS = [req(0), req(1, "a small blue square", 3.0), req(2, "x", 1.0)]


def wait_for(cond, timeout=20.0):
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.02)
    return cond()


def full(orch):
    return orch.pools_full() and all(not d.num_quarantined for d in orch.dit) and \
        all(a.num_leases == 0 and not a.stats()["leases"] for a in orch.ar)


def run_graph(graph):
    orch = Orchestrator(graph).start()
    try:
        outs = orch.run(list(REQS), concurrency=2)
        assert wait_for(lambda: full(orch))
        stats = orch.stats()
    finally:
        orch.shutdown()
    assert [o.status for o in outs] == ["ok"] * len(REQS), [o.error for o in outs]
    return outs, stats


def check_same_as_in_process(server, kind, threads=None):
    lo, ls = run_graph(load_stage_graph(stage_file(kind=kind, threads=threads)))
    ro, rs = run_graph(server.graph())
    assert all(np.array_equal(a.image, b.image) for a, b in zip(lo, ro))
    assert [o.stats.imported_tokens for o in lo] == [o.stats.imported_tokens for o in ro]
    assert ls == rs, (ls, rs)
    assert rs["transfers"]["ok"] == len(REQS) and rs["transfers"]["bytes"] > 0


def test_remote_ar_shm_matches_in_process(shm_server):
    check_same_as_in_process(shm_server, "shm")


def test_remote_ar_mooncake_matches_in_process(tmp_path):
    s = Server(tmp_path, "mooncake")
    try:
        check_same_as_in_process(s, "mooncake")
    finally:
        s.kill()


def test_cli_generate_with_remote_ar(shm_server, tmp_path):
    from ditkv.entrypoints.cli import main

    out, ref = tmp_path / "remote.png", tmp_path / "local.png"
    args = ["--prompt", "a red circle", "--steps", "1", "--height", "32", "--width", "32", "--no-progress"]
    assert main(["generate", "--config", str(shm_server.path), "--out", str(out)] + args) == 0
    local = tmp_path / "local.yaml"
    local.write_text(yaml.safe_dump(stage_file()))
    assert main(["generate", "--config", str(local), "--out", str(ref)] + args) == 0
    assert out.read_bytes() == ref.read_bytes()


@pytest.fixture
def restore_threads():
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_bit_exact_with_this_process_at_one_thread_and_the_server_at_the_host_default(shm_server,
                                                                                     restore_threads):
    """The CI failure of issue 12: this process runs torch at 1 thread (conftest), the server
    starts at the host's default (OMP_NUM_THREADS unset). Both apply torch_threads, so images and
    imported KV stay bit-identical whatever the host's core count."""
    import torch

    torch.set_num_threads(1)
    check_same_as_in_process(shm_server, "shm")


def test_torch_threads_two_on_both_sides_is_bit_exact(tmp_path, restore_threads):
    """torch_threads: 2 in the stage file: the orchestrator (this process, at 1 thread before) and a
    server started with OMP_NUM_THREADS=1 both run 2 threads."""
    import torch

    torch.set_num_threads(1)
    s = Server(tmp_path, threads=2, omp=1)
    try:
        check_same_as_in_process(s, "shm", threads=2)
        assert torch.get_num_threads() == 2
    finally:
        s.kill()


def test_torch_threads_mismatch_is_a_startup_error(shm_server, restore_threads):
    d = stage_file(shm_server.port, threads=3)
    with pytest.raises(ConfigError, match=r"engine\.torch_threads: server 1, here 3.*same stage file"):
        Orchestrator(load_stage_graph(d))


def test_stages_in_one_process_need_one_torch_threads():
    d = stage_file()
    d["stages"][1]["engine"]["torch_threads"] = 2
    with pytest.raises(ConfigError, match=r"torch_threads.*same torch_threads"):
        Orchestrator(load_stage_graph(d))


def test_mismatched_stage_file_is_a_startup_error(shm_server):
    d = stage_file(shm_server.port, block_size=32)
    with pytest.raises(ConfigError, match=r"engine\.block_size: server 16, here 32.*same stage file"):
        Orchestrator(load_stage_graph(d))


@pytest.mark.parametrize("remote, where, why", [
    ("127.0.0.1:7100", r"stages\[0\]\.remote", "tcp://HOST:PORT"),
    ("tcp://127.0.0.1:70000", r"stages\[0\]\.remote", "1..65535"),
    ({"address": "ipc:///tmp/x"}, r"stages\[0\]\.remote\.address", "tcp://HOST:PORT"),
    ({"address": "tcp://h:1", "heartbeat_timeout": 0.1}, r"heartbeat_timeout", "twice heartbeat_interval"),
    ({"address": "tcp://h:1", "retries": 3}, r"remote\.retries", "unknown remote key"),
    (7100, r"stages\[0\]\.remote", "AR stage server's address")])
def test_remote_config_errors_name_the_field(remote, where, why):
    d = stage_file()
    d["stages"][0]["remote"] = remote
    with pytest.raises(ConfigError, match=where) as e:
        load_stage_graph(d)
    assert why in str(e.value)


def test_remote_only_on_the_ar_stage():
    d = stage_file()
    d["stages"][1]["remote"] = "tcp://127.0.0.1:7100"
    with pytest.raises(ConfigError, match=r"stages\[1\]\.remote.*only the AR stage"):
        load_stage_graph(d)


def test_unreachable_server_fails_within_connect_timeout():
    g = load_stage_graph(stage_file(free_port(), remote={"connect_timeout": 1.0}))
    t0 = time.monotonic()
    with pytest.raises(DitkvError, match=r"did not answer within connect_timeout=1s.*ditkv stage"):
        Orchestrator(g)
    assert time.monotonic() - t0 < 10


def test_malformed_messages_never_crash_either_side(shm_server):
    import zmq

    from ditkv.stages.remote_messages import (PROTOCOL, ARDone, Hello, Refused, Sent, Settled, Submit, Welcome, decode,
                                              encode)

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{shm_server.port}")
    try:
        def ask(data):
            sock.send(data)
            assert sock.poll(5000)
            return decode(sock.recv())
        assert isinstance(ask(b"\x93garbage"), Refused)
        sub = Submit(replica=0, ticket_id="t", request_id="r", mode="native", head_ids=[1], tail_ids=[], seed=0,
                     max_new_tokens=0, temperature=0.0)
        assert "before Hello" in ask(encode(sub)).error
        old = ask(encode(Hello(protocol=PROTOCOL - 1, heartbeat_interval=0.2, heartbeat_timeout=5)))
        assert PROTOCOL == 6 and f"protocol {PROTOCOL - 1} != {PROTOCOL}" in old.error  # no skip_pages: refused
        assert isinstance(ask(encode(Hello(protocol=PROTOCOL, heartbeat_interval=0.2, heartbeat_timeout=5))), Welcome)
        m = ask(encode(Welcome(protocol=PROTOCOL)))  # a message only the server sends
        while not isinstance(m, Refused):  # heartbeats may come first
            m = decode(sock.recv()) if sock.poll(5000) else pytest.fail("no answer")
        assert "unexpected Welcome" in m.error
    finally:
        sock.close(0)
        ctx.term()
    orch = Orchestrator(shm_server.graph())
    try:
        stage = orch.ar[0].stage
        for junk in (b"", b"\xc1", encode(Hello(protocol=PROTOCOL, heartbeat_interval=1, heartbeat_timeout=3)),
                     encode(ARDone(ticket_id="nope", request_id="x", error="e")),
                     encode(Sent(ticket_id="nope", src=0, dst=0)), encode(Settled(ticket_id="nope"))):
            stage.handle(junk)  # logged and dropped
        assert orch.generate(req(0), timeout=60).ok  # both sides still serve
    finally:
        orch.shutdown()


def test_server_killed_mid_run(tmp_path):
    gate = tmp_path / "open"  # the server's writes wait for this file: never created
    s = Server(tmp_path, gate=gate)
    orch = Orchestrator(s.graph()).start()
    d = orch.dit[0]
    try:
        first = orch.submit(req(0))  # dispatched; its write hangs on the server
        assert wait_for(lambda: d.scheduler.num_waiting_for_kv == 1 and orch.ar[0].stats()["leases"] == 1)
        s.proc.send_signal(signal.SIGKILL)
        s.proc.wait(10)
        second = orch.submit(req(1))  # sent before the loss is noticed: fails with it
        a = orch.take(first, timeout=30)
        b = orch.take(second, timeout=30)
        addr = f"tcp://127.0.0.1:{s.port}"
        assert a.status == "error" and addr in a.error and "is lost" in a.error, a.error
        assert b.status == "error" and "failed closed" in b.error and addr in b.error, b.error
        assert orch.ar[0].dead and addr in orch.ar[0].dead
        with pytest.raises(DitkvError, match="no live AR replica"):
            orch.submit(req(2))
        st = orch.stats()["stages"]["ar"]
        assert st["dead"] == 1 and st["leases"] == 0 and st["kv_free_blocks"] == st["kv_num_blocks"]
        # the lost peer may still write into the first request's pages: they stay quarantined
        m = d.manager
        assert d.num_quarantined == 1 and m.num_quarantined_blocks > 0
        assert m.pool.num_free + m.num_quarantined_blocks == m.pool.num_blocks
        assert orch.pools_full() is False and all(a.blocks.num_free == a.blocks.num_blocks for a in orch.ar)
    finally:
        orch.shutdown()
        s.kill()
    assert full(orch)  # shutdown frees the quarantine


def test_sigterm_returns_every_lease(tmp_path):
    gate = tmp_path / "open"
    s = Server(tmp_path, gate=gate)
    orch = Orchestrator(s.graph()).start()
    try:
        rid = orch.submit(req(0))
        assert wait_for(lambda: orch.ar[0].stats()["leases"] == 1)  # a dispatched write holds a lease
        gate.touch()
        assert orch.take(rid, timeout=30).ok
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(20) == 0
        out = "".join(s.lines)
        assert "leases held: 0, pools full: True" in out, out
    finally:
        orch.shutdown()
        s.kill()


def test_silent_client_loses_its_leases(shm_server):
    import zmq

    from ditkv.stages.remote_messages import PROTOCOL, ARDone, Beat, Hello, Submit, decode, encode

    ctx = zmq.Context()
    socks = [ctx.socket(zmq.DEALER) for _ in range(2)]
    for s in socks:
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://127.0.0.1:{shm_server.port}")
        s.send(encode(Hello(protocol=PROTOCOL, heartbeat_interval=0.1, heartbeat_timeout=0.5)))

    def next_of(s, kind, cond=lambda m: True, timeout=10.0):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if s.poll(100):
                m = decode(s.recv())
                if isinstance(m, kind) and cond(m):
                    return m
            if s is socks[1]:
                s.send(encode(Beat()))  # the watcher stays alive
        pytest.fail(f"no {kind.__name__}")
    try:
        a, watcher = socks
        a.send(encode(Submit(replica=0, ticket_id="t-silent", request_id="r", mode="native", head_ids=[1, 65, 66, 67],
                             tail_ids=[], max_new_tokens=0, temperature=0.0, seed=0)))
        done = next_of(a, ARDone)
        assert done.error is None and done.source is not None  # the server now holds a lease for us
        next_of(watcher, Beat, lambda m: m.stats[0]["leases"] == 1)
        # `a` goes silent: after its heartbeat_timeout the server drops it and returns the lease
        next_of(watcher, Beat, lambda m: m.stats[0]["leases"] == 0 and
                m.stats[0]["kv_free_blocks"] == m.stats[0]["kv_num_blocks"])
    finally:
        for s in socks:
            s.close(0)
        ctx.term()


def test_serve_with_remote_ar_turns_503_when_the_stage_is_lost(tmp_path, servers):
    """`ditkv serve` in front of a remote AR stage: images while it lives; once it is lost, /health
    and new requests answer 503 (a server-side outage, not the client's fault), never 400; once a
    server is back on that address, /health is ok again and requests succeed."""
    pytest.importorskip("fastapi")
    from test_serve import Server as HTTPServer
    from test_serve import metric, post

    ar = Server(tmp_path)
    http = None
    try:
        http = HTTPServer(tmp_path, "--config", str(ar.path))
        r = post(http.url, {"prompt": "a large blue square", "size": "32x32", "steps": 1, "seed": 1})
        assert r.status_code == 200, r.text
        ar.kill()
        assert wait_for(lambda: http.health()["status"] == "dead")
        r = post(http.url, {"prompt": "a large blue square", "size": "32x32", "steps": 1})
        assert r.status_code == 503 and "failed closed" in r.json()["error"]["message"], r.text
        assert http.health()["remote_ar"]["state"] == "reconnecting"
        assert metric(http.metrics(), "ditkv_remote_ar_up") == 0
        servers.append(Server(tmp_path, port=ar.port))
        assert wait_for(lambda: http.health()["status"] == "ok", 30), http.health()
        assert http.health()["remote_ar"]["reconnects"] == 1
        text = http.metrics()
        assert metric(text, "ditkv_remote_ar_up") == 1 and metric(text, "ditkv_remote_ar_reconnects_total") == 1
        r = post(http.url, {"prompt": "a large blue square", "size": "32x32", "steps": 1, "seed": 1})
        assert r.status_code == 200, r.text
    finally:
        ar.kill()
        if http is not None:
            assert http.stop() == 0, http.log()


def lose_server_mid_write(tmp_path, servers, orch_graph=None):
    """A server whose writes hang on a gate, an orchestrator with one dispatched write, then SIGKILL:
    the request fails, its DiT pages stay quarantined, the stage is down (reconnecting)."""
    s = Server(tmp_path, gate=tmp_path / "never")
    servers.append(s)
    orch = Orchestrator(s.graph()).start()
    d = orch.dit[0]
    rid = orch.submit(req(0))
    assert wait_for(lambda: d.scheduler.num_waiting_for_kv == 1 and orch.ar[0].stats()["leases"] == 1)
    s.proc.send_signal(signal.SIGKILL)
    s.proc.wait(10)
    out = orch.take(rid, timeout=30)
    assert out.status == "error" and "is lost" in out.error, out.error
    assert wait_for(lambda: d.num_quarantined == 1)
    assert orch.remote.status()["state"] == "reconnecting" and orch.remote.status()["quarantined_tickets"] == 1
    with pytest.raises(DitkvError, match="no live AR replica.*reconnecting"):
        orch.submit(req(2))
    return s, orch


def test_restarted_server_brings_the_stage_back_and_releases_the_quarantine(tmp_path, servers):
    """SIGKILL mid-write, then a NEW server instance on the same port: the replicas are live again,
    the old instance's unsettled write can no longer land so its DiT pages return, and new requests
    are bit-identical to the in-process graph."""
    old, orch = lose_server_mid_write(tmp_path, servers)
    try:
        local = Orchestrator(load_stage_graph(stage_file())).start()
        try:
            lo = local.run(REQS[:2], concurrency=2)
        finally:
            local.shutdown()
        new = Server(tmp_path, port=old.port)  # no gate: its writes go through
        servers.append(new)
        assert wait_for(lambda: not orch.ar[0].dead, 30), orch.remote.status()
        st = orch.remote.status()
        assert st["state"] == "connected" and st["reconnects"] == 1 and st["error"] is None, st
        assert wait_for(lambda: full(orch)), orch.dit[0].stats()  # the quarantine is released
        orch_outputs = orch.run(REQS[:2], concurrency=2)
        assert [o.status for o in orch_outputs] == ["ok", "ok"], [o.error for o in orch_outputs]
        assert all(np.array_equal(a.image, b.image) for a, b in zip(lo, orch_outputs))
        assert wait_for(lambda: full(orch))
    finally:
        orch.shutdown()


def test_same_server_after_a_long_pause_keeps_a_held_write_quarantined(tmp_path, servers):
    """A network blip longer than heartbeat_timeout (the server SIGSTOPped): the client reconnects
    to the SAME instance, which still holds the dispatched write, so its pages stay quarantined until
    the write settles; then everything returns and new requests succeed."""
    gate = tmp_path / "open"
    s = Server(tmp_path, gate=gate)
    servers.append(s)
    orch = Orchestrator(s.graph()).start()
    d = orch.dit[0]
    try:
        rid = orch.submit(req(0))
        # the server's producer is inside the write (not merely sent the Dispatch) before the pause
        assert wait_for(lambda: (tmp_path / "open.waiting").exists())
        s.proc.send_signal(signal.SIGSTOP)
        try:
            out = orch.take(rid, timeout=30)
            assert out.status == "error" and "is lost" in out.error, out.error
            instance = orch.remote.instance
        finally:
            s.proc.send_signal(signal.SIGCONT)
        assert wait_for(lambda: not orch.ar[0].dead, 30), orch.remote.status()
        assert orch.remote.instance == instance and orch.remote.status()["reconnects"] == 1
        time.sleep(0.5)
        assert d.num_quarantined == 1  # the same instance still holds that write: it may land
        gate.touch()  # the write goes out and settles: the pages return
        assert wait_for(lambda: full(orch)), (d.stats(), orch.remote.status())
        assert orch.generate(req(1), timeout=60).ok
        assert wait_for(lambda: full(orch))
    finally:
        orch.shutdown()


def test_restarted_server_with_another_stage_file_keeps_the_stage_down(tmp_path, servers, caplog):
    old, orch = lose_server_mid_write(tmp_path, servers)
    try:
        with caplog.at_level("ERROR", logger="ditkv.remote_ar"):
            servers.append(Server(tmp_path, port=old.port, block_size=32))
            assert wait_for(lambda: orch.remote.status()["state"] == "refused", 30), orch.remote.status()
            st = orch.remote.status()
            assert "engine.block_size: server 32, here 16" in st["error"] and "same stage file" in st["error"], st
            assert orch.ar[0].dead and "cannot be used" in orch.ar[0].dead
            time.sleep(1.0)  # retries go on (0.2 s backoff doubling), the error is logged once
            assert sum("cannot be used" in r.getMessage() for r in caplog.records) == 1, caplog.text
        with pytest.raises(DitkvError, match="no live AR replica"):
            orch.submit(req(1))
        assert orch.dit[0].num_quarantined == 1  # kept: nothing proved the old write cannot land
    finally:
        orch.shutdown()
