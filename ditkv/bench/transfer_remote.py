"""`ditkv bench transfer --remote-ar`: the AR stage in-process vs as a separate server.

For each transport and transfer mode, the benchmark's stage file (`transfer_setup.graph_data`) runs twice
side by side in one invocation: all in-process (as `ditkv bench transfer`), and with `remote:` on
the AR stage, served by a `ditkv stage` subprocess on a free loopback port started from the same
stage file (the DiT stays in-process). Runs alternate in-process / remote (the first of the pair
swaps every run) over the same fixed prompt/seed set, so every request has a twin to compare its
image with. Per-request latency is submit -> output delivered. After every run both orchestrators'
pools must be full again (AR pool, DiT pool, no lease); the server is SIGTERMed at the end (killed
only when it does not exit) and its exit line must say "pools full: True".
"""

from __future__ import annotations

import copy
import os
import queue
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

REMOTE = {"connect_timeout": 120.0, "heartbeat_interval": 1.0, "heartbeat_timeout": 30.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StageServer:
    """`python -m ditkv stage` for stage 0 of `data` on a free loopback port; `stop()` always ends it."""

    def __init__(self, data: dict, workdir: str, start_timeout: float = 180.0, tries: int = 3):
        import yaml

        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = None
        for attempt in range(tries):  # the port may be taken between probing and binding
            self.port = free_port()
            self.address = f"tcp://127.0.0.1:{self.port}"
            self.data = copy.deepcopy(data)
            self.data["stages"][0]["remote"] = {"address": self.address, **REMOTE}
            self.path = os.path.join(workdir, f"stages-{self.port}.yaml")
            with open(self.path, "w") as f:
                yaml.safe_dump(self.data, f)
            self.lines: list[str] = []
            self._ready = threading.Event()
            self.proc = subprocess.Popen([sys.executable, "-m", "ditkv", "stage", "--config", self.path, "--stage", "0",
                                          "--bind", self.address, "--log-level", "warning"], env=env,
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()
            end = time.monotonic() + start_timeout
            while not self._ready.wait(0.1) and self.proc.poll() is None and time.monotonic() < end:
                pass
            if self._ready.is_set():
                return
            self.stop()
            log = "".join(self.lines)
            if "cannot bind" not in log or attempt == tries - 1:
                raise RuntimeError(f"the AR stage server did not start (rc {self.proc.returncode}):\n{log}")

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if "AR stage serving" in line:
                self._ready.set()

    def stop(self, timeout: float = 30.0) -> dict:
        """SIGTERM, wait; SIGKILL only if it does not exit. Returns its exit code and exit line."""
        p, killed = self.proc, False
        if p is None:
            return {"exit_code": None, "exit_line": "", "pools_full": False, "killed": False}
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                killed = True
                p.wait(10)
        self._reader.join(5)
        line = next((x.strip() for x in reversed(self.lines) if "AR stage shut down" in x), "")
        return {"exit_code": p.returncode, "exit_line": line, "pools_full": "pools full: True" in line,
                "leases_zero": "leases held: 0," in line, "killed": killed}


class _Timed:
    """Orchestrator outputs with their delivery time (the orchestrator's `on_output`)."""

    def __init__(self):
        self.q: queue.Queue = queue.Queue()

    def __call__(self, out) -> None:
        self.q.put((time.perf_counter(), out))


def timed_run(orch, sink: _Timed, reqs, concurrency: int, timeout: float = 600.0):
    """Like `Orchestrator.run` (outputs in input order) plus each request's submit -> output seconds."""
    from ..engine.types import GenerationOutput

    pending, t_sub, order, outs, lat = list(reqs), {}, [], {}, {}
    inflight = 0
    t0 = time.perf_counter()
    while pending or inflight:
        while pending and inflight < concurrency:
            r, ts = pending.pop(0), time.perf_counter()
            try:
                rid = orch.submit(r)
            except Exception as e:  # noqa: BLE001  e.g. "no live AR replica": a failed request
                rid = f"refused-{len(order)}"
                outs[rid], lat[rid] = GenerationOutput(request_id=rid, status="error", error=str(e)), 0.0
                order.append(rid)
                continue
            t_sub[rid] = ts
            order.append(rid)
            inflight += 1
        if not inflight:
            continue
        try:
            tdone, out = sink.q.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"no output within {timeout:g}s ({inflight} requests in flight)") from None
        outs[out.request_id], lat[out.request_id] = out, tdone - t_sub[out.request_id]
        inflight -= 1
    elapsed = time.perf_counter() - t0
    return [outs[r] for r in order], [lat[r] for r in order], elapsed


def settled(orch, timeout: float = 30.0) -> bool:
    """Both stages' pools full again and no AR lease held (remote gauges arrive with heartbeats)."""
    def full():
        return orch.pools_full() and all(not d.num_quarantined for d in orch.dit) and \
            all(a.num_leases == 0 and not a.stats()["leases"] for a in orch.ar)
    end = time.monotonic() + timeout
    while not full() and time.monotonic() < end:
        time.sleep(0.02)
    return full()


def _pct(xs, q) -> float:
    return float(np.percentile(np.asarray(xs) * 1e3, q)) if xs else float("nan")


def compare(args, kind: str, mode: str, bundle, workdir: str) -> dict:
    """One transport x mode: in-process vs remote AR, alternating runs."""
    from ..stages.orchestrator import Orchestrator
    from ..stages.graph import load_stage_graph
    from .transfer_setup import _requests, dit_blocks, graph_data

    data = graph_data(mode, kind, args.block_size, args, dit_blocks(args, bundle[0].config))
    sides = ("inprocess", "remote")
    sinks = {s: _Timed() for s in sides}
    rps = {s: [] for s in sides}
    lats = {s: [] for s in sides}
    images = {s: [] for s in sides}
    full_runs: list[bool] = []
    failed, errors = 0, []
    orchs: dict = {}
    server = None
    t_start = time.perf_counter()
    try:
        server = StageServer(data, workdir)
        orchs["inprocess"] = Orchestrator(load_stage_graph(data), bundle, on_output=sinks["inprocess"]).start()
        orchs["remote"] = Orchestrator(load_stage_graph(server.data), bundle, on_output=sinks["remote"]).start()
        for s in sides:  # warm-up
            timed_run(orchs[s], sinks[s], _requests(args, args.concurrency), args.concurrency)
        for i in range(args.runs):
            for s in (sides if i % 2 == 0 else sides[::-1]):
                outs, lat, dt = timed_run(orchs[s], sinks[s], _requests(args, args.requests), args.concurrency)
                rps[s].append(len(outs) / dt)
                lats[s] += lat
                bad = [x.error or x.status for x in outs if not x.ok]
                failed += len(bad)
                errors += bad[:3]
                images[s].append([x.image if x.ok else None for x in outs])
                full_runs.append(settled(orchs[s]))
                print(f"[bench transfer --remote-ar] {kind} {mode} {s} run {len(rps[s])}: {rps[s][-1]:.2f} req/s, "
                      f"p50 {_pct(lat, 50):.0f} ms, failed {len(bad)}, pools full {full_runs[-1]}", file=sys.stderr)
    finally:
        for o in orchs.values():
            o.shutdown()
        srv = server.stop() if server is not None else {"exit_code": None, "exit_line": "", "pools_full": False}
    exact = failed == 0 and len(images["remote"]) == len(images["inprocess"]) == args.runs and all(
        a is not None and b is not None and np.array_equal(a, b)
        for ra, rb in zip(images["inprocess"], images["remote"]) for a, b in zip(ra, rb))
    local, remote = statistics.mean(rps["inprocess"]), statistics.mean(rps["remote"])
    return {"transport": kind, "mode": mode, "inprocess_rps": local, "remote_rps": remote, "ratio": remote / local,
            "inprocess_runs": rps["inprocess"], "remote_runs": rps["remote"],
            "inprocess_p50_ms": _pct(lats["inprocess"], 50), "inprocess_p95_ms": _pct(lats["inprocess"], 95),
            "remote_p50_ms": _pct(lats["remote"], 50), "remote_p95_ms": _pct(lats["remote"], 95),
            "failed": failed, "errors": errors[:5], "bit_exact": exact,
            "pools_full": all(full_runs) and len(full_runs) == 2 * args.runs, "pools_full_runs": full_runs,
            "server": srv, "server_pools_full": bool(srv.get("pools_full")) and srv.get("exit_code") == 0,
            "seconds": time.perf_counter() - t_start}


def run(args) -> dict:
    import torch

    from ..stages.replicas import norm_device
    from ..models.loader import load_model, resolve_dtype
    from .common import emit, machine
    from .transfer_setup import _positions, prompt_set, stage_devices

    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    kinds = [k.strip() for k in args.transports.split(",") if k.strip()]
    modes = [m.strip() for m in args.remote_modes.split(",") if m.strip()]
    rows = []
    with tempfile.TemporaryDirectory(prefix="ditkv-bench-remote-") as workdir:
        for k in kinds:
            devs = stage_devices(args, k)
            dev = norm_device(torch.device(devs[1]))
            bundle = load_model("tiny", dev, resolve_dtype(args.dtype, dev))
            if _positions(args, bundle[0].config) > bundle[0].config.max_position_embeddings:
                raise SystemExit("ditkv bench transfer --remote-ar: the size needs more positions than the tiny "
                                 "model has; the server loads its own copy, so use a smaller --height/--width")
            for m in modes:
                rows.append(compare(args, k, m, bundle, workdir))
    head = next((r for r in rows if r["transport"] == "mooncake" and r["mode"] == "native"),
                next((r for r in rows if r["mode"] == "native"), rows[0]))
    out = {
        "inprocess_rps": head["inprocess_rps"], "remote_rps": head["remote_rps"], "ratio": head["ratio"],
        "latency_ms": {s: {"p50": head[f"{s}_p50_ms"], "p95": head[f"{s}_p95_ms"]} for s in ("inprocess", "remote")},
        "failed": sum(r["failed"] for r in rows), "bit_exact": all(r["bit_exact"] for r in rows),
        "pools_full": all(r["pools_full"] for r in rows),
        "server_pools_full": all(r["server_pools_full"] for r in rows),
        "headline": {"transport": head["transport"], "mode": head["mode"]},
        "remote": rows,
        "workload": {"requests": args.requests, "runs": args.runs, "concurrency": args.concurrency,
                     "size": f"{args.width}x{args.height}", "steps": args.steps, "guidance": args.guidance,
                     "block_size": args.block_size, "prompts": len(prompt_set()), "dtype": args.dtype,
                     "attention_backend": args.attention_backend, "transports": kinds, "modes": modes},
        "machine": machine(),
    }
    cols = ["transport", "mode", "inprocess_rps", "remote_rps", "ratio", "inprocess_p50_ms", "inprocess_p95_ms",
            "remote_p50_ms", "remote_p95_ms", "failed", "bit_exact", "pools_full", "server_pools_full"]
    emit(out, args.json, [{c: r[c] for c in cols} for r in rows], cols)
    return out
