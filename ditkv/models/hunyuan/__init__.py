"""HunyuanImage-3.0 reference architecture: config, modules, preprocessing, checkpoints."""

from ditkv.models.hunyuan.checkpoint import load_checkpoint, load_tokenizer, save_checkpoint
from ditkv.models.hunyuan.codec import ImageCodec, PixelCodec, VAECodec, from_pil, make_codec, to_pil
from ditkv.models.hunyuan.config import HunyuanImage3Config
from ditkv.models.hunyuan.layers import rope_2d
from ditkv.models.hunyuan.layout import (
    RequestLayout,
    RowInputs,
    build_positions,
    build_request_layout,
    max_prompt_tokens,
)
from ditkv.models.hunyuan.model import AttnFn, HunyuanImage3Model
from ditkv.models.hunyuan.qkv import grouped_to_split, split_to_grouped
from ditkv.models.hunyuan.sampler import cfg_combine, euler_step, flow_sigmas, flow_timesteps, initial_latents
from ditkv.models.hunyuan.tokenizer import ByteTokenizer, HFTokenizer, TextTokenizer, resolve_special_ids

__all__ = [
    "AttnFn",
    "ByteTokenizer",
    "HFTokenizer",
    "HunyuanImage3Config",
    "HunyuanImage3Model",
    "ImageCodec",
    "PixelCodec",
    "RequestLayout",
    "RowInputs",
    "TextTokenizer",
    "VAECodec",
    "build_positions",
    "build_request_layout",
    "cfg_combine",
    "euler_step",
    "flow_sigmas",
    "flow_timesteps",
    "from_pil",
    "grouped_to_split",
    "initial_latents",
    "load_checkpoint",
    "load_tokenizer",
    "make_codec",
    "max_prompt_tokens",
    "resolve_special_ids",
    "rope_2d",
    "save_checkpoint",
    "split_to_grouped",
    "to_pil",
]
