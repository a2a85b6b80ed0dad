"""A release checkpoint's generation_config.json (issue 13 item 5): its template keys and sampling
defaults are honoured, keys ditkv has no use for are ignored for a documented reason, anything else is
refused, and a setting config.json gives differently is an error (neither file silently wins)."""

import json

import pytest

from ditkv.errors import ConfigError
from ditkv.models.hunyuan import HunyuanImage3Config, HunyuanImage3Model, save_checkpoint
from ditkv.models.hunyuan.checkpoint import (
    GENERATION_AR, GENERATION_IGNORED, GENERATION_SAMPLING, GENERATION_TEMPLATE, load_model_config,
)
from ditkv.models.text_settings import TextSampling, checkpoint_sampling
from ditkv.models.hunyuan.template import TemplateSettings

# The base checkpoint's generation_config.json as published with the release weights.
RELEASE_BASE = {
    "bot_task": "image", "diff_guidance_scale": 5.0, "diff_infer_steps": 50, "disable_compile": True,
    "do_sample": True, "drop_think": False, "eos_token_id": [127957], "flow_shift": 3.0, "max_length": 12800,
    "moe_impl": "eager", "pad_token_id": 128009, "sequence_template": "pretrain", "temperature": 0.6,
    "top_k": 1024, "top_p": 0.95, "use_system_prompt": "None", "transformers_version": "4.50.0",
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny checkpoint whose config.json, like the release's, has no sampling defaults or template keys."""
    folder = tmp_path_factory.mktemp("gen") / "ckpt"
    save_checkpoint(HunyuanImage3Model.from_config(HunyuanImage3Config.tiny(), seed=0), folder)
    data = json.loads((folder / "config.json").read_text())
    for name in GENERATION_SAMPLING.values():
        del data[name]
    (folder / "config.json").write_text(json.dumps(data))
    return folder


def with_gen(folder, gen, config_changes=None):
    (folder / "generation_config.json").write_text(json.dumps(gen))
    if config_changes:
        data = json.loads((folder / "config.json").read_text())
        (folder.parent / "config.bak").write_text(json.dumps(data))
        data.update(config_changes)
        (folder / "config.json").write_text(json.dumps(data))
    return folder


@pytest.fixture
def folder(ckpt):
    yield ckpt
    (ckpt / "generation_config.json").unlink(missing_ok=True)
    bak = ckpt.parent / "config.bak"
    if bak.exists():
        bak.replace(ckpt / "config.json")


def test_the_release_base_file_loads_with_its_defaults(folder):
    cfg = load_model_config(with_gen(folder, RELEASE_BASE))
    assert (cfg.default_steps, cfg.default_guidance, cfg.flow_shift) == (50, 5.0, 3.0)
    assert TemplateSettings.from_config(cfg) == TemplateSettings()
    known = set(GENERATION_IGNORED) | set(GENERATION_SAMPLING) | set(GENERATION_TEMPLATE) | set(GENERATION_AR)
    assert set(RELEASE_BASE) <= known
    # the release's AR text defaults: sampled at 0.6 over the top 1024 ids and the top-p 0.95 mass
    assert checkpoint_sampling(cfg) == TextSampling(temperature=0.6, top_k=1024, top_p=0.95, do_sample=True)


def test_ar_sampling_defaults_and_their_refusals(folder):
    gen = {**RELEASE_BASE, "do_sample": False, "max_new_tokens": 256, "repetition_penalty": 1.0}
    assert checkpoint_sampling(load_model_config(with_gen(folder, gen))) == TextSampling(
        temperature=0.6, top_k=1024, top_p=0.95, do_sample=False, max_new_tokens=256)
    assert checkpoint_sampling(load_model_config(with_gen(folder, {}))) == TextSampling()  # greedy, no text
    for key, value, words in (("repetition_penalty", 1.1, "does not implement"), ("top_p", 1.5, "(0, 1]"),
                              ("top_k", -2, "0 / -1"), ("temperature", -1, ">= 0")):
        with pytest.raises(ConfigError) as e:
            load_model_config(with_gen(folder, {**RELEASE_BASE, key: value}))
        assert e.value.field == key and words in str(e.value) and "generation_config.json" in str(e.value)
    with pytest.raises(ConfigError, match="make the two files agree"):
        load_model_config(with_gen(folder, RELEASE_BASE, {"temperature": 0.7}))


def test_template_and_sampling_keys_are_honoured(folder):
    gen = {**RELEASE_BASE, "diff_infer_steps": 3, "diff_guidance_scale": 4.0, "flow_shift": 2.0,
           "use_system_prompt": "custom", "system_prompt": "Draw.", "sequence_template": "instruct",
           "bot_task": "recaption", "drop_think": True}
    cfg = load_model_config(with_gen(folder, gen))
    assert (cfg.default_steps, cfg.default_guidance, cfg.flow_shift) == (3, 4.0, 2.0)
    assert TemplateSettings.from_config(cfg) == TemplateSettings(
        use_system_prompt="custom", system_prompt="Draw.", sequence_template="instruct", bot_task="recaption",
        drop_think=True)
    assert "max_length" not in cfg.extra and "eos_token_id" not in cfg.extra  # ignored, not kept
    # the whole loader sees it (the engine's model, the stage graph's front end)
    from ditkv.models.loader import load_model

    model, _, _ = load_model(str(folder), *_cpu())
    assert model.config.default_steps == 3 and model.config.extra["bot_task"] == "recaption"


def _cpu():
    import torch

    return torch.device("cpu"), torch.float32


@pytest.mark.parametrize("gen, config_changes, key", [
    ({"diff_infer_steps": 50}, {"default_steps": 8}, "diff_infer_steps"),
    ({"flow_shift": 3.0}, {"flow_shift": 1.0}, "flow_shift"),
    ({"bot_task": "recaption"}, {"bot_task": "image"}, "bot_task"),
    ({"sequence_template": "instruct"}, {"sequence_template": "pretrain"}, "sequence_template"),
])
def test_a_setting_the_two_files_give_differently_is_an_error(folder, gen, config_changes, key):
    with pytest.raises(ConfigError, match="config.json sets") as e:
        load_model_config(with_gen(folder, gen, config_changes))
    assert e.value.field == key and "generation_config.json" in str(e.value)


def test_the_same_setting_in_both_files_is_fine(folder):
    cfg = load_model_config(with_gen(folder, {"diff_infer_steps": 8, "bot_task": "image"},
                                     {"default_steps": 8, "bot_task": "image"}))
    assert cfg.default_steps == 8


@pytest.mark.parametrize("gen, key, match", [
    ({"flow_reverse": True}, "flow_reverse", "does not know"),
    ({"bot_task": "paint"}, "bot_task", "'think'"),
    ({"drop_think": "yes"}, "drop_think", "true or false"),
    ({"use_system_prompt": "custom"}, "system_prompt", "system_prompt"),
    ({"diff_infer_steps": 0}, "diff_infer_steps", "positive integer"),
    ({"diff_guidance_scale": "high"}, "diff_guidance_scale", "finite number"),
])
def test_bad_or_unknown_keys_are_refused_by_name(folder, gen, key, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_model_config(with_gen(folder, gen))
    assert e.value.field == key and "generation_config.json" in str(e.value)


def test_a_file_that_is_not_an_object_is_refused(folder):
    (folder / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_model_config(folder)
