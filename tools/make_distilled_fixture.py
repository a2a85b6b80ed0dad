"""Regenerate tests/fixtures/release_distilled_tiny.{safetensors,json}: the first denoising step of a
guidance-distilled HunyuanImage-3.0 transformer (the `<guidance>` token path), as numbers only.

The official release (github.com/Tencent-Hunyuan/HunyuanImage-3.0) has no distilled code. Upstream's
Instruct / Instruct-Distil code (`cfg_distilled`) is carried by the fork
github.com/suryatmodulus/HunyuanImage-3.0 (commit 1ea1526, "Add support for hunyuanimage-3.0-Instruct &
hunyuanimage-3.0-Instruct-Distil"). This script imports, from a checkout of that fork (nothing of it is
copied into ditkv):

  hunyuan_image_3/modeling_hunyuan_image_3.py   `HunyuanImage3ForCausalMM` with `cfg_distilled=True`: its
                                                `guidance_emb` (a TimestepEmbedder of its own) fills the
                                                `<guidance>` slot (`instantiate_guidance_tokens`)
  hunyuan_image_3/tokenizer_wrapper.py          the pretrain text-to-image sequence with
                                                `ImageInfo(add_guidance_token=True)`: `<guidance>` right
                                                after `<timestep>` (`_add_image_meta_info_token`)

It builds a tiny float32 model (2 layers, 4 experts top-2 + shared expert, the ResBlock image path, the
guidance embedder), sets every transformer weight from a seed (the same rule as
tools/make_transformer_fixture.py; the test draws the same weights, none are stored) and runs ONE first
denoising step of a one-row (cfg_factor 1) text-to-image request on CPU, with the inputs the fork's
pipeline gives the model at step 0 (hunyuan_image_3_pipeline.py, `cfg_distilled` branch):

    guidance = torch.tensor([1000.0 * guidance_scale], dtype=torch.bfloat16)   (one value per request)
    model(input_ids, attention_mask, rope_image_info, position_ids, images=x, timesteps=t,
          timesteps_index, guidance, guidance_index, mode="gen_image", first_step=True)["diffusion_prediction"]

The step runs twice: at GUIDANCE_SCALE (5.0: 1000 x 5 = 5000, which bfloat16 stores as 4992) and at
GUIDANCE_SCALE_2, so the fixture shows that the guidance value reaches the image tokens.

Left out of the fork's run, and why:
  - the Instruct chat template / `HunyuanImage3TokenizerFast` (tokenization_hunyuan_image_3.py): ditkv builds
    the pretrain template; the sequence comes from the release `TokenizerWrapper` (same file in the release
    and the fork) on a stand-in tokenizer with ditkv's byte ids, as in make_transformer_fixture.py;
  - the KV cache (`HunyuanStaticCache`, bf16): the step runs without one, every number stays float32;
  - the VAE and the vision encoder/aligner: built with `skip_load_module={"vae", "vit"}`;
  - `torch.cuda.set_device` / `nvtx.range` (CUDA-only calls in the MoE forward): no-ops on CPU;
  - the image processor (`HunyuanImage3ImageProcessor`: SigLIP2 / torchvision preprocessing of input
    images, image-conditioned generation only): stubbed; torchvision is stubbed when absent.

Stored (safetensors): `latents` [1, C, h, w] (randn, seed 1), `timestep` [1], `guidance` [2] (the two
bf16 guidance values the model saw, as fp32), `velocity` [1, C, h, w] (at GUIDANCE_SCALE), `velocity_2`
(at GUIDANCE_SCALE_2), `token_ids` [1, L], `pos` [1, L, 2]. The JSON holds the release-spelled config.json,
the weight rule, the request, the slots and the router margins.

    git clone https://github.com/suryatmodulus/HunyuanImage-3.0 /tmp/hi3fork   # (LFS assets may fail:
    #   only hunyuan_image_3/ and utils/ are needed; `git archive 1ea1526 hunyuan_image_3 utils` works too)
    pip install --no-deps --target /tmp/hi3_deps transformers==4.56.2 huggingface_hub==0.35.3 \
        tokenizers==0.22.1 diffusers==0.35.2 einops          # tool-time only; not ditkv dependencies
    PYTHONPATH=/tmp/hi3_deps python tools/make_distilled_fixture.py --reference /tmp/hi3fork \
        [--out tests/fixtures/release_distilled_tiny.safetensors]
"""

import argparse
import contextlib
import importlib
import importlib.machinery
import json
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from make_transformer_fixture import (CONFIG as BASE_CONFIG, IMAGE_BASE_SIZE, LATENT_CHANNELS,  # noqa: E402
                                      LATENT_SEED, PROMPT, TIMESTEP, WEIGHT_RULE, _report, _StandInTokenizer,
                                      seeded_weights)

HEIGHT, WIDTH = 288, 224  # a resolution bucket at image_base_size 256: 18 x 14 latent cells
GUIDANCE_SCALE = 5.0  # 1000 * 5 = 5000 -> bfloat16 4992
GUIDANCE_SCALE_2 = 2.5  # 2500 -> bfloat16 2496
FORK = "suryatmodulus/HunyuanImage-3.0@1ea1526"

