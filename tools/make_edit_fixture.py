"""Regenerate tests/fixtures/release_edit_tiny.{safetensors,json}: the first denoising step of an
image-conditioned (editing) request, as numbers only.

Upstream's Instruct code (the official release has no image-conditioned code path) is carried by the fork
github.com/suryatmodulus/HunyuanImage-3.0 (commit 1ea1526, "Add support for hunyuanimage-3.0-Instruct &
hunyuanimage-3.0-Instruct-Distil"). This script imports, from a checkout of that fork (nothing of it is
copied into ditkv):

  hunyuan_image_3/modeling_hunyuan_image_3.py      `HunyuanImage3ForCausalMM` WITH its VAE
                                                   (`AutoencoderKLConv3D`), vision encoder (`Siglip2VisionTransformer`)
                                                   and aligner (`LightProjector`)
  hunyuan_image_3/tokenization_hunyuan_image_3.py  `HunyuanImage3TokenizerFast.apply_chat_template`: the
                                                   sequence, built on a small byte-level BPE tokenizer.json with
                                                   the release special tokens (trained here, stored in the fixture)
  hunyuan_image_3/image_processor.py               `HunyuanImage3ImageProcessor`: the input images' VAE bucket,
                                                   resize + centre crop, and the SigLIP2 preprocessing
                                                   (transformers' `Siglip2ImageProcessorFast`)

It builds a tiny float32 model (2 layers, 4 experts top-2 + shared expert, the ResBlock image path, a VAE of
5 x 32 channels at 16x with 4 latent channels and one frame (ffactor_temporal 1: encoding is the slow part on
CPU), a 2-layer SigLIP2 encoder with 8-pixel patches and at most 12 patches, an mlp_gelu aligner), sets EVERY
weight (VAE, vision encoder, aligner and transformer) from a seed (`seeded_weights`, the rule of
tools/make_transformer_fixture.py; the test draws the same ones, none are stored) and, for each case
(one input image with the pretrain template; two input images with the instruct template), runs what
`generate_image(prompt, image=[...], image_size="HxW", seed=SEED)` runs up to and including the first
denoising step, on CPU, with two CFG rows (cond, uncond):

    prepare_model_inputs(prompt, image=[PIL...], mode="gen_image", image_size="HxW", seed=SEED)
        apply_chat_template (tokens, slices), build_cond_images (VAE bucket + crop, SigLIP2 patches),
        generator = [torch.Generator(cpu).manual_seed(SEED)], _encode_cond_image: per image in order
        vae.encode(x).latent_dist.sample(generator), then (z - shift) * scale, cond timestep 0
    pipeline prepare_latents: randn_tensor((1, C, h, w), generator, dtype=bfloat16)   the initial noise,
        drawn from the same generator after the images' samples
    _prepare_attention_mask_for_generation                                     causal + full-attention slices
    prepare_inputs_for_generation(images=[x, x], timesteps=[1000, 1000]) ; forward(..., first_step=True)

The step itself runs in float32: the bf16 noise values are fed as float32 (the release pipeline feeds them
in bf16 under CUDA autocast); the KV cache (bf16 `HunyuanStaticCache`) is left out (the first step computes
the whole row anyway); `torch.cuda.set_device` / `nvtx.range` are no-ops on CPU. On CPU the fork's VAE runs
in float32 (its CUDA autocast is inert), so the posterior noise is drawn in float32 from the CPU generator.

Stored (safetensors), per case c in ("one", "two"):
  {c}.token_ids [2, L], {c}.pos [2, L, 2] (RoPE (y, x) the fork built; both int32), {c}.noise [1, C, h, w]
  (the bf16 initial noise, as fp32), {c}.velocity [2, C, h, w] (cond, uncond), and per input image j:
  {c}.vae_sample.{j} [1, C, hj, wj] (posterior sample, after shift/scale: what the DiT embeds),
  {c}.vae_mean.{j} (the posterior mean, same transform), {c}.vit.{j} [N, hidden] (vision encoder + aligner
  output, padding included).
The JSON holds the release-spelled config.json, tokenizer.json / tokenizer_config.json names, the weight rule
and shapes, the image rule, each case's request, slices, indices, the SHA-256 of each image's VAE crop
(uint8) and the router's smallest logit gap between the last chosen expert and the first left out
(1e-5 .. 4e-5 here, for logits of about 0.5: far above fp32 rounding, so routing is stable).

    git --git-dir=<mirror of suryatmodulus/HunyuanImage-3.0> archive 1ea1526 hunyuan_image_3 utils \
        | tar -x -C /tmp/ref_fork
    pip install --no-deps --target /tmp/hi3_deps transformers==4.56.2 huggingface_hub==0.35.3 \
        tokenizers==0.22.1 diffusers==0.35.2 einops               # tool-time only; not ditkv dependencies
    pip install --no-deps --target /tmp/hi3_tv torchvision==0.28.0   # the image processor's transforms
    PYTHONPATH=/tmp/hi3_deps:/tmp/hi3_tv python tools/make_edit_fixture.py --reference /tmp/ref_fork \
        [--cond-attn full|joint_full] [--out tests/fixtures/release_edit_tiny.safetensors]

`--cond-attn joint_full` (tests/fixtures/release_edit_joint_tiny.*): the same cases with the official base
config's `cond_token_attn_type`, one full-attention block over each input image's latent tokens,
`<joint_img_sep>` and vision tokens (the fork's `joint_image_slices`).

(A torchvision wheel built for another torch fails registering its C++ ops' meta kernels at import; the
image processor uses only its Python transforms, so `torchvision._meta_registrations`, which only
registers those, is stubbed when the import fails.)
"""

