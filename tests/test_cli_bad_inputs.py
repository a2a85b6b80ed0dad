"""Bad `ditkv` command lines: each one ends with a single error line that names the field or flag,
a non-zero exit and no traceback, before anything expensive runs (no model forward pass).

One table, `CASES`: (id, argv, what the message must name, how to build the files it points at).
`{tmp}` in an argv is the case's tmp_path. Most cases run in-process through `cli.main`; a few run
as real processes to show that the process itself prints no traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, NamedTuple

import pytest
import torch
from safetensors.torch import load_file, save_file

from ditkv.entrypoints.cli import main
from ditkv.models.loader import TINY_ASSET

SHARD = "model-00001-of-00001.safetensors"
INDEX = "model.safetensors.index.json"
GEN = ["generate", "--prompt", "a red circle", "--no-progress", "--out", "{tmp}/x.png"]
SERVE = ["serve", "--port", "0"]
STAGE = ["stage", "--bind", "tcp://127.0.0.1:7199"]


class Case(NamedTuple):
    id: str
    argv: list[str]
    needle: str  # the field, flag or file the one error line must name
    setup: Callable | None = None  # builds files under tmp_path


# ---- checkpoint folders: the bundled tiny checkpoint, broken one way each -----------------------
def _tiny_config() -> dict:
    return json.loads((TINY_ASSET / "config.json").read_text())


def _folder(tmp, config=None, index: str | None = None, shard: bytes | None = None, files: dict | None = None):
    """tmp/m with config.json (the tiny one, or `config`: a dict, raw text or bytes), optionally the
    index (raw text; "copy" = the tiny one), the shard's bytes and other files."""
    m = tmp / "m"
    m.mkdir()
    cfg = _tiny_config() if config is None else config
    if isinstance(cfg, dict):
        cfg = json.dumps(cfg)
    (m / "config.json").write_bytes(cfg.encode() if isinstance(cfg, str) else cfg)
    if index is not None:
        (m / INDEX).write_text((TINY_ASSET / INDEX).read_text() if index == "copy" else index)
    if shard is not None:
        (m / SHARD).write_bytes(shard)
    for name, text in (files or {}).items():
        (m / name).write_text(text)


def _config_without(key):
    return lambda tmp: _folder(tmp, {k: v for k, v in _tiny_config().items() if k != key})


def _config_with(**changes):
    return lambda tmp: _folder(tmp, {**_tiny_config(), **changes})


def _single_file(change: Callable[[dict], None]):
    """A single-file checkpoint (model.safetensors, no index) with `change` applied to its tensors."""
    def setup(tmp):
        _folder(tmp)
        state = load_file(str(TINY_ASSET / SHARD))
        change(state)
        save_file(state, str(tmp / "m" / "model.safetensors"))
    return setup


KEY = "model.layers.1.mlp.experts.3.down_proj.weight"
MODEL = ["--model", "{tmp}/m"]


