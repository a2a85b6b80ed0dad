"""HunyuanImage-3.0 model configuration.

Field names follow the release `config.json` so a real checkpoint folder can be read
directly; `from_dict` also understands the release's nested/aliased spellings
(`vae.latent_channels`, `head_dim`, per-layer lists that are all equal).
Every check runs at construction, so a bad value fails at startup with the field name.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ditkv.errors import ConfigError, is_finite_number

CODECS = ("pixel", "vae")
_MAX_INT = 2**31  # sizes and counts: far above any real model, far below what overflows a tensor size

# Release aliases: key in a release config.json -> our field name.
_ALIASES = {
    "head_dim": "attention_head_dim",
    "pad_id": "pad_token_id",
    "image_token_id": "img_token_id",
}
# Release keys whose value may be a per-layer list (we only support uniform layers).
_PER_LAYER = ("moe_topk", "num_experts", "moe_intermediate_size", "num_shared_expert")


@dataclass
class HunyuanImage3Config:
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
    torch_dtype: str = "bfloat16"
    # Release keys we do not model are kept here so to_dict() round-trips them.
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
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
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < _MAX_INT:
                raise ConfigError(name, value, f"must be a positive integer below {_MAX_INT}")
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
        if self.moe_topk > self.num_experts:
            raise ConfigError(
                "moe_topk", self.moe_topk, f"must be <= num_experts={self.num_experts}"
            )
        if not isinstance(self.num_shared_expert, int) or not 0 <= self.num_shared_expert < _MAX_INT:
            raise ConfigError("num_shared_expert", self.num_shared_expert, "must be an integer >= 0")
        if self.timestep_embed_dim % 2:
            raise ConfigError("timestep_embed_dim", self.timestep_embed_dim, "must be even (cos and sin halves)")
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
        if not isinstance(data, dict):
            raise ConfigError("config", type(data).__name__, "must be a mapping of model config fields")
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs: dict[str, Any] = {}
        if not isinstance(data.get("extra") or {}, dict):
            raise ConfigError("extra", data["extra"], "must be a mapping (release keys ditkv does not model)")
        extra: dict[str, Any] = dict(data.get("extra") or {})
        for key, value in data.items():
            if key == "extra":
                continue
            name = _ALIASES.get(key, key)
            if name in _PER_LAYER and isinstance(value, (list, tuple)):
                if not value or any(v != value[0] for v in value):
                    raise ConfigError(key, value, "per-layer values must all be equal (uniform layers only)")
                value = value[0]
            if name in known:
                kwargs.setdefault(name, value)
            else:
                extra[key] = value
        _check_behaviour_flags(extra)
        vae = data.get("vae")
        if isinstance(vae, dict) and "latent_channels" in vae:
            kwargs.setdefault("latent_channels", vae["latent_channels"])
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.name in known and f.default is dataclasses.MISSING and f.name not in kwargs]
        if missing:
            raise ConfigError(missing[0], None, f"required config key(s) missing: {', '.join(missing)}")
        return cls(**kwargs, extra=extra)

    @classmethod
    def from_json_file(cls, path: str | Path) -> "HunyuanImage3Config":
        """Read a checkpoint's config.json; every problem is a `ConfigError` naming the file."""
        path = Path(path)
        data = read_json(path, "fix it or re-save the checkpoint (its config.json is written by save_checkpoint)")
        if not isinstance(data, dict):
            raise ConfigError("checkpoint", str(path), f"config.json must hold a JSON object of model fields, "
                                                       f"got a JSON {_json_type(data)}")
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
        from ditkv.models.hunyuan.tokenizer import BYTE_SPECIAL_IDS, BYTE_VOCAB_SIZE

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


def read_json(path: str | Path, fix: str) -> Any:
    """The parsed content of a checkpoint's JSON file; an unreadable or malformed file is a
    `ConfigError` naming it (`fix`: what to do about it)."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except OSError as e:  # missing, a directory, no permission
        raise ConfigError("checkpoint", str(path), f"cannot read {path.name} ({e.strerror or e}); {fix}") from e
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer past 4300 digits
        raise ConfigError("checkpoint", str(path), f"{path.name} is not valid JSON ({e}); {fix}") from e


# Release config flags that change what the model computes. ditkv implements exactly one value of
# each (the release's); a checkpoint that sets another would load and compute something else, so it
# is refused by name. Absent flags mean the implemented behaviour.
BEHAVIOUR_FLAGS: dict[str, tuple[Any, str]] = {
    "use_qk_norm": (True, "ditkv always RMS-normalises each query and key head after RoPE"),
    "attention_bias": (False, "the attention projections have no bias"),
    "mlp_bias": (False, "the MLP / expert projections have no bias"),
    "use_cla": (False, "no cross-layer attention (every layer has its own K/V)"),
    "cla_share_factor": (1, "no cross-layer attention (every layer has its own K/V)"),
    "use_mixed_mlp_moe": (True, "every layer runs routed experts plus the shared expert"),
    "moe_drop_tokens": (False, "no token dropping: every routed token reaches its experts"),
    "moe_layer_num_skipped": (0, "every layer is an MoE layer"),
    "norm_topk_prob": (True, "the top-k routing weights are renormalised to sum to 1"),
    "routed_scaling_factor": (1.0, "routed expert outputs are not rescaled"),
    "group_limited_greedy": (False, "plain top-k routing over all experts (no expert groups)"),
}


def _check_behaviour_flags(extra: dict[str, Any]) -> None:
    for key, (want, why) in BEHAVIOUR_FLAGS.items():
        if key not in extra:
            continue
        got = extra[key]
        same = (type(got) is bool) == (type(want) is bool) and got == want
        if not same:
            raise ConfigError(key, got, f"ditkv implements only {key}={json.dumps(want)} ({why}); this "
                              "checkpoint needs behaviour ditkv does not have")


def _json_type(v: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(v), "number")


