"""Regenerate tests/fixtures/release_transformer_tiny.{safetensors,json}: the release transformer's first
denoising step, as numbers only.

This script imports the release model code (hunyuan_image_3/hunyuan.py of
github.com/Tencent-Hunyuan/HunyuanImage-3.0) from a checkout; nothing of it is copied into ditkv. It
builds a tiny float32 `HunyuanImage3ForCausalMM` (2 layers, 4 experts top-2 plus the shared expert, the
ResBlock image path), sets every transformer weight from a seed (`seeded_weights`: the test draws the
same ones, so none are stored) and runs ONE first denoising step of a text-to-image request with two
CFG rows (cond, uncond) on CPU, driven the way the release pipeline drives it:

    prepare_model_inputs(prompt, mode="gen_image", image_size="HxW")   token ids, 2D RoPE, image mask
    _prepare_attention_mask_for_generation                             the 4-D boolean mask
    prepare_inputs_for_generation(images=[x, x], timestep=[t, t])      the step's inputs
    forward(..., first_step=True)["diffusion_prediction"]              the velocity [2, C, h, w]

The prompt is encoded by a stand-in tokenizer with ditkv's byte ids (`ByteTokenizer`), its special
tokens mapped to ditkv's tiny special ids, through the release `TokenizerWrapper` (pretrain sequence
template, no system prompt: `<bos> prompt <boi> <img_size_B> <img_ratio_k> <timestep> <img>*h*w <eoi>`).

Left out of the release run, and why:
  - the KV cache: the release's `HunyuanStaticCache` stores K/V in bfloat16; the step runs without a
    cache so every number stays float32 (the first step computes the whole row anyway);
  - the VAE and the vision encoder/aligner (`vae.*`, `vision_model.*`, `vision_aligner.*`): a text-to-image
    denoising step does not run them, so they are built as empty modules (no weights);
  - the image processor's torchvision / SigLIP2 preprocessing (image-conditioned inputs only): stubbed,
    its resolution-bucket code (`build_image_info`) runs unchanged;
  - `torch.cuda.set_device` / `nvtx.range` (CUDA-only calls in the MoE forward): no-ops on CPU.

Stored (safetensors): `latents` [1, C, h, w] (randn, seed 1), `timestep` [1], `velocity` [2, C, h, w]
(cond, uncond), `token_ids` [2, L] and `pos` [2, L, 2] (the release's RoPE (y, x) positions), all from
the release. The JSON holds the release config.json (release spellings, plus the special ids ditkv
reads from it when there is no tokenizer.json), the weight rule, the request, the mask's shape and the
router margins (how far each top-k choice is from a tie; far from zero, so routing is stable).

    git clone https://github.com/Tencent-Hunyuan/HunyuanImage-3.0 /tmp/hi3
    pip install "transformers>=4.56,<5" einops diffusers   # tool-time only; not ditkv dependencies
    python tools/make_transformer_fixture.py --reference /tmp/hi3 [--out tests/fixtures/release_transformer_tiny.safetensors]

(transformers 4.56 wants huggingface_hub < 1.0; where the environment has a newer hub, install
transformers 4.56.2, huggingface_hub 0.35.3, tokenizers 0.22.1 and diffusers 0.35.2 with
`pip install --no-deps --target DIR` and run with PYTHONPATH=DIR.)
"""

import argparse
import contextlib
import json
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ditkv.models.hunyuan.tokenizer import BYTE_SPECIAL_IDS, BYTE_VOCAB_SIZE, ByteTokenizer  # noqa: E402

PROMPT = "a red fox sitting in fresh snow"
HEIGHT, WIDTH = 288, 224  # a resolution bucket at image_base_size 256: 18 x 14 latent cells
TIMESTEP = 1000.0  # the first step's timestep (sigma = 1)
LATENT_SEED = 1
IMAGE_BASE_SIZE = 256
LATENT_CHANNELS = 8

S = BYTE_SPECIAL_IDS
# The release config (HunyuanImage3Config keyword names = config.json spellings). The last group are the
# special ids ditkv reads from config.json when the folder has no tokenizer.json.
CONFIG = dict(
    vocab_size=BYTE_VOCAB_SIZE, hidden_size=64, intermediate_size=48, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, attention_head_dim=16,
    hidden_act="silu", max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
    rope_scaling={"type": "custom", "factor": 1.0}, use_qk_norm=True, use_rotary_pos_emb=True, norm_type="rms",
    num_experts=4, use_mixed_mlp_moe=True, num_shared_expert=1, moe_topk=2, capacity_factor=1.0,
    moe_drop_tokens=False, moe_layer_num_skipped=0, norm_topk_prob=True, routed_scaling_factor=1.0,
    group_limited_greedy=False, attention_bias=False, mlp_bias=False, use_cla=False, cla_share_factor=1,
    moe_impl="eager", img_proj_type="unet", patch_size=1, patch_embed_hidden_dim=32,
    vae_downsample_factor=[16, 16], image_base_size=IMAGE_BASE_SIZE,
    vae={"latent_channels": LATENT_CHANNELS, "ffactor_spatial": 16},
    bos_token_id=S["<bos>"], eos_token_id=S["<eos>"], pad_token_id=S["<pad>"], pad_id=S["<pad>"],
    image_token_id=S["<img>"], torch_dtype="float32",
    timestep_token_id=S["<timestep>"], boi_token_id=S["<boi>"], eoi_token_id=S["<eoi>"],
    guidance_token_id=S["<guidance>"], cfg_token_id=S["<cfg>"], img_size_token_id=S["<img_size>"],
    img_ratio_token_id=S["<img_ratio_0>"], num_ratio_tokens=33,
)

