import json
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from ditkv.entrypoints.cli import main


def _gen(tmp_path, mode, extra=()):
    out = tmp_path / f"{mode}.png"
    rc = main(["generate", "--prompt", "a large blue square", "--height", "64", "--width", "64", "--steps", "3",
               "--guidance", "3", "--seed", "2", "--out", str(out), "--mode", mode, "--no-progress", *extra])
    assert rc == 0
    return out


def test_generate_both_modes_write_matching_pngs(tmp_path, capsys):
    a = _gen(tmp_path, "paged_scheduler")
    b = _gen(tmp_path, "dense_legacy")
    ia, ib = Image.open(a), Image.open(b)
    assert ia.mode == "RGB" and ia.size == (64, 64)
    diff = np.abs(np.asarray(ia, dtype=int) - np.asarray(ib, dtype=int)).max()
    assert diff <= 1
    out = capsys.readouterr().out
    assert "blocks=" in out and "prefix tokens reused=" in out


@pytest.mark.parametrize("argv, flag", [  # request fields are named as the server names them
    (["--height", "0"], "height"),
    (["--width", "30"], "width"),
    (["--steps", "0"], "steps"),
    (["--mode", "paged"], "diffusion_kv_mode"),
    (["--block-size", "20"], "block_size"),
    (["--out", "x.jpg"], "--out"),
])
def test_invalid_values_exit_nonzero_naming_the_flag(argv, flag, capsys, tmp_path):
    args = ["generate", "--prompt", "a red circle", "--steps", "2", "--no-progress"]
    if "--out" not in argv:
        args += ["--out", str(tmp_path / "x.png")]
    try:
        rc = main(args + argv)
    except SystemExit as e:
        rc = e.code
    assert rc != 0
    err = capsys.readouterr().err + (rc if isinstance(rc, str) else "")
    assert flag in err


def test_bench_scheduler_json_subprocess():
    res = subprocess.run([sys.executable, "-m", "ditkv.entrypoints.cli", "bench", "scheduler", "--json",
                          "--requests", "200", "--repeats", "1"], capture_output=True, text=True, check=True)
    data = json.loads(res.stdout)
    assert data["admit_us_per_request"] > 0 and "admit_us_per_request_1024" in data
