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


def test_bench_ar_plain_and_instruct_rows(capsys):
    """--plain adds the same images without text; --instruct adds the issue's Instruct case (toy sizes
    under --shrink) with and without its text; every run reports images/min and where its time went."""
    assert main(["bench", "ar", "--shrink", "--layers", "1", "--concurrency", "2", "--prompt-tokens", "40",
                 "--new-tokens", "4", "--image", "64", "--steps", "2", "--block-size", "16", "--plain", "--instruct",
                 "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert [(r.get("case"), r["concurrency"], r["text"]) for r in runs] == [
        (None, 2, True), (None, 2, False), ("instruct", 8, True), ("instruct", 8, False)]
    assert runs[2]["generated_tokens"] == 8 * 8  # 8 requests, 8 tokens each under --shrink
    assert all(r["images_per_min"] > 0 for r in runs)
    assert runs[0]["outside_steps_s"] >= 0 and sum(runs[0]["step_seconds"].values()) > 0
