"""HunyuanImage-3.0 as a model family (`models/family.py`): each method is this package's own function."""

from __future__ import annotations

import contextlib

import msgspec

from ..family_api import ModelFamily


class HunyuanImage3Family(ModelFamily):
    name = "hunyuan_image_3"

    # ---- preprocessing ------------------------------------------------------------------------
    def request_layout(self, cfg, tokenizer, prompt, height, width, guidance, negative_prompt=None, **kw):
        from .layout import build_request_layout

        return build_request_layout(cfg, tokenizer, prompt, height, width, guidance, negative_prompt, **kw)

    def ar_head(self, cfg, tokenizer, prompt, height, width, **kw):
        from .layout import build_ar_head

        return build_ar_head(cfg, tokenizer, prompt, height, width, **kw)

    def image_tail_ids(self, cfg, height: int, width: int) -> list[int]:
        from .layout import image_tail_ids

        return image_tail_ids(cfg, height, width)

    def size_tail_ids(self, cfg) -> list[int]:
        from .layout import size_tail_ids

        return size_tail_ids(cfg)

    def auto_sizes(self, cfg):
        from .buckets import auto_sizes

        return auto_sizes(cfg)

    def auto_size_default(self, cfg) -> bool:
        """A request without a size is size=auto (generation_config.json's `image_size: auto`)."""
        return (cfg.extra or {}).get("image_size") == "auto"

    def banned_generation_ids(self, cfg) -> set[int]:
        from .tokenizer import banned_generation_ids

        return banned_generation_ids(cfg)

    def output_bucket(self, cfg, height: int, width: int):
        from .buckets import output_bucket

        return output_bucket(cfg, height, width)

    def text_task(self, cfg, tokenizer, template):
        from .text_task import TextTask

        return TextTask(cfg, tokenizer, template)

    @property
    def template(self):
        from . import template

        return template

    def prefix_block_keys(self, cfg, layout, seed: int, block_size: int) -> list[tuple[bytes, ...]]:
        from .prefix_keys import prefix_block_keys

        return prefix_block_keys(cfg, layout, seed, block_size)

    def input_image_keys(self, layout, seed: int) -> list[bytes]:
        from .prefix_keys import image_digest

        return [image_digest(im, j, seed) for j, im in enumerate(layout.images)]

    def input_image_tokens(self, cfg, max_height: int, max_width: int) -> int:
        """The most embedding tokens one input image can bring (0: the model takes none): its latent cells
        at its largest bucket (the release's buckets; without `image_base_size`, the generated size) plus
        its vision tokens. What one entry of the encoder cache holds, `hidden_size` wide."""
        if not cfg.max_input_images:
            return 0
        from . import buckets, vision

        ds = cfg.image_token_downsample
        sizes = ([(max_height, max_width)] if cfg.image_base_size is None
                 else [*buckets.bucket_table(cfg.image_base_size), *vision.EXTRA_RESOLUTIONS])
        vit = (vision.VisionConfig.from_extra(cfg.extra, cfg.hidden_size).max_num_patches
               if cfg.cond_image_type == "vae_vit" else 0)
        return max((h // ds) * (w // ds) for h, w in sizes) + vit

    def ar_head_block_keys(self, cfg, head_ids, block_size: int, head=None, seed: int = 0) -> tuple[bytes, ...]:
        """`head`: the `ARHead` of a head with input images (its ids must be `head_ids`), whose pages
        also name each image and `seed` (the AR's VAE seed); None: a text head."""
        from .prefix_keys import image_head_keys, text_head_keys

        if head is None:
            return text_head_keys(cfg, head_ids, block_size)
        if list(head.token_ids) != list(head_ids):
            raise ValueError("the AR head's image layout does not match its token ids")
        return image_head_keys(cfg, head, seed, block_size)

    # ---- the wire -----------------------------------------------------------------------------
    def layout_to_wire(self, layout) -> bytes:
        from .layout_wire import to_wire

        return msgspec.msgpack.encode(to_wire(layout))

    def layout_from_wire(self, data: bytes):
        from .layout_wire import WireLayout, from_wire

        return from_wire(msgspec.msgpack.decode(data, type=WireLayout))

    # ---- sampling -----------------------------------------------------------------------------
    def sampler(self, cfg):
        from .sampler import FlowMatchEulerSampler

        return FlowMatchEulerSampler(cfg.flow_shift)

    def initial_noise(self, cfg, h: int, w: int, seed: int, device="cpu"):
        from .sampler import initial_latents

        return initial_latents(cfg, h, w, seed, device)

    def noise(self, shape, generator):
        from .sampler import release_noise

        return release_noise(shape, generator)

    # ---- the step's inputs and heads ----------------------------------------------------------
    def guidance_value(self, scale: float):
        from .model import guidance_value

        return guidance_value(scale)

    # ---- loading and sharding -----------------------------------------------------------------
    def claims(self, config_json: dict) -> bool:
        """ditkv's own config.json (no model_type) or the release's (HunyuanImage-3.0's class names)."""
        from .release_keys import is_release_file

        return config_json.get("model_type") is None or is_release_file(config_json)

    def load(self, folder, device, dtype, quantization=None, ignored: tuple = ()):
        """(model, tokenizer, codec) from `folder` (None: the deterministic tiny preset)."""
        from . import ByteTokenizer, HunyuanImage3Config, HunyuanImage3Model, load_checkpoint, load_tokenizer
        from .checkpoint import load_vae
        from .codec import make_codec
        from .quantize import apply_quantization

        if folder is None:
            model = HunyuanImage3Model.from_config(HunyuanImage3Config.tiny(), seed=0).to(device=device, dtype=dtype)
            if quantization is not None:
                model = apply_quantization(model, quantization, tuple(ignored))
            return model.eval(), ByteTokenizer(), make_codec(model.config)
        tok = load_tokenizer(folder)  # first: a broken tokenizer.json fails before the weights load
        model = load_checkpoint(folder, device=device, dtype=dtype, quantization=quantization, ignored=ignored)
        vae = load_vae(folder, model.config, device, dtype)
        return model.eval(), tok, make_codec(model.config, vae)

    def load_shard(self, folder, spec, device, dtype, quantization=None, ignored: tuple = ()):
        """`load` for one TP/EP rank: only its shard of the folder is read."""
        from . import load_tokenizer
        from .checkpoint import load_vae
        from .codec import make_codec
        from .sharded_load import load_checkpoint_shard

        tok = load_tokenizer(folder)  # first, as in load
        model = load_checkpoint_shard(folder, spec, device=device, dtype=dtype, quantization=quantization,
                                      ignored=ignored)
        return model, tok, make_codec(model.config, load_vae(folder, model.config, device, dtype))

    def load_frontend(self, folder):
        """(model config, tokenizer) without weights (None: the tiny preset's)."""
        from . import ByteTokenizer, HunyuanImage3Config, load_tokenizer
        from .checkpoint import load_model_config

        if folder is None:
            return HunyuanImage3Config.tiny(), ByteTokenizer()
        return load_model_config(folder), load_tokenizer(folder)

    def apply_quantization(self, model, method: str, ignored: tuple = ()):
        from .quantize import apply_quantization

        return apply_quantization(model, method, tuple(ignored))

    def shard_of(self, model):
        from .sharded_load import shard_of

        return shard_of(model)

    def shard_key(self, parallel):
        from .sharded_load import shard_key

        return shard_key(parallel)

    def shard_model(self, model, parallel):
        from .parallel_layers import shard_model

        return shard_model(model, parallel)

    def quantization_of(self, model):
        from .quantize import quantization_of

        return quantization_of(model)

    def move_model(self, model, device, dtype):
        """`model.to(device, dtype)` that keeps FP8 weights and their scales as they are."""
        from .quantize import move_model

        return move_model(model, device, dtype)

    # ---- run-time modes -----------------------------------------------------------------------
    def set_fused_elementwise(self, on: bool) -> None:
        from .fused import set_fused_elementwise

        set_fused_elementwise(on)

    def set_batch_invariant(self, on: bool) -> None:
        from .invariant import set_batch_invariant

        set_batch_invariant(on)

    def batch_invariant_unusable(self, device):
        from .invariant import unusable

        return unusable(device)

    # ---- CUDA graphs --------------------------------------------------------------------------
    def graph_blocker(self, model, device) -> str | None:
        """Why the model's step cannot be captured on `device` (None: it can): the MoE must size
        expert batches on the device (the grouped GEMM)."""
        from .layers import RoutedExperts

        for m in model.modules():
            if isinstance(m, RoutedExperts) and m.resolved_impl(device, model.dtype) != "grouped":
                return ("the MoE runs its per-expert loop, which sizes expert batches on the host; the grouped "
                        "GEMM needs bf16 on sm90/sm100 (dtype=bfloat16)")
        return None

    def prepare_capture(self, model) -> None:
        from .layers import stack_experts

        stack_experts(model)  # the grouped MoE reads stacked weights: stack before, never inside, capture

    def dense_routing(self, model) -> contextlib.AbstractContextManager:
        from .moe_routing import graph_safe_moe

        return graph_safe_moe(model)