import argparse
import contextlib
import hashlib
import importlib
import json
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from make_transformer_fixture import WEIGHT_RULE, _report, seeded_weights

FORK = "suryatmodulus/HunyuanImage-3.0@1ea1526"
SEED = 42  # the request seed: the images' VAE samples, then the initial noise
TIMESTEP = 1000.0  # first step (sigma = 1)
IMAGE_BASE_SIZE = 256  # bucket step 16 px: every bucket side is a multiple of the release's align (16)
LATENT_CHANNELS = 4
NAMED = {"bos": "<|startoftext|>", "eos": "<|endoftext|>", "pad": "<pad>"}
SPECIALS = [*NAMED.values(), "<boi>", "<eoi>", "<img>", "<cfg>", "<timestep>", "<guidance>",
            f"<img_size_{IMAGE_BASE_SIZE}>", *[f"<img_ratio_{k}>" for k in range(37)], "<joint_img_sep>",
            "<think>", "</think>", "<recaption>", "</recaption>", "<answer>", "</answer>", "<timestep_r>"]

# (prompt, generated size, input images (h, w, seed) for `make_image`, template); the image ratios are near
# buckets of the 33, not the four extra sizes (those are absolute: 1024x768 ... whatever the base)
CASES = {
    "one": dict(prompt="make the fox blue and add falling snow", height=224, width=288,
                images=[(70, 54, 11)], sequence_template="pretrain"),
    "two": dict(prompt="put the cat from the second picture on the sofa", height=256, width=256,
                images=[(64, 64, 12), (46, 66, 13)], sequence_template="instruct"),
}

VIT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
       "num_channels": 3, "patch_size": 8, "num_patches": 16, "layer_norm_eps": 1e-6,
       "hidden_act": "gelu_pytorch_tanh", "attention_dropout": 0.0, "vision_use_head": True,
       "_attn_implementation": "eager", "output_attentions": False, "output_hidden_states": False,
       "use_return_dict": True}
