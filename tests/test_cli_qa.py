"""Issue 33, QA findings on the `ditkv` command line: output paths probed before any work, every
flag's help and default, the address `ditkv serve` listens on, FP8 named in the closing and startup
lines, and stage YAML paths read from the file's folder."""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from ditkv.entrypoints.cli import build_parser, main
from ditkv.models.loader import TINY_ASSET

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
GEN = ["generate", "--prompt", "a red circle", "--steps", "2", "--no-progress"]
# a folder that os.access calls writable for root, where no file can be created
UNWRITABLE = "/proc"
needs_unwritable = pytest.mark.skipif(not os.path.isdir(UNWRITABLE), reason="needs Linux /proc")


def _exit_text(capsys, call) -> str:
    """Run `call`; return its one error line (SystemExit's message or stderr), asserting it failed."""
    try:
        rc = call()
    except SystemExit as e:
        rc = e.code
    assert rc not in (0, None)
    return capsys.readouterr().err + (rc if isinstance(rc, str) else "")


def _boom(*a, **k):
    raise AssertionError("the command started its work before checking its output path")


# ---- output paths: probed before any work ----------------------------------------------------------
@needs_unwritable
def test_generate_out_in_an_unwritable_folder_fails_before_the_model_loads(monkeypatch, capsys):
    monkeypatch.setattr("ditkv.engine.engine.Engine.__init__", _boom)
    err = _exit_text(capsys, lambda: main([*GEN, "--out", f"{UNWRITABLE}/x.png"]))
    assert "--out" in err and "cannot create a file in /proc" in err and "pick a folder you can write to" in err


@needs_unwritable
def test_quantize_out_in_an_unwritable_folder_fails_before_any_shard_is_read(monkeypatch, capsys):
    monkeypatch.setattr("ditkv.entrypoints.quantize._targets", _boom)
    err = _exit_text(capsys, lambda: main(["quantize", "--model", "tiny", "--out", f"{UNWRITABLE}/q"]))
    assert "out" in err and "pick a folder you can write to" in err


