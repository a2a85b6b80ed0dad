"""Input images of image-conditioned generation (editing): the release's vision encoder, its aligner
and the preprocessing of each input image for the VAE and for the vision encoder.

Facts (release Instruct code, github.com/suryatmodulus/HunyuanImage-3.0@1ea1526, upstream's Instruct
code; the official release's hunyuan.py has the same path), checked by numbers in
tests/test_release_edit.py:

- `vision_model.*` is a SigLIP2 (NaFlex) vision transformer (siglip2.py `Siglip2VisionTransformer`):
  patches of `patch_size`^2 RGB pixels (flattened patch-row, patch-col, then (py, px, channel)) ->
  Linear `embeddings.patch_embedding`; plus `embeddings.position_embedding` ([num_patches, hidden] seen as a
  square grid) resized to the image's patch grid by bilinear antialiased interpolation (fp32), padding
  positions getting the first resized row; `encoder.layers.{i}` pre-LayerNorm blocks (`layer_norm1`,
  `self_attn.{q,k,v,out}_proj` with biases, eager softmax in fp32 with the padding patches masked as
  keys only, `layer_norm2`, `mlp.fc1/fc2` with tanh-GELU); `post_layernorm`. The pooling `head.*` exists in
  the checkpoint but its output is never used: it is loaded, never run.
- `vision_aligner.*` (siglip2.py `LightProjector`): `layers` = Linear (projector_type "linear"), or
  Linear, then (GELU, Linear) x (depth - 1) ("mlp_gelu"), from the encoder width to the transformer's.
- Every one of the `max_num_patches` outputs (padding patches too) becomes a token of the row.
- ViT preprocessing (transformers `Siglip2ImageProcessorFast`, as the release configures it from
  config.json's `vit_processor`): the largest patch grid keeping the aspect ratio with at most
  `max_num_patches` patches (binary search on the scale, sides rounded up to whole patches), a bilinear
  antialiased resize of the uint8 image (torch's uint8 kernel, what torchvision runs), x / 255, then
  (x - mean) / std, cut into patches, zero-padded to `max_num_patches` (mask 0 for padding).
- VAE preprocessing (image_processor.py `resize_and_crop`, crop "center"): the nearest resolution bucket by
  height/width ratio (the 33 buckets plus four extra sizes, see `cond_bucket`), a PIL LANCZOS resize keeping
  the aspect ratio so the bucket is covered (`round` of the scaled side), a centre crop, then x / 255 * 2 - 1.

Nothing here is copied from the release; the module names match its parameter names so the
checkpoint's keys load without a map.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ditkv.errors import ConfigError, LayoutError

# image_processor.py (fork): `vae_reso_group` = the buckets around image_base_size plus these (h, w),
# appended (in this order) when no bucket has their ratio; their ratio tokens are <img_ratio_33..36>
EXTRA_RESOLUTIONS = ((1024, 768), (1280, 720), (768, 1024), (720, 1280))
_ACTS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu,
         "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}


def _req(section: dict, key: str, where: str):
    if key not in section:
        raise ConfigError(f"{where}.{key}", None, f"config.json's `{where}` section needs `{key}` (image input)")
    return section[key]


@dataclass(frozen=True)
class VisionConfig:
    """config.json's `vit` (encoder), `vit_aligner` and `vit_processor` sections, release key names."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_patches: int  # position-embedding table: a square grid of this many cells
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    use_head: bool = True
    # aligner
    projector_type: str = "mlp_gelu"
    aligner_depth: int = 2
    aligner_in: int = 0
    aligner_out: int = 0
    # processor
    max_num_patches: int = 1024
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255

    @classmethod
    def from_extra(cls, extra: dict, hidden_size: int) -> "VisionConfig":
        vit, al, proc = (extra.get(k) for k in ("vit", "vit_aligner", "vit_processor"))
        for name, sec in (("vit", vit), ("vit_aligner", al), ("vit_processor", proc)):
            if not isinstance(sec, dict):
                raise ConfigError(name, sec, "image input with a vision encoder (cond_image_type 'vae_vit') needs "
                                  f"config.json's `{name}` section (the release's)")
        ptype = al.get("projector_type", "mlp_gelu")
        if ptype not in ("linear", "mlp_gelu"):
            raise ConfigError("vit_aligner.projector_type", ptype, "must be 'linear' or 'mlp_gelu' (the release's)")
        act = vit.get("hidden_act", "gelu_pytorch_tanh")
        if act not in _ACTS:
            raise ConfigError("vit.hidden_act", act, f"must be one of {sorted(_ACTS)}")
        for flag in ("do_resize", "do_rescale", "do_normalize"):
            if proc.get(flag, True) is not True:
                raise ConfigError(f"vit_processor.{flag}", proc[flag], "ditkv implements the release's true")
        mean, std = proc.get("image_mean", [0.5] * 3), proc.get("image_std", [0.5] * 3)
        mean = tuple(mean) * (3 if len(mean) == 1 else 1) if isinstance(mean, (list, tuple)) else (mean,) * 3
        std = tuple(std) * (3 if len(std) == 1 else 1) if isinstance(std, (list, tuple)) else (std,) * 3
        out = cls(
            hidden_size=_req(vit, "hidden_size", "vit"), intermediate_size=_req(vit, "intermediate_size", "vit"),
            num_hidden_layers=_req(vit, "num_hidden_layers", "vit"),
            num_attention_heads=_req(vit, "num_attention_heads", "vit"), num_patches=_req(vit, "num_patches", "vit"),
            patch_size=_req(vit, "patch_size", "vit"), num_channels=vit.get("num_channels", 3),
            layer_norm_eps=vit.get("layer_norm_eps", 1e-6), hidden_act=act,
            use_head=bool(vit.get("vision_use_head", True)), projector_type=ptype,
            aligner_depth=al.get("depth", 1), aligner_in=_req(al, "input_dim", "vit_aligner"),
            aligner_out=_req(al, "n_embed", "vit_aligner"),
            max_num_patches=proc.get("max_num_patches", 256), image_mean=mean, image_std=std,
            rescale_factor=proc.get("rescale_factor", 1 / 255))
        if proc.get("patch_size", out.patch_size) != out.patch_size:
            raise ConfigError("vit_processor.patch_size", proc["patch_size"], f"must equal vit.patch_size={out.patch_size}")
        if out.aligner_in != out.hidden_size or out.aligner_out != hidden_size:
            raise ConfigError("vit_aligner", al, f"input_dim/n_embed must be the encoder width {out.hidden_size} and "
                              f"the transformer's hidden_size {hidden_size}")
        side = math.isqrt(out.num_patches)
        if side * side != out.num_patches or out.hidden_size % out.num_attention_heads or out.num_channels != 3:
            raise ConfigError("vit", vit, "num_patches must be a square, hidden_size a multiple of "
                              "num_attention_heads, num_channels 3")
        return out


