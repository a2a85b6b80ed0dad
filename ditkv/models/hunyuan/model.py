"""HunyuanImage-3.0 as plain torch modules, with release parameter names.

The model does not own attention or a KV cache: `backbone` projects q/k/v for every layer and
hands them to a caller-supplied `attn(layer, q, k, v)` callback, which may write them into a
paged cache and apply any mask it likes. Tokens are packed rows [N, hidden]; nothing here
assumes which row a token belongs to.

Top-level names (so release state dicts load unchanged):
    model.wte, model.layers.{i}.*, model.ln_f, lm_head,
    patch_embed.model.{0: conv3x3, 1: ResBlock}, final_layer.model.{0: ResBlock, 1: norm/act/conv},
    timestep_emb, time_embed, time_embed_2 (TimestepEmbedder, `mlp.0` / `mlp.2`), guidance_emb
    (distilled checkpoints only), and vision_model / vision_aligner (input images through a vision encoder:
    `max_input_images > 0` with cond_image_type "vae_vit"; vision.py).
"""

from __future__ import annotations

import zlib
from typing import Callable

import torch
from torch import nn

from ditkv.errors import ConfigError, LayoutError
from ditkv.models import fp8
from ditkv.models.hunyuan import fp8_layer, invariant
from ditkv.models.hunyuan.config import HunyuanImage3Config
from ditkv.models.hunyuan.image_layers import (GroupNorm32, ResBlock, TimestepEmbedder, channels_last_weights,
                                               fast_path, norm_act)
from ditkv.models.hunyuan.layers import MoE, RMSNorm, rope_cos_sin, rope_rms_norm, set_moe_impl
from ditkv.models.hunyuan.qkv import QKVProjection

AttnFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

INIT_STD = 0.02  # release `initializer_range`; small enough for finite random-model outputs

# Distilled checkpoints embed the guidance scale in the `<guidance>` slot as GUIDANCE_FACTOR x scale
# (upstream's Instruct-Distil pipeline: suryatmodulus/HunyuanImage-3.0@1ea1526 hunyuan_image_3_pipeline.py:848-851).
GUIDANCE_FACTOR = 1000.0


def guidance_value(scale: float) -> torch.Tensor:
    """The number a distilled checkpoint's `guidance_emb` embeds: fp32 [1].

    Upstream builds it as `torch.tensor([1000.0 * guidance_scale], dtype=torch.bfloat16)` for every
    step, whatever the scale (no CFG branch, no check; a scale <= 1 is embedded like any other), and
    its TimestepEmbedder takes `t.float()`: so the value is 1000 x scale rounded to bfloat16
    (5.0 -> 4992, 2.5 -> 2496), then fp32. Verified by tests/test_release_distilled.py."""
    g = torch.tensor([GUIDANCE_FACTOR * float(scale)], dtype=torch.bfloat16).float()
    if not torch.isfinite(g).all():
        raise LayoutError(f"guidance_scale={scale!r}: 1000 x scale must fit bfloat16 (the distilled "
                          "checkpoint embeds it as a <guidance> token)", field="guidance_scale")
    return g


class SelfAttention(nn.Module):
    """Projections around attention: fused qkv -> RoPE -> QK RMSNorm ... o_proj."""

    def __init__(self, cfg: HunyuanImage3Config) -> None:
        super().__init__()
        d = cfg.attention_head_dim
        self.qkv_proj = QKVProjection(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, d)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, cfg.hidden_size, bias=False)
        self.query_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.key_layernorm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor | fp8.QuantizedTokens, cos: torch.Tensor, sin: torch.Tensor, attn: AttnFn,
                layer: int) -> torch.Tensor:
        """x [N, hidden], or those tokens already quantized for an FP8 QKV projection (`fp8_layer.py`)."""
        q, k, v = self.qkv_proj(x)
        # Release order: rotate first, then normalise each head (cached K is post-both).
        qn, kn = self.query_layernorm, self.key_layernorm
        q = rope_rms_norm(q, cos, sin, qn.weight, qn.eps)
        k = rope_rms_norm(k, cos, sin, kn.weight, kn.eps)
        o = attn(layer, q, k, v)
        return invariant.run(self.o_proj, o.reshape(q.shape[0], -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: HunyuanImage3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.moe_topk,
                       cfg.num_shared_expert)

    def forward(self, h, cos, sin, attn: AttnFn, layer: int) -> torch.Tensor:
        if fp8_layer.applies(self, h):  # FP8 on CUDA: norms, quantizations and adds fused
            return fp8_layer.layer_forward(self, h, cos, sin, attn, layer)
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, attn, layer)
        return h + self.mlp(self.post_attention_layernorm(h))


