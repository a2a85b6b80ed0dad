"""The release config.json keys that are not fields of `HunyuanImage3Config`: which change the
computation (checked at the one value ditkv implements, refused by name otherwise), which the release
never reads given the other keys (any value accepted, kept in `extra`), which other parts of ditkv
read, and the release config class's defaults for keys its files may leave out."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ditkv.errors import ConfigError

MAX_INT = 2**31  # sizes and counts: far above any real model, far below what overflows a tensor size


# Release config flags that change what the model computes. ditkv implements exactly one value of
# each (the release's); a checkpoint that sets another would load and compute something else, so it
# is refused by name. Absent flags mean the implemented behaviour.
BEHAVIOUR_FLAGS: dict[str, tuple[Any, str]] = {
    "use_qk_norm": (True, "ditkv always RMS-normalises each query and key head after RoPE"),
    "attention_bias": (False, "the attention projections have no bias"),
    "mlp_bias": (False, "the MLP / expert projections have no bias"),
    "use_cla": (False, "no cross-layer attention (every layer has its own K/V)"),
    "use_mixed_mlp_moe": (True, "every layer runs routed experts plus the shared expert"),
    "moe_drop_tokens": (False, "no token dropping: every routed token reaches its experts"),
    "moe_layer_num_skipped": (0, "every layer is an MoE layer"),
    "norm_topk_prob": (True, "the top-k routing weights are renormalised to sum to 1"),
    "group_limited_greedy": (False, "plain top-k routing over all experts (no expert groups)"),
    "patch_size": (1, "patch_embed / final_layer are the release's patch-size-1 UNet ends (conv + ResBlock on "
                      "the latent grid, one token per latent cell); patch sizes 2/4/8 add down/up-sampling "
                      "ResBlocks ditkv does not have"),
    "img_proj_type": ("unet", "the image path is the release's UNet-style patch_embed / final_layer"),
    "hidden_act": ("silu", "the MLP and experts are SwiGLU (SiLU gate)"),
    "use_rotary_pos_emb": (True, "ditkv always applies the release's 2D RoPE"),
    "add_classification_head": (False, "the model ends in ln_f and the LM head (no classification head)"),
    "tie_word_embeddings": (False, "lm_head and the token embedding are separate weights"),
    "use_meanflow": (False, "no mean-flow interval conditioning (no timestep_r embedding)"),
}
# Flags with more than one spelling of the implemented behaviour: key -> (accepted values, why).
BEHAVIOUR_CHOICES: dict[str, tuple[tuple[Any, ...], str]] = {
    "norm_type": (("hf_rms", "rms"), "the decoder norms are RMSNorm (the release's 'fused' / 'torch_nn' are "
                                     "LayerNorm)"),
}
# Release keys ditkv does not read, each with the reason it does not need to. They stay in `extra`, so
# to_dict() round-trips them. Every key of the release config class (configuration_hunyuan.py) is a
# field, an `_ALIASES` key, a flag above, in `READ_HERE` / `READ_ELSEWHERE`, or here; a key in none of
# them (not a release key) is kept in `extra` unread, as before.
_NEVER_READ = "stored by the release config class; the release model never reads it"
_SPECIAL_BY_NAME = ("stored by the release config class, never read by its model (the tokenizer wrapper looks "
                    "special tokens up by name); ditkv has no use for it")
RELEASE_UNUSED: dict[str, str] = {
    "eod_token_id": _SPECIAL_BY_NAME, "im_start_id": _SPECIAL_BY_NAME, "im_end_id": _SPECIAL_BY_NAME,
    "text_start_id": _SPECIAL_BY_NAME, "text_end_id": _SPECIAL_BY_NAME, "video_start_id": _SPECIAL_BY_NAME,
    "video_end_id": _SPECIAL_BY_NAME, "im_newline_id": _SPECIAL_BY_NAME, "mask_init_id": _SPECIAL_BY_NAME,
    "initializer_range": "weight initialisation for training; a loaded checkpoint does not use it",
    "attention_dropout": "dropout is off at inference (the release runs the model in eval mode)",
    "use_cache": "transformers generate()'s KV-cache switch; ditkv manages its own KV cache",
    "pretraining_tp": _NEVER_READ,
    "use_mla": _NEVER_READ + " (it has no MLA attention)",
    "kv_lora_rank": _NEVER_READ + " (MLA setting)", "q_lora_rank": _NEVER_READ + " (MLA setting)",
    "qk_rope_head_dim": _NEVER_READ + " (MLA setting)", "qk_nope_head_dim": _NEVER_READ + " (MLA setting)",
    "v_head_dim": _NEVER_READ + " (MLA setting)",
    "moe_random_routing_dropped_token": "stored by the release MoE layer, never used (and it only concerns "
                                        "dropped tokens: moe_drop_tokens=true is refused)",
    "capacity_factor": "sizes the expert buffers only when moe_drop_tokens=true, which is refused",
    "cla_share_factor": "read only with use_cla=true (cross-layer attention), which is refused",
    # release topkgating: with norm_topk_prob and top-k > 1 the top-k weights are renormalised and the
    # factor unused; otherwise the softmax probabilities are scaled by it
    "routed_scaling_factor": "read only where the top-k weights are not renormalised (norm_topk_prob=false or "
                             "moe_topk=1, both refused)",
    "n_group": "read only by group-limited routing (group_limited_greedy=true is refused)",
    "topk_group": "read only by group-limited routing (group_limited_greedy=true is refused)",
    "class_num": _NEVER_READ + " (classification head; add_classification_head=true is refused)",
    "pool_type": _NEVER_READ + " (classification head; add_classification_head=true is refused)",
    "dense_list": _NEVER_READ + " (classification head; add_classification_head=true is refused)",
    "moe_impl": "the release's MoE kernel choice (eager / flashinfer: the same result); ditkv has its own",
    "model_type": "transformers' class lookup; no effect on the computation",
    "architectures": "transformers' class lookup; no effect on the computation",
    "auto_map": "transformers' remote-code class lookup; no effect on the computation",
    "transformers_version": "the writer's transformers version; no effect on the computation",
    "_name_or_path": "where transformers loaded the config from; no effect on the computation",
}
# Release keys read here that are not fields: key -> what they do.
READ_HERE: dict[str, str] = {
    "vae_downsample_factor": "sets image_token_downsample (then dropped: the field carries it, so a later "
                             "replace() cannot leave a stale copy behind)",
    "rope_scaling": "checked: only the release's 'custom' type (ditkv's 2D RoPE); kept in extra",
    "quantization_config": "an FP8 checkpoint's scheme (`read_quantization_config`): checked here (fp8 e4m3, "
                           "per-channel or per-tensor weight scales, dynamic per-token activations; static, "
                           "block-wise or other methods refused by name), its ignored layers checked against the "
                           "tensors when they load (fp8_checkpoint.py); kept in extra",
}
# Keys kept in `extra` because another part of ditkv reads them there.
READ_ELSEWHERE: dict[str, str] = {
    "vae": "checkpoint.load_vae builds the release VAE from it; its latent_channels and ffactor_spatial are "
           "checked against the transformer's here",
    "vit": "vision.VisionConfig: the vision encoder (vision_model.*) of image inputs (cond_image_type 'vae_vit')",
    "vit_processor": "vision.VisionConfig: the vision encoder's preprocessing (patch size, max_num_patches, mean/std)",
    "vit_aligner": "vision.VisionConfig: the aligner (vision_aligner.*) from vision features to the transformer",
    "use_system_prompt": "template.TemplateSettings", "bot_task": "template.TemplateSettings",
    "sequence_template": "template.TemplateSettings", "drop_think": "template.TemplateSettings",
    "system_prompt": "template.TemplateSettings",
}


# Fields whose ditkv default (the tiny model's) differs from the release config class's default, for
# a release config.json that leaves them out: the official base file has no image_base_size, and the
# release then snaps sizes to the buckets around 1024.
RELEASE_CLASS_DEFAULTS: dict[str, Any] = {"image_base_size": 1024}


def is_release_file(extra: dict[str, Any]) -> bool:
    """Written by the release config class (its model_type / architectures), not by ditkv."""
    archs = extra.get("architectures")
    return extra.get("model_type") in ("hunyuan_image_3_moe", "Hunyuan") or (
        isinstance(archs, list) and "HunyuanImage3ForCausalMM" in archs)


def same_value(got: Any, want: Any) -> bool:
    """JSON equality that does not let true stand for 1 (or 1 for true)."""
    return (type(got) is bool) == (type(want) is bool) and got == want


def show(v: Any) -> str:
    return json.dumps(v, default=repr)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


COND_ATTN_TYPES = ("full", "joint_full")


def check_cond_attn(image_type: str, attn_type: Any) -> None:
    """The release's `prepare_full_attn_slices`: with latent tokens only ('vae') just 'full' exists."""
    allowed = COND_ATTN_TYPES if image_type == "vae_vit" else ("full",)
    if attn_type not in allowed:
        raise ConfigError("cond_token_attn_type", attn_type, f"ditkv implements {list(allowed)} with "
                          f"cond_image_type={image_type!r} ('full': each input image's latent and vision tokens "
                          "are two full-attention blocks; 'joint_full': one block over both and the separator; "
                          "the release's 'causal' and 'full_causal' are not implemented); or set max_input_images 0")