# release spelling of the distilled flag (configuration_hunyuan_image_3.py: `cfg_distilled`)
CONFIG = dict(BASE_CONFIG, cfg_distilled=True, use_meanflow=False, model_version="HunyuanImage-3.0-Instruct",
              rope_type="2d")


def _install_stubs() -> None:
    import diffusers  # noqa: F401  (first: both probe for torchvision, which a stub would confuse)
    import transformers  # noqa: F401

    if "torchvision" not in sys.modules:
        try:
            import torchvision  # noqa: F401
        except ImportError:
            tv = types.ModuleType("torchvision")
            tv.__spec__ = importlib.machinery.ModuleSpec("torchvision", None)
            tv.transforms = types.SimpleNamespace(Compose=lambda *a, **k: None, ToTensor=lambda *a, **k: None,
                                                  Normalize=lambda *a, **k: None)
            sys.modules["torchvision"] = tv
            sys.modules["torchvision.transforms"] = tv.transforms


def _load_reference(root: Path):
    """The fork's modules, imported without its lazy package __init__ (which probes optional packages)."""
    _install_stubs()
    pkg = types.ModuleType("hunyuan_image_3")
    pkg.__path__ = [str(root / "hunyuan_image_3")]
    sys.modules["hunyuan_image_3"] = pkg
    ref = importlib.import_module("hunyuan_image_3.modeling_hunyuan_image_3")
    tw = importlib.import_module("hunyuan_image_3.tokenizer_wrapper")
    # the image processor reads the SigLIP2 config (image-conditioned inputs only): not built
    ref.HunyuanImage3ImageProcessor = lambda config: types.SimpleNamespace(cond_token_attn_type="full")
    torch.cuda.set_device = lambda *a, **k: None
    ref.nvtx.range = lambda *a, **k: contextlib.nullcontext()
    return ref, tw