VIT_PROCESSOR = {"image_processor_type": "Siglip2ImageProcessorFast", "patch_size": 8, "max_num_patches": 12,
                 "do_resize": True, "do_rescale": True, "do_normalize": True, "resample": 2,
                 "rescale_factor": 1 / 255, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
VIT_ALIGNER = {"projector_type": "mlp_gelu", "input_dim": 32, "n_embed": 64, "depth": 2}
VAE = {"in_channels": 3, "out_channels": 3, "latent_channels": LATENT_CHANNELS, "block_out_channels": [32] * 5,
       "layers_per_block": 1, "ffactor_spatial": 16, "ffactor_temporal": 1, "sample_size": 256, "sample_tsize": 4,
       "scaling_factor": 0.75, "shift_factor": 0.1, "downsample_match_channel": True,
       "upsample_match_channel": True}

# the release config (fork spellings); vocab_size and the special ids are filled from the tokenizer
CONFIG = dict(
    hidden_size=64, intermediate_size=48, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, attention_head_dim=16,
    hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
    rope_scaling={"type": "custom", "factor": 1.0}, use_qk_norm=True, use_rotary_pos_emb=True, norm_type="rms",
    num_experts=4, use_mixed_mlp_moe=True, num_shared_expert=1, moe_topk=2, capacity_factor=1.0,
    moe_drop_tokens=False, moe_layer_num_skipped=0, norm_topk_prob=True, routed_scaling_factor=1.0,
    group_limited_greedy=False, attention_bias=False, mlp_bias=False, use_cla=False, cla_share_factor=1,
    moe_impl="eager", img_proj_type="unet", patch_size=1, patch_embed_hidden_dim=32,
    vae_downsample_factor=[16, 16], image_base_size=IMAGE_BASE_SIZE, rope_type="2d",
    cond_image_type="vae_vit", cond_token_attn_type="full",
    vae_type="hunyuan-image-3-vae", vae_dtype="float32", vae_autocast_dtype="float32", vae=VAE,
    vit_type="siglip2-so400m-patch16-naflex", vit=VIT, vit_processor=VIT_PROCESSOR, vit_aligner=VIT_ALIGNER,
    cfg_distilled=False, use_meanflow=False, model_version="HunyuanImage-3.0-Instruct", torch_dtype="float32",
)


def make_image(h: int, w: int, seed: int) -> np.ndarray:
    """The input images (tests/test_release_edit.py has the same rule): uint8 [h, w, 3], a 2x nearest upsample
    of a half-size random draw (some structure for the resize to keep)."""
    small = np.random.default_rng(seed).integers(0, 256, (-(-h // 2), -(-w // 2), 3), dtype=np.uint8)
    return np.ascontiguousarray(small.repeat(2, 0).repeat(2, 1)[:h, :w])


def train_tokenizer():
    """A small byte-level BPE with the release special tokens (a few merges from the prompts)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [c["prompt"] for c in CASES.values()] * 3 + ["User: Assistant: \n\n"] * 2
    trainer = trainers.BpeTrainer(vocab_size=len(SPECIALS) + 256 + 40, special_tokens=SPECIALS,
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return tok


def _install_stubs() -> None:
    import diffusers  # noqa: F401  (first: both probe for torchvision)
    import transformers  # noqa: F401

    try:
        import torchvision
    except RuntimeError:  # a wheel for another torch: its meta-kernel registration fails; nothing else needs it
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")
        import torchvision  # noqa: F401


def _load_reference(root: Path):
    """The fork's modules, imported without its lazy package __init__ (which probes optional packages)."""
    _install_stubs()
    pkg = types.ModuleType("hunyuan_image_3")
    pkg.__path__ = [str(root / "hunyuan_image_3")]
    sys.modules["hunyuan_image_3"] = pkg
    ref = importlib.import_module("hunyuan_image_3.modeling_hunyuan_image_3")
    tkz = importlib.import_module("hunyuan_image_3.tokenization_hunyuan_image_3")
    ref.HunyuanStaticCache = lambda *a, **k: None  # bf16 K/V cache: left out, the step stays fp32
    torch.cuda.set_device = lambda *a, **k: None
    ref.nvtx.range = lambda *a, **k: contextlib.nullcontext()
    return ref, tkz


@contextlib.contextmanager
def _cpu_for_cuda_empty():
    """The fork's VAE keeps a `torch.empty(0, device="cuda")` for its distributed decode (never run here)."""
    real = torch.empty

    def empty(*a, device=None, **k):
        return real(*a, device="cpu" if device is not None and str(device).startswith("cuda") else device, **k)

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real


def run_case(ref, model, name: str, case: dict) -> tuple[dict, dict]:
    from diffusers.utils.torch_utils import randn_tensor
    from PIL import Image

    gen = model.generation_config
    gen.sequence_template, gen.drop_think = case["sequence_template"], False
    gen.max_length = model.config.max_position_embeddings  # HF's default 20; the release's generation_config sets it
    arrays = [make_image(h, w, s) for h, w, s in case["images"]]
    pil = [Image.fromarray(a) for a in arrays]
    H, W = case["height"], case["width"]
    with torch.no_grad():
        # generate_image: system prompt "" (use_system_prompt None), bot_task "auto", explicit image_size
        mk = model.prepare_model_inputs(prompt=case["prompt"], image=pil, mode="gen_image", image_size=f"{H}x{W}",
                                        system_prompt="", seed=SEED)
        info = mk["batch_gen_image_info"][0]
        generator = mk["generator"]
        # the pipeline's prepare_latents (batch_size 1): drawn after the images' posterior samples
        noise = randn_tensor((1, LATENT_CHANNELS, info.token_height, info.token_width), generator=generator,
                             device=torch.device("cpu"), dtype=torch.bfloat16)
        input_ids = mk.pop("input_ids")
        tok_out = mk["tokenizer_output"]
        mask = model._prepare_attention_mask_for_generation(input_ids, gen, model_kwargs=mk)
        mk["attention_mask"] = mask
        # what generate() sets before the pipeline
        img_id = model._tokenizer.img_token_id
        last = int(torch.where(input_ids[0] == img_id)[0][-1])
        model.post_token_len = int(input_ids.shape[1] - 1 - last)
        model.num_image_tokens = info.image_token_length
        model.num_special_tokens = 1
        x = noise.float()
        t = torch.tensor([TIMESTEP])
        inputs = model.prepare_inputs_for_generation(input_ids, images=torch.cat([x, x]), timesteps=t.repeat(2),
                                                     **mk)
        velocity = model(**inputs, first_step=True)["diffusion_prediction"].float()

        L = input_ids.shape[1]
        _, _, all_pos = ref.build_batch_2d_rope(seq_len=L, n_elem=model.config.attention_head_dim,
                                                image_infos=mk["rope_image_info"], base=model.config.rope_theta,
                                                return_all_pos=True)
        pos = torch.stack([p[:, 0, :] for p in all_pos])

        # the images: what the DiT embeds for each (the cond row's; the uncond row gets the same)
        conds = mk["batch_cond_images"][0]
        cvae = mk["cond_vae_images"]
        per_row = cvae[0] if isinstance(cvae, list) else cvae[:1]
        samples = [z[None] if z.dim() == 3 else z for z in (list(per_row) if isinstance(per_row, list)
                                                             else list(per_row.split(1)))]
        assert len(samples) == len(conds)
        if isinstance(cvae, list):  # the uncond row's images are the cond row's (cfg repeat of the same list)
            for a, b in zip(cvae[0], cvae[1]):
                assert torch.equal(a, b)
        else:
            assert torch.equal(cvae[0], cvae[1])
        cfgv = model.vae.config
        means, vits, crops = [], [], []
        for c in conds:
            v = c.vae_image
            post = model.vae.encode(v[None]).latent_dist
            means.append(((post.mean - cfgv.shift_factor) * cfgv.scaling_factor).squeeze(2))
            u8 = ((v * 0.5 + 0.5) * 255).round().clamp(0, 255).to(torch.uint8)
            crops.append({"size": [int(v.shape[1]), int(v.shape[2])],
                          "sha256": hashlib.sha256(u8.permute(1, 2, 0).contiguous().numpy().tobytes()).hexdigest()})
            kw = c.vit_image.vision_encoder_kwargs
            feats = model._forward_vision_encoder(c.vit_image[None].float(),
                                                  attention_mask=kw["pixel_attention_mask"][None],
                                                  spatial_shapes=kw["spatial_shapes"][None])
            vits.append(feats[0])

    # the mask: causal + the full-attention slices of each row (checked), the same in both rows
    spans = []
    for i in range(input_ids.shape[0]):
        sl = model.image_processor.prepare_full_attn_slices(tok_out, i)
        want = torch.ones(L, L, dtype=torch.bool).tril()
        for s in sl:
            want[s, s] = True
        assert torch.equal(mask[i, 0], want), "the fork's mask is not causal + the full-attention slices"
        spans.append(sorted([s.start, s.stop] for s in sl))
    assert spans[0] == spans[1]
    ts = [int(i) for i in tok_out.gen_timestep_scatter_index.reshape(2, -1)[0]]
    cts = tok_out.cond_timestep_scatter_index
    cond_ts = [int(i) for i in cts.reshape(2, -1)[0]] if cts is not None else []
    assert torch.equal(mk["cond_timesteps"] if isinstance(mk["cond_timesteps"], torch.Tensor)
                       else torch.cat(mk["cond_timesteps"]), torch.zeros_like(
                           mk["cond_timesteps"] if isinstance(mk["cond_timesteps"], torch.Tensor)
                           else torch.cat(mk["cond_timesteps"])))
    images_meta = []
    for j, c in enumerate(conds):
        vi, ti = c.vae_image.i, c.vit_image.i
        images_meta.append({
            "size_hw": list(arrays[j].shape[:2]), "seed": case["images"][j][2],
            "vae_bucket_hw": [vi.image_height, vi.image_width], "vae_tokens_hw": [vi.token_height, vi.token_width],
            "ratio_index": int(vi.ratio_index), "vit_grid_hw": [ti.token_height, ti.token_width],
            "vit_tokens": int(ti.image_token_length), "vae_crop_uint8": crops[j],
            "vae_slice": [tok_out.vae_image_slices[0][j].start, tok_out.vae_image_slices[0][j].stop],
            "vit_slice": [tok_out.vit_image_slices[0][j].start, tok_out.vit_image_slices[0][j].stop],
            "timestep_index": cond_ts[j],
        })
    tensors = {f"{name}.token_ids": input_ids.int(), f"{name}.pos": pos.int(), f"{name}.noise": x,
               f"{name}.velocity": velocity}
    for j in range(len(conds)):
        tensors[f"{name}.vae_sample.{j}"] = samples[j].float()
        tensors[f"{name}.vae_mean.{j}"] = means[j].float()
        tensors[f"{name}.vit.{j}"] = vits[j].float()
    gi = tok_out.gen_image_slices[0][0]
    meta = {
        "prompt": case["prompt"], "height": H, "width": W, "sequence_template": case["sequence_template"],
        "system_prompt": None, "seed": SEED, "timestep": TIMESTEP, "cfg_rows": ["cond", "uncond"],
        "token_height": info.token_height, "token_width": info.token_width, "ratio_index": int(info.ratio_index),
        "image_span": [gi.start, gi.stop], "timestep_index": ts[0], "full_attn_spans": spans[0],
        "images": images_meta,
        "uncond_cfg_positions": [int(i) for i in torch.where(input_ids[0] != input_ids[1])[0]],
    }
    return {k: v.detach().contiguous() for k, v in tensors.items()}, meta


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reference", required=True, help="checkout of suryatmodulus/HunyuanImage-3.0 (commit 1ea1526)")
    p.add_argument("--cond-attn", default="full", choices=["full", "joint_full"],
                   help="cond_token_attn_type: 'full' (two blocks per input image) or 'joint_full' (one block over "
                        "latent tokens, separator and vision tokens: the official base config's value)")
    p.add_argument("--out", default=None, help="default: tests/fixtures/release_edit_tiny.safetensors "
                                               "(release_edit_joint_tiny.safetensors for joint_full)")
    a = p.parse_args(argv)
    CONFIG["cond_token_attn_type"] = a.cond_attn
    name = "release_edit_tiny" if a.cond_attn == "full" else "release_edit_joint_tiny"
    out = Path(a.out or ROOT / f"tests/fixtures/{name}.safetensors")
    ref, tkz = _load_reference(Path(a.reference).resolve())
    from hunyuan_image_3.configuration_hunyuan_image_3 import HunyuanImage3Config

    tok = train_tokenizer()
    with tempfile.TemporaryDirectory() as d:
        tok.save(f"{d}/tokenizer.json")
        hf = tkz.HunyuanImage3TokenizerFast(tokenizer_file=f"{d}/tokenizer.json",
                                            model_version=CONFIG["model_version"],
                                            **{f"{k}_token": v for k, v in NAMED.items()})
    ids = {name: tok.token_to_id(name) for name in SPECIALS}
    vocab = tok.get_vocab_size(with_added_tokens=True)
    vocab = -(-vocab // 64) * 64  # an embedding table a little larger than the tokenizer, as the release's
    config_kw = dict(CONFIG, vocab_size=vocab, bos_token_id=ids[NAMED["bos"]], eos_token_id=ids[NAMED["eos"]],
                     pad_token_id=ids[NAMED["pad"]], pad_id=ids[NAMED["pad"]], image_token_id=ids["<img>"],
                     # ditkv's config.json keys for the special ids (read without a tokenizer.json; with one,
                     # as here, ditkv resolves them by name): the tokenizer's ids, so the tiny vocabulary holds them
                     timestep_token_id=ids["<timestep>"], boi_token_id=ids["<boi>"], eoi_token_id=ids["<eoi>"],
                     guidance_token_id=ids["<guidance>"], cfg_token_id=ids["<cfg>"],
                     img_size_token_id=ids[f"<img_size_{IMAGE_BASE_SIZE}>"], img_ratio_token_id=ids["<img_ratio_0>"],
                     num_ratio_tokens=33)
    config = HunyuanImage3Config(**config_kw)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with _cpu_for_cuda_empty():
        model = ref.HunyuanImage3ForCausalMM(config).float().eval()
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.load_state_dict(seeded_weights(shapes), strict=True)
    model._tokenizer = hf

    margins = []  # router logit gap between the last chosen expert and the first left out (a tie flips routing)

    def gate_hook(mod, args, _out):
        x = args[0].reshape(-1, args[0].shape[-1]).float()
        logits = torch.nn.functional.linear(x, mod.wg.weight.float())  # ranked as their softmax
        top = logits.topk(mod.moe_topk + 1, dim=-1).values
        margins.append(float((top[:, -2] - top[:, -1]).min()))

    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(gate_hook)

    tensors, cases = {}, {}
    for name, case in CASES.items():
        margins.clear()
        t, m = run_case(ref, model, name, case)
        m["min_router_logit_gap"] = min(margins)
        tensors.update(t)
        cases[name] = m
        rel_u = ((t[f"{name}.velocity"][0] - t[f"{name}.velocity"][1]).abs().max()
                 / t[f"{name}.velocity"].abs().max()).item()
        shown = [(i["vae_bucket_hw"], i["ratio_index"], i["vit_grid_hw"]) for i in m["images"]]
        print(f"case {name}: {t[f'{name}.token_ids'].shape[1]} tokens, spans {m['full_attn_spans']}, timestep "
              f"{m['timestep_index']}, images (bucket, ratio, vit grid) {shown}, "
              f"cond/uncond velocity differ (rel) {rel_u:.3g}, min router logit gap {m['min_router_logit_gap']:.3g}")
    for k, v in tensors.items():
        _report(k, v)

    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata={"source": f"{FORK} hunyuan_image_3/modeling_hunyuan_image_3.py"})
    meta = {
        "source": f"{FORK} hunyuan_image_3/modeling_hunyuan_image_3.py HunyuanImage3ForCausalMM "
                  "(prepare_model_inputs with input images, _prepare_attention_mask_for_generation, "
                  "prepare_inputs_for_generation, forward first_step=True), the sequence from "
                  "tokenization_hunyuan_image_3.py apply_chat_template, the images from image_processor.py; "
                  "noise as hunyuan_image_3_pipeline.py prepare_latents",
        "config": json.loads(config.to_json_string(use_diff=True)),
        "tokenizer_json": tok.to_str(),
        "named_specials": NAMED,
        "dtype": "float32",
        "weights": WEIGHT_RULE + " (every key: transformer, vae.*, vision_model.*, vision_aligner.*)",
        "weight_shapes": {k: list(v) for k, v in shapes.items()},
        "image_rule": "make_image(h, w, seed): small = np.random.default_rng(seed).integers(0, 256, (ceil(h/2), "
                      "ceil(w/2), 3), dtype=np.uint8); small.repeat(2, 0).repeat(2, 1)[:h, :w] (RGB)",
        "seed_rule": "one torch.Generator('cpu').manual_seed(seed) per request: each input image in order draws "
                     "its VAE posterior noise (randn of the posterior's shape [1, C, 1, h, w], fp32 on CPU), then the "
                     "initial noise randn((1, C, h, w), dtype=bfloat16) (at these shapes the fp32 draw rounded to bf16; not in general)",
        "cases": cases,
        "left_out": ["KV cache (bf16 HunyuanStaticCache)", "bf16 autocast of the CUDA pipeline (fp32 here)",
                     "AR image-ratio prediction (image_size is given)"],
        "shapes": {k: list(v.shape) for k, v in tensors.items()},
    }
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"{out.stat().st_size / 1024:.1f} KiB -> {out} (+ {out.with_suffix('.json').stat().st_size / 1024:.1f} KiB "
          f"{out.with_suffix('.json').name})")


if __name__ == "__main__":
    main()