def check_behaviour_flags(extra: dict[str, Any]) -> None:
    for key, (want, why) in BEHAVIOUR_FLAGS.items():
        if key in extra and not same_value(extra[key], want):
            raise ConfigError(key, extra[key], f"ditkv implements only {key}={json.dumps(want)} ({why}); this "
                              "checkpoint needs behaviour ditkv does not have")
    for key, (allowed, why) in BEHAVIOUR_CHOICES.items():
        if key in extra and not any(same_value(extra[key], a) for a in allowed):
            raise ConfigError(key, extra[key], f"ditkv implements only {key} in {json.dumps(list(allowed))} "
                              f"({why}); this checkpoint needs behaviour ditkv does not have")
    read_quantization_config(extra.get(QUANT_KEY))
    rope = extra.get("rope_scaling")
    if rope is not None and not (isinstance(rope, dict) and rope.get("type") == "custom"):
        raise ConfigError("rope_scaling", rope, "ditkv implements only the release's rope_scaling type 'custom' "
                          "(2D RoPE over image rows/columns, plain 1D for text); other types scale positions "
                          "in ways ditkv does not have")


def read_image_geometry(extra: dict[str, Any], kwargs: dict[str, Any], source: dict[str, str], default_ds: int) -> None:
    """`vae_downsample_factor` (release: pixels per latent cell, (h, w)) sets image_token_downsample;
    with patch_size 1 (checked) that is also pixels per image token, as in the release's image
    processor (`image_height // (vae_downsample_factor[0] * patch_size)`). The `vae` section must agree."""
    if "vae_downsample_factor" in extra:
        f = extra["vae_downsample_factor"]
        if not (isinstance(f, (list, tuple)) and len(f) == 2 and all(is_int(v) and 0 < v < MAX_INT for v in f)):
            raise ConfigError("vae_downsample_factor", f, "must be [h, w]: two positive integers (pixels per latent "
                              "cell down and across)")
        if f[0] != f[1]:
            raise ConfigError("vae_downsample_factor", f, "ditkv implements square latent cells only (one "
                              "image_token_downsample divides both image sides); this checkpoint's differ")
        if "image_token_downsample" in kwargs and not same_value(kwargs["image_token_downsample"], f[0]):
            raise ConfigError("vae_downsample_factor", f, f"conflicts with image_token_downsample="
                              f"{show(kwargs['image_token_downsample'])}: both set the pixels per latent cell; "
                              "make them equal or drop one")
        kwargs["image_token_downsample"], source["image_token_downsample"] = f[0], "vae_downsample_factor"
        del extra["vae_downsample_factor"]
    vae = extra.get("vae")
    if not isinstance(vae, dict):
        return  # checkpoint.load_vae refuses vae.* weights without a `vae` section
    if "latent_channels" in vae:
        if "latent_channels" in kwargs and not same_value(kwargs["latent_channels"], vae["latent_channels"]):
            raise ConfigError("vae.latent_channels", vae["latent_channels"], f"conflicts with latent_channels="
                              f"{show(kwargs['latent_channels'])}: the transformer's image path and the VAE "
                              "must use the same latent channels")
        kwargs["latent_channels"] = vae["latent_channels"]
    if "ffactor_spatial" in vae:
        ds = kwargs.get("image_token_downsample", default_ds)
        if not same_value(vae["ffactor_spatial"], ds):
            where = source.get("image_token_downsample", "image_token_downsample (default)")
            shown = [ds, ds] if where == "vae_downsample_factor" else ds
            raise ConfigError("vae.ffactor_spatial", vae["ffactor_spatial"], f"does not match {where}="
                              f"{show(shown)}: the VAE's spatial downsampling must be the transformer's "
                              "pixels per latent cell")


