"""`ditkv quantize`: write a pre-quantized FP8 (W8A8 e4m3) copy of a checkpoint folder, one
safetensors file at a time.

    ditkv quantize --model tiny --out /tmp/tiny-fp8 [--ignored-layers 'model.layers.0.*' ...] [--device cuda]

Each file is read tensor by tensor; the decoder layers' linears (quantize.QUANTIZED, less
--ignored-layers) are quantized per output channel from their stored values (fp32 math, the step
`load_checkpoint(quantization="fp8")` runs: fp8_checkpoint.prepare) and written to OUT under the
same file name; every other tensor (vae.*, vision_*, norms, router, embeddings) is written as it is.
The index gains the `weight_scale` keys and the new total_size, config.json a `quantization_config`,
and every other file of the folder is copied. Only one file's tensors are in memory at a time.
`--model OUT` loads the same bits that `--model IN --quantization fp8` quantizes while loading on
the same device type: CUDA rounds the scale's division by 448 differently from the CPU in the last
bit today (measured on an H200: elements of every scale tensor; fp8.quantize_rows_ref divides by a scalar,
which CUDA turns into a multiply by its rounded reciprocal), so quantize with `--device cuda` for a
model served on CUDA. OUT is written under a temporary name and renamed at the end: a failed run
leaves nothing behind.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path
from typing import Self

from ..argtypes import cannot_write_in, nearest_folder
from ..errors import ConfigError

QUANTIZED_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": None}


def add_parser(sub) -> None:
    p = sub.add_parser("quantize", help="write an FP8 (W8A8 e4m3) copy of a checkpoint, shard by shard",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="'tiny', 'tiny-edit' (bundled) or a checkpoint folder")
    p.add_argument("--out", required=True, help="folder to write (must not exist, or be empty)")
    p.add_argument("--ignored-layers", nargs="+", default=[], metavar="PATTERN",
                   help="module-name patterns (fnmatch) kept unquantized, e.g. 'model.layers.0.*'")
    p.add_argument("--device", default="cpu", help="where to quantize: cpu, cuda or cuda:N. For the bits "
                   "`--quantization fp8` gives while loading, quantize on the device type you serve on (CUDA "
                   "and the CPU round the scales differently in the last bit today)")
    p.set_defaults(func=run)


def run(a) -> None:
    from ..models.loader import resolve_device

    quantize_folder(a.model, a.out, tuple(a.ignored_layers), resolve_device(a.device))


class PeakMemory:
    """Peak memory over a `with` block, in bytes. CUDA: the allocator's peak. CPU: the process's
    peak resident set (VmHWM, reset at the start through /proc/self/clear_refs; where that is not
    possible, ru_maxrss, the peak since the process started). `added`: the peak over the start."""

    def __init__(self, device="cpu") -> None:
        import torch

        self.device = torch.device(device)
        self.kind = "allocated" if self.device.type == "cuda" else "RSS"
        self.peak = self.start = 0

    def __enter__(self) -> Self:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
        else:
            self.start = _proc_status("VmRSS") or 0
            _reset_peak_rss()
        return self

    def __exit__(self, *exc) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self.peak = _proc_status("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    @property
    def added(self) -> int:
        return max(0, self.peak - self.start)


def _proc_status(field: str) -> int | None:
    """A `/proc/self/status` memory line in bytes (Linux), else None."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak_rss() -> None:
    try:  # "5" resets the peak resident set (VmHWM) to the current one
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def quantize_folder(model: str, out: str | Path, ignored: tuple = (), device="cpu", log=print) -> dict:
    """Write the FP8 copy of checkpoint `model` (bundled name or folder) to `out`; returns a summary
    (per-shard peaks in bytes, bytes in / out). ConfigError for a bad input or output folder."""
    from ..models.hunyuan import fp8_checkpoint as f8
    from ..models.loader import bundled_or_path

    src, out = _source(model), Path(out)
    _check_out(out, src)
    files, modules = _targets(src, model, tuple(ignored), log)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would stay on OUT after the rename
    try:
        t0, shards, weight_map = time.monotonic(), [], {}
        plan = f8.Fp8Plan(online=frozenset(modules))
        for i, name in enumerate(sorted(files), 1):
            shard = _convert_file(src / name, tmp / name, plan, device)
            weight_map.update(dict.fromkeys(shard["keys"], name))
            shards.append({k: v for k, v in shard.items() if k != "keys"} | {"file": name})
            log(f"shard {i}/{len(files)} {name}: {shard['quantized']} tensors quantized, peak {shard['kind']} "
                f"{size(shard['peak'])} (+{size(shard['added'])} over the shard's start)")
        bytes_out = sum(s["bytes_out"] for s in shards)
        _write_index(src, tmp, weight_map, bytes_out)
        _write_config(src, tmp, ignored)
        _copy_rest(src, tmp, set(files))
        if out.exists():
            out.rmdir()  # checked empty
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    summary = {"out": str(out), "shards": shards, "quantized": sum(s["quantized"] for s in shards),
               "bytes_in": sum(s["bytes_in"] for s in shards), "bytes_out": bytes_out,
               "seconds": time.monotonic() - t0, "source": str(bundled_or_path(model))}
    log(f"wrote {out}: {summary['quantized']} linears quantized in {len(shards)} shard(s) in "
        f"{summary['seconds']:.1f}s; tensor bytes in {summary['bytes_in']} ({size(summary['bytes_in'])}), out "
        f"{bytes_out} ({size(bytes_out)})")
    return summary


