"""Regenerate tests/fixtures/release_vae_tiny.{safetensors,json} from the release VAE (numbers only).

The release decodes image latents with `AutoencoderKLConv3D` (hunyuan_image_3/autoencoder_kl_3d.py of
github.com/Tencent-Hunyuan/HunyuanImage-3.0). This script imports that file from a checkout of the
reference (nothing of it is copied into ditkv), builds a tiny float32 instance of it, re-initialises
every parameter (biases and norm affines included) with seeded randn * 0.05 (`seeded_weights`: the
test draws the same weights, so none are stored) so that no zero-initialised layer can hide a bug,
runs it on seeded inputs and stores inputs and outputs in one safetensors file:

    decode_in/out         z [1,16,1,8,8] (randn, seed 1) -> decode(z).sample, tiling off
    decode_tiled_in       z [1,16,1,16,12] (randn, seed 2)
    decode_tiled_out      decode with spatial tiling on (tile_latent_min_size 8: overlapping tiles blended)
    decode_untiled_out    the same z decoded with tiling off
    encode_in             x [1,3,1,32,32] (uniform in [-1,1], seed 3)
    encode_mean/logvar    encode(x).latent_dist.mean / .logvar (logvar clamped to [-30, 20]), tiling off

The JSON next to it holds the VAE config, the seeds, and what the release pipeline does to latents around
vae.decode / vae.encode. Input seed s means torch.manual_seed(s) immediately before drawing that input.

    git clone https://github.com/Tencent-Hunyuan/HunyuanImage-3.0 /tmp/hi3
    pip install einops diffusers
    python tools/make_vae_fixture.py --reference /tmp/hi3 [--out tests/fixtures/release_vae_tiny.safetensors]

If `diffusers` is absent, the few names the module imports from it are stubbed.
"""

import argparse
import importlib.util
import json
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

CONFIG = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[32, 64, 64],
              layers_per_block=1, ffactor_spatial=4, ffactor_temporal=2, sample_size=32, sample_tsize=4,
              scaling_factor=0.5, shift_factor=0.1, downsample_match_channel=True, upsample_match_channel=True)

PIPELINE_DECODE_NOTE = (
    "hunyuan_image_3_pipeline.py (end of __call__): latents = latents / scaling_factor (if set); "
    "latents = latents + shift_factor (if set); latents.unsqueeze(2) -> [B,C,1,H,W]; "
    "image = vae.decode(latents)[0] under torch.autocast(cuda, float16); image.squeeze(2); then "
    "diffusers VaeImageProcessor.postprocess with do_denormalize=True: (image * 0.5 + 0.5).clamp(0, 1).")
PIPELINE_ENCODE_NOTE = (
    "hunyuan.py vae_encode: pixels are ToTensor() then Normalize(0.5, 0.5) -> [-1,1], shape [1,3,H,W] "
    "(encode adds T and expands T=1 to ffactor_temporal frames); under torch.autocast(cuda, float16): "
    "latents = vae.encode(image).latent_dist.sample() (a random sample, not the mean); "
    "latents -= shift_factor (if set); latents *= scaling_factor (if set); then latents.squeeze(2) -> [B,C,H,W]. "
    "Exact inverse of the decode transform: z_model = (z_vae - shift) * scale, z_vae = z_model / scale + shift.")


def _stub_diffusers() -> None:
    try:
        import diffusers  # noqa: F401
        from diffusers.models.modeling_outputs import AutoencoderKLOutput  # noqa: F401
        return
    except ImportError:
        pass

    class AutoencoderKLOutput:
        def __init__(self, latent_dist):
            self.latent_dist = latent_dist

    def randn_tensor(shape, generator=None, device=None, dtype=None):
        return torch.randn(shape, generator=generator, device=device, dtype=dtype)

    mods = {
        "diffusers": {},
        "diffusers.configuration_utils": dict(ConfigMixin=object, register_to_config=lambda f: f),
        "diffusers.models": {},
        "diffusers.models.modeling_outputs": dict(AutoencoderKLOutput=AutoencoderKLOutput),
        "diffusers.models.modeling_utils": dict(ModelMixin=torch.nn.Module),
        "diffusers.utils": dict(BaseOutput=object),
        "diffusers.utils.torch_utils": dict(randn_tensor=randn_tensor),
    }
    for name, attrs in mods.items():
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        sys.modules[name] = mod