# ---------------------------------------------------------------- quantization_config (FP8 checkpoints)
# config.json's `quantization_config`, as `ditkv quantize` writes it (vLLM's "fp8" spelling) or as
# llm-compressor ("compressed-tensors") and ModelOpt ("modelopt") write theirs. What ditkv runs: e4m3
# weights with one fp32 scale per output channel (or per tensor), activations quantized dynamically,
# one scale per token. Any other scheme is refused by name: it would load and compute something else.
# The tensors are checked against it when the weights load (fp8_checkpoint.py).
QUANT_KEY = "quantization_config"
QUANT_FIX = ("re-export with per-channel e4m3 weight scales and dynamic per-token activations (e.g. `ditkv "
             "quantize --model UNQUANTIZED --out FOLDER`), or load the unquantized checkpoint")
_STATIC = ("static activation scales (one calibrated input_scale per layer): ditkv quantizes activations "
           "dynamically, one scale per token")
_BLOCK = ("block-wise (128x128) weight scales: torch's sm90 grouped FP8 GEMM, which runs the MoE experts, takes "
          "rowwise scales only")
_FP8_KEYS = ("quant_method", "activation_scheme", "ignored_layers", "modules_to_not_convert", "weight_block_size",
             "fmt")


@dataclass(frozen=True)
class QuantizationConfig:
    """What a checkpoint's quantization_config says, normalised: the method ("fp8"), the module
    patterns its exporter left unquantized (fnmatch, or compressed-tensors' "re:<regex>"), its spelling."""
    method: str
    ignored: tuple[str, ...]
    spelling: str