# --------------------------------------------------------------------------------- modules
class _MLP(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(c.hidden_size, c.intermediate_size)
        self.fc2 = nn.Linear(c.intermediate_size, c.hidden_size)
        self.act = _ACTS[c.hidden_act]

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class _Attention(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        d = c.hidden_size
        self.heads = c.num_attention_heads
        self.k_proj, self.v_proj, self.q_proj, self.out_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        hd = d // self.heads
        q, k, v = (p(x).view(b, n, self.heads, hd).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        w = torch.matmul(q, k.transpose(2, 3)) * hd ** -0.5 + bias
        w = w.softmax(-1, dtype=torch.float32).to(q.dtype)
        return self.out_proj(torch.matmul(w, v).transpose(1, 2).reshape(b, n, d))


class _Layer(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.self_attn = _Attention(c)
        self.layer_norm2 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.mlp = _MLP(c)

    def forward(self, x, bias):
        x = x + self.self_attn(self.layer_norm1(x), bias)
        return x + self.mlp(self.layer_norm2(x))


class _Encoder(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(c) for _ in range(c.num_hidden_layers))


class _Embeddings(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Linear(c.num_channels * c.patch_size ** 2, c.hidden_size)
        self.position_embedding = nn.Embedding(c.num_patches, c.hidden_size)
        self.side = math.isqrt(c.num_patches)

    def forward(self, patches: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        emb = self.patch_embedding(patches.to(self.patch_embedding.weight.dtype))  # [1, N, d]
        table = self.position_embedding.weight
        grid = table.reshape(self.side, self.side, -1).permute(2, 0, 1)[None].float()  # fp32 (antialias on CPU)
        h, w = shape
        pos = F.interpolate(grid, size=(h, w), mode="bilinear", align_corners=False, antialias=True)
        pos = pos.reshape(table.shape[1], h * w).transpose(0, 1).to(table.dtype)
        full = pos[:1].expand(patches.shape[1], -1).clone()
        full[: h * w] = pos
        return emb + full[None]


class _PoolingHead(nn.Module):
    """The release's attention-pooling head: its weights are in the checkpoint, its output is unused."""

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.probe = nn.Parameter(torch.zeros(1, 1, c.hidden_size))
        self.attention = nn.MultiheadAttention(c.hidden_size, c.num_attention_heads, batch_first=True)
        self.layernorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.mlp = _MLP(c)


class VisionTransformer(nn.Module):
    """`vision_model.*`: patches [N, 3*p*p] of one image -> features [N, hidden] (N = max_num_patches)."""

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.config = c
        self.embeddings = _Embeddings(c)
        self.encoder = _Encoder(c)
        self.post_layernorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.head = _PoolingHead(c) if c.use_head else None

    def forward(self, patches: torch.Tensor, mask: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        x = self.embeddings(patches[None], shape)
        # padding patches are masked as keys (an additive finfo.min), as the release's eager attention
        bias = (1.0 - mask.to(x.dtype))[None, None, None, :] * torch.finfo(x.dtype).min
        for layer in self.encoder.layers:
            x = layer(x, bias)
        return self.post_layernorm(x)[0]


class Aligner(nn.Module):
    """`vision_aligner.*`: encoder features -> the transformer's hidden size."""

    def __init__(self, c: VisionConfig, hidden_size: int) -> None:
        super().__init__()
        if c.projector_type == "linear":
            self.layers = nn.Linear(c.hidden_size, hidden_size)
        else:
            mods = [nn.Linear(c.hidden_size, hidden_size)]
            for _ in range(1, c.aligner_depth):
                mods += [nn.GELU(), nn.Linear(hidden_size, hidden_size)]
            self.layers = nn.Sequential(*mods)

    def forward(self, x):
        return self.layers(x)


# --------------------------------------------------------------------------- preprocessing
def check_image(img, i: int) -> np.ndarray:
    """An input image: a uint8 numpy array [H, W, 3] (RGB); anything else is a LayoutError."""
    if not isinstance(img, np.ndarray) or img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != 3 \
            or img.shape[0] < 1 or img.shape[1] < 1:
        what = f"{type(img).__name__}" + (f" {img.dtype} {list(img.shape)}" if isinstance(img, np.ndarray) else "")
        raise LayoutError(f"images[{i}] must be a uint8 RGB array [H, W, 3], got {what}", field="image")
    return img


def vit_grid(height: int, width: int, patch: int, max_patches: int, eps: float = 1e-5) -> tuple[int, int]:
    """Pixel size of the resized image: the largest scale whose patch grid (sides rounded up to whole
    patches, at least one) has at most `max_patches` patches, found by bisection on the scale."""
    def side(scale: float, n: int) -> int:
        return int(max(patch, math.ceil(n * scale / patch) * patch))

    lo, hi = eps / 10, 100.0
    while hi - lo >= eps:
        mid = (lo + hi) / 2
        if (side(mid, height) // patch) * (side(mid, width) // patch) <= max_patches:
            lo = mid
        else:
            hi = mid
    return side(lo, height), side(lo, width)


def vit_inputs(img: np.ndarray, c: VisionConfig) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """uint8 [H, W, 3] -> (patches [N, 3*p*p] fp32, mask [N] int32, (patch rows, patch cols))."""
    p, n = c.patch_size, c.max_num_patches
    th, tw = vit_grid(img.shape[0], img.shape[1], p, n)
    if not img.flags.writeable:  # a view of a message's bytes: torch wants memory it may write
        img = img.copy()
    x = torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1)[None]  # uint8 [1, 3, H, W]
    x = F.interpolate(x, size=(th, tw), mode="bilinear", align_corners=False, antialias=True)[0].float()
    mean = torch.tensor(c.image_mean).view(3, 1, 1)
    std = torch.tensor(c.image_std).view(3, 1, 1)
    x = (x * c.rescale_factor - mean) / std
    gh, gw = th // p, tw // p
    patches = x.reshape(3, gh, p, gw, p).permute(1, 3, 2, 4, 0).reshape(gh * gw, -1)
    mask = torch.zeros(n, dtype=torch.int32)
    mask[: gh * gw] = 1
    out = torch.zeros(n, patches.shape[1])
    out[: gh * gw] = patches
    return out, mask, (gh, gw)


def cond_bucket(height: int, width: int, base: int | None, out_hw: tuple[int, int]) -> tuple[int, int, int]:
    """(target height, target width, ratio index k) of an input image for the VAE. With `base` (the
    release): the resolution bucket of nearest height/width ratio among the 33 buckets, then the extra
    sizes (first nearest wins, as the release's argmin); without (the tiny model): the generated size."""
    from ditkv.models.hunyuan import buckets

    if base is None:
        return out_hw[0], out_hw[1], buckets.ratio_index(*out_hw)
    table = [tuple(b) for b in buckets.bucket_table(base)]
    ratios = [h / w for h, w in table]
    for h, w in EXTRA_RESOLUTIONS:
        if h / w not in ratios:
            table.append((h, w))
            ratios.append(h / w)
    r = height / width
    k = int(np.argmin(np.abs(np.array(ratios) - r)))
    return table[k][0], table[k][1], k


def vae_pixels(img: np.ndarray, target: tuple[int, int]) -> torch.Tensor:
    """uint8 [H, W, 3] -> [1, 3, th, tw] fp32 in [-1, 1]: keep the aspect ratio, cover the target
    (LANCZOS), centre crop; the release's resize_and_crop(crop_type='center')."""
    from PIL import Image

    th, tw = target
    h, w = img.shape[:2]
    if h / w < th / tw:
        rh, rw = th, int(round(th / h * w))
    else:
        rh, rw = int(round(tw / w * h)), tw
    top, left = int(round((rh - th) / 2.0)), int(round((rw - tw) / 2.0))
    im = Image.fromarray(img).resize((rw, rh), resample=Image.Resampling.LANCZOS)
    im = im.crop((left, top, left + tw, top + th))
    x = torch.from_numpy(np.asarray(im, dtype=np.uint8).copy()).permute(2, 0, 1).float() / 255.0
    return ((x - 0.5) / 0.5)[None]
