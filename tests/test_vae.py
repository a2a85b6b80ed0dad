"""The release VAE against the release code's numbers (issue 13).

tests/fixtures/release_vae_tiny.{safetensors,json}: tiny random weights with the release module
tree, and the reference `AutoencoderKLConv3D`'s decode (whole and tiled) and encode on fixed inputs;
`tools/make_vae_fixture.py --reference CHECKOUT` regenerates them.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ditkv.models.hunyuan.vae import ReleaseVAE, VAEConfig

HERE = Path(__file__).parent / "fixtures"  # tracked in git: a missing fixture fails, never skips


@pytest.fixture(scope="module")
def loaded():
    data = load_file(HERE / "release_vae_tiny.safetensors")
    cfg = VAEConfig.from_dict(json.loads((HERE / "release_vae_tiny.json").read_text())["config"])
    vae = ReleaseVAE(cfg).eval()
    # the fixture's weights, drawn as tools/make_vae_fixture.py drew them for the release module:
    # one generator, key by key in sorted name order; equal names and shapes make equal weights
    shapes = {k: tuple(v.shape) for k, v in vae.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    vae.load_state_dict({k: torch.randn(shapes[k], generator=g) * 0.05 for k in sorted(shapes)}, strict=True)
    return vae, data


def test_parameter_names_and_shapes_are_the_release_ones():
    meta = json.loads((HERE / "release_vae_tiny.json").read_text())
    vae = ReleaseVAE(VAEConfig.from_dict(meta["config"]))
    assert {k: list(v.shape) for k, v in vae.state_dict().items()} == meta["weight_shapes"]


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_decode_equals_the_release(loaded):
    vae, d = loaded
    with torch.no_grad():
        out = vae.decode_frames(d["decode_in"])
    assert out.shape == d["decode_out"].shape
    assert _rel(out, d["decode_out"]) <= 1e-5


def test_tiled_decode_equals_the_release(loaded):
    vae, d = loaded
    vae.tile_latent = vae.config.sample_size // vae.config.ffactor_spatial
    try:
        with torch.no_grad():
            out = vae.decode_frames(d["decode_tiled_in"])
    finally:
        vae.tile_latent = None
    assert out.shape == d["decode_tiled_out"].shape
    assert _rel(out, d["decode_tiled_out"]) <= 1e-5
    with torch.no_grad():  # and the whole decode of the same latent
        assert _rel(vae.decode_frames(d["decode_tiled_in"]), d["decode_untiled_out"]) <= 1e-5


def test_encode_equals_the_release(loaded):
    vae, d = loaded
    with torch.no_grad():
        mean, logvar = vae.encode_moments(d["encode_in"])
    assert _rel(mean, d["encode_mean"]) <= 1e-5 and _rel(logvar, d["encode_logvar"]) <= 1e-5


def test_codec_applies_the_latent_scale_and_shift(loaded):
    """decode(latents) = the network on latents / scale + shift; encode is its inverse transform."""
    vae, d = loaded
    c = vae.config
    z = d["decode_in"][:, :, 0]
    with torch.no_grad():
        img = vae.decode((z - c.shift_factor) * c.scaling_factor)
        lat = vae.encode(d["encode_in"][:, :, 0])
    assert _rel(img, d["decode_out"][:, :, 0]) <= 1e-5
    assert _rel(lat, (d["encode_mean"][:, :, 0] - c.shift_factor) * c.scaling_factor) <= 1e-5


def _release_folder(tmp_path, extra_keys=None, vae_keys=True):
    """A tiny release-format checkpoint: transformer + `vae.*` + the vision groups text-to-image skips."""
    import dataclasses

    from safetensors.torch import save_file

    from ditkv.models.hunyuan import HunyuanImage3Config, HunyuanImage3Model, save_checkpoint
    from ditkv.models.hunyuan.checkpoint import INDEX_NAME

    meta = json.loads((HERE / "release_vae_tiny.json").read_text())
    cfg = dataclasses.replace(HunyuanImage3Config.tiny(), codec="vae", latent_channels=16,
                              extra={"vae": meta["config"]})
    save_checkpoint(HunyuanImage3Model.from_config(cfg, seed=0), tmp_path)
    tensors = {"vision_model.embeddings.weight": torch.zeros(4, 4), "vision_aligner.proj.weight": torch.zeros(4, 4)}
    if vae_keys:
        vae = ReleaseVAE(VAEConfig.from_dict(meta["config"]))
        tensors.update({f"vae.{k}": v.contiguous() for k, v in vae.state_dict().items()})
    tensors.update(extra_keys or {})
    save_file(tensors, str(tmp_path / "extra.safetensors"))
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    index["weight_map"].update({k: "extra.safetensors" for k in tensors})
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    return tmp_path


def test_release_format_folder_loads_whole_and_generate_writes_a_png(tmp_path):
    """vae.* goes to the VAE, the vision groups are skipped by name, and `ditkv generate` runs end
    to end through the VAE (random weights: the picture is noise)."""
    from PIL import Image

    from ditkv.entrypoints.cli import main
    from ditkv.models.hunyuan.codec import VAECodec
    from ditkv.models.loader import load_model

    folder = _release_folder(tmp_path / "ckpt")
    model, _, codec = load_model(str(folder), torch.device("cpu"), torch.float32)
    assert isinstance(codec, VAECodec)
    img = codec.decode(torch.randn(1, 16, 8, 8))
    assert img.shape == (1, 3, 32, 32) and torch.isfinite(img).all()
    out = tmp_path / "x.png"
    assert main(["generate", "--model", str(folder), "--prompt", "a red circle", "--height", "32", "--width", "32",
                 "--steps", "1", "--no-progress", "--out", str(out)]) == 0
    assert Image.open(out).size == (32, 32)


@pytest.mark.parametrize("extra, match", [({"foo.bar": torch.zeros(2)}, "unexpected key"),
                                          ({"vae.decoder.extra.weight": torch.zeros(2)}, "vae.* keys do not match")])
def test_unknown_keys_are_still_errors(tmp_path, extra, match):
    from ditkv.errors import ConfigError
    from ditkv.models.loader import load_model

    folder = _release_folder(tmp_path, extra_keys=extra)
    with pytest.raises(ConfigError, match=match):
        load_model(str(folder), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("change, field", [({"block_out_channels": 64}, "vae"), ({"ffactor_spatial": 0}, "ffactor_spatial"),
                                           ({"latent_channels": "x"}, "latent_channels"),
                                           ({"block_out_channels": [32, 48, 64]}, "block_out_channels")])
def test_a_bad_vae_config_is_a_config_error_naming_it(change, field):
    from ditkv.errors import ConfigError

    base = json.loads((HERE / "release_vae_tiny.json").read_text())["config"]
    with pytest.raises(ConfigError, match=field):
        VAEConfig.from_dict({**base, **change})


def test_skip_sample_draws_what_encode_sample_draws(loaded):
    """An input image whose K/V were imported is not encoded again, but the request generator must still
    advance past its posterior sample (the noise comes next): the next draw after `skip_sample` equals the
    next draw after `encode_sample`, for one and two images; a wrong shape would not."""
    vae, d = loaded
    img = d["encode_in"][:, :, 0]
    for n in (1, 2):
        g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
        with torch.no_grad():
            for _ in range(n):
                vae.encode_sample(img, g1)
                vae.skip_sample(img, g2)
        assert torch.equal(torch.randn(64, generator=g1), torch.randn(64, generator=g2))
    g3 = torch.Generator().manual_seed(5)
    vae.skip_sample(img[..., :-16, :], g3)  # another latent shape: another draw
    g1 = torch.Generator().manual_seed(5)
    with torch.no_grad():
        vae.encode_sample(img, g1)
    assert not torch.equal(torch.randn(64, generator=g1), torch.randn(64, generator=g3))
