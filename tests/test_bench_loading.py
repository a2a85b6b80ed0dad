"""`ditkv bench loading` on the tiny preset: one JSON object, both paths per (tp, ep, rank), and a
TP = 2 rank's sliced load reads fewer bytes than the full load."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_loading_tiny_json():
    res = subprocess.run([sys.executable, "-m", "ditkv.entrypoints.cli", "bench", "loading", "--preset", "tiny",
                          "--tp", "1,2", "--no-ep", "--json"], capture_output=True, text=True, timeout=120,
                         check=False)
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1  # --json: exactly one object
    out = json.loads(lines[0])
    assert out["checkpoint"]["files"] > 2 and out["checkpoint"]["preset"] == "tiny"
    assert {"cpus", "torch", "date"} <= set(out["machine"])
    runs = {(r["tp"], r["ep"], r["rank"]): r for r in out["runs"]}
    assert set(runs) == {(1, 1, 0), (2, 1, 0), (2, 1, 1)}
    keys = {"time_s", "peak_rss_bytes", "bytes_read", "kept_bytes"}
    for r in runs.values():
        assert keys <= set(r["full"]) and keys <= set(r["sliced"])
        assert {"time_s", "peak_rss_bytes", "bytes_read"} <= set(r["ratio_sliced_over_full"])
        assert r["full"]["kept_bytes"] == r["sliced"]["kept_bytes"] > 0
        assert r["full"]["peak_rss_bytes"] > 0 and r["sliced"]["time_s"] > 0
    assert runs[(1, 1, 0)]["equal"] is True and runs[(2, 1, 0)]["equal"] is True
    for rank in (0, 1):
        r = runs[(2, 1, rank)]
        assert r["sliced"]["bytes_read"] < r["full"]["bytes_read"]
        assert r["ratio_sliced_over_full"]["bytes_read"] < 1
        assert r["sliced"]["kept_bytes"] < runs[(1, 1, 0)]["sliced"]["kept_bytes"]


def test_a_tp_the_model_cannot_split_is_an_error_not_an_empty_table():
    import pytest

    from ditkv.bench.loading import layouts, make_config
    from ditkv.errors import ConfigError

    cfg = make_config("tiny", None, None)
    with pytest.raises(ConfigError, match="tensor_parallel_size=3"):
        layouts(cfg, [1, 3], with_ep=True)
    assert layouts(cfg, [1, 2], with_ep=True) == [(1, 1), (2, 1), (2, 2)]