def _gen_image_info(tw):
    """The release's `build_image_info(f"{H}x{W}")` (image_processor.py of the release): bucket, tokens."""
    reso = tw.ResolutionGroup(base_size=IMAGE_BASE_SIZE)
    image_width, image_height = reso.get_target_size(WIDTH, HEIGHT)
    f = BASE_CONFIG["vae_downsample_factor"]
    base_size, ratio_idx = reso.get_base_size_and_ratio_index(WIDTH, HEIGHT)
    return tw.ImageInfo(image_type="gen_image", image_width=image_width, image_height=image_height,
                        token_width=image_width // f[1], token_height=image_height // f[0],
                        base_size=base_size, ratio_index=ratio_idx, add_guidance_token=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reference", required=True, help="checkout of suryatmodulus/HunyuanImage-3.0 (commit 1ea1526)")
    p.add_argument("--out", default=str(ROOT / "tests/fixtures/release_distilled_tiny.safetensors"))
    a = p.parse_args(argv)
    out = Path(a.out)
    ref, tw = _load_reference(Path(a.reference).resolve())
    from hunyuan_image_3.configuration_hunyuan_image_3 import HunyuanImage3Config

    config = HunyuanImage3Config(**CONFIG)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = ref.HunyuanImage3ForCausalMM(config, skip_load_module={"vae", "vit"}).float().eval()
    assert isinstance(model.guidance_emb, ref.TimestepEmbedder)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.load_state_dict(seeded_weights(shapes), strict=True)

    margins = []

    def gate_hook(mod, args, _out):
        x = args[0].reshape(-1, args[0].shape[-1]).float()
        probs = torch.nn.functional.linear(x, mod.wg.weight.float()).softmax(-1)
        top = probs.topk(mod.moe_topk + 1, dim=-1).values
        margins.append(float((top[:, -2] - top[:, -1]).min()))

    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(gate_hook)

    # the sequence: release TokenizerWrapper, pretrain template, one row (cfg_factor 1, as the fork's
    # prepare_model_inputs sets for cfg_distilled), the image section with a <guidance> token
    info = _gen_image_info(tw)
    wrapper = tw.TokenizerWrapper(_StandInTokenizer())
    res = wrapper.apply_chat_template(
        batch_prompt=[PROMPT], batch_message_list=None, mode="gen_image", batch_gen_image_info=[info],
        batch_cond_image_info=None, batch_system_prompt=None, batch_cot_text=None, max_length=None,
        bot_task="auto", image_base_size=IMAGE_BASE_SIZE, sequence_template="pretrain", cfg_factor=1,
        drop_think=False)
    tok_out, sections = res["output"], res["sections"]
    input_ids = tok_out.tokens
    assert input_ids.shape[0] == 1, "a distilled request is one row"
    L = input_ids.shape[1]
    rope_info = model.build_batch_rope_image_info(tok_out, sections)
    (sl,) = tok_out.gen_image_slices[0]
    mask = torch.ones(L, L, dtype=torch.bool).tril()
    mask[sl, sl] = True  # the fork's _prepare_attention_mask_for_generation: causal + full image block
    mask = mask[None, None]

    torch.manual_seed(LATENT_SEED)
    latents = torch.randn(1, LATENT_CHANNELS, info.token_height, info.token_width)
    t = torch.tensor([TIMESTEP])
    ts_index = tok_out.gen_timestep_scatter_index.reshape(1, -1)
    g_index = tok_out.guidance_scatter_index.reshape(1, -1)
    image_mask = tok_out.gen_image_mask.reshape(1, -1)

    # what generate_image (modeling_hunyuan_image_3.py) sets before the pipeline runs
    last_img = int(torch.where(input_ids[0] == CONFIG["image_token_id"])[0][-1])
    model.post_token_len = L - 1 - last_img
    model.num_image_tokens = info.image_token_length
    model.num_special_tokens = 2  # <timestep>, <guidance>

    def step(scale: float):
        # hunyuan_image_3_pipeline.py (cfg_distilled): one bf16 value, 1000 x guidance_scale
        guidance = torch.tensor([1000.0 * scale], dtype=torch.bfloat16)
        outv = model(input_ids=input_ids, attention_mask=mask, position_ids=torch.arange(L)[None],
                     past_key_values=None, rope_image_info=rope_info, mode="gen_image", images=latents,
                     image_mask=image_mask, timesteps=t, timesteps_index=ts_index, guidance=guidance,
                     guidance_index=g_index, first_step=True, use_cache=False,
                     gen_timestep_scatter_index=ts_index)
        return outv["diffusion_prediction"].float(), guidance.float()

    with torch.no_grad():
        velocity, g1 = step(GUIDANCE_SCALE)
        velocity_2, g2 = step(GUIDANCE_SCALE_2)
        _, _, all_pos = ref.build_batch_2d_rope(seq_len=L, n_elem=config.attention_head_dim, image_infos=rope_info,
                                                base=config.rope_theta, return_all_pos=True)
        pos = torch.stack([p_[:, 0, :] for p_ in all_pos])  # [1, L, (y, x)]

    ti, gi = int(ts_index.reshape(-1)[0]), int(g_index.reshape(-1)[0])
    assert gi == ti + 1 and int(input_ids[0, gi]) == CONFIG["guidance_token_id"]
    tensors = {"latents": latents, "timestep": t, "guidance": torch.cat([g1, g2]), "velocity": velocity,
               "velocity_2": velocity_2, "token_ids": input_ids.long(), "pos": pos.long()}
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    for k, v in tensors.items():
        _report(k, v)
    rel = ((velocity - velocity_2).abs().max() / velocity.abs().max()).item()
    print(f"row: {L} tokens; image span [{sl.start}, {sl.stop}); timestep index {ti}; guidance index {gi}; "
          f"guidance {g1.item()} / {g2.item()}; velocity change between the two scales (rel) {rel:.3g}; "
          f"min router margin {min(margins):.3g}")

    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata={"source": f"{FORK} hunyuan_image_3/modeling_hunyuan_image_3.py"})
    cfg_json = json.loads(config.to_json_string(use_diff=True))
    meta = {
        "source": f"{FORK} hunyuan_image_3/modeling_hunyuan_image_3.py HunyuanImage3ForCausalMM.forward "
                  "(cfg_distilled=True, first_step=True, mode=gen_image), inputs as hunyuan_image_3_pipeline.py's "
                  "cfg_distilled step 0; sequence from hunyuan_image_3/tokenizer_wrapper.py (pretrain template)",
        "config": cfg_json,
        "dtype": "float32",
        "weights": WEIGHT_RULE,
        "weight_shapes": {k: list(v) for k, v in shapes.items()},
        "request": {"prompt": PROMPT, "height": HEIGHT, "width": WIDTH, "rows": ["cond"],
                    "guidance_scale": GUIDANCE_SCALE, "guidance_scale_2": GUIDANCE_SCALE_2,
                    "sequence_template": "pretrain", "system_prompt": None,
                    "token_height": info.token_height, "token_width": info.token_width,
                    "base_size": info.base_size, "ratio_index": int(info.ratio_index)},
        "guidance_rule": "torch.tensor([1000.0 * guidance_scale], dtype=torch.bfloat16) -> guidance_emb "
                         "(TimestepEmbedder: sinusoid of t.float(), 256 freqs, max_period 10000) -> <guidance> slot",
        "latents": f"torch.manual_seed({LATENT_SEED}); torch.randn(1, {LATENT_CHANNELS}, h, w)",
        "timestep": TIMESTEP,
        "image_span": [sl.start, sl.stop],
        "timestep_index": ti,
        "guidance_index": gi,
        "attention_mask": "causal, plus bidirectional within the image span [start, stop)",
        "min_router_margin": min(margins),
        "left_out": ["Instruct chat template / HunyuanImage3TokenizerFast (ditkv builds the pretrain template)",
                     "KV cache (bf16 HunyuanStaticCache)", "VAE / vision encoder / aligner (not run)"],
        "shapes": {k: list(v.shape) for k, v in tensors.items()},
    }
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"{out.stat().st_size / 1024:.1f} KiB -> {out} (+ {out.with_suffix('.json').name})")


if __name__ == "__main__":
    main()
