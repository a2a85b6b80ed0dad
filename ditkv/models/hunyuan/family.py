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

    def banned_generation_ids(self, cfg) -> set[int]:
        from .tokenizer import banned_generation_ids

        return banned_generation_ids(cfg)

    def output_bucket(self, cfg, height: int, width: int):
        from .buckets import output_bucket

        return output_bucket(cfg, height, width)

    def fixed_prompt_tokenizer(self, tokenizer, ids):
        from .tokenizer import FixedPromptTokenizer

        return FixedPromptTokenizer(tokenizer, ids)

    @property
    def template(self):
        from . import template

        return template

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
