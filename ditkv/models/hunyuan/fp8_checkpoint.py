"""FP8 checkpoints: which linears of a folder load as FP8 W8A8, checked from the tensor headers before
any weight is read, and the per-tensor step the loaders (and `ditkv quantize`) apply while streaming.

On disk a quantized linear <m> keeps its names (the llm-compressor / ModelOpt layout):
    <m>.weight        float8_e4m3fn [out, in]    (qkv_proj: the release grouped row order)
    <m>.weight_scale  float32 [out]              (one per output row, in the weight's row order)
Also loaded: a [out, 1] scale (llm-compressor), a per-tensor [] / [1] scale (ModelOpt's default
weights), broadcast exactly to [out]; bf16 / fp16 scales, widened to fp32 exactly.

Two ways a model loads FP8 (`plan_fp8`):
- online (`quantization="fp8"` on an unquantized folder): each target weight is quantized from its
  STORED tensor as it is read (fp32 math, `fp8.quantize_weight`), before any dtype cast, so the
  model never exists in bf16; the bits equal `quantize_model` run on the model loaded in its stored
  dtype (per-row quantization commutes with qkv's grouped -> split row permutation);
- pre-quantized (e4m3 weights on disk, whatever `quantization` says): loaded as stored.

Refused, each by the tensor's name with the fix: static activation scales (`input_scale`), block
scales, zero points, FP8 KV-cache scales, weight dtypes ditkv cannot run (float8_e5m2, integers),
e4m3 tensors in a module ditkv does not quantize (or that `ignored` / the config's ignore list keeps),
a weight without its scale or a scale without its e4m3 weight, a scale of any other shape.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ditkv.errors import ConfigError

from .. import fp8
from .safetensors_io import _FP32_SUFFIXES, open_safetensors
from .quantize import check_ignored, ignored_by, quantize_linear_, target_names
from .release_keys import QUANT_KEY, read_quantization_config

SCALE = ".weight_scale"
WEIGHT = ".weight"
E4M3 = "F8_E4M3"  # safetensors' dtype names (headers)
FLOAT_SCALES = ("F32", "BF16", "F16")
_RUNNABLE = ("F32", "BF16", "F16", "F64")  # floating weights ditkv loads (and, for targets, can quantize)
_REEXPORT = "re-export it with per-channel e4m3 scales and dynamic activations (`ditkv quantize`)"
# tensors of other quantization schemes, refused by their suffix: what they are, the fix
REFUSED_SUFFIXES = {
    ".input_scale": "a static activation scale: ditkv quantizes activations dynamically, one scale per token; "
                    "re-export with dynamic activation scales (llm-compressor FP8_DYNAMIC, ModelOpt "
                    "FP8_PER_CHANNEL_PER_TOKEN, `ditkv quantize`) or drop the key",
    ".weight_scale_inv": "block-wise (128x128) scales: torch's sm90 grouped FP8 GEMM (the MoE experts) takes "
                         f"rowwise scales only; {_REEXPORT}",
    ".weight_zero_point": f"an asymmetric weight zero point: ditkv's FP8 is symmetric; {_REEXPORT}",
    ".input_zero_point": f"an asymmetric activation zero point: ditkv's FP8 is symmetric; {_REEXPORT}",
    ".k_scale": "an FP8 KV-cache scale: ditkv's KV cache stays in the model dtype; drop the key",
    ".v_scale": "an FP8 KV-cache scale: ditkv's KV cache stays in the model dtype; drop the key",
    ".output_scale": "an FP8 KV-cache / output scale: ditkv does not quantize outputs; drop the key",
}


@dataclass(frozen=True)
class Header:
    """One stored tensor, from its safetensors header: dtype name ("BF16", "F8_E4M3", ...) and shape."""
    dtype: str
    shape: tuple[int, ...]


@dataclass
class Fp8Plan:
    """Which linears load as FP8: `online` modules are quantized from their stored weights while
    loading; `stored` ones are e4m3 on disk (module -> its weight's rows, for the scale broadcast)."""
    online: frozenset[str] = frozenset()
    stored: dict[str, int] = field(default_factory=dict)

    @property
    def modules(self) -> set[str]:
        return set(self.online) | set(self.stored)

    def stored_scale_keys(self) -> set[str]:
        """The checkpoint's `weight_scale` keys (checked here, not by the plain key check)."""
        return {m + SCALE for m in self.stored}


def module_of(key: str, suffix: str = WEIGHT) -> str | None:
    return key[:-len(suffix)] if key.endswith(suffix) else None


def read_headers(folder: Path, files: dict[str, list[str]]) -> dict[str, Header]:
    """Dtype and shape of every indexed tensor that its file holds (headers only, no data)."""
    out = {}
    for name, keys in files.items():
        with open_safetensors(folder / name) as f:
            present = set(f.keys())
            for key in keys:
                if key in present:
                    sl = f.get_slice(key)
                    out[key] = Header(sl.get_dtype(), tuple(sl.get_shape()))
    return out


def is_prequantized(headers: dict[str, Header]) -> bool:
    return any(h.dtype == E4M3 or k.endswith(SCALE) for k, h in headers.items())


def plan_fp8(model, headers: dict[str, Header], quantization: str | None, ignored=()) -> Fp8Plan:
    """The FP8 plan of a checkpoint for `model` (built on meta, not yet quantized), every stored
    tensor checked first. Pre-quantized folders load as stored; otherwise `quantization="fp8"`
    quantizes the targets (`quantize.QUANTIZED`, `ignored` excepted) while loading."""
    if quantization is not None and quantization not in fp8.METHODS:
        raise ConfigError("quantization", quantization,
                          f"choose one of {', '.join(fp8.METHODS)}, or leave it unset")
    ignored = check_ignored(ignored)
    declared = read_quantization_config(model.config.extra.get(QUANT_KEY))
    targets = set(target_names(model))
    _refuse_other_schemes(headers)
    stored = _stored_fp8(headers, targets, ignored, declared.ignored if declared else ())
    if declared is not None:
        _check_declared(stored, targets, headers, declared.ignored)
    if stored:
        return Fp8Plan(stored=stored)
    if quantization is None:
        return Fp8Plan()
    return Fp8Plan(online=frozenset(m for m in targets if not ignored_by(m, ignored)))


def apply_plan(model, plan: Fp8Plan) -> None:
    """Give the meta model the FP8 structure of `plan`, the one `quantize.quantize_model` builds (e4m3
    `weight`, fp32 `weight_scale` [out]), so `load_state_dict(assign=True)` and the sharded loader
    fill it as they fill any parameter (`quantize_linear_` on a meta weight builds the structure only)."""
    for name in sorted(plan.modules):
        quantize_linear_(model.get_submodule(name))
    if plan.modules:
        model._ditkv_quantization = "fp8"  # what quantize_model marks


# ------------------------------------------------------------------------- header checks
def _refuse_other_schemes(headers: dict[str, Header]) -> None:
    for key, h in headers.items():
        suffix = next((s for s in REFUSED_SUFFIXES if key.endswith(s)), None)
        if suffix is not None:
            raise ConfigError("checkpoint", key, f"{REFUSED_SUFFIXES[suffix]}")
        if key.endswith(WEIGHT) and h.dtype not in _RUNNABLE + (E4M3,):
            raise ConfigError("checkpoint", key, f"weight dtype {h.dtype} is not one ditkv runs: FP8 checkpoints "
                              "store float8_e4m3fn (F8_E4M3) weights with a per-channel weight_scale (e5m2 and "
                              f"integer weights are other schemes); {_REEXPORT}, or store it in bf16")


def _stored_fp8(headers: dict[str, Header], targets: set[str], ignored: tuple, declared: tuple) -> dict[str, int]:
    """module -> out rows, for every e4m3 weight on disk, each checked with its scale."""
    stored = {}
    for key, h in headers.items():
        if key.endswith(SCALE):
            mod = module_of(key, SCALE)
            if mod + WEIGHT not in headers or headers[mod + WEIGHT].dtype != E4M3:
                got = headers.get(mod + WEIGHT)
                raise ConfigError("checkpoint", key, f"a weight_scale without an e4m3 weight ({mod}.weight is "
                                  f"{got.dtype if got else 'missing'}): store the e4m3 weight beside it, or drop "
                                  "the scale to load the weight unquantized")
        if h.dtype != E4M3:
            continue
        mod = module_of(key)
        _check_module(key, mod, targets, ignored, declared)
        scale = headers.get(mod + SCALE) if mod is not None else None
        if scale is None:
            raise ConfigError("checkpoint", key, f"an e4m3 weight without {mod}.weight_scale: ditkv needs its "
                              f"scale (fp32, one per output channel) to run it; {_REEXPORT}")
        check_scale(mod + SCALE, scale, h.shape)
        stored[mod] = h.shape[0]
    return stored


def _check_module(key: str, mod: str | None, targets: set[str], ignored: tuple, declared: tuple) -> None:
    if mod is None or mod not in targets:
        raise ConfigError("checkpoint", key, "an e4m3 tensor in a module ditkv does not quantize (it runs FP8 "
                          "only in the decoder layers' attention and MLP/expert linears, quantize.QUANTIZED): "
                          "store it in the model dtype (re-export with the module ignored)")
    if ignored_by(mod, ignored):
        raise ConfigError("checkpoint", key, f"stored in e4m3, but quantization_ignored_layers {list(ignored)} "
                          "keeps this module unquantized: drop the pattern, or load an unquantized checkpoint")
    if matches(mod, declared):
        raise ConfigError("checkpoint", key, f"stored in e4m3, but config.json's {QUANT_KEY} lists the module "
                          "among its ignored layers: the weights and the config disagree; re-export the checkpoint")


def check_scale(key: str, h: Header, weight_shape: tuple[int, ...]) -> str:
    """"channel" or "tensor" for a scale ditkv loads; a ConfigError naming `key` otherwise."""
    out, cols = weight_shape[0], weight_shape[-1]
    if h.dtype not in FLOAT_SCALES:
        raise ConfigError("checkpoint", key, f"scale dtype {h.dtype}: weight scales are floating point "
                          "(fp32, or bf16/fp16 widened exactly); re-export it")
    if h.shape in ((out,), (out, 1)):
        return "channel"
    if h.shape in ((), (1,)):
        return "tensor"
    if len(h.shape) == 2 and h.shape == (math.ceil(out / 128), math.ceil(cols / 128)):
        raise ConfigError("checkpoint", key, f"shape {list(h.shape)} is a 128x128 block scale of the "
                          f"{list(weight_shape)} weight: torch's sm90 grouped FP8 GEMM (the MoE experts) takes "
                          f"rowwise scales only; {_REEXPORT}")
    raise ConfigError("checkpoint", key, f"shape {list(h.shape)} does not fit the {list(weight_shape)} weight: "
                      f"ditkv loads per-channel [{out}] / [{out}, 1] or per-tensor [] / [1] scales; {_REEXPORT}")


def _check_declared(stored: dict[str, int], targets: set[str], headers: dict[str, Header], declared: tuple) -> None:
    """config.json's quantization_config against the tensors: it must describe FP8 weights that are
    there, and every target it does not ignore must be one of them."""
    if not stored:
        raise ConfigError("checkpoint", QUANT_KEY, f"config.json has a {QUANT_KEY} but no weight is stored in "
                          "e4m3: remove the key to load the unquantized weights (quantization=fp8 quantizes "
                          "them while loading), or copy the quantized shards in")
    for mod in sorted(targets - set(stored)):
        if mod + WEIGHT in headers and not matches(mod, declared):
            raise ConfigError("checkpoint", mod + WEIGHT, f"stored in {headers[mod + WEIGHT].dtype}, but "
                              f"config.json's {QUANT_KEY} does not list it among its ignored layers: the folder "
                              "mixes two exports; re-export the checkpoint")


def matches(name: str, patterns: tuple[str, ...]) -> bool:
    """A module against an exporter's ignore list: fnmatch patterns (ditkv, vLLM, ModelOpt) or
    compressed-tensors' "re:<regex>" entries (matched from the start of the name, as it does)."""
    fn = tuple(p for p in patterns if not p.startswith("re:"))
    return ignored_by(name, fn) or any(re.match(p[3:], name) for p in patterns if p.startswith("re:"))


# ------------------------------------------------------------------------- per-tensor step
def normalise_scale(key: str, s: torch.Tensor, rows: int) -> torch.Tensor:
    """A stored scale as the model holds it: fp32 [rows], a per-tensor scale broadcast exactly."""
    s = s.float()
    s = s.reshape(()).expand(rows) if s.numel() == 1 and s.dim() <= 1 else s.reshape(rows)
    if not bool(torch.isfinite(s).all()) or bool((s <= 0).any()):
        raise ConfigError("checkpoint", key, "weight scales must be finite and > 0; re-export the checkpoint")
    return s.contiguous()


def cast(key: str, t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`t` in `dtype` where the loaders cast: floating tensors, but never e4m3 weights, their fp32
    scales or the fp32 router (torch counts e4m3 as floating point)."""
    if dtype is None or not t.is_floating_point() or fp8.is_fp8(t) or key.endswith((SCALE, *_FP32_SUFFIXES)):
        return t
    return t.to(dtype)


def prepare(key: str, t: torch.Tensor, plan: Fp8Plan, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The state-dict entries one stored tensor becomes: an online target's weight quantized from
    its stored values (before any cast) into the e4m3 weight and its scale; a stored scale
    normalised; anything else cast as the loaders cast."""
    mod = module_of(key)
    if mod in plan.online:
        q, s = fp8.quantize_weight(t)
        return {key: q, mod + SCALE: s}
    smod = module_of(key, SCALE)
    if smod in plan.stored:
        return {key: normalise_scale(key, t, plan.stored[smod])}
    return {key: cast(key, t, dtype)}


def scale_rows(s: torch.Tensor, reads: list) -> torch.Tensor:
    """A TP rank's rows of a whole normalised scale [out]: the row ranges its weight reads (a
    column-split weight reads all rows, so its scale comes whole)."""
    parts = [s if rows is None else s[rows] for rows, _ in reads]
    return parts[0] if len(parts) == 1 else torch.cat(parts)
