"""HunyuanImage-3.0 model configuration.

Field names follow the release `config.json` so a real checkpoint folder can be read
directly; `from_dict` also understands the release's nested/aliased spellings
(`vae.latent_channels`, `head_dim`, `pad_id`, `image_token_id`, `vae_downsample_factor`, per-layer
lists that are all equal). Every key of the release config class is read, checked at the one value
ditkv implements (a ConfigError naming it otherwise), or listed as unused with a reason: see
`BEHAVIOUR_FLAGS`, `BEHAVIOUR_CHOICES`, `READ_HERE`, `READ_ELSEWHERE` and `RELEASE_UNUSED` below.
Every check runs at construction, so a bad value fails at startup with the field name.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ditkv.errors import ConfigError, is_finite_number
from ditkv.models.hunyuan.files import read_json
from ditkv.models.hunyuan.release_keys import (  # noqa: F401 - BEHAVIOUR_*, READ_*, RELEASE_UNUSED: re-exported
    BEHAVIOUR_CHOICES,
    BEHAVIOUR_FLAGS,
    MAX_INT,
    READ_ELSEWHERE,
    READ_HERE,
    RELEASE_CLASS_DEFAULTS,
    RELEASE_UNUSED,
    check_behaviour_flags,
    check_cond_attn,
    is_int,
    is_release_file,
    read_image_geometry,
    require_spelled_ids,
    same_value,
    show,
)

# The byte tokenizer's vocabulary (tokenizer.py), which the tiny preset uses: ids 0..255 are the UTF-8
# bytes, the specials follow, then unused ids up to a round size.
_BYTE_SPECIALS = (
    "<pad>", "<bos>", "<eos>", "<boi>", "<eoi>", "<img>", "<timestep>", "<guidance>",
    "<cfg>", "<img_size>",
) + tuple(f"<img_ratio_{k}>" for k in range(33))
BYTE_SPECIAL_IDS: dict[str, int] = {name: 256 + i for i, name in enumerate(_BYTE_SPECIALS)}
BYTE_VOCAB_SIZE = 320  # 256 bytes + 43 specials, padded to a multiple of 64

CODECS = ("pixel", "vae")
COND_IMAGE_TYPES = ("vae_vit", "vae")
RELEASE_MAX_INPUT_IMAGES = 3  # release README: multi-image fusion takes up to 3 input images

# Release aliases: key in a release config.json -> our field name. Precedence is by key, never by the
# order of the file: the field's own key wins, an alias fills it only when that key is absent, and an
# alias that disagrees with the field's key (or another alias) is a ConfigError naming both keys.
_ALIASES = {
    "head_dim": "attention_head_dim",
    # The release reads `pad_token_id` (the embedding's padding_idx; its tokenizer wrapper pads with the
    # tokenizer's own pad id). `pad_id` is stored by the release config class and never read.
    "pad_id": "pad_token_id",
    # The release config.json spelling; the release model never reads it (its tokenizer wrapper looks
    # `<img>` up by name, as load_model_config does when tokenizer.json is present).
    "image_token_id": "img_token_id",
    "dtype": "torch_dtype",  # transformers >= 4.56 writes `dtype` where older versions wrote `torch_dtype`
    # Instruct-Distil configs (upstream's fork): guidance as a `<guidance>` token, one branch
    "cfg_distilled": "use_guidance_token",
}
# Alias values that mean "unset" in the release config class (its defaults), ignored when read:
# pad_id=-1 is the class default and no token id.
_ALIAS_UNSET: dict[str, Any] = {"pad_id": -1}
# Release keys whose value may be a per-layer list (we only support uniform layers).
_PER_LAYER = ("moe_topk", "num_experts", "moe_intermediate_size", "num_shared_expert")
# Release keys whose null means "derive", as in the release config class.
_NULL_DERIVED = ("attention_head_dim", "num_key_value_heads")


@dataclass
class HunyuanImage3Config:
    family = "hunyuan_image_3"  # its `models.family` name (a class attribute, not a field)

    # --- transformer backbone ---
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    attention_head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    moe_topk: int
    num_shared_expert: int = 1
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 22800
    # --- image path ---
    latent_channels: int = 32
    patch_embed_hidden_dim: int = 1024
    timestep_embed_dim: int = 256
    image_token_downsample: int = 16  # pixels per latent cell (per side)
    codec: str = "vae"
    vae_scaling_factor: float = 0.562679178327931  # (unverified) release VAE scale
    # --- sampling defaults ---
    flow_shift: float = 3.0
    default_steps: int = 50
    default_guidance: float = 5.0
    use_guidance_token: bool = False  # distilled checkpoint: guidance as a token, one CFG row
    # --- special token ids ---
    bos_token_id: int = 127958
    eos_token_id: int = 127957
    pad_token_id: int = 128009
    img_token_id: int = 128006
    timestep_token_id: int = 128017
    # The following ids are placeholders for a folder without tokenizer.json; with one,
    # `load_model_config` resolves every special id by its name (a missing name is an error).
    boi_token_id: int = 128000
    eoi_token_id: int = 128001
    guidance_token_id: int = 128018
    cfg_token_id: int = 128019
    img_size_token_id: int = 128020  # `<img_size_1024>`
    img_ratio_token_id: int = 128021  # `<img_ratio_0>`; ratio k is this id + k
    num_ratio_tokens: int = 33  # the release's 33 resolution buckets (buckets.py), or 1
    # release: requested sizes snap to the resolution buckets around this size (buckets.py);
    # None (the tiny model): any size that is a multiple of the latent cell is generated as asked
    image_base_size: int | None = None
    # --- input images (image-conditioned generation / editing; vision.py, layout.py) ---
    # How many input images a request may bring; 0 = the model takes no input images. Read from config.json;
    # a release config with a vision encoder (`vit` section) defaults to 3, the release's documented limit
    # (README "Multi-Image Fusion ... up to 3 inputs"), any other config to 0.
    max_input_images: int = 0
    # Release names and values: "vae_vit" (the release default: each image as VAE latent tokens, then
    # `<joint_img_sep>`, then vision-encoder tokens) or "vae" (latent tokens only: no vision encoder needed).
    cond_image_type: str = "vae_vit"
    # "full" (the release config class's default): each input image's latent and vision tokens are two
    # full-attention blocks; "joint_full" (the official base config.json): one block over both and the
    # <joint_img_sep> between them
    cond_token_attn_type: str = "full"
    # `<joint_img_sep>` when the tokenizer has no such token (a folder without tokenizer.json)
    joint_img_sep_token_id: int | None = None
    # `<img_ratio_33>` of an Instruct tokenizer: its four extra buckets' ratio tokens 33..36 are
    # consecutive from here, not after `<img_ratio_32>` (resolved by name from tokenizer.json)
    img_ratio_extra_token_id: int | None = None
    torch_dtype: str = "bfloat16"
    # Release keys we do not model are kept here so to_dict() round-trips them.
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        self._validate_geometry()
        self._validate_numbers()
        self._validate_tokens()

    def _validate_geometry(self) -> None:
        """Sizes of the transformer and its MoE."""
        positive = (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "attention_head_dim", "intermediate_size",
            "moe_intermediate_size", "num_experts", "moe_topk", "max_position_embeddings",
            "latent_channels", "patch_embed_hidden_dim", "timestep_embed_dim",
            "image_token_downsample", "default_steps", "num_ratio_tokens",
        )
        for name in positive:
            value = getattr(self, name)
            # the bound keeps a corrupt config.json from overflowing torch's tensor sizes
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < MAX_INT:
                raise ConfigError(name, value, f"must be a positive integer below {MAX_INT}")
        if self.hidden_size != self.num_attention_heads * self.attention_head_dim:
            raise ConfigError(
                "hidden_size", self.hidden_size,
                f"must equal num_attention_heads * attention_head_dim = "
                f"{self.num_attention_heads} * {self.attention_head_dim}",
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                "num_key_value_heads", self.num_key_value_heads,
                f"must divide num_attention_heads={self.num_attention_heads} (GQA groups)",
            )
        if self.attention_head_dim % 4:
            raise ConfigError(
                "attention_head_dim", self.attention_head_dim,
                "must be a multiple of 4 (2D RoPE uses frequency pairs for y and x)",
            )
        if self.num_experts == 1:  # the release builds a dense MLP (other keys, other math) for one expert
            raise ConfigError("num_experts", 1, "the release runs a dense MLP instead of the MoE when num_experts "
                              "is 1; ditkv implements the MoE layers only: use num_experts >= 2")
        if self.moe_topk == 1:  # release topkgating: no renormalisation for one expert
            raise ConfigError("moe_topk", 1, "the release does not renormalise a lone expert's weight (it scales "
                              "the softmax probability by routed_scaling_factor); ditkv renormalises the top-k "
                              "weights only: use moe_topk >= 2")
        if self.moe_topk > self.num_experts:
            raise ConfigError(
                "moe_topk", self.moe_topk, f"must be <= num_experts={self.num_experts}"
            )
        if not isinstance(self.num_shared_expert, int) or not 0 <= self.num_shared_expert < MAX_INT:
            raise ConfigError("num_shared_expert", self.num_shared_expert, "must be an integer >= 0")
        if self.timestep_embed_dim % 2:
            raise ConfigError("timestep_embed_dim", self.timestep_embed_dim, "must be even (cos and sin halves)")

    def _validate_numbers(self) -> None:
        """Float settings, flags and the codec."""
        # a config.json may hold any JSON type: check before arithmetic turns a string into a crash
        for name in ("rms_norm_eps", "rope_theta", "flow_shift", "vae_scaling_factor", "default_guidance"):
            value = getattr(self, name)
            if not is_finite_number(value):
                raise ConfigError(name, value, "must be a finite number")
        for name in ("rms_norm_eps", "rope_theta", "flow_shift", "vae_scaling_factor"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, getattr(self, name), "must be > 0")
        if self.default_guidance < 0:
            raise ConfigError("default_guidance", self.default_guidance, "must be >= 0 (<= 1 disables CFG)")
        if not isinstance(self.use_guidance_token, bool):
            raise ConfigError("use_guidance_token", self.use_guidance_token, "must be true or false")
        if not isinstance(self.codec, str) or self.codec not in CODECS:
            raise ConfigError("codec", self.codec, f"must be one of {CODECS}")
        if self.codec == "pixel":
            want = 3 * self.image_token_downsample ** 2
            if self.latent_channels != want:
                raise ConfigError(
                    "latent_channels", self.latent_channels,
                    f"the pixel codec packs 3*p*p = {want} channels for "
                    f"image_token_downsample={self.image_token_downsample}; set latent_channels={want}",
                )

    def _validate_tokens(self) -> None:
        """Special ids, ratio tokens, buckets and input images."""
        for name in self.special_token_fields():
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value < self.vocab_size:
                raise ConfigError(name, value, f"must be a token id in [0, vocab_size={self.vocab_size})")
        if self.num_ratio_tokens not in (1, 33):
            raise ConfigError("num_ratio_tokens", self.num_ratio_tokens,
                              "must be 33 (one per release resolution bucket) or 1 (no ratio conditioning)")
        b = self.image_base_size
        cell = 16 * self.image_token_downsample  # bucket sides step by base/16: whole latent cells
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < cell or b % cell):
            raise ConfigError("image_base_size", b, f"must be a positive multiple of {cell} (16 latent cells of "
                              f"{self.image_token_downsample} px: the buckets step by base/16), or unset")
        m = self.max_input_images
        if not isinstance(m, int) or isinstance(m, bool) or not 0 <= m <= 64:
            raise ConfigError("max_input_images", m, "must be an integer in [0, 64] (0: no input images)")
        # checked only where input images are on: a text-to-image run never reads them
        if m and self.cond_image_type not in COND_IMAGE_TYPES:
            raise ConfigError("cond_image_type", self.cond_image_type, f"ditkv implements {list(COND_IMAGE_TYPES)} "
                              "(the release's 'vit' alone is not implemented); or set max_input_images 0")
        if m:
            check_cond_attn(self.cond_image_type, self.cond_token_attn_type)
        j = self.joint_img_sep_token_id
        if j is not None and (not isinstance(j, int) or isinstance(j, bool) or not 0 <= j < self.vocab_size):
            raise ConfigError("joint_img_sep_token_id", j, f"must be a token id in [0, vocab_size={self.vocab_size})")
        x = self.img_ratio_extra_token_id
        if x is not None and (not isinstance(x, int) or isinstance(x, bool) or not 0 <= x <= self.vocab_size - 4):
            raise ConfigError("img_ratio_extra_token_id", x, f"must be a token id with 3 more after it below "
                              f"vocab_size={self.vocab_size} (<img_ratio_33..36>)")
        last_ratio = self.img_ratio_token_id + self.num_ratio_tokens - 1
        if last_ratio >= self.vocab_size:
            raise ConfigError(
                "num_ratio_tokens", self.num_ratio_tokens,
                f"ratio ids run up to {last_ratio}, past vocab_size={self.vocab_size}",
            )

    @staticmethod
    def special_token_fields() -> tuple[str, ...]:
        return (
            "bos_token_id", "eos_token_id", "pad_token_id", "img_token_id", "timestep_token_id",
            "boi_token_id", "eoi_token_id", "guidance_token_id", "cfg_token_id",
            "img_size_token_id", "img_ratio_token_id",
        )

    # --------------------------------------------------------------- derived
    @property
    def num_kv_groups(self) -> int:
        """Query heads per KV head."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def qkv_rows(self) -> int:
        return (self.num_attention_heads + 2 * self.num_key_value_heads) * self.attention_head_dim

    # ---------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        for key, value in self.extra.items():
            out.setdefault(key, value)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "HunyuanImage3Config":
        """A config from a release-format (or ditkv-saved) dict. Every release key is read, checked at
        the one value ditkv implements (`BEHAVIOUR_FLAGS`, `BEHAVIOUR_CHOICES`), or deliberately
        unused (`RELEASE_UNUSED`, `READ_ELSEWHERE`); other keys are kept in `extra` (round-tripped)."""
        if not isinstance(data, dict):
            raise ConfigError("config", type(data).__name__, "must be a mapping of model config fields")
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs: dict[str, Any] = {}
        source: dict[str, str] = {}  # field -> the key its value came from
        if not isinstance(data.get("extra") or {}, dict):
            raise ConfigError("extra", data["extra"], "must be a mapping (release keys ditkv does not model)")
        extra: dict[str, Any] = dict(data.get("extra") or {})
        # the field's own key first, then aliases: which key wins never depends on the file's order
        for key in sorted((k for k in data if k != "extra"), key=lambda k: k in _ALIASES):
            value = data[key]
            name = _ALIASES.get(key, key)
            if key in _ALIAS_UNSET and same_value(value, _ALIAS_UNSET[key]):
                continue  # the release class's "unset" default: not a value
            if name in _PER_LAYER and isinstance(value, (list, tuple)):
                if not value or any(v != value[0] for v in value):
                    raise ConfigError(key, value, "per-layer values must all be equal (uniform layers only)")
                value = value[0]
            if name not in known:
                extra[key] = value
            elif name not in kwargs:
                kwargs[name], source[name] = value, key
            elif not same_value(kwargs[name], value):
                raise ConfigError(key, value, f"conflicts with {source[name]}={show(kwargs[name])}: both "
                                  f"set {name}; make them equal or drop {key}")
        for name in _NULL_DERIVED:  # the release config class derives these from a null
            if name in kwargs and kwargs[name] is None:
                del kwargs[name]
                if name == "attention_head_dim" and is_int(kwargs.get("hidden_size")) \
                        and is_int(kwargs.get("num_attention_heads")) and kwargs["num_attention_heads"] > 0:
                    kwargs[name] = kwargs["hidden_size"] // kwargs["num_attention_heads"]
                elif name == "num_key_value_heads" and "num_attention_heads" in kwargs:
                    kwargs[name] = kwargs["num_attention_heads"]
        check_behaviour_flags(extra)
        if is_release_file(extra):  # the release config class's defaults for keys its file may leave out
            for name, value in RELEASE_CLASS_DEFAULTS.items():
                kwargs.setdefault(name, value)
        if "max_input_images" not in kwargs:  # the release allows input images wherever it has a vision encoder
            kwargs["max_input_images"] = RELEASE_MAX_INPUT_IMAGES if isinstance(extra.get("vit"), dict) else 0
        read_image_geometry(extra, kwargs, source, cls.__dataclass_fields__["image_token_downsample"].default)
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.name in known and f.default is dataclasses.MISSING and f.name not in kwargs]
        if missing:
            raise ConfigError(missing[0], None, f"required config key(s) missing: {', '.join(missing)}")
        return cls(**kwargs, extra=extra)

    @classmethod
    def from_json_file(cls, path: str | Path, tokenizer_ids: bool = False) -> "HunyuanImage3Config":
        """Read a checkpoint's config.json; every problem is a `ConfigError` naming the file.

        `tokenizer_ids`: a tokenizer.json will set the special ids the file does not give (the release
        config gives none but bos/eos/pad/image), so those take id 0 until then instead of ditkv's
        placeholders, which a small vocabulary would refuse. Without it, a release-style config that
        leaves special ids to the tokenizer is refused, naming tokenizer.json."""
        path = Path(path)
        data = read_json(path, "fix it or re-save the checkpoint (its config.json is written by save_checkpoint)")
        if not isinstance(data, dict):
            raise ConfigError("checkpoint", str(path), f"config.json must hold a JSON object of model fields, "
                                                       f"got a JSON {_json_type(data)}")
        missing = [f for f in cls.special_token_fields() if not _gives(data, f)]
        if tokenizer_ids:
            data = {**data, **dict.fromkeys(missing, 0)}
        else:
            require_spelled_ids(data, missing, path)
        try:
            return cls.from_dict(data)
        except ConfigError as e:  # the field alone does not say which file to fix
            raise ConfigError(e.field, e.value, f"{e.fix} (in {path})") from e

    def save_json(self, path: str | Path) -> None:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, indent=2, sort_keys=True)
            fh.write("\n")

    def replace(self, **changes: Any) -> "HunyuanImage3Config":
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    # ---------------------------------------------------------------- presets
    @classmethod
    def tiny(cls) -> "HunyuanImage3Config":
        """A few-MB model with the release structure: byte vocabulary, pixel codec."""
        ids = BYTE_SPECIAL_IDS
        return cls(
            vocab_size=BYTE_VOCAB_SIZE,
            hidden_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            attention_head_dim=32,
            intermediate_size=128,
            moe_intermediate_size=128,
            num_experts=8,
            moe_topk=2,
            num_shared_expert=1,
            max_position_embeddings=8192,
            latent_channels=48,
            patch_embed_hidden_dim=64,
            timestep_embed_dim=256,
            image_token_downsample=4,
            codec="pixel",
            flow_shift=3.0,
            default_steps=8,
            default_guidance=5.0,
            bos_token_id=ids["<bos>"],
            eos_token_id=ids["<eos>"],
            pad_token_id=ids["<pad>"],
            img_token_id=ids["<img>"],
            timestep_token_id=ids["<timestep>"],
            boi_token_id=ids["<boi>"],
            eoi_token_id=ids["<eoi>"],
            guidance_token_id=ids["<guidance>"],
            cfg_token_id=ids["<cfg>"],
            img_size_token_id=ids["<img_size>"],
            img_ratio_token_id=ids["<img_ratio_0>"],
            num_ratio_tokens=33,
            torch_dtype="float32",
        )

    @classmethod
    def release(cls) -> "HunyuanImage3Config":
        """The published HunyuanImage-3.0 sizes (about 80B parameters, 13B active)."""
        return cls(
            vocab_size=133120,
            hidden_size=4096,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            attention_head_dim=128,
            intermediate_size=3072,
            moe_intermediate_size=3072,
            num_experts=64,
            moe_topk=8,
            num_shared_expert=1,
            max_position_embeddings=22800,
            latent_channels=32,
            patch_embed_hidden_dim=1024,
            image_token_downsample=16,
            codec="vae",
            image_base_size=1024,
        )


def _gives(data: dict[str, Any], name: str) -> bool:
    """Does a config dict set field `name`, by its own key or an alias (not the alias's unset value)?"""
    return any(_ALIASES.get(k, k) == name and not (k in _ALIAS_UNSET and same_value(v, _ALIAS_UNSET[k]))
               for k, v in data.items())


def _json_type(v: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(v), "number")
