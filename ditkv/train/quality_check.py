"""Quality check of a trained model through the real engine: held-out caption accuracy.

Generates one image per (held-out full caption, seed) with `Engine` in each KV mode
(paged_scheduler and dense_legacy), scores them with `ditkv.data.accuracy` and compares the two
modes image by image (they run the same math, so pixels may differ by at most rounding).

    ditkv bench quality            # = python -m ditkv.bench.quality (the command line: ditkv/bench/quality.py)
    ditkv bench quality --edit     # held-out edits (`edit_quality.py`)
"""

from __future__ import annotations

import time

import numpy as np


MODES = ("paged_scheduler", "dense_legacy")
FIELDS = ("shape", "color", "size", "position", "all")


def load_bundle(model: str = "tiny", device: str = "cpu", dtype: str = "float32"):
    """(model, tokenizer, codec) loaded once and shared by the engines of both modes."""
    from ..models.loader import load_model, resolve_device, resolve_dtype

    dev = resolve_device(device)
    return load_model(model, dev, resolve_dtype(dtype, dev))


def generate_images(bundle, mode: str, prompts: list[str], seeds: list[int], steps: int | None = None,
                    guidance: float | None = None, device: str = "cpu", input_images: list | None = None,
                    quantization: str | None = None) -> list[np.ndarray]:
    """uint8 [64, 64, 3] images, one per (prompt, seed), from a fresh engine in `mode`; `input_images`: per
    prompt, the request's input images (editing); `quantization`: the engine's (fp8: W8A8)."""
    from ..config import EngineConfig
    from ..engine.engine import Engine
    from ..engine.types import GenerationRequest

    paged = mode == "paged_scheduler"
    cfg = EngineConfig(device=device, diffusion_kv_mode=mode,
                       diffusion_kv_max_rows_per_request=2 if paged else None,
                       num_kv_blocks=64 if paged else None,  # 64 x 64-token blocks: plenty for one request
                       quantization=quantization)
    engine = Engine(cfg, model_bundle=bundle)
    images = []
    try:
        for i, (prompt, seed) in enumerate(zip(prompts, seeds)):
            out = engine.generate(GenerationRequest(prompt=prompt, steps=steps, guidance_scale=guidance,
                                                    seed=seed, request_id=f"q{i}",
                                                    images=None if input_images is None else input_images[i]))
            if not out.ok:
                raise RuntimeError(f"{mode}: {prompt!r} failed: {out.error}")
            images.append(out.image)
    finally:
        engine.shutdown()
    return images


def compare_modes(a: list[np.ndarray], b: list[np.ndarray], specs) -> dict:
    """Largest pixel difference and whether the checker's verdicts agree on every image."""
    from ..data import check

    diff = max(int(np.abs(x.astype(np.int16) - y.astype(np.int16)).max()) for x, y in zip(a, b))
    same = all(check(x, s) == check(y, s) for x, y, s in zip(a, b, specs))
    return {"max_abs_pixel_diff": diff, "same_verdicts": same}


def quality_check(model: str = "tiny", device: str = "cpu", seeds_per_caption: int = 1,
                  steps: int | None = None, guidance: float | None = None, limit: int | None = None,
                  modes=MODES, quantization: str | None = None) -> dict:
    """Held-out accuracy per mode plus the paged-vs-dense comparison. With `quantization` (fp8) both
    modes run quantized, and a paged run in the model's own dtype on the same seeds is the baseline
    (`quantized_vs_baseline`: accuracy difference per attribute)."""
    from ..data import accuracy, heldout_specs

    bundle = load_bundle(model, device)
    specs = list(heldout_specs())[:limit] if limit else list(heldout_specs())
    specs = [s for s in specs for _ in range(seeds_per_caption)]
    prompts = [s.caption() for s in specs]
    seeds = list(range(len(specs)))  # a different noise per image
    mc = bundle[0].config
    result = {"model": model, "device": device, "captions": len(set(prompts)), "images": len(specs),
              "steps": steps or mc.default_steps,
              "guidance": mc.default_guidance if guidance is None else guidance, "modes": {}}
    images = {}
    runs = [(m, quantization) for m in modes] + ([("paged_scheduler", None)] if quantization else [])
    for mode, quant in runs:
        t0 = time.monotonic()
        key = mode if quant == quantization else f"{mode} (baseline, unquantized)"
        images[key] = generate_images(bundle, mode, prompts, seeds, steps, guidance, device, quantization=quant)
        acc = accuracy(images[key], specs)
        acc["seconds"] = time.monotonic() - t0
        result["modes"][key] = acc
    if len(modes) == 2:
        result["paged_vs_dense"] = compare_modes(images[modes[0]], images[modes[1]], specs)
    if quantization:
        base = result["modes"]["paged_scheduler (baseline, unquantized)"]
        got = result["modes"]["paged_scheduler"]
        result["quantization"] = quantization
        result["quantized_vs_baseline"] = {f: got[f] - base[f] for f in FIELDS}
        result["quantized_vs_baseline_images"] = compare_modes(images["paged_scheduler"],
                                                               images["paged_scheduler (baseline, unquantized)"], specs)
    return result


def table_rows(result: dict) -> list[dict]:
    return [{"mode": m, **{f: acc[f] for f in FIELDS}, "n": acc["n"], "seconds": acc["seconds"]}
            for m, acc in result["modes"].items()]