def _truncated(tmp):
    data = (TINY_ASSET / SHARD).read_bytes()
    _folder(tmp, index="copy", shard=data[: len(data) // 2])


# ---- YAML files -------------------------------------------------------------------------------------
def _yaml(text: str | bytes):
    def setup(tmp):
        path = tmp / "c.yaml"
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return setup


CONFIG = ["--config", "{tmp}/c.yaml"]

AR = ("  - stage_id: 0\n    kind: ar\n    engine: {model: tiny, device: cpu, block_size: 16, num_kv_blocks: 64}\n"
      "    kv_transfer_config: {kv_connector: shm, engine_id: ar, kv_role: kv_producer}\n")
DIT = ("  - stage_id: 1\n    kind: dit\n    inputs: [0]\n"
       "    engine: {model: tiny, device: cpu, diffusion_kv_mode: paged_scheduler,\n"
       "             diffusion_kv_max_rows_per_request: 2, block_size: 16, num_kv_blocks: 64}\n"
       "    kv_transfer_config: {kv_connector: shm, engine_id: dit, kv_role: kv_consumer}\n")


def _stages(ar: str = AR, dit: str = DIT, tail: str = ""):
    """A stage file: the two stages of examples/stages-native.yaml (small pools), edited."""
    return _yaml("stages:\n" + ar + dit + tail)


def _edit(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new)


CASES = [
    # -- request fields: the server's rules (engine/request_check.py), checked before loading ---------
    Case("prompt-empty", ["generate", "--prompt", "", "--out", "{tmp}/x.png"], "prompt"),
    Case("prompt-blank", ["generate", "--prompt", "   ", "--out", "{tmp}/x.png"], "prompt"),
    Case("seed-negative", GEN + ["--seed", "-1"], "seed"),
    Case("seed-2**64", GEN + ["--seed", str(2**64)], "seed"),
    Case("seed-2**63", GEN + ["--seed", str(2**63)], "seed"),
    Case("seed-not-int", GEN + ["--seed", "abc"], "--seed"),
    Case("steps-0", GEN + ["--steps", "0"], "steps"),
    Case("steps-100000", GEN + ["--steps", "100000"], "steps"),
    Case("steps-above-max-steps", GEN + ["--steps", "5", "--max-steps", "4"], "steps"),
    # a max_steps below the model's default (8 for tiny) would refuse every request without --steps
    Case("cuda-graphs-bogus", GEN + ["--cuda-graphs", "maybe"], "cuda_graphs"),
    Case("cuda-graphs-on-cpu", GEN + ["--cuda-graphs", "on"], "cuda_graphs='on': CUDA graphs need a CUDA device"),
    Case("max-steps-below-default", GEN + ["--max-steps", "4"], "max_steps=4: is below the model's default"),
    Case("height-0", GEN + ["--height", "0"], "height"),
    Case("width-negative", GEN + ["--width", "-64"], "width"),
    Case("guidance-negative", GEN + ["--guidance", "-1"], "guidance"),
    Case("guidance-nan", GEN + ["--guidance", "nan"], "guidance"),
    # -- --out: checked first -----------------------------------------------------------------------
    Case("out-missing-dir", GEN + ["--out", "/missing-dir/x.png"], "--out"),
    Case("out-not-png", GEN + ["--out", "{tmp}/x.jpg"], "--out"),
    Case("out-is-dir", GEN + ["--out", "{tmp}/d.png"], "--out", lambda tmp: (tmp / "d.png").mkdir()),
    Case("out-parent-is-file", GEN + ["--out", "{tmp}/f/x.png"], "--out", lambda tmp: (tmp / "f").write_text("")),
    # -- engine flags ---------------------------------------------------------------------------------
    Case("device-bogus", GEN + ["--device", "bogus"], "device"),
    Case("device-mps", GEN + ["--device", "mps"], "device"),
    Case("device-cuda-999", GEN + ["--device", "cuda:999"], "device"),
    Case("dtype", GEN + ["--dtype", "float64"], "dtype"),
    Case("mode", GEN + ["--mode", "paged"], "diffusion_kv_mode"),
    Case("block-size", GEN + ["--block-size", "20"], "block_size"),
    Case("max-steps-0", GEN + ["--max-steps", "0"], "max_steps"),
    Case("num-kv-blocks-0", GEN + ["--num-kv-blocks", "0"], "num_kv_blocks"),
    Case("gpu-memory-utilization", GEN + ["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization"),
    Case("max-model-len-0", GEN + ["--max-model-len", "0"], "max_model_len"),
    Case("torch-threads-0", GEN + ["--torch-threads", "0"], "torch_threads"),
    Case("cfg-parallel-3", GEN + ["--cfg-parallel-size", "3"], "cfg_parallel_size"),
    Case("attention-backend", GEN + ["--attention-backend", "flash"], "attention_backend"),
    Case("step-execution-not-bool", GEN + ["--step-execution", "maybe"], "--step-execution"),
    Case("dense-max-num-seqs", GEN + ["--mode", "dense_legacy", "--max-num-seqs", "2"], "max_num_seqs"),
    Case("max-num-batched-tokens-zero", GEN + ["--max-num-batched-tokens", "0"], "max_num_batched_tokens"),
    Case("model-empty", GEN + ["--model", ""], "model"),
    # these two load the tiny model (no forward pass): the request is refused at admission
    Case("num-kv-blocks-1", GEN + ["--mode", "paged_scheduler", "--num-kv-blocks", "1"], "num_kv_blocks"),
    Case("max-model-len-dense", GEN + ["--mode", "dense_legacy", "--max-model-len", "100"], "max_model_len"),
    Case("num-kv-blocks-huge", GEN + ["--mode", "paged_scheduler", "--num-kv-blocks", str(10**15)], "num_kv_blocks"),
    Case("kv-cache-bytes-huge", GEN + ["--mode", "paged_scheduler", "--profile-memory", "false",
                                       "--kv-cache-memory-bytes", str(10**20)], "kv_cache_memory_bytes"),
    # -- checkpoint folders (--model PATH) --------------------------------------------------------------
    Case("model-no-folder", GEN + ["--model", "{tmp}/nope"], "model"),
    Case("model-no-config", GEN + MODEL, "config.json", lambda tmp: (tmp / "m").mkdir()),
    Case("config-garbage", GEN + MODEL, "config.json", lambda tmp: _folder(tmp, "{not json")),
    Case("config-list", GEN + MODEL, "config.json", lambda tmp: _folder(tmp, "[]")),
    Case("config-not-utf8", GEN + MODEL, "config.json", lambda tmp: _folder(tmp, b"\xff\xfe")),
    Case("config-huge-int", GEN + MODEL, "num_hidden_layers", _config_with(num_hidden_layers=2**70)),
    Case("config-5000-digits", GEN + MODEL, "config.json", lambda tmp: _folder(tmp, '{"vocab_size": 1' + "0" * 5000 + "}")),
    Case("config-missing-field", GEN + MODEL, "vocab_size", _config_without("vocab_size")),
    Case("config-str-int", GEN + MODEL, "hidden_size", _config_with(hidden_size="128")),
    Case("config-str-float", GEN + MODEL, "rms_norm_eps", _config_with(rms_norm_eps="tiny")),
    Case("config-null-float", GEN + MODEL, "flow_shift", _config_with(flow_shift=None)),
    Case("config-bad-gqa", GEN + MODEL, "num_key_value_heads", _config_with(num_key_value_heads=3)),
    Case("config-extra-list", GEN + MODEL, "extra", _config_with(extra=[1, 2])),
    Case("no-weights", GEN + MODEL, INDEX, lambda tmp: _folder(tmp)),
    Case("index-garbage", GEN + MODEL, INDEX, lambda tmp: _folder(tmp, index="{{{")),
    Case("index-list", GEN + MODEL, "weight_map", lambda tmp: _folder(tmp, index="[]")),
    Case("index-bad-file-name", GEN + MODEL, "weight_map",
         lambda tmp: _folder(tmp, index=json.dumps({"weight_map": {KEY: 5}}))),
    Case("index-missing-shard", GEN + MODEL, SHARD, lambda tmp: _folder(tmp, index="copy")),
    Case("shard-garbage", GEN + MODEL, "safetensors", lambda tmp: _folder(tmp, index="copy", shard=b"garbage" * 9)),
    Case("shard-empty", GEN + MODEL, "safetensors", lambda tmp: _folder(tmp, index="copy", shard=b"")),
    Case("shard-truncated", GEN + MODEL, "safetensors", _truncated),
    Case("tensor-wrong-shape", GEN + MODEL, KEY, _single_file(lambda st: st.__setitem__(KEY, torch.zeros(7, 5)))),
    Case("tensor-missing", GEN + MODEL, "missing key", _single_file(lambda st: st.pop(KEY))),
    Case("tensor-unknown", GEN + MODEL, "unexpected key",
         _single_file(lambda st: st.__setitem__("bogus.weight", torch.zeros(2)))),
    Case("tokenizer-garbage", GEN + MODEL, "tokenizer.json", lambda tmp: _folder(tmp, files={"tokenizer.json": "{"})),
    # -- engine YAML (--config) ----------------------------------------------------------------------
    Case("config-file-missing", GEN + ["--config", "{tmp}/none.yaml"], "config"),
    Case("config-file-empty", GEN + CONFIG, "file is empty", _yaml("")),
    Case("config-file-comments", GEN + CONFIG, "file is empty", _yaml("# nothing here\n")),
    Case("config-file-garbage", GEN + CONFIG, "not valid YAML", _yaml("block_size: [16,\n")),
    Case("config-file-list", GEN + CONFIG, "mapping", _yaml("- 1\n- 2\n")),
    Case("config-file-not-utf8", GEN + CONFIG, "UTF-8", _yaml(b"block_size: \xff\n")),
    Case("config-file-unknown-key", GEN + CONFIG, "block_sise", _yaml("block_sise: 16\n")),
    Case("config-file-wrong-type", GEN + CONFIG, "block_size", _yaml("block_size: big\n")),
    Case("config-file-device-int", GEN + CONFIG, "device", _yaml("device: 0\n")),
    Case("config-file-engine-int", GEN + CONFIG, "engine", _yaml("engine: 5\n")),
    Case("config-file-int-key", GEN + CONFIG, "keys must be strings", _yaml("1: 2\nblock_size: 16\n")),
    Case("config-file-huge-int", GEN + CONFIG, "gpu_memory_utilization",
         _yaml(f"gpu_memory_utilization: {10**400}\n")),
    Case("config-file-5000-digits", GEN + CONFIG, "not valid YAML", _yaml("block_size: 1" + "0" * 5000 + "\n")),
    # -- stage files (--config with stages:) ---------------------------------------------------------------
    Case("stages-not-list", GEN + CONFIG, "stages", _yaml("stages: 5\n")),
    Case("stages-empty", GEN + CONFIG, "stages", _yaml("stages: []\n")),
    Case("stages-one", GEN + CONFIG, "stages", _stages(dit="")),
    Case("stages-max-steps-below-default", GEN + CONFIG, "max_steps=3: is below the model's default",
         _stages(dit=_edit(DIT, "block_size: 16,", "block_size: 16, max_steps: 3,"))),
    Case("stages-item-str", GEN + CONFIG, "stages", _yaml("stages: [ar, dit]\n")),
    Case("stages-inputs-int", GEN + CONFIG, "stages", _stages(dit=_edit(DIT, "inputs: [0]", "inputs: 0"))),
    Case("stage-unknown-key", GEN + CONFIG, "stages[0].replica", _stages(ar=AR + "    replica: 2\n")),
    Case("stage-replicas-0", GEN + CONFIG, "stages[1].replicas", _stages(dit=DIT + "    replicas: 0\n")),
    Case("stage-engine-str", GEN + CONFIG + ["--device", "cpu"], "stages[0].engine",
         _stages(ar=_edit(AR, "engine: {model: tiny, device: cpu, block_size: 16, num_kv_blocks: 64}", "engine: x"))),
    Case("ar-engine-unknown-key", GEN + CONFIG, "stages[0].engine.diffusion_kv_mode",
         _stages(ar=_edit(AR, "block_size: 16", "block_size: 16, diffusion_kv_mode: paged_scheduler"))),
    Case("ar-engine-device-int", GEN + CONFIG, "stages[0].engine.device",
         _stages(ar=_edit(AR, "device: cpu", "device: 3"))),
    Case("ar-engine-dtype", GEN + CONFIG, "stages[0].engine.dtype",
         _stages(ar=_edit(AR, "device: cpu", "device: cpu, dtype: fp8"))),
    Case("dit-engine-wrong-type", GEN + CONFIG, "diffusion_kv_max_rows_per_request",
         _stages(dit=_edit(DIT, "diffusion_kv_max_rows_per_request: 2", "diffusion_kv_max_rows_per_request: two"))),
    Case("block-size-mismatch", GEN + CONFIG, "stages[0].engine.block_size",
         _stages(ar=_edit(AR, "block_size: 16", "block_size: 32"))),
    Case("temperature-huge", GEN + CONFIG, "stages[0].temperature", _stages(ar=AR + f"    temperature: {10**400}\n")),
    Case("no-transfer", GEN + CONFIG, "kv_transfer_config",
         _stages(dit=DIT.split("    kv_transfer_config")[0])),
    Case("kv-role-swapped", GEN + CONFIG, "kv_role", _stages(ar=_edit(AR, "kv_producer", "kv_consumer"))),
    Case("top-level-unknown", GEN + CONFIG, "orchestrater", _stages(tail="orchestrater: {max_inflight: 8}\n")),
    Case("max-inflight-0", GEN + CONFIG, "orchestrator.max_inflight", _stages(tail="orchestrator: {max_inflight: 0}\n")),
    Case("remote-on-dit", GEN + CONFIG, "stages[1].remote", _stages(dit=DIT + "    remote: tcp://127.0.0.1:7100\n")),
    Case("remote-bad-address", GEN + CONFIG, "stages[0].remote", _stages(ar=AR + "    remote: localhost\n")),
    Case("stage-file-flag-override", GEN + CONFIG + ["--block-size", "32"], "--block-size", _stages()),
    # -- ditkv stage ----------------------------------------------------------------------------------
    Case("stage-id-1", STAGE + ["--stage", "1"] + CONFIG, "--stage", _stages()),
    Case("stage-id-not-int", STAGE + ["--stage", "x"] + CONFIG, "--stage", _stages()),
    Case("stage-bind", ["stage", "--bind", "localhost:7100"] + CONFIG, "--bind", _stages()),
    Case("stage-bind-port", ["stage", "--bind", "tcp://127.0.0.1:70000"] + CONFIG, "--bind", _stages()),
    Case("stage-no-bind", ["stage"] + CONFIG, "--bind", _stages()),
    Case("stage-config-missing", STAGE + ["--config", "{tmp}/none.yaml"], "config"),
    Case("stage-config-empty", STAGE + CONFIG, "file is empty", _yaml("")),
    Case("stage-config-no-stages", STAGE + CONFIG, "stages", _yaml("block_size: 16\n")),
    # -- ditkv serve: its own flags and the engine config, before any engine starts ------------------------
    Case("serve-port", ["serve", "--port", "70000"], "--port"),
    Case("serve-port-not-int", ["serve", "--port", "http"], "--port"),
    Case("serve-max-n", SERVE + ["--max-n", "0"], "--max-n"),
    Case("serve-shutdown-timeout", SERVE + ["--shutdown-timeout", "nan"], "--shutdown-timeout"),
    Case("serve-block-size", SERVE + ["--block-size", "20"], "block_size"),
    Case("serve-max-steps", SERVE + ["--max-steps", "0"], "max_steps"),
    Case("serve-config-empty", SERVE + CONFIG, "file is empty", _yaml("")),
    Case("serve-dense-max-num-seqs", SERVE + ["--mode", "dense_legacy", "--max-num-seqs", "2"], "max_num_seqs"),
    # the address is bound before the model loads: a bad one fails at once, naming the flag
    Case("serve-host-unresolvable", SERVE + ["--host", "bogus.invalid."], "--host=bogus.invalid.: cannot resolve"),
    Case("serve-host-not-local", SERVE + ["--host", "192.0.2.1"], "--host=192.0.2.1 --port=0: cannot listen"),
    # -- ditkv bench (the cheap checks) --------------------------------------------------------------------
    Case("bench-unknown", ["bench", "nope"], "bench"),
    Case("bench-scheduler-requests", ["bench", "scheduler", "--requests", "many"], "--requests"),
    Case("bench-serve-concurrency", ["bench", "serve", "--concurrency", "0"], "--concurrency"),
    Case("bench-loading-tp", ["bench", "loading", "--tp", "3", "--layers", "1"], "tensor_parallel_size"),
    Case("bench-scheduler-zero", ["bench", "scheduler", "--requests", "0"], "--requests"),
    Case("bench-scheduler-repeats", ["bench", "scheduler", "--repeats", "0"], "--repeats"),
    Case("bench-capacity-budget", ["bench", "capacity", "--budget-gib", "-1"], "--budget-gib"),
    Case("bench-capacity-tiny-budget", ["bench", "capacity", "--budget-gib", "1e-6"], "budget_gib"),
    Case("bench-capacity-block", ["bench", "capacity", "--block-size", "0"], "--block-size"),
    Case("bench-loading-tp-text", ["bench", "loading", "--tp", "abc"], "--tp"),
    Case("bench-loading-tp-empty", ["bench", "loading", "--tp", ","], "--tp"),
    Case("bench-step-guidance", ["bench", "step", "--guidance", "nan"], "--guidance"),
    Case("bench-attention-seed", ["bench", "attention", "--seed", "-1"], "--seed"),
    Case("bench-transfer-pages", ["bench", "transfer", "--pages", "0"], "--pages"),
]


def _argv(case: Case, tmp) -> list[str]:
    return [a.replace("{tmp}", str(tmp)) for a in case.argv]


def _run_in_process(argv, capsys) -> tuple[int, str]:
    """(exit status, the error text): main's return value or SystemExit's code, and stderr plus a
    SystemExit message (which Python prints to stderr at exit)."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc, msg = (1, str(e.code)) if isinstance(e.code, str) else (e.code, "")
    else:
        msg = ""
    err = capsys.readouterr().err
    return rc, err + msg


def _error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines, "no error message"
    return lines[-1]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_naming_the_field(case, tmp_path, capsys):
    if case.setup:
        case.setup(tmp_path)
    rc, err = _run_in_process(_argv(case, tmp_path), capsys)
    assert rc not in (0, None), err
    assert "Traceback" not in err
    line = _error_line(err)
    assert "error" in line, err
    assert case.needle in line, err
    assert not (tmp_path / "x.png").exists()  # nothing ran to the end


def test_table_is_large_and_unique():
    ids = [c.id for c in CASES]
    assert len(ids) >= 40 and len(set(ids)) == len(ids)


# ---- a few as real processes: the process itself prints one line and no traceback ------------------
SUBPROCESS = ["config-list", "shard-truncated", "out-missing-dir", "device-bogus", "stage-bind",
              "serve-host-unresolvable"]


@pytest.mark.parametrize("case_id", SUBPROCESS)
def test_real_process_prints_no_traceback(case_id, tmp_path):
    case = next(c for c in CASES if c.id == case_id)
    if case.setup:
        case.setup(tmp_path)
    res = subprocess.run([sys.executable, "-m", "ditkv.entrypoints.cli", *_argv(case, tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0, res.stderr
    assert "Traceback" not in res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and case.needle in lines[0], res.stderr


def test_help_documents_max_model_len_in_both_modes(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "in both modes" in out and "writable" in out


def test_checkpoint_copy_still_loads(tmp_path):
    """The broken folders above differ from a good one only by their fault: an intact copy loads."""
    from ditkv.models.hunyuan.checkpoint import load_checkpoint

    shutil.copytree(TINY_ASSET, tmp_path / "m")
    assert load_checkpoint(tmp_path / "m").config.vocab_size == 320


def _subparsers(parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def test_every_bench_number_flag_is_range_checked():
    """A bare `type=int`/`type=float` lets 0, -1 or nan through to a traceback deep in a bench; every
    numeric bench flag must use one of the checked types of bench/common.py."""
    from ditkv.entrypoints.cli import build_parser

    bench = dict(_subparsers(build_parser()))["bench"]
    loose = [f"bench {name} {'/'.join(a.option_strings)}" for name, sub in _subparsers(bench)
             for a in sub._actions if a.type in (int, float)]
    assert not loose, loose


# ---- ditkv serve: the address before the model ---------------------------------------------------------
def _taken_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


@pytest.mark.parametrize("host, needle", [
    ("bogus.invalid.", "--host=bogus.invalid.: cannot resolve this host name"),
    ("192.0.2.1", "it is not an address of this machine"),  # TEST-NET-1: never this machine's
    ("taken", "another process listens there: stop it or pick another --port"),
])
def test_serve_checks_its_address_before_the_model_loads(host, needle, monkeypatch, capsys):
    from ditkv.entrypoints import serve

    monkeypatch.setattr(serve, "_start_backend", lambda a: pytest.fail("the model loaded before the address was bound"))
    with _taken_port() as taken:
        port = str(taken.getsockname()[1]) if host == "taken" else "0"
        t0 = time.monotonic()
        rc, err = _run_in_process(["serve", "--host", "127.0.0.1" if host == "taken" else host, "--port", port], capsys)
    assert rc not in (0, None) and time.monotonic() - t0 < 30
    line = _error_line(err)
    assert line.startswith("ditkv serve: error: --host=") and needle in line and "127.0.0.1" in line, err
    assert "Application shutdown" not in err and "Traceback" not in err


def test_bound_sockets_cover_every_address_of_the_host():
    from ditkv.entrypoints.listen import bind_sockets

    socks = bind_sockets("localhost", 0)
    try:
        assert socks and {s.getsockname()[0] for s in socks} <= {"127.0.0.1", "::1"}
    finally:
        for s in socks:
            s.close()


# ---- ditkv generate --image: at most the limit is read, whatever the file ---------------------------------
def test_image_from_a_pipe_is_read_only_up_to_the_limit(tmp_path, capsys):
    from ditkv.engine.request_check import MAX_INPUT_IMAGE_BYTES as LIMIT

    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)
    written = [0]

    def writer():  # an endless source, as /dev/zero or a pipe into /dev/stdin would be (4x the limit here)
        with open(fifo, "wb", buffering=0) as f:
            try:
                while written[0] < 4 * LIMIT:
                    written[0] += f.write(b"\0" * (1 << 16))
            except BrokenPipeError:  # the reader closed its end: it took no more
                pass

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    rc, err = _run_in_process(_argv(Case("", GEN + ["--image", str(fifo)], ""), tmp_path), capsys)
    t.join(30)
    assert rc not in (0, None) and not t.is_alive()
    line = _error_line(err)
    assert f"--image={fifo}: larger than the limit of {LIMIT} bytes per image" in line, err
    assert written[0] <= LIMIT + 1 + (2 << 20), written[0]  # what was read, plus at most the pipe's buffer
