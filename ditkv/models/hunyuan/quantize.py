"""Which HunyuanImage-3.0 layers run FP8 W8A8 (`quantization: fp8`), and turning them FP8.

Quantized: every linear of the decoder layers, the FLOPs of a step:
    model.layers.{i}.self_attn.qkv_proj, .self_attn.o_proj,
    model.layers.{i}.mlp.shared_mlp.gate_and_up_proj / .down_proj,
    model.layers.{i}.mlp.experts.{e}.gate_and_up_proj / .down_proj.
A quantized module keeps its names: `weight` becomes e4m3 and `weight_scale` (fp32, one per output
channel) joins it, which is the layout llm-compressor and ModelOpt export, so the state dict of a
quantized model is a pre-quantized checkpoint. Everything else stays in the model dtype, for the
reasons in `KEPT`. `ignored` keeps more layers unquantized: fnmatch patterns over module names.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable

import torch
from torch import nn

from ditkv.errors import ConfigError

from .. import fp8

QUANTIZED = re.compile(r"model\.layers\.\d+\.(self_attn\.(qkv_proj|o_proj)"
                       r"|mlp\.(shared_mlp|experts\.\d+)\.(gate_and_up_proj|down_proj))$")
KEPT = {
    "model.wte, lm_head": "embedding lookups and the text head: no GEMM on the denoising path (lm_head is the "
                          "AR stage's one projection per token, and its logits decide sampling)",
    "*.input_layernorm, *.post_attention_layernorm, *.query_layernorm, *.key_layernorm, model.ln_f":
        "norms: elementwise, statistics in fp32",
    "*.mlp.gate.wg": "the router: fp32 as released, since a flipped top-k choice changes which expert runs",
    "timestep_emb, time_embed, time_embed_2, guidance_emb, patch_embed, final_layer":
        "the image path's small embedders and ResBlocks: well under 1% of a step's FLOPs, and the latent's "
        "first and last layers",
    "vae, vision_model, vision_aligner": "run once per request (decode, encode, input images), not per step",
}


def target_names(model: nn.Module) -> list[str]:
    """Module names the release layout quantizes (whatever `ignored` says)."""
    return [n for n, _ in model.named_modules() if QUANTIZED.search(n)]


def check_ignored(patterns: Iterable[str]) -> tuple[str, ...]:
    """The ignore list as a tuple of non-empty strings (ConfigError otherwise)."""
    if isinstance(patterns, str) or not all(isinstance(p, str) and p.strip() for p in patterns):
        raise ConfigError("quantization_ignored_layers", patterns,
                          "must be a list of module-name patterns, e.g. ['model.layers.0.*', '*.shared_mlp.*']")
    return tuple(p.strip() for p in patterns)


def ignored_by(name: str, patterns: Iterable[str]) -> bool:
    """Whether module `name` matches one of the fnmatch patterns (a module or any of its parents)."""
    parts = name.split(".")
    prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(fnmatch.fnmatchcase(p, pat) for pat in patterns for p in prefixes)


def quantize_linear_(mod: nn.Module) -> None:
    """Turn `mod.weight` e4m3 in place and register its per-row `weight_scale` (works on meta too:
    then it only builds the quantized structure, e.g. before a pre-quantized checkpoint loads)."""
    w = mod._parameters["weight"]
    if fp8.is_fp8(w):
        return
    if w.is_meta:  # the structure alone: torch's meta kernels would take ~5 ms a linear (~20 s at release size)
        q = torch.empty(w.shape, dtype=fp8.FP8, device="meta")
        s = torch.empty(w.shape[:-1], dtype=torch.float32, device="meta")
    else:
        q, s = fp8.quantize_weight(w.detach())
    mod._parameters["weight"] = nn.Parameter(q, requires_grad=False)
    mod._parameters["weight_scale"] = nn.Parameter(s, requires_grad=False)


def quantize_model(model: nn.Module, ignored: Iterable[str] = (), names: Iterable[str] | None = None) -> int:
    """Quantize the targets of `model` (or only `names` among them) in place, skipping `ignored`;
    returns how many modules were quantized. Each weight is quantized on its own device, one at a
    time, so the bf16 and e4m3 copies of only one linear coexist."""
    ignored = check_ignored(ignored)
    wanted = set(target_names(model) if names is None else names)
    n = 0
    for name, mod in model.named_modules():
        if name in wanted and not ignored_by(name, ignored):
            quantize_linear_(mod)
            n += 1
    if n:
        model._ditkv_quantization = "fp8"
    from .layers import RoutedExperts

    for m in model.modules():  # old stacks point at the bf16 weights: drop them, restack on use
        if isinstance(m, RoutedExperts):
            m.expert_stack.clear()
    return n


def quantization_of(model: nn.Module) -> str | None:
    """"fp8" when any linear of `model` holds e4m3 weights, else None."""
    if getattr(model, "_ditkv_quantization", None):
        return model._ditkv_quantization
    return "fp8" if any(fp8.is_fp8(p) for p in model.parameters()) else None


def fp8_bytes(model: nn.Module) -> dict[str, int]:
    """Parameter bytes by kind: e4m3 weights, their scales, everything else."""
    out = {"fp8_weights": 0, "scales": 0, "other": 0}
    for name, p in model.named_parameters():
        kind = "fp8_weights" if fp8.is_fp8(p) else "scales" if name.endswith(".weight_scale") else "other"
        out[kind] += p.numel() * p.element_size()
    return out


def apply_quantization(model: nn.Module, method: str | None, ignored: Iterable[str] = ()) -> nn.Module:
    """The engine's entry: quantize `model` as `method` asks, in place (None: leave it as loaded).
    A model already FP8 (loaded so, or pre-quantized) is left as it is."""
    if method is None:
        return model
    if method not in fp8.METHODS:
        raise ConfigError("quantization", method, f"choose one of {', '.join(fp8.METHODS)}, or leave it unset")
    if quantization_of(model) is None:
        with torch.no_grad():
            quantize_model(model, ignored)
    return model


def move_model(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """`model.to(device, dtype)` that keeps e4m3 weights and their fp32 scales as they are (a plain
    `.to(dtype)` would cast them, since torch counts e4m3 as floating point)."""
    model.to(device=device)
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is None or not p.is_floating_point() or fp8.is_fp8(p) or name == "weight_scale":
                continue
            if p.dtype != dtype:
                mod._parameters[name] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
        for name, b in mod._buffers.items():
            if b is not None and b.is_floating_point() and b.dtype != dtype:
                mod._buffers[name] = b.to(dtype)
    return model