@needs_unwritable
@pytest.mark.parametrize("argv, flag", [
    (["bench", "attention", "--json-out", f"{UNWRITABLE}/a.json"], "--json-out"),
    (["bench", "handoff", "--out", f"{UNWRITABLE}/h.json"], "--out"),
    (["train-tiny", "--out", f"{UNWRITABLE}/t"], "--out"),
    (["train-tiny", "--metrics", f"{UNWRITABLE}/m.json"], "--metrics"),
    (["train-text-head", "--out", f"{UNWRITABLE}/t", "--metrics", "x.json"], "--out"),
    (["train-tiny-edit", "--metrics", f"{UNWRITABLE}/m.json"], "--metrics"),
])
def test_other_output_flags_are_probed_while_parsing(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and "pick a folder you can write to" in err


def test_the_probe_leaves_nothing_behind(tmp_path):
    out = tmp_path / "sub" / "r.json"
    (tmp_path / "sub").mkdir()
    args = build_parser().parse_args(["bench", "handoff", "--out", str(out), "--json"])
    assert args.out == str(out) and list((tmp_path / "sub").iterdir()) == []
    # a missing output folder of a checkpoint is made later: its nearest existing folder is probed
    args = build_parser().parse_args(["train-tiny", "--out", str(tmp_path / "new" / "ckpt")])
    assert args.out == str(tmp_path / "new" / "ckpt") and sorted(p.name for p in tmp_path.iterdir()) == ["sub"]


# ---- help texts -----------------------------------------------------------------------------------
def _subcommands(parser, path=("ditkv",)):
    """(command path, parser) of every parser in the tree, the root included."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subcommands(sub, (*path, name))


def _flags():
    for path, parser in _subcommands(build_parser()):
        for action in parser._actions:
            if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                yield " ".join(path), parser, action


def test_every_flag_has_help_that_shows_its_default():
    missing, no_default = [], []
    for cmd, parser, action in _flags():
        name = f"{cmd} {'/'.join(action.option_strings) or action.dest}"
        if not (action.help or "").strip():
            missing.append(name)
            continue
        text = parser._get_formatter()._expand_help(action)
        if not action.required and ("default" not in text or "default: None" in text):
            no_default.append(f"{name}: {text}")
    assert not missing, f"{len(missing)} flags without help: {missing}"
    assert not no_default, "flags whose help shows no default:\n" + "\n".join(no_default)


@pytest.mark.parametrize("cmd", [["generate"], ["serve"], ["quantize"]])
def test_model_help_names_every_bundled_model(cmd, capsys):
    with pytest.raises(SystemExit):
        main([*cmd, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "'tiny', 'tiny-edit'" in out and "checkpoint folder" in out


def test_serve_help_shows_the_port_default(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--port PORT" in out and "(default: 8000)" in out


# ---- FP8 named in the closing and startup lines ----------------------------------------------------
@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory):
    """A pre-quantized copy of the bundled tiny checkpoint, as `ditkv quantize` writes it."""
    from ditkv.entrypoints.quantize import quantize_folder

    out = tmp_path_factory.mktemp("fp8") / "tiny-fp8"
    quantize_folder("tiny", out, log=lambda *_: None)
    return out


def _closing_line(capsys, argv) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out.strip().splitlines()[-1]


def test_generate_names_fp8_from_a_prequantized_folder_and_from_the_flag(fp8_folder, tmp_path, capsys):
    line = _closing_line(capsys, [*GEN, "--model", str(fp8_folder), "--out", str(tmp_path / "a.png")])
    assert line.startswith("wrote") and "weights fp8 (pre-quantized checkpoint)" in line
    line = _closing_line(capsys, [*GEN, "--quantization", "fp8", "--out", str(tmp_path / "b.png")])
    assert "weights fp8 (quantized while loading)" in line
    line = _closing_line(capsys, [*GEN, "--out", str(tmp_path / "c.png")])
    assert "weights fp8" not in line and "weights float32" in line


def test_a_stage_graph_run_names_fp8(fp8_folder, tmp_path, capsys):
    line = _closing_line(capsys, [*GEN, "--config", str(EXAMPLES / "stages-native.yaml"), "--model",
                                  str(fp8_folder), "--out", str(tmp_path / "s.png")])
    assert "stages=AR->DiT" in line and "weights fp8 (pre-quantized checkpoint)" in line


# ---- serve: the address it listens on ----------------------------------------------------------------
def _serve_until_listening(argv, cwd, timeout=120.0):
    """Start `ditkv serve ARGV` in a process; return (process, its "listening on" line). Its stderr
    is read on a thread: a server that never says the line must fail the test, not block it."""
    proc = subprocess.Popen([sys.executable, "-m", "ditkv.entrypoints.cli", "serve", *argv], cwd=cwd,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True).start()
    seen, deadline = [], time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=min(left, 1.0))
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        if "listening on" in line:
            return proc, line
    _stop(proc)
    raise AssertionError("serve never said where it listens:\n" + "".join(seen))


def _stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_serve_logs_the_address_it_listens_on_with_fp8(fp8_folder, tmp_path):
    proc, line = _serve_until_listening(["--port", "0", "--model", str(fp8_folder)], cwd=tmp_path)
    try:
        url = re.search(r"listening on (http://127\.0\.0\.1:(\d+))", line)
        assert url and int(url.group(2)) > 0, line  # the port the system picked, not 0
        assert "model tiny-fp8" in line and "mode=paged_scheduler" in line
        assert "weights fp8 (pre-quantized checkpoint)" in line
        with urllib.request.urlopen(url.group(1) + "/health", timeout=30) as r:  # it does listen there
            assert json.load(r)["status"] == "ok"
    finally:
        _stop(proc)


# ---- stage YAML: paths read from the file's folder -------------------------------------------------
def _elsewhere(tmp_path, monkeypatch) -> Path:
    """A stage file in tmp/conf whose DiT and AR model is `ckpt`, a folder next to it; cwd is tmp/run."""
    conf, run = tmp_path / "conf", tmp_path / "run"
    conf.mkdir()
    run.mkdir()
    shutil.copytree(TINY_ASSET, conf / "ckpt")
    text = (EXAMPLES / "stages-native.yaml").read_text()
    assert text.count("model: tiny\n") == 2
    (conf / "stages.yaml").write_text(text.replace("model: tiny\n", "model: ckpt\n"))
    monkeypatch.chdir(run)
    return conf


def test_stage_file_model_folders_are_read_from_the_files_folder(tmp_path, monkeypatch):
    from ditkv.stages.graph import load_stage_graph

    conf = _elsewhere(tmp_path, monkeypatch)
    graph = load_stage_graph("../conf/stages.yaml")
    assert graph.ar.engine.model == graph.dit.engine.model == str(conf / "ckpt")
    # bundled names stay names, from any working directory
    graph = load_stage_graph(str(EXAMPLES / "stages-native-edit.yaml"))
    assert graph.ar.engine.model == graph.dit.engine.model == "tiny-edit"


def test_generate_runs_a_stage_file_from_another_folder(tmp_path, monkeypatch, capsys):
    _elsewhere(tmp_path, monkeypatch)
    line = _closing_line(capsys, [*GEN, "--config", "../conf/stages.yaml", "--out", "x.png"])
    assert line.startswith("wrote x.png") and (tmp_path / "run" / "x.png").is_file()


def test_engine_file_model_folder_and_the_model_flag(tmp_path, monkeypatch):
    """An engine YAML's relative model is the file's; a --model flag on top stays relative to the cwd."""
    from ditkv.entrypoints.engine_args import config_from_args
    from ditkv.stages.graph import stage_graph_from_args

    conf = _elsewhere(tmp_path, monkeypatch)
    (conf / "engine.yaml").write_text("model: ckpt\ndevice: cpu\n")
    args = build_parser().parse_args([*GEN, "--config", "../conf/engine.yaml"])
    assert config_from_args(args).model == str(conf / "ckpt")
    args = build_parser().parse_args([*GEN, "--config", "../conf/engine.yaml", "--model", "mine"])
    assert config_from_args(args).model == "mine"
    args = build_parser().parse_args([*GEN, "--config", "../conf/stages.yaml", "--model", "mine"])
    graph = stage_graph_from_args(args, "ditkv generate")
    assert graph.ar.engine.model == graph.dit.engine.model == "mine"
