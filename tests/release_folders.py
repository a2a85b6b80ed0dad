"""Release-format checkpoint folders from the official config files, on random weights.

`tests/fixtures/release_config_base.json` is the official HunyuanImage-3.0 (base) config.json, key for
key and value for value (docs/release-checkpoint.md says where it comes from); the Instruct and
Instruct-Distil files are built from the fork's configuration class by tools/make_release_configs.py,
as their published config.json files are in no reachable repository. `shrunk` makes a copy small
enough for the CPU while keeping every other key at its official value: only widths, layer and
expert counts and the vision / VAE sizes change, so the vocabulary stays 133120 and every token id,
behaviour flag and image setting stays the release's.

The tokenizer.json beside it is synthetic (the release's is not stored here): byte-level tokens at
ids 0..255 and the release's special tokens at ids in the release's range (bos/eos/pad/<img> at the
config's ids), so special ids are resolved by name as in a real folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

FIXTURES = Path(__file__).parent / "fixtures"
CONFIGS = {name: FIXTURES / f"release_config_{name}.json" for name in ("base", "instruct", "instruct_distil")}

# The special tokens a HunyuanImage-3 tokenizer defines, at fixed ids (those of config.json where it
# gives one; the others in the release's special range, <img_ratio_k> consecutive).
_FIXED = {"<|endoftext|>": 127957, "<|startoftext|>": 127958, "<boi>": 128000, "<eoi>": 128001,
          "<img>": 128006, "<pad>": 128009, "<timestep>": 128017, "<guidance>": 128018, "</recaption>": 128019}
_MORE = ["<cfg>", "<joint_img_sep>", "<think>", "</think>", "<recaption>", "<answer>", "</answer>", "<timestep_r>",
         *(f"<img_size_{s}>" for s in (256, 512, 768, 1024)), *(f"<img_ratio_{k}>" for k in range(37))]
SPECIAL_IDS = {**_FIXED, **{name: 128100 + i for i, name in enumerate(_MORE)}}


def official(name: str = "base") -> dict:
    return json.loads(CONFIGS[name].read_text())


def shrunk(config: dict, layers: int = 2, experts: int = 16) -> dict:
    """`config` at CPU size: widths, layer and expert counts, vision and VAE sizes; nothing else."""
    c = json.loads(json.dumps(config))
    topk = c["moe_topk"][0] if isinstance(c["moe_topk"], list) else c["moe_topk"]
    per_layer = {"moe_intermediate_size": 32, "moe_topk": topk, "num_shared_expert": 1}
    c.update(hidden_size=64, attention_head_dim=16, head_dim=16, num_attention_heads=4, num_key_value_heads=1,
             intermediate_size=48, num_hidden_layers=layers, num_experts=experts, dense_list=[64, 0],
             patch_embed_hidden_dim=32,  # a width of the image path (the release class's default, 1024, is absent)
             **{k: [v] * layers for k, v in per_layer.items()})
    c["vit"].update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    num_patches=16)
    c["vit_processor"]["max_num_patches"] = 16
    c["vit_aligner"].update(input_dim=32, n_embed=64)
    c["vae"].update(block_out_channels=[32, 32, 32, 32, 64], layers_per_block=1)  # GroupNorm: x32
    return c


def tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update(SPECIAL_IDS)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_IDS))
    return tok.to_str()


def write_folder(folder: Path, config: dict, seed: int = 0, tokenizer: bool = True) -> Path:
    """config.json (as given), tokenizer.json, and random weights in the release's key names: the
    transformer (with the vision encoder and aligner where the config has them) and `vae.*`."""
    from ditkv.models.hunyuan import HunyuanImage3Model
    from ditkv.models.hunyuan.checkpoint import INDEX_NAME, load_model_config
    from ditkv.models.hunyuan.vae import ReleaseVAE, VAEConfig

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    (folder / "tokenizer.json").write_text(tokenizer_json())
    cfg = load_model_config(folder)
    torch.manual_seed(seed)
    state = dict(HunyuanImage3Model.from_config(cfg, seed=seed, zero_init_resblocks=False).state_dict())
    state.update({"vae." + k: v for k, v in ReleaseVAE(VAEConfig.from_dict(cfg.extra["vae"])).state_dict().items()})
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model-00001-of-00001.safetensors"))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
             "weight_map": dict.fromkeys(state, "model-00001-of-00001.safetensors")}
    (folder / INDEX_NAME).write_text(json.dumps(index))
    if not tokenizer:
        (folder / "tokenizer.json").unlink()
    return folder
