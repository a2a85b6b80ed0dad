"""The engine's command-line flags: one `--field-name` per `EngineConfig` field, and the merge
defaults < command defaults < YAML file < flags."""

from __future__ import annotations

import argparse
from dataclasses import fields

from ..config import FP8_GROUPED_GEMMS, KV_MODES, EngineConfig, engine_section, load_yaml



def _parse_bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")


def _parse_opt_int(s: str):
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One `--field-name` flag per config field; unset flags leave YAML/defaults alone."""
    g = parser.add_argument_group("engine")
    g.add_argument("--config", help="stage YAML file with engine fields (CLI flags override it)")
    for f in fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "model":
            g.add_argument(flag, dest=f.name, default=None, help="'tiny' (bundled) or a checkpoint folder")
        elif f.name == "diffusion_kv_mode":
            # default=None leaves a YAML file's value alone; the help names EngineConfig's own default
            g.add_argument(flag, "--mode", dest=f.name, default=None,
                           help=f"one of {', '.join(KV_MODES)}; {f.default} unless this or --config sets it")
        elif f.name == "diffusion_kv_max_rows_per_request":
            g.add_argument(flag, dest=f.name, default=None, type=_parse_opt_int,
                           help=f"KV rows one request may hold in the paged pool: 2 = CFG (cond + uncond), a "
                                f"one-row request fits too; {f.default} unless this or --config sets it")
        elif f.name == "enable_expert_parallel":
            g.add_argument(flag, dest=f.name, default=None, action="store_const", const=True,
                           help="shard MoE experts across the replica's ranks")
        elif f.name in ("profile_memory", "torch_compile"):
            g.add_argument(flag, dest=f.name, default=None, type=_parse_bool, help="true/false")
        elif f.name == "fp8_fast_accum":
            g.add_argument(flag, dest=f.name, default=None, type=_parse_bool, nargs="?", const=True,
                           help="[true/false] (bare flag: true; unset: true) with FP8 weights on CUDA: the FP8 "
                                "GEMMs' fast (reduced-precision) accumulation, as vLLM's FP8 kernels run on Hopper; "
                                "false: fp32 promotion, ~5 %% slower, less error (docs/quantization.md)")
        elif f.name == "fp8_grouped_gemm":
            g.add_argument(flag, dest=f.name, default=None, choices=FP8_GROUPED_GEMMS,
                           help="with FP8 weights on CUDA: the routed experts' grouped GEMM (auto: quack's varlen "
                                "GEMM where ditkv[fa4] is installed on sm90 with fast accumulation, else torch)")
        elif f.name == "batch_invariant":
            g.add_argument(flag, dest=f.name, default=None, type=_parse_bool, nargs="?", const=True,
                           help="[true/false] (bare flag: true) on CUDA, fixed-tiling Triton kernels for the "
                                "projections, MoE and norms: a request's image is the same alone or batched "
                                "(slower). CPU: accepted, changes nothing (the CPU path is invariant already)")
        elif f.name == "gpu_memory_utilization":
            g.add_argument(flag, dest=f.name, default=None, type=float)
        elif f.name == "max_model_len":
            g.add_argument(flag, dest=f.name, default=None, type=_parse_opt_int,
                           help="longest row (prompt + image tokens) a request may have, in both modes: "
                                "longer requests are refused at admission. -1 = no limit beyond the KV "
                                "pool (paged) / the profiled envelope (dense)")
        elif f.name == "quantization":
            g.add_argument(flag, dest=f.name, default=None, choices=["fp8"],
                           help="fp8: W8A8 e4m3 for the decoder layers' linears, quantized while loading "
                                "(docs/quantization.md)")
        elif f.name == "quantization_ignored_layers":
            g.add_argument(flag, dest=f.name, default=None, nargs="+", metavar="PATTERN",
                           help="module-name patterns (fnmatch) kept unquantized, e.g. 'model.layers.0.*'")
        elif "int" in str(f.type):
            g.add_argument(flag, dest=f.name, default=None, type=_parse_opt_int)
        else:
            g.add_argument(flag, dest=f.name, default=None)


def config_from_args(args: argparse.Namespace, **defaults) -> EngineConfig:
    """Defaults < `defaults` given by the command < YAML file < CLI flags."""
    data = dict(defaults)
    if getattr(args, "config", None):
        data.update(engine_section(load_yaml(args.config)))
    for f in fields(EngineConfig):
        v = getattr(args, f.name, None)
        if v is not None:
            data[f.name] = v
    return EngineConfig.from_dict(data, source=getattr(args, "config", None) or "flags")
