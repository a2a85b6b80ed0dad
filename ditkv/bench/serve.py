"""`ditkv bench serve`: closed-loop HTTP load test of `ditkv serve`.

N concurrent clients send M image requests in total and report req/s, latency percentiles and
errors (by HTTP status). Without `--url` it starts a local `ditkv serve` on a free loopback port
for the run and stops it afterwards (its engine flags: `--server-args`). Latency figures come
from successful requests only: with none they are null in the JSON and "-" in the table, and
when nothing succeeded the command exits non-zero (a run that measured nothing is no result).
"""

from __future__ import annotations

import asyncio
import os
import shlex
import socket
import subprocess
import sys
import time

from ..errors import DitkvError
from ..argtypes import positive_float, positive_int
from .common import emit, machine


def add_arguments(p):
    p.add_argument("--url", default=None, help="server base URL, e.g. http://127.0.0.1:8000 "
                                               "(default: start a local server on loopback)")
    p.add_argument("--concurrency", type=positive_int, default=4, help="clients sending at the same time")
    p.add_argument("--num-requests", type=positive_int, default=32, help="requests in total")
    p.add_argument("--prompt", default="a large blue square", help="prompt of every request")
    p.add_argument("--size", default="64x64", help="image size WIDTHxHEIGHT of every request")
    p.add_argument("--steps", type=positive_int, default=2, help="denoising steps per request")
    p.add_argument("--n", type=positive_int, default=1, help="images per request")
    p.add_argument("--timeout", type=positive_float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--server-args", default="", help="extra `ditkv serve` flags for the local server (default: none)")
    p.add_argument("--json", action="store_true", help="print one JSON object only")


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values (there is no latency to report)."""
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(-(-q * len(s) // 100)) - 1))
    return s[k]


async def _load(url: str, body: dict, concurrency: int, num_requests: int, timeout: float) -> dict:
    import httpx

    latencies: list[float] = []
    errors: dict[str, int] = {}
    counter = iter(range(num_requests))

    async def client(http):
        for _ in counter:  # shared iterator: each request is sent exactly once
            t0 = time.perf_counter()
            try:
                r = await http.post(url + "/v1/images/generations", json=body)
                ok = r.status_code == 200 and len(r.json().get("data", [])) == body["n"]
                key = None if ok else str(r.status_code)
            except httpx.HTTPError as e:
                key = type(e).__name__
            if key is None:
                latencies.append(time.perf_counter() - t0)
            else:
                errors[key] = errors.get(key, 0) + 1

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    return {"latencies": latencies, "errors": errors, "elapsed": elapsed}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_local_server(extra_args: str = "", timeout: float = 120.0) -> tuple[subprocess.Popen, str]:
    """`ditkv serve` on a free loopback port; returns once /health answers 200."""
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "ditkv.entrypoints.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", *shlex.split(extra_args)]
    proc = subprocess.Popen(cmd, env=dict(os.environ), stdout=sys.stderr)  # keep stdout for the result
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"ditkv bench serve: the local server exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise SystemExit(f"ditkv bench serve: the local server did not become healthy within {timeout:.0f}s")


def run(args) -> dict:
    for flag, v in (("--concurrency", args.concurrency), ("--num-requests", args.num_requests),
                    ("--steps", args.steps), ("--n", args.n)):
        if v < 1:
            raise SystemExit(f"ditkv bench serve: error: {flag}={v} must be >= 1")
    body = {"prompt": args.prompt, "size": args.size, "steps": args.steps, "n": args.n,
            "response_format": "b64_json", "seed": 0}
    proc, url = (None, args.url.rstrip("/")) if args.url else start_local_server(args.server_args)
    try:
        res = asyncio.run(_load(url, body, args.concurrency, args.num_requests, args.timeout))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    lat, elapsed = res["latencies"], res["elapsed"]
    ok = len(lat)
    row = {
        "concurrency": args.concurrency, "requests": args.num_requests, "ok": ok,
        "errors": sum(res["errors"].values()),
        "req_per_s": ok / elapsed if elapsed else 0.0,
        "images_per_s": ok * args.n / elapsed if elapsed else 0.0,
        "p50_s": percentile(lat, 50), "p95_s": percentile(lat, 95), "p99_s": percentile(lat, 99),
        "mean_s": sum(lat) / ok if ok else None, "max_s": max(lat, default=None),
    }
    out = {**row, "duration_s": elapsed, "errors_by_kind": res["errors"], "url": url,
           "request": {k: v for k, v in body.items() if k != "prompt"}, "local_server": proc is not None,
           "machine": machine()}
    shown = {k: "-" if v is None else v for k, v in row.items()}  # no sample, no figure
    emit(out, args.json, [shown], list(row))
    if not ok:  # a load test where nothing succeeded measured nothing: fail the run
        raise DitkvError(f"bench serve: all {args.num_requests} requests failed ({_kinds(res['errors'])}) "
                         f"against {url}; check that the server is up and accepts this request")
    return out


def _kinds(errors: dict[str, int]) -> str:
    return ", ".join(f"{n}x {kind}" for kind, n in sorted(errors.items(), key=lambda kv: -kv[1]))

