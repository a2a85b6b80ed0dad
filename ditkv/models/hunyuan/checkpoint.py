"""Checkpoint folders in the Hugging Face layout used by the release.

    config.json
    model-00001-of-0000N.safetensors ...
    model.safetensors.index.json   {"metadata": {"total_size": bytes}, "weight_map": {key: file}}
    tokenizer.json                 (optional; without it the byte tokenizer is used)
    generation_config.json         (optional; the release's template and sampling defaults, see
                                    `apply_generation_config`)

Keys use release names; `qkv_proj.weight` is in the release grouped-per-KV-head layout and
`gate_and_up_proj.weight` in the fused [up; gate] layout (the model converts on the fly).
Loading validates the key set and every shape before any weight is read, builds the model on
the meta device (no throw-away random init) and assigns tensors shard by shard.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ditkv.errors import ConfigError, LayoutError
from ditkv.alignment import align_module
from ditkv.models.hunyuan.config import HunyuanImage3Config
from ditkv.models.hunyuan.files import read_json
from ditkv.models.hunyuan.model import HunyuanImage3Model
from ditkv.models.hunyuan.safetensors_io import _FP32_SUFFIXES, open_safetensors  # noqa: F401 - re-exported
from ditkv.models.hunyuan.template import TemplateSettings
from ditkv.models.hunyuan.tokenizer import ByteTokenizer, HFTokenizer, TextTokenizer, resolve_special_ids
from ditkv.models.text_settings import SAMPLING_KEYS, TextSampling

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_SHARD_BYTES = 4 * 1024**3


def save_checkpoint(model: HunyuanImage3Model, folder: str | Path,
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[Path]:
    """Write config.json, safetensors shards and the index; returns the shard paths."""
    from safetensors.torch import save_file

    if max_shard_bytes <= 0:
        raise ConfigError("max_shard_bytes", max_shard_bytes, "must be > 0")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}

    # Greedy packing in state-dict order; a tensor larger than the limit gets its own shard.
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes

    n = len(shards)
    paths, weight_map = [], {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        paths.append(folder / name)
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(folder / INDEX_NAME, "w", encoding="utf-8") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2, sort_keys=True)
        fh.write("\n")
    model.config.save_json(folder / CONFIG_NAME)
    return paths


def _weight_files(folder: Path) -> dict[str, list[str]]:
    """file name -> keys it holds, from the index (or the single-file checkpoint)."""
    index = folder / INDEX_NAME
    if index.exists():
        weight_map = _index_weight_map(index)
        files: dict[str, list[str]] = {}
        for key, name in weight_map.items():
            files.setdefault(name, []).append(key)
        for name in files:
            if not (folder / name).is_file():
                raise ConfigError("checkpoint", str(folder / name), f"shard listed in {INDEX_NAME} is missing; "
                                                                   "copy it into the folder or re-save the checkpoint")
        return files
    single = folder / SINGLE_NAME
    if single.exists():
        with open_safetensors(single) as f:
            return {SINGLE_NAME: list(f.keys())}
    raise ConfigError("checkpoint", str(folder), f"no {INDEX_NAME} or {SINGLE_NAME} in the folder")


def _index_weight_map(index: Path) -> dict[str, str]:
    """The index's `weight_map` (tensor name -> shard file name), checked for shape."""
    fix = "re-save the checkpoint (save_checkpoint writes the index)"
    data = read_json(index, fix)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConfigError("checkpoint", str(index), f"{INDEX_NAME} needs a non-empty weight_map object; {fix}")
    bad = next((k for k, v in weight_map.items() if not isinstance(v, str) or not v), None)
    if bad is not None:
        raise ConfigError("checkpoint", str(index), f"weight_map[{bad!r}] = {weight_map[bad]!r} must be a shard "
                                                    f"file name; {fix}")
    return weight_map


VAE_PREFIX = "vae."  # the release VAE (models/hunyuan/vae.py), loaded by `load_vae`
# key groups of a release checkpoint that a model without image input never reads, with the reason; a
# config with input images through the vision encoder (`max_input_images > 0`, cond_image_type "vae_vit")
# loads them into `HunyuanImage3Model.vision_model` / `.vision_aligner` (vision.py)
UNUSED_KEY_GROUPS = {
    "vision_model.": "the SigLIP2 vision encoder: it reads input images, for image-conditioned generation "
                     "(loaded when the config takes input images through it)",
    "vision_aligner.": "maps vision-encoder features into the transformer, for image-conditioned generation "
                       "(loaded when the config takes input images through it)",
}


def transformer_key(key: str, vision: bool = False) -> bool:
    """A key the `HunyuanImage3Model` loads (not the VAE, not a deliberately unused group); with `vision`
    (a model with a vision encoder) the vision groups are its keys too."""
    if key.startswith(VAE_PREFIX):
        return False
    return vision or not key.startswith(tuple(UNUSED_KEY_GROUPS))


