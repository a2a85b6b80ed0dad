"""The engine's command-line flags: one `--field-name` per `EngineConfig` field, and the merge
defaults < command defaults < YAML file < flags."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields

from ..config import (ATTENTION_BACKENDS, DTYPES, FP8_GROUPED_GEMMS, KV_MODES, QUANTIZATIONS, EngineConfig,
                      engine_section, load_yaml)


def _parse_bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")


def _parse_json_mapping(s: str) -> dict:
    import json

    if s.strip().lower() == "none":
        return {"type": "none"}
    try:
        v = json.loads(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, e.g. '{{\"type\": \"fbcache\"}}' ({e})") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(v).__name__}")
    return v


def _parse_opt_int(s: str):
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None


# Each engine flag's help. The default is appended from EngineConfig (`_help`), so it stays true
# when a default changes there; a text that speaks of its default itself is left as it is.
ENGINE_HELP = {
    "model": "'tiny', 'tiny-edit' (bundled models, by name) or a checkpoint folder (config.json + safetensors)",
    "device": "auto (cuda if available, else cpu), cpu, cuda or cuda:N",
    "dtype": f"weights and activations: {', '.join(DTYPES)} (auto: bfloat16 on CUDA, float32 on CPU)",
    "diffusion_kv_mode": f"the DiT's KV cache, one of {', '.join(KV_MODES)} (paged_scheduler: a paged pool "
                         "and step-level batching; dense_legacy: one dense cache per request)",
    "diffusion_kv_max_rows_per_request": "KV rows one request may hold in the paged pool: 2 = CFG (cond + uncond), "
                                         "a one-row request fits too",
    "block_size": "tokens per KV page, a multiple of 16",
    "kv_cache_memory_bytes": "KV pool bytes per rank (default: unset or 0, sized from --gpu-memory-utilization)",
    "num_kv_blocks": "KV pool size in blocks per rank, instead of a byte budget (default: unset, sized in bytes)",
    "gpu_memory_utilization": "share of the GPU's memory the engine may take (weights + KV pool), in (0, 1]",
    "max_model_len": "longest row (prompt + image tokens) a request may have, in both modes: longer requests are "
                     "refused at admission. -1 = no limit beyond the KV pool (paged) / the profiled envelope (dense)",
    "enable_prefix_caching": "[true/false] (bare flag: true; default: unset, on in paged mode) keep full prefix "
                             "pages after a request and reuse them for later requests with the same prefix "
                             "(docs/prefix-cache.md); false: no cache",
    "encoder_cache_images": "with the prefix cache on: input images whose embeddings the DiT keeps across "
                            "requests (the last used), so a hit ending inside an image does not encode it "
                            "again; ~40 MiB per release image in bf16, reserved at startup; default 4, 0 = off "
                            "(docs/prefix-cache.md)",
    "max_num_seqs": "requests batched into one denoising step (paged mode; 1 = one at a time)",
    "max_num_batched_tokens": "query tokens of one batched denoising step (paged mode; default: unset, no bound "
                              "beyond --max-num-seqs)",
    "max_steps": "largest denoising step count a request may ask for",
    "torch_threads": "torch intra-op threads of every engine process (one fixed number: CPU sums round by it)",
    "attention_backend": f"attention kernels, one of {', '.join(ATTENTION_BACKENDS)} (auto: the best that runs "
                         "here)",
    "cuda_graphs": "denoise steps as CUDA graph replays: auto (where the step can be captured), on (required), off",
    "torch_compile": "true/false: on CUDA, the norm / RoPE / gate / MoE-combine chains as torch.compile'd kernels",
    "batch_invariant": "[true/false] (bare flag: true) on CUDA, fixed-tiling Triton kernels for the projections, "
                       "MoE and norms: a request's image is the same alone or batched (slower). CPU: accepted, "
                       "changes nothing (the CPU path is invariant already)",
    "quantization": "fp8: W8A8 e4m3 for the decoder layers' linears, quantized while loading (default: unset, the "
                    "checkpoint's weights as stored: a pre-quantized folder runs FP8 anyway; docs/quantization.md)",
    "quantization_ignored_layers": "module-name patterns (fnmatch) kept unquantized, e.g. 'model.layers.0.*' "
                                   "(default: none)",
    "fp8_fast_accum": "[true/false] (bare flag: true; default: true) with FP8 weights on CUDA: the FP8 GEMMs' fast "
                      "(reduced-precision) accumulation, as vLLM's FP8 kernels run on Hopper; false: fp32 "
                      "promotion, ~5 %% slower, less error (docs/quantization.md)",
    "fp8_grouped_gemm": "with FP8 weights on CUDA: the routed experts' grouped GEMM (default: auto, quack's varlen "
                        "GEMM where ditkv[fa4] is installed on sm90 with fast accumulation, else torch)",
    "max_image_height": "tallest image a request may ask for; the startup profile runs it (default: the model's)",
    "max_image_width": "widest image a request may ask for; the startup profile runs it (default: the model's)",
    "max_prompt_tokens": "longest prompt in tokens a request may have; the startup profile runs it (default: the "
                         "model's)",
    "profile_memory": "true/false: paged mode, sizing the pool from GPU memory: run the largest admitted request "
                      "once at startup and leave room for its non-KV peak (default: unset, auto: on CUDA only; "
                      "the CPU pool is sized against a fixed host-memory analogue)",
    "tensor_parallel_size": "ranks that split every layer's heads and MLP (1 = off)",
    "ulysses_degree": "ranks that split the sequence, Ulysses attention (1 = off)",
    "cfg_parallel_size": "2: the cond and uncond rows on two ranks (1 = off)",
    "enable_expert_parallel": "shard MoE experts across the replica's ranks",
    "cache_config": "step caching as JSON, e.g. '{\"type\": \"fbcache\", \"residual_threshold\": 0.08}': type "
                    "none | fbcache | dbcache, Fn, Bn, residual_threshold, warmup_steps, max_cached_steps, "
                    "max_continuous_cached_steps, steps_mask, taylorseer (default: unset, no cache; "
                    "docs/step-cache.md)",
}


def _help(f) -> str:
    text = ENGINE_HELP.get(f.name, "")  # a new field without a text: the CLI still starts, the help test fails
    if not text:
        return text
    if "default" in text:
        return text
    default = f.default_factory() if f.default is MISSING else f.default
    shown = str(default).lower() if isinstance(default, bool) else default
    return f"{text} (default: {shown})"


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One `--field-name` flag per config field; unset flags leave YAML/defaults alone (default=None
    here; the help shows EngineConfig's own default)."""
    g = parser.add_argument_group("engine", "a flag wins over the --config file's value, which wins over the "
                                            "default shown")
    g.add_argument("--config", help="YAML file: engine fields, or a stages: section (an AR -> DiT stage graph) "
                                    "whose relative model folders are read from the file's own folder "
                                    "(default: none, flags and defaults only)")
    for f in fields(EngineConfig):
        flag, kw = "--" + f.name.replace("_", "-"), {"dest": f.name, "default": None, "help": _help(f)}
        if f.name == "diffusion_kv_mode":
            g.add_argument(flag, "--mode", **kw)  # no choices: EngineConfig names the field and the fix
        elif f.name == "enable_expert_parallel":
            g.add_argument(flag, action="store_const", const=True, **kw)
        elif f.name in ("profile_memory", "torch_compile"):
            g.add_argument(flag, type=_parse_bool, metavar="true/false", **kw)
        elif f.name in ("fp8_fast_accum", "batch_invariant", "enable_prefix_caching"):
            g.add_argument(flag, type=_parse_bool, nargs="?", const=True, metavar="true/false", **kw)
        elif f.name == "fp8_grouped_gemm":
            g.add_argument(flag, choices=FP8_GROUPED_GEMMS, **kw)
        elif f.name == "gpu_memory_utilization":
            g.add_argument(flag, type=float, **kw)
        elif f.name == "quantization":
            g.add_argument(flag, choices=QUANTIZATIONS, **kw)
        elif f.name == "quantization_ignored_layers":
            g.add_argument(flag, nargs="+", metavar="PATTERN", **kw)
        elif f.name == "cache_config":
            g.add_argument(flag, type=_parse_json_mapping, metavar="JSON", **kw)
        elif "int" in str(f.type):
            g.add_argument(flag, type=_parse_opt_int, **kw)
        else:
            g.add_argument(flag, **kw)


def config_from_args(args: argparse.Namespace, **defaults) -> EngineConfig:
    """Defaults < `defaults` given by the command < YAML file < CLI flags."""
    data = dict(defaults)
    if getattr(args, "config", None):
        from ..stages.graph import resolve_model_paths

        data.update(engine_section(resolve_model_paths(load_yaml(args.config), args.config)))
    for f in fields(EngineConfig):
        v = getattr(args, f.name, None)
        if v is not None:
            data[f.name] = v
    return EngineConfig.from_dict(data, source=getattr(args, "config", None) or "flags")