def read_quantization_config(qc: Any) -> QuantizationConfig | None:
    """`quantization_config` checked and normalised; None when absent. A ConfigError names the key."""
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ConfigError(QUANT_KEY, qc, "must be an object with a quant_method (e.g. {\"quant_method\": \"fp8\", "
                          "\"activation_scheme\": \"dynamic\"})")
    method = qc.get("quant_method")
    reader = _QUANT_READERS.get(method) if isinstance(method, str) else None
    if reader is None:
        raise ConfigError(f"{QUANT_KEY}.quant_method", method, f"ditkv loads FP8 checkpoints spelled "
                          f"{', '.join(map(repr, _QUANT_READERS))}; {QUANT_FIX}")
    return reader(qc)


def _refuse(key: str, value: Any, why: str) -> None:
    raise ConfigError(f"{QUANT_KEY}.{key}", value, f"{why}; {QUANT_FIX}")


def _patterns(qc: dict[str, Any], key: str) -> tuple[str, ...]:
    v = qc.get(key)
    if v is None:
        return ()
    if isinstance(v, str) or not isinstance(v, list) or not all(isinstance(p, str) and p for p in v):
        _refuse(key, v, "must be a list of module names or patterns")
    return tuple(v)


def _read_fp8(qc: dict[str, Any]) -> QuantizationConfig:
    """`ditkv quantize` / vLLM / transformers' fp8 spelling."""
    unknown = sorted(set(qc) - set(_FP8_KEYS))
    if unknown:
        _refuse(unknown[0], qc[unknown[0]], f"not a key ditkv knows in an fp8 quantization_config (known: "
                                            f"{', '.join(_FP8_KEYS)}), so it cannot honour it")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        _refuse("activation_scheme", scheme, _STATIC if scheme == "static" else "ditkv runs 'dynamic' only")
    if qc.get("weight_block_size") is not None:
        _refuse("weight_block_size", qc["weight_block_size"], _BLOCK)
    if qc.get("fmt", "e4m3") != "e4m3":
        _refuse("fmt", qc["fmt"], "ditkv runs float8_e4m3fn weights only")
    return QuantizationConfig("fp8", _patterns(qc, "ignored_layers") + _patterns(qc, "modules_to_not_convert"), "fp8")