def _loads_vision(model: HunyuanImage3Model) -> bool:
    return getattr(model, "vision_model", None) is not None


def _check_keys_and_shapes(model: HunyuanImage3Model, folder: Path, files: dict[str, list[str]],
                           checked: set[str] = frozenset()) -> None:
    """Every key of the (unquantized, meta) model stored with its shape, and no other; `checked`:
    keys validated elsewhere (a pre-quantized folder's weight_scales, fp8_checkpoint.py)."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    vision = _loads_vision(model)
    found = {k for keys in files.values() for k in keys if transformer_key(k, vision)} - set(checked)
    missing = sorted(set(expected) - found)
    unexpected = sorted(found - set(expected))
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing key(s), e.g. {missing[:5]}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected key(s), e.g. {unexpected[:5]}")
    for name, keys in files.items():
        with open_safetensors(folder / name) as f:
            present = set(f.keys())
            for key in keys:
                if key not in present:
                    problems.append(f"{key} is mapped to {name} but not stored there")
                elif key in expected:
                    shape = tuple(f.get_slice(key).get_shape())
                    if shape != expected[key]:
                        problems.append(f"{key}: checkpoint shape {shape} != model shape {expected[key]}")
    if problems:
        raise ConfigError(
            "checkpoint", str(folder),
            "does not match its config.json: " + "; ".join(problems[:10])
            + ("" if len(problems) <= 10 else f"; ... {len(problems) - 10} more")
            + ". Check that config.json belongs to these weights",
        )


def load_checkpoint(folder: str | Path, device: str | torch.device = "cpu",
                    dtype: torch.dtype | None = None, quantization: str | None = None,
                    ignored: tuple = ()) -> HunyuanImage3Model:
    """Load a checkpoint folder into a `HunyuanImage3Model` on `device`.

    `dtype` casts floating weights (router weights, e4m3 weights and their scales keep theirs);
    None keeps the stored dtypes. FP8 (fp8_checkpoint.py): a pre-quantized folder (e4m3 weights
    + weight_scale) loads FP8 whatever `quantization` says; otherwise `quantization` "fp8" quantizes
    the decoder layers' linears (`ignored` excepted) from their stored tensors as each file is read,
    so the model never exists whole in the unquantized dtype.
    """
    from ditkv.models.hunyuan import fp8_checkpoint as f8

    folder = Path(folder)
    if not (folder / CONFIG_NAME).exists():
        raise ConfigError("checkpoint", str(folder), f"no {CONFIG_NAME}; is this a checkpoint folder?")
    cfg = load_model_config(folder)
    with torch.device("meta"):
        model = HunyuanImage3Model(cfg)
    files = _weight_files(folder)
    plan = f8.plan_fp8(model, f8.read_headers(folder, files), quantization, ignored)
    _check_keys_and_shapes(model, folder, files, plan.stored_scale_keys())
    f8.apply_plan(model, plan)  # meta: the e4m3 weights and fp32 scales the state dict then fills

    for name in sorted(files):
        shard: dict[str, torch.Tensor] = {}
        with open_safetensors(folder / name, device=str(device)) as f:
            for key in f.keys():  # one stored tensor at a time: quantized / cast before the next is read
                if transformer_key(key, _loads_vision(model)):
                    shard.update(f8.prepare(key, f.get_tensor(key), plan, dtype))
        result = model.load_state_dict(shard, strict=False, assign=True)
        if result.unexpected_keys:  # pre-checked; guards against a racing writer
            raise ConfigError("checkpoint", name, f"unexpected keys {result.unexpected_keys[:5]}")
        del shard
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    if leftover:
        raise ConfigError("checkpoint", str(folder), f"weights never loaded: {leftover[:5]}")
    align_module(model)  # safetensors maps tensors 8-byte aligned; CPU BLAS needs 64 for fixed bits
    return model.requires_grad_(False).eval()


def load_vae(folder: str | Path, cfg: HunyuanImage3Config, device="cpu", dtype: torch.dtype | None = None):
    """The release VAE from the checkpoint's `vae.*` weights and config.json's `vae` section, or None
    when the checkpoint has no VAE weights. Every `vae.` key must match the module, and the reverse."""
    from ditkv.models.hunyuan.vae import ReleaseVAE, VAEConfig

    folder = Path(folder)
    files = _weight_files(folder)
    keys = {k: name for name, ks in files.items() for k in ks if k.startswith(VAE_PREFIX)}
    if not keys:
        return None
    section = cfg.extra.get("vae")
    if not isinstance(section, dict):
        raise ConfigError("vae", section, "the checkpoint has vae.* weights but config.json has no `vae` section")
    vcfg = VAEConfig.from_dict(section)
    if vcfg.latent_channels != cfg.latent_channels or vcfg.ffactor_spatial != cfg.image_token_downsample:
        raise ConfigError("vae", section, f"latent_channels={vcfg.latent_channels} and ffactor_spatial="
                          f"{vcfg.ffactor_spatial} must equal the transformer's latent_channels={cfg.latent_channels} "
                          f"and image_token_downsample={cfg.image_token_downsample}")
    vae = ReleaseVAE(vcfg)
    state = {}
    for name in sorted(set(keys.values())):
        with open_safetensors(folder / name, device=str(device)) as f:
            state.update({k[len(VAE_PREFIX):]: f.get_tensor(k) for k in f.keys() if k in keys})
    missing, unexpected = vae.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ConfigError("checkpoint", str(folder), f"vae.* keys do not match the release VAE: missing "
                          f"{missing[:5]}, unexpected {unexpected[:5]}")
    vae = vae.to(device=device, dtype=dtype).eval().requires_grad_(False)
    align_module(vae)  # a same-dtype CPU .to() keeps the mapped (8-byte aligned) tensors
    return vae


def load_model_config(folder: str | Path) -> HunyuanImage3Config:
    """`config.json` of a checkpoint folder; with a `tokenizer.json` beside it, every special id
    is resolved by its name in that tokenizer (bos/eos/pad by the names in tokenizer_config.json)."""
    folder = Path(folder)
    has_tokenizer = (folder / "tokenizer.json").exists()
    # ids first from the tokenizer, then checked against vocab_size (replace() validates again)
    cfg = HunyuanImage3Config.from_json_file(folder / CONFIG_NAME, tokenizer_ids=has_tokenizer)
    if (folder / GENERATION_CONFIG_NAME).exists():
        cfg = apply_generation_config(cfg, folder)
    if has_tokenizer:
        cfg = resolve_special_ids(cfg, HFTokenizer(folder / "tokenizer.json"), _named_specials(folder))
    _check_image_size(cfg)
    return cfg


def _check_image_size(cfg: HunyuanImage3Config) -> None:
    """generation_config.json's `image_size: auto` needs a model that can pick its size (its ratio ids known)."""
    if cfg.extra.get(GENERATION_SIZE) == "auto":
        from .buckets import auto_sizes

        try:
            auto_sizes(cfg)
        except LayoutError as e:
            raise ConfigError(GENERATION_SIZE, "auto", f"{e} (generation_config.json sets image_size auto: remove it "
                              "for this model)") from e