def seeded_weights(shapes: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """Every weight drawn from one seed, key by key in sorted name order: randn * 0.05 (tests/test_vae.py
    draws the same, so the fixture holds no weights)."""
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(shapes[k], generator=g) * 0.05 for k in sorted(shapes)}


def _load_reference(root: Path):
    _stub_diffusers()
    path = root / "hunyuan_image_3" / "autoencoder_kl_3d.py"
    spec = importlib.util.spec_from_file_location("release_autoencoder_kl_3d", path)
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    return ref


def _report(name: str, t: torch.Tensor) -> None:
    print(f"{name:20s} {str(list(t.shape)):22s} max|x| = {t.abs().max().item():.6g}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reference", required=True, help="checkout of Tencent-Hunyuan/HunyuanImage-3.0")
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests/fixtures/release_vae_tiny.safetensors"))
    a = p.parse_args(argv)
    out = Path(a.out)
    ref = _load_reference(Path(a.reference))

    model = ref.AutoencoderKLConv3D(**CONFIG).float().eval()
    with torch.no_grad():
        weights = seeded_weights({k: tuple(v.shape) for k, v in model.state_dict().items()})
        model.load_state_dict(weights, strict=True)
    tensors = {}  # the weights are not stored: tests/test_vae.py draws the same ones from the seed

    with torch.no_grad():
        model.disable_spatial_tiling()
        model.disable_temporal_tiling()
        torch.manual_seed(1)
        z = torch.randn(1, 16, 1, 8, 8)
        tensors["decode_in"] = z
        tensors["decode_out"] = model.decode(z).sample

        torch.manual_seed(2)
        z = torch.randn(1, 16, 1, 16, 12)
        tensors["decode_tiled_in"] = z
        tensors["decode_untiled_out"] = model.decode(z.clone()).sample
        model.enable_spatial_tiling()
        assert model.tile_latent_min_size == 8 and model.tile_sample_min_size == 32
        tensors["decode_tiled_out"] = model.decode(z.clone()).sample
        model.disable_spatial_tiling()

        torch.manual_seed(3)
        x = torch.rand(1, 3, 1, 32, 32) * 2 - 1
        tensors["encode_in"] = x
        post = model.encode(x).latent_dist
        tensors["encode_mean"] = post.mean
        tensors["encode_logvar"] = post.logvar

    tensors = {k: v.detach().float().contiguous() for k, v in tensors.items()}
    for k, v in tensors.items():
        if not k.startswith("vae."):
            _report(k, v)
    diff = (tensors["decode_tiled_out"] - tensors["decode_untiled_out"]).abs().max().item()
    print(f"max |decode_tiled_out - decode_untiled_out| = {diff:.6g}")

    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata={"source": "Tencent-Hunyuan/HunyuanImage-3.0 autoencoder_kl_3d.py"})
    meta = {
        "source": "Tencent-Hunyuan/HunyuanImage-3.0 hunyuan_image_3/autoencoder_kl_3d.py AutoencoderKLConv3D",
        "config": CONFIG,
        "dtype": "float32",
        "weights": "not stored: torch.Generator().manual_seed(0), then for each state_dict key in sorted order "
                   "torch.randn(shape, generator=g) * 0.05",
        "tiling": {"tile_sample_min_size": model.tile_sample_min_size, "tile_latent_min_size": model.tile_latent_min_size,
                   "tile_overlap_factor": model.tile_overlap_factor},
        "cases": {
            "decode": {"input": "decode_in", "seed": 1, "dist": "randn", "output": "decode_out", "tiling": False},
            "decode_tiled": {"input": "decode_tiled_in", "seed": 2, "dist": "randn", "output": "decode_tiled_out",
                             "tiling": "spatial", "untiled_output": "decode_untiled_out",
                             "max_abs_diff_tiled_vs_untiled": diff},
            "encode": {"input": "encode_in", "seed": 3, "dist": "torch.rand * 2 - 1",
                       "outputs": ["encode_mean", "encode_logvar"], "tiling": False},
        },
        "shapes": {k: list(v.shape) for k, v in tensors.items()},
        "weight_shapes": {k: list(v.shape) for k, v in model.state_dict().items()},
        "pipeline_decode_note": PIPELINE_DECODE_NOTE,
        "pipeline_encode_note": PIPELINE_ENCODE_NOTE,
    }
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"{out.stat().st_size / 2**20:.3f} MiB -> {out} (+ {out.with_suffix('.json').name})")


if __name__ == "__main__":
    main()