def _source(model: str) -> Path:
    from ..models.loader import MODEL_FIX, bundled_or_path

    folder = bundled_or_path(model)
    if not (folder / "config.json").is_file():
        why = "no such folder" if not folder.is_dir() else "the folder has no config.json"
        raise ConfigError("model", model, f"{why}; {MODEL_FIX}")
    return folder


def _check_out(out: Path, src: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError("out", str(out), "exists and is not an empty folder: pick another folder, or delete it "
                                           "first")
    if out.resolve().is_relative_to(src.resolve()):
        raise ConfigError("out", str(out), f"is inside the input folder {src}: write the copy elsewhere")
    # the copy is written next to OUT and renamed: probe that folder before any shard is read
    folder = nearest_folder(out)
    why = f"{folder} is not a folder" if not folder.is_dir() else cannot_write_in(folder)
    if why is not None:
        raise ConfigError("out", str(out), f"{why}; pick a folder you can write to")


def _targets(src: Path, model: str, ignored: tuple, log) -> tuple[dict[str, list[str]], set[str]]:
    """(file -> keys, the module names to quantize), the input checked as `load_checkpoint` checks
    it (config, keys, shapes) and refused when it is pre-quantized already."""
    import torch

    from ..models.hunyuan import fp8_checkpoint as f8
    from ..models.hunyuan.checkpoint import (
        _check_keys_and_shapes,
        _weight_files,
        load_model_config,
    )
    from ..models.hunyuan.model import HunyuanImage3Model
    from ..models.hunyuan.quantize import check_ignored, ignored_by, target_names
    from ..models.hunyuan.release_keys import QUANT_KEY

    ignored = check_ignored(ignored)
    cfg = load_model_config(src)
    files = _weight_files(src)
    if QUANT_KEY in cfg.extra or f8.is_prequantized(f8.read_headers(src, files)):
        raise ConfigError("model", model, "is pre-quantized already (e4m3 weights / a quantization_config): load "
                                          "it as it is, or quantize the unquantized checkpoint")
    with torch.device("meta"):
        meta = HunyuanImage3Model(cfg)
    _check_keys_and_shapes(meta, src, files)
    targets = target_names(meta)
    for pat in ignored:
        if not any(ignored_by(m, (pat,)) for m in targets):
            log(f"note: --ignored-layers {pat!r} matches none of the {len(targets)} quantized linears")
    return files, {m for m in targets if not ignored_by(m, ignored)}


def _convert_file(src: Path, dst: Path, plan, device) -> dict:
    """One safetensors file: read tensor by tensor, quantize the plan's weights, write it."""
    from safetensors.torch import save_file

    from ..models.hunyuan import fp8_checkpoint as f8
    from ..models.hunyuan.checkpoint import open_safetensors

    with PeakMemory(device) as peak:
        state, n, bytes_in = {}, 0, 0
        with open_safetensors(src, device=str(device)) as f:
            for key in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                t = f.get_tensor(key)
                bytes_in += t.numel() * t.element_size()
                entries = f8.prepare(key, t, plan, None)
                n += len(entries) - 1  # a quantized weight comes with its scale
                state.update({k: v.cpu().contiguous() for k, v in entries.items()})
                del t, entries
        save_file(state, str(dst), metadata={"format": "pt"})
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(dst, 0o666 & ~umask)  # safetensors writes 0600; the copy reads like its input
        bytes_out = sum(v.numel() * v.element_size() for v in state.values())
        keys = list(state)
        del state
    return {"keys": keys, "quantized": n, "bytes_in": bytes_in, "bytes_out": bytes_out, "peak": peak.peak,
            "added": peak.added, "kind": peak.kind}


def _write_index(src: Path, tmp: Path, weight_map: dict[str, str], total: int) -> None:
    from ..models.hunyuan.checkpoint import INDEX_NAME
    from ..models.hunyuan.files import read_json

    if not (src / INDEX_NAME).exists():  # a single model.safetensors: no index, as in the input
        return
    index = read_json(src / INDEX_NAME, "re-save the checkpoint")
    meta = dict(index.get("metadata") or {}) | {"total_size": total}
    with open(tmp / INDEX_NAME, "w", encoding="utf-8") as fh:
        json.dump({"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}, fh, indent=2)
        fh.write("\n")


def _write_config(src: Path, tmp: Path, ignored: tuple) -> None:
    """The input's config.json as written (its own spelling and order), plus `quantization_config`."""
    from ..models.hunyuan.checkpoint import CONFIG_NAME
    from ..models.hunyuan.files import read_json
    from ..models.hunyuan.release_keys import QUANT_KEY

    raw = read_json(src / CONFIG_NAME, "fix it or re-save the checkpoint")
    raw[QUANT_KEY] = {**QUANTIZED_CONFIG, "ignored_layers": list(ignored)}
    with open(tmp / CONFIG_NAME, "w", encoding="utf-8") as fh:
        json.dump(raw, fh, indent=2)
        fh.write("\n")


def _copy_rest(src: Path, tmp: Path, shard_files: set[str]) -> None:
    """Every other file of the input (tokenizer, generation config, ...) copied as it is."""
    from ..models.hunyuan.checkpoint import CONFIG_NAME, INDEX_NAME

    for p in src.iterdir():
        if p.name in shard_files or p.name in (CONFIG_NAME, INDEX_NAME):
            continue
        if p.is_dir():
            shutil.copytree(p, tmp / p.name)
        else:
            shutil.copy2(p, tmp / p.name)


# ---- what a run's closing / startup line says about its weights ----------------------------------
def checkpoint_quantization(model: str) -> str | None:
    """'fp8' when checkpoint `model` (a bundled name or a folder) is stored pre-quantized, as the
    loader tells: a quantization_config in config.json, or e4m3 weights / weight scales without
    one. Headers only, no tensor data. None for an unquantized folder and the generated tiny preset."""
    from ..models.hunyuan import fp8_checkpoint as f8
    from ..models.hunyuan.checkpoint import CONFIG_NAME, _weight_files
    from ..models.hunyuan.files import read_json
    from ..models.hunyuan.release_keys import QUANT_KEY
    from ..models.loader import checkpoint_folder

    folder = checkpoint_folder(model)
    if folder is None:
        return None
    if QUANT_KEY in read_json(folder / CONFIG_NAME, "fix it or re-save the checkpoint"):
        return "fp8"  # the only scheme ditkv loads; read_quantization_config refuses the rest
    return "fp8" if f8.is_prequantized(f8.read_headers(folder, _weight_files(folder))) else None


def fp8_label(cfg) -> str | None:
    """FP8, named whichever way it came for engine fields `cfg` (EngineConfig or a stage's): a
    pre-quantized folder (loaded as stored whatever `quantization` says) or `quantization: fp8`."""
    if checkpoint_quantization(cfg.model):
        return "fp8 (pre-quantized checkpoint)"
    if cfg.quantization:
        return f"{cfg.quantization} (quantized while loading)"
    return None


def weights_label(cfg) -> str:
    """How the decoder weights of a run with engine fields `cfg` are held: FP8 (`fp8_label`), else
    the dtype the model runs in."""
    fp8 = fp8_label(cfg)
    if fp8 is not None:
        return fp8
    if cfg.dtype != "auto":
        return cfg.dtype
    from ..models.loader import resolve_device, resolve_dtype

    return str(resolve_dtype(cfg.dtype, resolve_device(cfg.device))).removeprefix("torch.")


def graph_weights_label(graph) -> str:
    """`weights_label` of a stage graph's DiT, and of its AR stage where that differs (a remote AR
    stage's device is another machine's: only its quantization is told)."""
    dit, ar = weights_label(graph.dit.engine), graph.ar.engine
    ar = weights_label(ar) if graph.ar.remote is None else fp8_label(ar) or f"dtype {ar.dtype} on its server"
    return dit if ar == dit else f"DiT {dit}, AR {ar}"
