"""`ditkv bench prefix --geometry release`: the engine run of a case at HunyuanImage-3 release geometry.

The same A/B as the tiny engine run (`prefix.run_engine`: each request alone through a cache-off and a
cache-on `Engine`, the order swapped every request), but the DiT is the release architecture with random
weights made on the device (`step_release.build_model`: `--layers` decoder layers, bf16 or `--quantization
fp8`), 1024x1024 CFG requests by default, the byte tokenizer and a small random VAE (`step_e2e`'s `--shrink`
VAE: the decode is not in the timed first step). The device is synchronised before the clock stops.

Only cases without input images run here (`system`, `nohit`): an edit's vision encoder has no random
release build. `--shrink` runs the release structure at toy widths (a CPU test of this path).
"""

from __future__ import annotations

import torch

RELEASE_CASES = ("system", "nohit")


def check_case(name: str) -> None:
    if name not in RELEASE_CASES:
        raise SystemExit(f"ditkv bench prefix: --geometry release runs the cases {', '.join(RELEASE_CASES)}; "
                         f"{name!r} needs the tiny models (its input images need a vision encoder, or it has an AR "
                         "phase): drop it from --cases, or run it with --geometry tiny")


def check_device(args) -> None:
    """The release architecture at full width needs a GPU: one of its layers is ~5 GB in bf16, and the CPU
    would build and run it for minutes. Refused before anything is built, naming the way out."""
    from ..models.loader import resolve_device

    if resolve_device(args.device).type == "cpu" and not args.shrink:
        raise SystemExit("ditkv bench prefix: --geometry release at full width needs a GPU (--device cuda); "
                         "on a CPU add --shrink (the release structure at toy widths)")


_BUILT: dict = {}  # (layers, shrink, quantization, device) -> (model, tokenizer, codec, base config)


def bundle(args, change):
    """(model, tokenizer, codec) at release geometry: random weights on `args.device`, made once per process
    (two 16-layer FP8 models do not fit an 80 GB card) and given the case's config change (the system prompt;
    the weights do not depend on it)."""
    from ..models.hunyuan import ByteTokenizer
    from ..models.hunyuan.codec import make_codec
    from ..models.loader import resolve_device, resolve_dtype
    from .step_e2e import random_vae_on_device, vae_config
    from .step_release import build_model, release_config

    device = resolve_device(args.device)
    key = (args.layers, args.shrink, args.quantization, str(device))
    if key not in _BUILT:
        _BUILT.clear()
        dtype = resolve_dtype("auto", device)
        cfg = release_config(args.layers, args.shrink)
        model, _ = build_model(cfg, device, dtype, args.quantization)
        vae = random_vae_on_device(vae_config(cfg, shrink=True), device, dtype)
        _BUILT[key] = (model, ByteTokenizer(), make_codec(cfg, vae), cfg)
    model, tok, codec, cfg = _BUILT[key]
    model.config = cfg if change is None else change(cfg)
    return model, tok, codec


def engine_factory(args, bundle_, requests):
    """A function cache -> Engine over the shared `bundle_`: paged, pages for two requests' rows, FP8 as
    built. Eager steps: the first step always is, and the prefix-prefill measure subtracts a denoise step
    from it (a captured one would be faster for reasons the cache has no part in)."""
    from ..config import EngineConfig
    from ..engine.engine import Engine

    model = bundle_[0]
    cfg, device = model.config, next(model.parameters()).device
    longest = max(len(r.prompt) for r in requests)
    side = max(max(r.height, r.width) for r in requests)
    system = len(cfg.extra.get("system_prompt", "") or "") if isinstance(cfg.extra, dict) else 0
    tokens = system + longest + 2 * (side // cfg.image_token_downsample) ** 2 + 64
    blocks = 2 * 2 * -(-tokens // args.block_size) + 64  # two requests' rows: the cache keeps the last one's pages

    def make(cache: bool):
        return Engine(EngineConfig(diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2,
                                   block_size=args.block_size, device=str(device), num_kv_blocks=blocks,
                                   max_prompt_tokens=max(256, longest), max_image_height=side, max_image_width=side,
                                   profile_memory=False, cuda_graphs="off", max_num_seqs=1,
                                   quantization=args.quantization, enable_prefix_caching=cache,
                                   batch_invariant=args.batch_invariant),
                      model_bundle=bundle_)
    return make


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def describe(args, bundle_) -> dict:
    model = bundle_[0]
    return {"geometry": "release", "layers": args.layers, "shrink": args.shrink, "quantization": args.quantization,
            "device": str(next(model.parameters()).device), "block_size": args.block_size,
            "batch_invariant": args.batch_invariant,
            "dtype": str(model.model.ln_f.weight.dtype).replace("torch.", "")}