# generation_config.json (the release reads it as a Hugging Face GenerationConfig: hunyuan.py reads
# diff_infer_steps, diff_guidance_scale, flow_shift, use_system_prompt, bot_task, sequence_template,
# drop_think, max_length; HF `generate` the text-sampling keys). Every key is either used, or ignored
# for the reason given, or refused: nothing is applied by guess.
GENERATION_SAMPLING = {  # release key -> the ditkv config field it sets
    "diff_infer_steps": "default_steps",
    "diff_guidance_scale": "default_guidance",
    "flow_shift": "flow_shift",
}
GENERATION_TEMPLATE = ("use_system_prompt", "bot_task", "sequence_template", "drop_think", "system_prompt")
# ditkv's extension: "auto" makes a request without a size let the model pick it (the release's generate_image
# default, image_size="auto"), kept in cfg.extra; the front ends read it (Processor.auto_size_default)
GENERATION_SIZE = "image_size"
# the checkpoint's AR text defaults (`worker.sampling.TextSampling`), kept in cfg.extra under these names;
# repetition_penalty is checked (only 1 is accepted) and not kept
GENERATION_AR = SAMPLING_KEYS
_AR_SAMPLING = ("Hugging Face generate's length / search settings: ditkv's AR text is bounded by max_new_tokens "
                "and drawn by sampling or greedily, one sequence, no beams")
_STOP_IDS = ("token ids: the release passes its own stop ids for each bot_task (prepare_model_inputs), and "
             "ditkv resolves the special ids from tokenizer.json / config.json")
_RUNTIME = "a release runtime choice (torch.compile, the MoE kernel): ditkv's engine config picks its kernels"
_HF_META = "Hugging Face bookkeeping"
GENERATION_IGNORED = {
    **dict.fromkeys(("max_length", "min_length", "min_new_tokens", "num_beams", "length_penalty",
                     "no_repeat_ngram_size", "typical_p", "num_return_sequences", "early_stopping", "use_cache"),
                    _AR_SAMPLING),
    **dict.fromkeys(("eos_token_id", "bos_token_id", "pad_token_id"), _STOP_IDS),
    **dict.fromkeys(("disable_compile", "moe_impl"), _RUNTIME),
    **dict.fromkeys(("transformers_version", "_from_model_config"), _HF_META),
}