class Transformer(nn.Module):
    """The `model.` prefix of the release: embeddings, decoder layers, final norm."""

    def __init__(self, cfg: HunyuanImage3Config) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.ln_f = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class PatchEmbed(nn.Module):
    """Latents [R, C, h, w] -> tokens [R, h*w, hidden] (patch size 1 on the latent grid)."""

    def __init__(self, cfg: HunyuanImage3Config) -> None:
        super().__init__()
        mid = cfg.patch_embed_hidden_dim
        self.model = nn.ModuleList([
            nn.Conv2d(cfg.latent_channels, mid, 3, padding=1),
            ResBlock(mid, cfg.hidden_size, cfg.hidden_size),
        ])

    def forward(self, latents: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        if fast_path(latents):  # channels-last: the tokens below are then a view, not a transpose
            channels_last_weights(self)
            latents = latents.contiguous(memory_format=torch.channels_last)
        x = self.model[1](self.model[0](latents), emb)
        return x.flatten(2).transpose(1, 2)  # row-major: token = row * w + col


class FinalLayer(nn.Module):
    """Tokens [R, h*w, hidden] -> velocity [R, C, h, w]."""

    def __init__(self, cfg: HunyuanImage3Config) -> None:
        super().__init__()
        mid = cfg.patch_embed_hidden_dim
        self.model = nn.ModuleList([
            ResBlock(cfg.hidden_size, cfg.hidden_size, mid),
            nn.Sequential(GroupNorm32(mid), nn.SiLU(), nn.Conv2d(mid, cfg.latent_channels, 3, padding=1)),
        ])

    def forward(self, tokens: torch.Tensor, emb: torch.Tensor, h: int, w: int) -> torch.Tensor:
        r, n, c = tokens.shape
        if n != h * w:
            raise ValueError(f"final_layer got {n} image tokens per row, expected h*w = {h}*{w}")
        x = tokens.transpose(1, 2).reshape(r, c, h, w)  # contiguous tokens: a channels-last view
        if not fast_path(x):
            return self.model[1](self.model[0](x, emb))
        channels_last_weights(self)
        x = self.model[0](x.contiguous(memory_format=torch.channels_last), emb)
        norm, _, conv = self.model[1]
        return conv(norm_act(norm, x, silu=True, fp32=True)).contiguous()  # latents stay NCHW


class HunyuanImage3Model(nn.Module):
    def __init__(self, cfg: HunyuanImage3Config) -> None:
        super().__init__()
        self.config = cfg
        self.model = Transformer(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.timestep_emb = TimestepEmbedder(cfg.hidden_size, cfg.timestep_embed_dim)
        self.time_embed = TimestepEmbedder(cfg.hidden_size, cfg.timestep_embed_dim)
        self.time_embed_2 = TimestepEmbedder(cfg.hidden_size, cfg.timestep_embed_dim)
        self.patch_embed = PatchEmbed(cfg)
        self.final_layer = FinalLayer(cfg)
        # Distilled variant only (`cfg_distilled` / use_guidance_token): its own TimestepEmbedder, not
        # shared with timestep_emb; it embeds `guidance_value(scale)` in the `<guidance>` slot.
        self.guidance_emb = (
            TimestepEmbedder(cfg.hidden_size, cfg.timestep_embed_dim) if cfg.use_guidance_token else None
        )
        # Input images through the vision encoder (release: `vision_model.*`, `vision_aligner.*`); a model
        # that takes images as latent tokens only (cond_image_type "vae") has neither.
        self.vision_model = self.vision_aligner = None
        if uses_vision(cfg):
            from ditkv.models.hunyuan.vision import Aligner, VisionConfig, VisionTransformer

            vcfg = VisionConfig.from_extra(cfg.extra, cfg.hidden_size)
            self.vision_model = VisionTransformer(vcfg)
            self.vision_aligner = Aligner(vcfg, cfg.hidden_size)

    # ------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, cfg: HunyuanImage3Config, seed: int = 0, *, zero_init_resblocks: bool = True,
                    device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> "HunyuanImage3Model":
        """Deterministic random init: every parameter is drawn from its own generator seeded by
        (seed, parameter name), so weights do not depend on construction order or threads.

        Linear/conv/embedding weights ~ N(0, 0.02), biases 0, norm weights 1. With
        `zero_init_resblocks` (release behaviour) each ResBlock's last conv starts at zero, so the
        block is initially its skip path; pass False to make every weight random (stricter tests).
        """
        with torch.device("meta"):
            model = cls(cfg)
        model = model.to_empty(device="cpu")
        zero = {n for n, _ in model.named_parameters()
                if zero_init_resblocks and ".out_layers.3." in n}
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in zero or name.endswith(".bias"):
                    p.zero_()
                elif _is_norm_weight(name, p):
                    p.fill_(1.0)
                else:
                    g = torch.Generator().manual_seed((seed * 0x9E3779B1 + zlib.crc32(name.encode())) % 2**63)
                    p.normal_(0.0, INIT_STD, generator=g)
        model.requires_grad_(False)
        model = model.to(device=device, dtype=dtype)
        for layer in model.model.layers:  # routing stays fp32 whatever the model dtype
            layer.mlp.gate.float()
        return model.eval()

    def set_moe_impl(self, impl: str) -> int:
        """Routed-expert implementation of every MoE layer: "auto" (grouped GEMM where it runs
        fused, i.e. CUDA sm90/sm100 in bf16, else the loop), "loop" or "grouped"; see layers.py."""
        return set_moe_impl(self, impl)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    # ----------------------------------------------------------------- inputs
    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """LongTensor[N] -> [N, hidden]."""
        return self.model.wte(ids)

    def timestep_token(self, t: torch.Tensor) -> torch.Tensor:
        """Embedding that fills the `<timestep>` slot: [R] -> [R, hidden]."""
        return self.timestep_emb(t)

    def guidance_token(self, g: torch.Tensor) -> torch.Tensor:
        """Embedding for the `<guidance>` slot of the distilled variant: [R] -> [R, hidden]. `g` is the
        embedded number, `guidance_value(scale)` (1000 x scale in bfloat16), not the scale itself."""
        if self.guidance_emb is None:
            raise ConfigError("use_guidance_token", False, "guidance tokens need use_guidance_token=True")
        return self.guidance_emb(g)

    def embed_image(self, latents: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Latents [R, C, h, w] at timesteps t [R] -> image tokens [R, h*w, hidden]."""
        return self.patch_embed(latents.to(self.dtype), self.time_embed(t))

    def cond_image_tokens(self, latents: torch.Tensor) -> torch.Tensor:
        """A clean input image's VAE latents [1, C, h, w] -> its latent tokens [h*w, hidden]: the image path
        at timestep 0, as the release conditions on input images."""
        t0 = torch.zeros(1, device=latents.device)
        return self.embed_image(latents, t0)[0]

    def vision_tokens(self, patches: torch.Tensor, mask: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """One input image's patches [N, 3*p*p] -> vision tokens [N, hidden] (encoder, then aligner)."""
        if self.vision_model is None:
            raise ConfigError("cond_image_type", self.config.cond_image_type,
                              "this model has no vision encoder (vision_model.*); input images are latent tokens only")
        feats = self.vision_model(patches.to(self.device), mask.to(self.device), shape)
        return self.vision_aligner(feats)

    # --------------------------------------------------------------- backbone
    def backbone(self, hidden: torch.Tensor, pos_y: torch.Tensor, pos_x: torch.Tensor, attn: AttnFn,
                 layers: range | None = None) -> torch.Tensor:
        """Run every decoder layer (or those of `layers`, a contiguous range: step caching runs the
        front, middle and back blocks as separate calls) over packed tokens [N, hidden]; no final norm.

        In layer i, `attn(i, q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, D])` must return [N, Hq, D].
        q and k arrive rotated (2D RoPE at pos_y/pos_x) and QK-normalised: exactly what a KV
        cache stores.
        """
        cfg = self.config
        if hidden.dim() != 2 or pos_y.shape != (hidden.shape[0],) or pos_x.shape != pos_y.shape:
            raise ValueError(
                f"backbone wants hidden [N, hidden] with pos_y/pos_x [N]; got {tuple(hidden.shape)}, "
                f"{tuple(pos_y.shape)}, {tuple(pos_x.shape)}"
            )
        cos, sin = rope_cos_sin(pos_y, pos_x, cfg.attention_head_dim, cfg.rope_theta)
        layers = range(len(self.model.layers)) if layers is None else layers
        if layers.step != 1 or not 0 <= layers.start <= layers.stop <= len(self.model.layers):
            raise ValueError(f"backbone layers must be a contiguous range within [0, {len(self.model.layers)}), "
                             f"got {layers}")
        for i in layers:
            hidden = self.model.layers[i](hidden, cos, sin, attn, i)
        return hidden

    # ---------------------------------------------------------------- outputs
    def final_layer_velocity(self, hidden_img: torch.Tensor, t: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """Raw last hidden states of the image tokens [R, h*w, hidden] -> velocity [R, C, h, w]."""
        return self.final_layer(hidden_img, self.time_embed_2(t), h, w)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Text head for the AR stage: ln_f then lm_head."""
        return self.lm_head(self.model.ln_f(hidden))


def uses_vision(cfg: HunyuanImage3Config) -> bool:
    """The model reads input images through a vision encoder (and so has vision_model / vision_aligner)."""
    return cfg.max_input_images > 0 and cfg.cond_image_type == "vae_vit"


def _is_norm_weight(name: str, p: torch.Tensor) -> bool:
    """RMSNorm / GroupNorm scales (1-D weights that are not biases) start at one."""
    return name.endswith(".weight") and p.dim() == 1
