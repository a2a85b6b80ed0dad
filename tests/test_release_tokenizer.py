"""A real tokenizer.json sets every special id by its name (issue 13): never a placeholder id,
a clear error for a missing or misnumbered special token."""

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from ditkv.errors import ConfigError
from ditkv.models.hunyuan import HunyuanImage3Config, HunyuanImage3Model, save_checkpoint
from ditkv.models.hunyuan.checkpoint import load_model_config

SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<pad>", "<boi>", "<eoi>", "<img>", "<cfg>", "<timestep>",
            "<guidance>", "<img_size_1024>", *[f"<img_ratio_{k}>" for k in range(33)]]


def _tokenizer(path, drop=(), swap_ratio=False):
    words = ["[UNK]", *"a red blue circle square large small in the top left".split()]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = [s for s in SPECIALS if s not in drop]
    if swap_ratio:  # <img_ratio_5> and <img_ratio_6> out of order
        i, j = specials.index("<img_ratio_5>"), specials.index("<img_ratio_6>")
        specials[i], specials[j] = specials[j], specials[i]
    tok.add_special_tokens(specials)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|startoftext|>", "eos_token": {"content": "<|endoftext|>"}, "pad_token": "<pad>"}))
    return tok


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("release-tok")
    save_checkpoint(HunyuanImage3Model.from_config(HunyuanImage3Config.tiny(), seed=0), path)
    return path


def test_every_special_id_comes_from_the_tokenizer_by_name(folder):
    tok = _tokenizer(folder)
    cfg = load_model_config(folder)
    placeholder = HunyuanImage3Config.tiny()
    want = {"bos_token_id": "<|startoftext|>", "eos_token_id": "<|endoftext|>", "pad_token_id": "<pad>",
            "boi_token_id": "<boi>", "eoi_token_id": "<eoi>", "img_token_id": "<img>", "cfg_token_id": "<cfg>",
            "timestep_token_id": "<timestep>", "img_size_token_id": "<img_size_1024>",
            "img_ratio_token_id": "<img_ratio_0>"}
    for field, name in want.items():
        assert getattr(cfg, field) == tok.token_to_id(name), field
        assert getattr(cfg, field) != getattr(placeholder, field), field  # no placeholder left


@pytest.mark.parametrize("drop, match", [(("<cfg>",), "'<cfg>'"), (("<img_size_1024>",), "'<img_size_1024>'"),
                                         (("<|startoftext|>",), "'<|startoftext|>'")])
def test_a_missing_special_token_is_an_error_naming_it(folder, tmp_path, drop, match):
    import shutil

    for f in folder.iterdir():
        shutil.copy(f, tmp_path / f.name)
    _tokenizer(tmp_path, drop=drop)
    with pytest.raises(ConfigError, match=match):
        load_model_config(tmp_path)


def test_ratio_tokens_must_be_consecutive(folder, tmp_path):
    import shutil

    for f in folder.iterdir():
        shutil.copy(f, tmp_path / f.name)
    _tokenizer(tmp_path, swap_ratio=True)
    with pytest.raises(ConfigError, match="<img_ratio_5> has id"):
        load_model_config(tmp_path)


def test_generate_runs_with_a_release_style_tokenizer(folder, tmp_path):
    """The CLI end to end on a checkpoint with tokenizer.json: resolved ids, HF tokenizer prompt."""
    from PIL import Image

    from ditkv.entrypoints.cli import main

    _tokenizer(folder)
    out = tmp_path / "x.png"
    assert main(["generate", "--model", str(folder), "--prompt", "a red circle", "--steps", "1",
                 "--no-progress", "--out", str(out)]) == 0
    assert Image.open(out).size == (64, 64)
