"""`ditkv bench transfer --remote-ar` at a tiny workload: the JSON keys, no failure, images identical
between the in-process graph and the `ditkv stage` subprocess, pools full, a clean SIGTERM exit."""

import json

from ditkv.entrypoints.cli import main

ROW_KEYS = {"transport", "mode", "inprocess_rps", "remote_rps", "ratio", "inprocess_runs", "remote_runs",
            "inprocess_p50_ms", "inprocess_p95_ms", "remote_p50_ms", "remote_p95_ms", "failed", "errors",
            "bit_exact", "pools_full", "pools_full_runs", "server", "server_pools_full", "seconds"}


def test_bench_transfer_remote_ar_json(capsys):
    argv = ["bench", "transfer", "--remote-ar", "--json", "--transports", "shm", "--remote-modes", "native",
            "--requests", "4", "--runs", "1", "--concurrency", "2", "--height", "32", "--width", "32",
            "--steps", "1"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)  # --json: exactly one JSON object on stdout
    assert {"inprocess_rps", "remote_rps", "ratio", "latency_ms", "failed", "bit_exact", "pools_full",
            "server_pools_full", "headline", "remote", "workload", "machine"} <= set(out)
    assert out["failed"] == 0 and out["bit_exact"] is True
    assert out["pools_full"] is True and out["server_pools_full"] is True
    assert out["headline"] == {"transport": "shm", "mode": "native"}
    assert set(out["latency_ms"]) == {"inprocess", "remote"}
    assert all(0 < out["latency_ms"][s][q] for s in ("inprocess", "remote") for q in ("p50", "p95"))
    (row,) = out["remote"]
    assert ROW_KEYS <= set(row)
    assert len(row["inprocess_runs"]) == len(row["remote_runs"]) == 1 and row["pools_full_runs"] == [True, True]
    assert out["ratio"] == row["remote_rps"] / row["inprocess_rps"] > 0
    srv = row["server"]
    assert srv["exit_code"] == 0 and not srv["killed"] and srv["pools_full"] and srv["leases_zero"], srv
    assert "pools full: True" in srv["exit_line"]
