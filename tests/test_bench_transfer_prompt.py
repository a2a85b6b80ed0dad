"""`ditkv bench transfer --prompt-tokens N`: synthetic prompts of exactly N byte tokens, above the
tiny model's default envelope (256), run end to end bit-exact; the JSON reports the length."""

import json

from ditkv.bench.transfer import prompt_set
from ditkv.entrypoints.cli import main


def test_prompt_set_lengths():
    ps = prompt_set(prompt_tokens=300)
    assert {len(p.encode("utf-8")) for p, _ in ps} == {300}
    assert len({p for p, _ in ps}) == len(ps)  # prompts differ
    assert [s for _, s in ps] == [s for _, s in prompt_set()]  # same seeds
    assert prompt_set()[0] == ("a small red circle", 0)  # default set unchanged


def test_bench_transfer_prompt_tokens_json(capsys):
    argv = ["bench", "transfer", "--json", "--prompt-tokens", "300", "--transports", "shm", "--requests", "2",
            "--runs", "1", "--concurrency", "2", "--height", "32", "--width", "32", "--steps", "1"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"legacy_rps", "native_rps", "ratio", "bit_exact", "page_bandwidth_ratio"} <= set(out)
    assert out["prompt_tokens"] == out["prompt_tokens_min"] == 300
    assert out["workload"]["prompt_tokens_flag"] == 300
    assert out["bit_exact"] is True
    (row,) = out["throughput"]
    assert row["failed"] == 0 and row["pools_full"]
    # the cond row's prefix: <bos> + 300 prompt tokens + <boi> <img_size> <img_ratio> (+ specials)
    assert row["imported_tokens"]["legacy"] == row["imported_tokens"]["native"] > 300