def _read_compressed_tensors(qc: dict[str, Any]) -> QuantizationConfig:
    """llm-compressor's spelling: FP8 per-channel (or per-tensor) weights, dynamic per-token activations
    (its FP8_DYNAMIC scheme) in the float-quantized format."""
    if qc.get("format") not in ("float-quantized", "naive-quantized"):
        _refuse("format", qc.get("format"), "ditkv loads the float-quantized (e4m3) format only")
    for key, why in (("kv_cache_scheme", "an FP8 KV cache: ditkv's KV cache stays in the model dtype"),
                     ("sparsity_config", "sparse weights: ditkv loads dense ones")):
        if qc.get(key):
            _refuse(key, qc[key], why)
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        _refuse("config_groups", groups, "must give the weight and activation schemes")
    for name, group in groups.items():
        g = group if isinstance(group, dict) else {}
        _ct_scheme(f"config_groups.{name}.weights", g.get("weights"), ("channel", "tensor"), dynamic=False)
        _ct_scheme(f"config_groups.{name}.input_activations", g.get("input_activations"), ("token",), dynamic=True)
    return QuantizationConfig("fp8", _patterns(qc, "ignore"), "compressed-tensors")


def _ct_scheme(key: str, s: Any, strategies: tuple[str, ...], dynamic: bool) -> None:
    if not isinstance(s, dict):
        _refuse(key, s, "ditkv runs W8A8: both the weight and the input-activation scheme must be FP8")
    if s.get("type") != "float" or s.get("num_bits") != 8 or s.get("symmetric", True) is not True:
        _refuse(key, s, "ditkv runs symmetric 8-bit float (e4m3) only")
    strategy = s.get("strategy")
    if strategy in ("block", "group") or s.get("block_structure") is not None:
        _refuse(key + ".strategy", strategy, _BLOCK)
    if strategy not in strategies:
        _refuse(key + ".strategy", strategy, f"ditkv runs {' or '.join(strategies)} scales here")
    if bool(s.get("dynamic", False)) != dynamic:
        _refuse(key + ".dynamic", s.get("dynamic"), _STATIC if dynamic else "weights need stored scales")


def _read_modelopt(qc: dict[str, Any]) -> QuantizationConfig:
    """ModelOpt's spelling (flat, or nested under `quantization` as in its hf_quant_config.json)."""
    q = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else qc
    algo = q.get("quant_algo")
    if algo == "FP8":  # ModelOpt's default: per-tensor weights with calibrated static input scales
        _refuse("quant_algo", algo, _STATIC + " (ModelOpt's FP8_PER_CHANNEL_PER_TOKEN is what ditkv runs)")
    if isinstance(algo, str) and algo.upper() in ("FP8_BLOCK", "FP8_PB_WO"):
        _refuse("quant_algo", algo, _BLOCK)
    if algo != "FP8_PER_CHANNEL_PER_TOKEN":
        _refuse("quant_algo", algo, "ditkv loads ModelOpt's FP8_PER_CHANNEL_PER_TOKEN only")
    if q.get("kv_cache_quant_algo") is not None:
        _refuse("kv_cache_quant_algo", q["kv_cache_quant_algo"], "an FP8 KV cache: ditkv's stays in the model dtype")
    return QuantizationConfig("fp8", _patterns(q, "exclude_modules"), "modelopt")


_QUANT_READERS = {"fp8": _read_fp8, "compressed-tensors": _read_compressed_tensors, "modelopt": _read_modelopt}


# Special ids the release looks up by name in its tokenizer (never in config.json); bos/eos/pad and
# the image token are config keys of the release. The guidance token only where it is used.
_BY_NAME = ("timestep_token_id", "boi_token_id", "eoi_token_id", "cfg_token_id", "img_size_token_id",
            "img_ratio_token_id")


def require_spelled_ids(data: dict[str, Any], missing: list[str], path) -> None:
    """Without a tokenizer.json the ids the release looks up by name must be spelled in config.json."""
    distilled = any(same_value(data.get(k), True) for k in ("use_guidance_token", "cfg_distilled"))
    needed = [f for f in missing if f in _BY_NAME or (f == "guidance_token_id" and distilled)]
    if needed:
        raise ConfigError("tokenizer", str(path.parent / "tokenizer.json"), f"there is no tokenizer.json beside "
                          f"{path.name} and it does not give {', '.join(needed)}: the release looks these special "
                          "tokens up by name in its tokenizer. Put the checkpoint's tokenizer.json in the folder, "
                          "or spell the ids out in config.json")
