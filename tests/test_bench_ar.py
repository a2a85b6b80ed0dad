"""`ditkv bench ar --shrink`: the AR-phase benchmark's code path on the CPU (toy widths)."""

import json

from ditkv.entrypoints.cli import main


def test_bench_ar_reports_decode_steps_at_every_concurrency(tmp_path, capsys):
    out = tmp_path / "ar.json"
    assert main(["bench", "ar", "--shrink", "--layers", "2", "--concurrency", "1,3", "--prompt-tokens", "40",
                 "--new-tokens", "6", "--image", "64", "--block-size", "16", "--json", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    for run, r in zip(printed["runs"], (1, 3)):
        assert run["concurrency"] == r and run["generated_tokens"] == 6 * r  # ignore_eos: exactly 6 each
        assert run["decode_steps"] >= 4 and run["decode_ms_per_step"] > 0
        assert abs(run["decode_tokens_per_s"] - r / (run["decode_ms_per_step"] / 1e3)) < 1e-6 * run["decode_tokens_per_s"]
