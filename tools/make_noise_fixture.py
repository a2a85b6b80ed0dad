"""Regenerate tests/fixtures/release_noise.json: the initial noise of a text-to-image request, drawn by
the release pipeline's own code (numbers only).

`HunyuanImage3Text2ImagePipeline.prepare_latents` (hunyuan_image_3/hunyuan_image_3_pipeline.py of the
fork github.com/suryatmodulus/HunyuanImage-3.0 @1ea1526, which its base code hunyuan.py runs too) draws it with
diffusers' `randn_tensor(shape, generator, device, dtype=torch.bfloat16)`; `generate_image` gives it a
fresh generator per request seed (`prepare_model_inputs`), which draws nothing before it when there are
no input images (tests/fixtures/release_edit_tiny.* has the noise drawn after the images' samples). This
script imports the pipeline from a checkout (nothing of it is copied into ditkv) and runs that method
on a stand-in `self` (the latent scale factor, the pipeline's scheduler) with a CPU generator, the one ditkv
uses (the release makes its generator on the model's device: CUDA there, so other numbers), for a few
(latent channels, size, seed): the release size, the tiny model's, the edit fixture's, and element counts
that are not a multiple of 16, where torch's CPU bf16 draw is not the fp32 draw rounded to bf16.

Stored per case: the shape, the SHA-256 of the noise as little-endian fp32 bytes, and the values
themselves (fp32, exact bf16 values) where there are at most 128.

    PYTHONPATH=/tmp/hi3_deps:/tmp/hi3_tv python tools/make_noise_fixture.py --reference /tmp/ref_fork \\
        [--out tests/fixtures/release_noise.json]
"""

import argparse
import hashlib
import importlib
import json
import sys
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from make_edit_fixture import _load_reference

FORK = "suryatmodulus/HunyuanImage-3.0@1ea1526"
DOWNSAMPLE = 16  # the release VAE's pixels per latent cell (config vae_downsample_factor)
# (name, latent channels, height, width in pixels, seed)
CASES = [
    ("release-1024", 32, 1024, 1024, 42),
    ("tiny-64", 48, 256, 256, 0),  # the bundled tiny model: 48 channels, 16 x 16 latents
    ("edit-one", 4, 224, 288, 42),  # release_edit_tiny's case "one", drawn from a fresh generator
    ("tail-105", 3, 80, 112, 1),  # 105 values: not a multiple of 16
    ("tail-17", 17, 16, 16, 7),
    ("tail-1768", 4, 208, 544, 123),
]
MAX_STORED = 128


def digest(x: torch.Tensor) -> str:
    return hashlib.sha256(x.float().contiguous().numpy().astype("<f4").tobytes()).hexdigest()


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reference", required=True, help="checkout of suryatmodulus/HunyuanImage-3.0 (commit 1ea1526)")
    p.add_argument("--out", default=str(ROOT / "tests/fixtures/release_noise.json"))
    a = p.parse_args(argv)
    _load_reference(Path(a.reference).resolve())
    pipe = importlib.import_module("hunyuan_image_3.hunyuan_image_3_pipeline")
    # what the pipeline's __init__ sets and prepare_latents reads (the model's pipeline property builds the same)
    stub = types.SimpleNamespace(latent_scale_factor=[DOWNSAMPLE, DOWNSAMPLE],
                                 scheduler=pipe.FlowMatchDiscreteScheduler(shift=3.0, reverse=True, solver="euler"))
    cases = []
    for name, channels, height, width, seed in CASES:
        generator = [torch.Generator("cpu").manual_seed(seed)]  # prepare_model_inputs: a list, one per request
        x = pipe.HunyuanImage3Text2ImagePipeline.prepare_latents(
            stub, batch_size=1, latent_channel=channels, image_size=(height, width), dtype=torch.bfloat16,
            device=torch.device("cpu"), generator=generator)
        assert x.dtype == torch.bfloat16
        case = {"name": name, "seed": seed, "height": height, "width": width, "shape": list(x.shape),
                "sha256_fp32": digest(x)}
        if x.numel() <= MAX_STORED:
            case["values"] = x.float().flatten().tolist()
        rounded = torch.randn(tuple(x.shape), generator=torch.Generator().manual_seed(seed)).bfloat16()
        case["equals_fp32_draw_rounded"] = bool(torch.equal(rounded, x))
        cases.append(case)
        print(f"{name}: shape {list(x.shape)} ({x.numel()} values), fp32 draw rounded to bf16 the same: "
              f"{case['equals_fp32_draw_rounded']}")
    out = {
        "source": f"{FORK} hunyuan_image_3/hunyuan_image_3_pipeline.py HunyuanImage3Text2ImagePipeline."
                  "prepare_latents (randn_tensor, dtype=torch.bfloat16) with a fresh CPU generator per seed, "
                  "run by tools/make_noise_fixture.py",
        "latent_downsample": DOWNSAMPLE,
        "digest": "sha256 of the noise as little-endian float32 bytes (C order)",
        "cases": cases,
    }
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"{len(cases)} cases -> {a.out}")


if __name__ == "__main__":
    main()