WEIGHT_RULE = ("not stored: g = torch.Generator().manual_seed(0); for each transformer state_dict key in sorted "
               "order w = torch.randn(shape, generator=g) * 0.05, plus 1.0 for 1-D '.weight' tensors (RMSNorm / "
               "GroupNorm scales)")


def seeded_weights(shapes: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """Every weight from one seed, key by key in sorted name order (tests/test_release_transformer.py
    draws the same): randn * 0.05, norm scales (1-D `.weight`) around 1."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for k in sorted(shapes):
        w = torch.randn(shapes[k], generator=g) * 0.05
        if k.endswith(".weight") and len(shapes[k]) == 1:
            w += 1.0
        out[k] = w
    return out


class _StandInTokenizer:
    """What the release TokenizerWrapper reads from a tokenizer: ditkv's byte ids and tiny special ids."""

    def __init__(self) -> None:
        names = {"<pad>": S["<pad>"], "<boi>": S["<boi>"], "<eoi>": S["<eoi>"], "<img>": S["<img>"],
                 "<cfg>": S["<cfg>"], "<timestep>": S["<timestep>"], "<guidance>": S["<guidance>"],
                 f"<img_size_{IMAGE_BASE_SIZE}>": S["<img_size>"],
                 # never produced by the pretrain text-to-image sequence; unused ids of the byte vocabulary
                 "</answer>": BYTE_VOCAB_SIZE - 3, "</recaption>": BYTE_VOCAB_SIZE - 2,
                 "<joint_img_sep>": BYTE_VOCAB_SIZE - 1}
        names.update({f"<img_ratio_{k}>": S["<img_ratio_0>"] + k for k in range(33)})
        self.added_tokens_encoder = names
        self.bos_token_id, self.eos_token_id, self.pad_token_id = S["<bos>"], S["<eos>"], S["<pad>"]
        self._bytes = ByteTokenizer()

    def convert_tokens_to_ids(self, name):
        return self.added_tokens_encoder[name]

    def encode(self, text, add_special_tokens=False):
        assert not add_special_tokens
        return self._bytes.encode(text)

    def decode(self, ids, **kwargs):
        return self._bytes.decode(ids)


def _install_stubs() -> None:
    """torchvision is only needed by the image processor's image-conditioning transforms."""
    import diffusers  # noqa: F401  (first: both probe for torchvision, which a stub would confuse)
    import transformers  # noqa: F401

    if "torchvision" not in sys.modules:
        try:
            import torchvision  # noqa: F401
        except ImportError:
            tv = types.ModuleType("torchvision")
            tv.transforms = types.SimpleNamespace(Compose=lambda *a, **k: None, ToTensor=lambda *a, **k: None,
                                                  Normalize=lambda *a, **k: None)
            sys.modules["torchvision"] = tv
            sys.modules["torchvision.transforms"] = tv.transforms


class _Empty(torch.nn.Module):
    @classmethod
    def from_config(cls, *a, **k):
        return cls()

    def __init__(self, *a, **k):
        super().__init__()


class _NoProcessor:
    @classmethod
    def from_dict(cls, *a, **k):
        return cls()


def _load_reference(root: Path):
    _install_stubs()
    sys.path.insert(0, str(root))
    import hunyuan_image_3.image_processor as ip
    import hunyuan_image_3.hunyuan as ref

    ip.Siglip2ImageProcessorFast = _NoProcessor
    ref.AutoencoderKLConv3D = _Empty  # not run by a text-to-image denoising step
    ref.Siglip2VisionTransformer = _Empty
    ref.LightProjector = _Empty
    ref.HunyuanStaticCache = lambda *a, **k: None  # bf16 K/V cache: left out, the step stays fp32
    torch.cuda.set_device = lambda *a, **k: None
    ref.nvtx.range = lambda *a, **k: contextlib.nullcontext()
    return ref


def _report(name: str, t: torch.Tensor) -> None:
    print(f"{name:12s} {str(list(t.shape)):20s} max|x| = {t.float().abs().max().item():.6g}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reference", required=True, help="checkout of Tencent-Hunyuan/HunyuanImage-3.0")
    p.add_argument("--out", default=str(ROOT / "tests/fixtures/release_transformer_tiny.safetensors"))
    a = p.parse_args(argv)
    out = Path(a.out)
    ref = _load_reference(Path(a.reference).resolve())
    from hunyuan_image_3.configuration_hunyuan import HunyuanImage3Config

    config = HunyuanImage3Config(**CONFIG)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = ref.HunyuanImage3ForCausalMM(config).float().eval()
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.load_state_dict(seeded_weights(shapes), strict=True)
    model.load_tokenizer(_StandInTokenizer())
    gen = model.generation_config
    gen.sequence_template, gen.drop_think = "pretrain", False

    # router margins: p_k - p_{k+1} of every token's softmax (top-k choice vs the first one left out)
    margins = []

    def gate_hook(mod, args, _out):
        x = args[0].reshape(-1, args[0].shape[-1]).float()
        probs = torch.nn.functional.linear(x, mod.wg.weight.float()).softmax(-1)
        top = probs.topk(mod.moe_topk + 1, dim=-1).values
        margins.append(float((top[:, -2] - top[:, -1]).min()))

    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(gate_hook)

    with torch.no_grad():
        mk = model.prepare_model_inputs(prompt=PROMPT, mode="gen_image", image_size=f"{HEIGHT}x{WIDTH}", seed=0)
        input_ids = mk.pop("input_ids")
        mask = model._prepare_attention_mask_for_generation(input_ids, gen, model_kwargs=mk)
        mk["attention_mask"] = mask
        torch.manual_seed(LATENT_SEED)
        info = mk["batch_gen_image_info"][0]
        latents = torch.randn(1, LATENT_CHANNELS, info.token_height, info.token_width)
        t = torch.tensor([TIMESTEP])
        inputs = model.prepare_inputs_for_generation(input_ids, images=torch.cat([latents] * 2),
                                                     timestep=t.repeat(2), **mk)
        velocity = model(**inputs, first_step=True)["diffusion_prediction"].float()

        # the RoPE positions the release used, and the mask's structure
        tok_out = mk["tokenizer_output"]
        rope_info = [[(sl, (info.token_height, info.token_width)) for sl in tok_out.gen_image_slices[i]]
                     for i in range(input_ids.shape[0])]
        _, _, all_pos = ref.build_batch_2d_rope(seq_len=input_ids.shape[1], n_elem=config.attention_head_dim,
                                                image_infos=rope_info, base=config.rope_theta, return_all_pos=True)
        pos = torch.stack([p_[:, 0, :] for p_ in all_pos])  # [2, L, (y, x)]

    L = input_ids.shape[1]
    spans = []
    for i in range(input_ids.shape[0]):
        (sl,) = tok_out.gen_image_slices[i]
        want = torch.ones(L, L, dtype=torch.bool).tril()
        want[sl, sl] = True
        assert torch.equal(mask[i, 0], want), "the release mask is not causal + one bidirectional image block"
        spans.append([sl.start, sl.stop])

    tensors = {"latents": latents, "timestep": t, "velocity": velocity, "token_ids": input_ids.long(),
               "pos": pos.long()}
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    for k, v in tensors.items():
        _report(k, v)
    print(f"rows: {L} tokens; image span {spans}; timestep index {tok_out.gen_timestep_scatter_index.tolist()}; "
          f"min router margin {min(margins):.3g}")

    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata={"source": "Tencent-Hunyuan/HunyuanImage-3.0 hunyuan_image_3/hunyuan.py"})
    meta = {
        "source": "Tencent-Hunyuan/HunyuanImage-3.0 hunyuan_image_3/hunyuan.py HunyuanImage3ForCausalMM.forward "
                  "(first_step=True, mode=gen_image), driven as hunyuan_image_3_pipeline.py's first step",
        "config": json.loads(config.to_json_string(use_diff=True)),
        "dtype": "float32",
        "weights": WEIGHT_RULE,
        "weight_shapes": {k: list(v) for k, v in shapes.items()},
        "request": {"prompt": PROMPT, "height": HEIGHT, "width": WIDTH, "cfg_rows": ["cond", "uncond"],
                    "sequence_template": "pretrain", "system_prompt": None,
                    "token_height": info.token_height, "token_width": info.token_width,
                    "base_size": info.base_size, "ratio_index": int(info.ratio_index)},
        "latents": f"torch.manual_seed({LATENT_SEED}); torch.randn(1, {LATENT_CHANNELS}, h, w); both CFG rows "
                   "get the same latents",
        "timestep": TIMESTEP,
        "image_spans": spans,
        "timestep_index": tok_out.gen_timestep_scatter_index.reshape(-1).tolist(),
        "attention_mask": "per row: causal, plus bidirectional within the image span [start, stop) (checked)",
        "min_router_margin": min(margins),
        "left_out": ["KV cache (release: bf16 HunyuanStaticCache)", "VAE / vision encoder / aligner (not run)",
                     "image processor torchvision/SigLIP2 transforms (stubbed)"],
        "shapes": {k: list(v.shape) for k, v in tensors.items()},
    }
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"{out.stat().st_size / 1024:.1f} KiB -> {out} (+ {out.with_suffix('.json').name})")


if __name__ == "__main__":
    main()
