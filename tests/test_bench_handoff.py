"""`ditkv bench handoff` at the tiny KV geometry over shm: keys, positive handoffs, exact byte counts,
legacy == native images, and the release geometry's bytes per token (config only)."""

import argparse
import json
import math

import numpy as np
import pytest
import torch

from ditkv.bench import handoff
from ditkv.entrypoints.cli import main
from ditkv.errors import ConfigError
from ditkv.models.hunyuan import HunyuanImage3Config

PROMPT, BS = 50, 16  # prefix 54 tokens: not a whole number of 16-token pages, so page rounding shows


def args(**kw):
    p = argparse.ArgumentParser()
    handoff.add_arguments(p)
    a = p.parse_args(["--kv-geometry", "tiny", "--prefix-tokens", str(PROMPT), "--transports", "shm,cuda",
                      "--requests", "2", "--guidance", "1.0,2.0", "--height", "32", "--width", "32",
                      "--block-size", str(BS), "--torch-threads", "1"])
    for k, v in kw.items():
        setattr(a, k, v)
    return a


@pytest.fixture(scope="module")
def result():
    return handoff.bench(args())


def test_handoff_tiny_shm(result):
    out, images = result
    tiny = HunyuanImage3Config.tiny()
    token_bytes = 2 * tiny.num_hidden_layers * tiny.num_key_value_heads * tiny.attention_head_dim * 4  # fp32
    assert out["model"]["kv_bytes_per_token_per_row"] == token_bytes == 2048
    assert out["failed"] == 0 and out["pools_full"] and out["bit_exact"]
    for key in ("goal", "min_ratio", "goal_met", "results", "skipped", "workload", "machine"):
        assert key in out
    if not torch.cuda.is_available():
        assert [s["transport"] for s in out["skipped"]] == ["cuda"]
    rows = [r for r in out["results"] if r["transport"] == "shm"]
    assert [(r["prefix_tokens"], r["rows"]) for r in rows] == [(PROMPT, 1), (PROMPT, 2)]
    prefix = 1 + PROMPT + 3  # <bos> prompt <boi> <img_size> <img_ratio>: what the AR prefills
    for r in rows:
        cfg_rows = r["rows"]
        assert r["ratio"] == pytest.approx(r["legacy"]["handoff_ms"]["p50"] / r["native"]["handoff_ms"]["p50"])
        for mode in ("legacy", "native"):
            x = r[mode]
            h = x["handoff_ms"]
            assert len(x["handoff_ms_all"]) == 2 and all(v > 0 for v in x["handoff_ms_all"])
            assert 0 < h["min"] <= h["p50"] <= h["max"] and h["min"] <= h["mean"] <= h["max"]
            b = x["breakdown_ms_p50"]
            assert min(b["orchestrator"], b["dit_intake"], b["write"], b["notice_to_run"], b["run_to_step"]) >= 0
            # with 2 requests a median is a mean, so the split of to_dispatch adds up exactly
            assert b["orchestrator"] + b["dit_intake"] == pytest.approx(b["to_dispatch"])
            assert b["to_notice"] >= b["write"]  # the notice comes after the data
            # every phase lies inside the handoff (it ends when the first step starts)
            assert b["to_dispatch"] + b["to_notice"] + b["notice_to_run"] + b["run_to_step"] <= h["max"] + 1e-6
            # the cond row imports its whole prefix; the uncond row shares only <bos>: under a page, nothing
            assert x["imported_tokens"] == prefix
            assert x["payload_bytes"] == prefix * token_bytes
            assert x["gbps"] == pytest.approx(x["bytes_per_request"] / (h["p50"] / 1e3) / 1e9)
        # legacy: one [L, 2, P, H, D] tensor for every row; native: whole pages of every imported row
        assert r["legacy"]["bytes_per_request"] == prefix * token_bytes
        pages = math.ceil(prefix / BS)
        assert r["legacy"]["descriptors"] == [1, 1]  # one contiguous tensor, one destination rank
        assert all(1 <= n <= pages for n in r["native"]["descriptors"])  # pages, adjacent ones merged
        assert r["native"]["bytes_per_request"] == pages * BS * token_bytes
        # legacy holds 2 producer staging slots + 1 receive slot of legacy_max_tokens; native nothing extra
        assert r["legacy"]["staging_bytes"] == 2 * prefix * token_bytes
        assert r["legacy"]["receive_slot_bytes"] == prefix * token_bytes
        assert r["native"]["extra_buffer_bytes"] == 0 and r["native"]["dense_cache_bytes"] == 0
        assert r["legacy"]["dense_cache_bytes"] > 0
        imgs = images[(PROMPT, r["guidance"], "shm")]
        assert len(imgs["legacy"]) == len(imgs["native"]) == 2
        assert all(np.array_equal(a, b) for a, b in zip(imgs["legacy"], imgs["native"]))
        assert not np.array_equal(imgs["native"][0], imgs["native"][1])  # two different requests


def test_cli_json_and_out(tmp_path, capsys):
    path = tmp_path / "h.json"
    main(["bench", "handoff", "--kv-geometry", "tiny", "--prefix-tokens", "20", "--transports", "shm",
          "--requests", "1", "--warmup", "0", "--height", "32", "--width", "32", "--torch-threads", "1",
          "--json", "--out", str(path)])
    printed = json.loads(capsys.readouterr().out)  # exactly one JSON object on stdout
    assert printed == json.loads(path.read_text())
    (r,) = printed["results"]
    assert r["transport"] == "shm" and r["rows"] == 1 and r["native"]["handoff_ms"]["p50"] > 0


def test_release_geometry_config():
    cfg = handoff.model_config("release")
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.attention_head_dim) == (32, 8, 128)
    assert cfg.hidden_size == 1024  # hidden must be query heads x head_dim; 8 x 128 is the least
    assert handoff.kv_token_bytes(cfg, torch.bfloat16) == 128 * 1024
    assert handoff.kv_token_bytes(cfg, torch.float32) == 256 * 1024
    with pytest.raises(ConfigError, match="hidden_size"):  # the config forbids a smaller hidden size
        cfg.replace(hidden_size=512)