def apply_generation_config(cfg: HunyuanImage3Config, folder: str | Path) -> HunyuanImage3Config:
    """`cfg` with the defaults of the folder's `generation_config.json` (release key names).

    - template keys (`GENERATION_TEMPLATE`) go to `cfg.extra`, where the prompt template reads them;
      checked at once (an unknown value is a ConfigError naming the key and the valid values);
    - `diff_infer_steps`, `diff_guidance_scale`, `flow_shift` set `default_steps`, `default_guidance`,
      `flow_shift` (a request's own steps / guidance still win);
    - AR keys (`GENERATION_AR`: do_sample, temperature, top_k, top_p, max_new_tokens) go to
      `cfg.extra`, the checkpoint's AR text defaults (`worker.sampling.checkpoint_sampling`), checked
      at once; `repetition_penalty` only at 1 (ditkv has no penalties);
    - keys in `GENERATION_IGNORED` are ignored, each for its documented reason;
    - any other key is refused (a ConfigError naming it): ditkv does not guess what it means.

    A setting that both files give must agree: config.json (ditkv's field name, or the release key
    among its extra keys) and generation_config.json disagreeing is a ConfigError naming both; neither
    file silently wins. A null value counts as absent."""
    folder = Path(folder)
    path = folder / GENERATION_CONFIG_NAME
    fix = "fix it, or remove it to use config.json's (or the base checkpoint's) defaults"
    gen = read_json(path, fix)
    if not isinstance(gen, dict):
        raise ConfigError("checkpoint", str(path), f"{path.name} must hold a JSON object; {fix}")
    unknown = sorted(k for k in gen if k not in GENERATION_SAMPLING and k not in GENERATION_TEMPLATE
                     and k not in GENERATION_AR and k not in GENERATION_IGNORED and k != "repetition_penalty"
                     and k != GENERATION_SIZE)
    if unknown:
        raise ConfigError(unknown[0], gen[unknown[0]],
                          f"{path} has key(s) {', '.join(map(repr, unknown))} that ditkv does not know, so it cannot "
                          f"honour them: remove them (known: {', '.join(GENERATION_SAMPLING)}, "
                          f"{', '.join(GENERATION_TEMPLATE)}, {', '.join(GENERATION_AR)}, {GENERATION_SIZE}, and "
                          "ignored search / "
                          "bookkeeping keys)")
    raw = read_json(folder / CONFIG_NAME, fix)  # which settings config.json itself gives (not defaults)
    changes: dict = {}
    extra = dict(cfg.extra)
    TextSampling.from_release(gen, str(path))  # every AR value (and repetition_penalty), checked now
    if gen.get(GENERATION_SIZE) not in (None, "auto"):
        raise ConfigError(GENERATION_SIZE, gen[GENERATION_SIZE], f"{path.name}: image_size may only be \"auto\" (a "
                          "request without a size lets the model pick one of its resolution buckets); remove it to "
                          "keep the front ends' default size")
    for key in (*GENERATION_SAMPLING, *GENERATION_TEMPLATE, *GENERATION_AR, GENERATION_SIZE):
        value = gen.get(key)
        if value is None:
            continue
        name = GENERATION_SAMPLING.get(key, key)
        for cname in dict.fromkeys((name, key)):
            if raw.get(cname) is not None and raw[cname] != value:
                raise ConfigError(key, value, f"{path.name} sets {key}={value!r} but config.json sets "
                                  f"{cname}={raw[cname]!r} (in {folder}): make the two files agree, or remove the "
                                  "key from one of them")
        if key in GENERATION_SAMPLING:
            changes[name] = value
        else:
            extra[key] = value
    try:
        TemplateSettings.from_config(cfg.replace(extra=extra))  # every template value, checked now
        out = cfg.replace(**changes, extra=extra)
    except ConfigError as e:  # name the file, and the release key rather than ditkv's field
        key = next((k for k, f in GENERATION_SAMPLING.items() if f == e.field and k in gen), e.field)
        raise ConfigError(key, e.value, f"{e.fix} (in {path})") from e
    return out


def _named_specials(folder: Path) -> dict[str, str]:
    """bos/eos/pad token names from tokenizer_config.json (HF layout), where it names them."""
    path = folder / "tokenizer_config.json"
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError("tokenizer", str(path), f"tokenizer_config.json is not valid JSON ({e})") from e
    out = {}
    for key in ("bos", "eos", "pad"):
        v = data.get(f"{key}_token") if isinstance(data, dict) else None
        v = v.get("content") if isinstance(v, dict) else v
        if isinstance(v, str):
            out[key] = v
    return out


def load_tokenizer(folder: str | Path) -> TextTokenizer:
    """`tokenizer.json` via the `tokenizers` package when present, else the byte tokenizer."""
    path = Path(folder) / "tokenizer.json"
    if path.exists():
        return HFTokenizer(path)
    return ByteTokenizer()
