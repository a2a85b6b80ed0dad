"""The prompt template of an Instruct / Instruct-Distil checkpoint: ditkv's rows equal, id for id, the rows
the Instruct code builds (tests/fixtures/release_instruct_template.json, made by
tools/make_instruct_template_fixture.py running the fork's generate_image on a stand-in model). Its
generate_image strips the system prompt (the base code keeps the newlines around it: one more token, and
another first-step velocity) and applies drop_think in its own way; `template.instruct_code` tells the
families apart by the config's model_version."""

import json
from pathlib import Path

import pytest

from ditkv.errors import ConfigError
from ditkv.models.hunyuan import HunyuanImage3Config
from ditkv.models.hunyuan.layout import build_ar_head, build_request_layout
from ditkv.models.hunyuan.template import TemplateSettings, instruct_code, rewrite_from_ar, system_prompt_text
from ditkv.models.hunyuan.tokenizer import HFTokenizer, resolve_special_ids

FIXTURE = Path(__file__).parent / "fixtures" / "release_instruct_template.json"
DATA = json.loads(FIXTURE.read_text(encoding="utf-8"))
ROWS = DATA["image_rows"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("itpl") / "tokenizer.json"
    path.write_text(DATA["tokenizer_json"], encoding="utf-8")
    return HFTokenizer(path)


def _cfg(tok, settings, model_version=DATA["model_version"]):
    """A release config whose config.json / generation_config carried `settings` and `model_version`."""
    cfg = HunyuanImage3Config.release().replace(extra={"model_version": model_version, **settings})
    return resolve_special_ids(cfg, tok, DATA["named_specials"])


def _ids(runs):
    out = []
    for e in runs:
        out += [e[0]] * e[1] if isinstance(e, list) else [e]
    return out


def _layout(tok, r, model_version=DATA["model_version"]):
    cfg = _cfg(tok, r["settings"], model_version)
    tpl = TemplateSettings.from_config(cfg)  # the settings and the code family, from the config alone
    rewrite = rewrite_from_ar(tpl, r["generated"]) if "generated" in r else None
    return cfg, build_request_layout(cfg, tok, r["prompt"], r["height"], r["width"], 5.0, rewrite=rewrite)


def test_fixture_covers_the_system_prompt_modes_and_the_rewrites():
    modes = {r["settings"].get("use_system_prompt", "None") for r in ROWS}
    assert modes == {"None", "en_vanilla", "en_recaption", "en_think_recaption", "dynamic", "custom"}
    assert {r["settings"].get("sequence_template", "pretrain") for r in ROWS} == {"pretrain", "instruct"}
    assert {r["settings"].get("bot_task") for r in ROWS if "ar_ids" in r} == {"think", "recaption"}
    assert any(r["settings"].get("drop_think") for r in ROWS if "ar_ids" in r)
    assert len(ROWS) == 35  # keep the parametrize range in step


@pytest.mark.parametrize("i", range(35), ids=lambda i: f"{ROWS[i]['case']}-{ROWS[i]['height']}x{ROWS[i]['width']}")
def test_image_rows_match_the_instruct_code(tok, i):
    r = ROWS[i]
    cfg, lay = _layout(tok, r)
    cond = _ids(r["cond"])
    uncond = list(cond)
    for start, stop in r["uncond_cfg_runs"]:
        uncond[start:stop] = [cfg.cfg_token_id] * (stop - start)
    assert lay.rows[0].token_ids.tolist() == cond, r["case"]
    assert lay.rows[1].token_ids.tolist() == uncond, r["case"]
    for row in lay.rows:
        assert (row.timestep_index, row.image_start) == (r["timestep_index"], r["image_start"])
        assert row.full_attn_spans == ((r["image_start"], r["image_stop"]),)


@pytest.mark.parametrize("i", [i for i, r in enumerate(ROWS) if "ar_ids" in r], ids=lambda i: ROWS[i]["case"])
def test_ar_inputs_match_the_instruct_code(tok, i):
    r = ROWS[i]
    cfg = _cfg(tok, r["settings"])
    head = build_ar_head(cfg, tok, r["prompt"], r["height"], r["width"], rewrite_input=True)
    assert head.token_ids == r["ar_ids"], r["case"]


@pytest.mark.parametrize("case", ["instruct-vanilla", "pretrain-vanilla", "instruct-recaption-prompt",
                                  "instruct-custom", "instruct-recaption-drop"])
def test_a_base_family_checkpoint_keeps_the_newlines_and_misses(tok, case):
    """The same settings under the base family (model_version "HunyuanImage-3.0"): the system prompt keeps
    its newlines (and drop_think switches after a recaption step), so the row is longer and differs."""
    r = next(r for r in ROWS if r["case"] == case)
    _, lay = _layout(tok, r, model_version="HunyuanImage-3.0")
    ids = lay.rows[0].token_ids.tolist()
    assert ids != _ids(r["cond"]), case
    if not r["settings"].get("drop_think"):
        assert len(ids) > len(_ids(r["cond"])), case


def test_system_prompt_is_stripped_only_for_the_instruct_family():
    for mode in ("en_vanilla", "en_recaption", "en_think_recaption"):
        base = system_prompt_text(TemplateSettings(use_system_prompt=mode))
        inst = system_prompt_text(TemplateSettings(use_system_prompt=mode, instruct_family=True))
        assert base.startswith("\n") and base.endswith("\n") and inst == base.strip()
    blank = TemplateSettings(use_system_prompt="custom", system_prompt=" \n", instruct_family=True)
    assert system_prompt_text(blank) is None  # nothing left: no system piece, as the Instruct code


@pytest.mark.parametrize("version, want", [(None, False), ("HunyuanImage-3.0", False),
                                           ("HunyuanImage-3.0-Instruct", True),
                                           ("HunyuanImage-3.0-Instruct-Distil", True)])
def test_instruct_code_reads_model_version(version, want):
    extra = {} if version is None else {"model_version": version}
    cfg = HunyuanImage3Config.tiny().replace(extra=extra)
    assert instruct_code(cfg) is want
    assert TemplateSettings.from_config(cfg).instruct_family is want


def test_an_unknown_model_version_is_an_error_naming_it():
    cfg = HunyuanImage3Config.tiny().replace(extra={"model_version": "HunyuanImage-3.5"})
    with pytest.raises(ConfigError, match="model_version"):
        instruct_code(cfg)
    with pytest.raises(ConfigError, match="instruct_family"):
        TemplateSettings(instruct_family="yes")
