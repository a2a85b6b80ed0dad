"""The release prompt template (issue 13): ditkv's rows equal, id for id, the rows the release's own
template code builds (tests/fixtures/release_template.json, made by tools/make_template_fixture.py
from the reference checkout; this test needs neither it nor the network)."""

import json
from pathlib import Path

import pytest

from ditkv.errors import ConfigError, LayoutError
from ditkv.models.hunyuan import ByteTokenizer, HunyuanImage3Config
from ditkv.models.hunyuan.layout import build_request_layout, max_prompt_tokens
from ditkv.models.hunyuan.template import (
    BOT_TASKS, SEQUENCE_TEMPLATES, SYSTEM_PROMPT_MODES, SYSTEM_PROMPTS, EncodedText, TemplateSettings,
    ar_prompt_pieces, ar_stop_ids,
)
from ditkv.models.hunyuan.tokenizer import HFTokenizer, resolve_special_ids

FIXTURE = Path(__file__).parent / "fixtures" / "release_template.json"


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    assert FIXTURE.is_file(), (f"{FIXTURE} is missing: regenerate it with "
                               "python tools/make_template_fixture.py --reference /tmp/hi3")
    data = json.loads(FIXTURE.read_text(encoding="utf-8"))
    path = tmp_path_factory.mktemp("tpl") / "tokenizer.json"
    path.write_text(data["tokenizer_json"], encoding="utf-8")
    tok = HFTokenizer(path)
    cfg = resolve_special_ids(HunyuanImage3Config.release(), tok, data["named_specials"])
    return data, tok, cfg


def _ids(runs):
    out = []
    for e in runs:
        out += [e[0]] * e[1] if isinstance(e, list) else [e]
    return out


def _rows(data):
    return [pytest.param(i, id=f"{r['case']}-{r['height']}x{r['width']}-p{r['prompt'][:6]}")
            for i, r in enumerate(data["image_rows"])]


def test_fixture_covers_every_mode(golden):
    data, _, _ = golden
    seen = {(r["settings"].get("use_system_prompt", "None"), r["settings"].get("sequence_template", "pretrain"))
            for r in data["image_rows"]}
    assert {m for m, _ in seen} == set(SYSTEM_PROMPT_MODES)
    assert {t for _, t in seen} == set(SEQUENCE_TEMPLATES)
    assert {r["settings"].get("bot_task") for r in data["ar_rows"]} == {"think", "recaption"}
    assert len(data["image_rows"]) >= 30


@pytest.mark.parametrize("i", range(34))
def test_image_rows_match_the_release(golden, i):
    data, tok, cfg = golden
    r = data["image_rows"][i]
    cond = _ids(r["cond"])
    uncond = list(cond)
    for start, stop in r["uncond_cfg_runs"]:
        uncond[start:stop] = [cfg.cfg_token_id] * (stop - start)
    lay = build_request_layout(cfg, tok, r["prompt"], r["height"], r["width"], 5.0, rewrite=r["rewrite"],
                               template=TemplateSettings(**r["settings"]))
    assert lay.cfg_factor == 2
    assert lay.rows[0].token_ids.tolist() == cond, r["case"]
    assert lay.rows[1].token_ids.tolist() == uncond, r["case"]
    for row in lay.rows:
        assert (row.timestep_index, row.image_start) == (r["timestep_index"], r["image_start"])
        assert row.full_attn_spans == ((r["image_start"], r["image_stop"]),)


def test_fixture_row_count(golden):
    assert len(golden[0]["image_rows"]) == 34  # keep test_image_rows_match_the_release's range in step


def test_ar_inputs_match_the_release(golden):
    data, tok, cfg = golden
    for r in data["ar_rows"]:
        pieces = ar_prompt_pieces(TemplateSettings(**r["settings"]), r["prompt"])
        assert [cfg.bos_token_id, *EncodedText.encode(tok, pieces, []).head_ids()] == r["ids"], r["case"]
    stops = ar_stop_ids(tok, cfg.eos_token_id)
    assert stops == [tok.token_to_id("</recaption>"), tok.token_to_id("</answer>"), cfg.eos_token_id]


def test_settings_come_from_the_model_config(golden):
    """The release keys in config.json (cfg.extra) select the template; absent keys: the base default."""
    data, tok, cfg = golden
    r = next(r for r in data["image_rows"] if r["case"] == "instruct-vanilla")
    cfg_mode = cfg.replace(extra={**cfg.extra, **r["settings"]})
    lay = build_request_layout(cfg_mode, tok, r["prompt"], r["height"], r["width"], 5.0)
    assert lay.rows[0].token_ids.tolist() == _ids(r["cond"])
    default = next(r for r in data["image_rows"] if r["case"] == "release-default")
    lay = build_request_layout(cfg, tok, default["prompt"], default["height"], default["width"], 5.0)
    assert lay.rows[0].token_ids.tolist() == _ids(default["cond"])
    assert TemplateSettings.from_config(cfg) == TemplateSettings()


def test_release_default_is_the_plain_row(golden):
    """The base checkpoint's mode (no system prompt, pretrain) is `<bos> prompt <boi> ...`."""
    _, tok, cfg = golden
    lay = build_request_layout(cfg, tok, "a red fox", 1024, 1024, 5.0)
    ids = lay.rows[0].token_ids.tolist()
    n = len(tok.encode("a red fox"))
    assert ids[: n + 2] == [cfg.bos_token_id, *tok.encode("a red fox"), cfg.boi_token_id]
    assert ids[-1] == cfg.eoi_token_id and lay.prompt_tokens == n


def test_tiny_model_rows_are_unchanged():
    cfg, tok = HunyuanImage3Config.tiny(), ByteTokenizer()
    lay = build_request_layout(cfg, tok, "hi", 32, 32, 5.0, negative_prompt="x")
    ratio = cfg.img_ratio_token_id + 16
    tail = [cfg.boi_token_id, cfg.img_size_token_id, ratio, cfg.timestep_token_id] + [cfg.img_token_id] * 64
    assert lay.rows[0].token_ids.tolist() == [cfg.bos_token_id, *b"hi", *tail, cfg.eoi_token_id]
    assert lay.rows[1].token_ids.tolist() == [cfg.bos_token_id, ord("x"), cfg.cfg_token_id, *tail, cfg.eoi_token_id]


def test_the_prompt_may_be_given_as_ids():
    """`prompt_ids=` (an AR text that extends the prompt: the ids the AR wrote) take the prompt's slots, in
    the cond row and, as `<cfg>` one for one, in the uncond row; the negative prompt is still encoded."""
    cfg, tok = HunyuanImage3Config.tiny(), ByteTokenizer()
    lay = build_request_layout(cfg, tok, "hi", 32, 32, 5.0, negative_prompt="", prompt_ids=[97, 98, 99])
    assert lay.cond_text_ids() == [cfg.bos_token_id, 97, 98, 99] and lay.prompt_tokens == 3
    assert lay.rows[1].token_ids.tolist()[:4] == [cfg.bos_token_id] + [cfg.cfg_token_id] * 3
    same = build_request_layout(cfg, tok, "abc", 32, 32, 5.0, negative_prompt="")
    assert all(a.token_ids.equal(b.token_ids) for a, b in zip(lay.rows, same.rows))


def test_cond_text_ids_is_the_templated_text(golden):
    _, tok, cfg = golden
    tpl = TemplateSettings(use_system_prompt="en_vanilla", sequence_template="instruct")
    lay = build_request_layout(cfg, tok, "a red fox", 1024, 1024, 5.0, template=tpl)
    ids = lay.rows[0].token_ids.tolist()
    text = lay.cond_text_ids()
    assert ids[len(text)] == cfg.boi_token_id and text[0] == cfg.bos_token_id
    assert tok.decode(text[1:]) == SYSTEM_PROMPTS["en_vanilla"] + "\n\nUser: a red fox\n\nAssistant: <answer>"


def test_negative_prompt_takes_only_the_prompt_slots(golden):
    _, tok, cfg = golden
    tpl = TemplateSettings(use_system_prompt="en_vanilla", sequence_template="instruct")
    lay = build_request_layout(cfg, tok, "a red fox", 1024, 1024, 5.0, negative_prompt="blurry", template=tpl)
    plain = build_request_layout(cfg, tok, "a red fox", 1024, 1024, 5.0, template=tpl)
    cond, neg, uncond = (r.token_ids.tolist() for r in (lay.rows[0], lay.rows[1], plain.rows[1]))
    slots = [i for i, (c, u) in enumerate(zip(cond, uncond)) if c != u]  # the prompt's (all <cfg> in uncond)
    assert len(slots) == len(tok.encode("a red fox")) and slots == list(range(slots[0], slots[-1] + 1))
    want = (tok.encode("blurry") + [cfg.cfg_token_id] * len(slots))[: len(slots)]
    assert [neg[i] for i in slots] == want
    assert [t for i, t in enumerate(neg) if i not in slots] == [t for i, t in enumerate(uncond) if i not in slots]


def test_template_counts_against_the_position_budget(golden):
    """The system prompt takes positions: max_prompt_tokens (given the tokenizer) and the layout's
    length check both count it."""
    _, tok, cfg = golden
    prompt = "a red fox sitting in fresh snow"
    n, overhead = len(tok.encode(prompt)), len(tok.encode(SYSTEM_PROMPTS["en_recaption"]))
    tpl_cfg = cfg.replace(extra={**cfg.extra, "use_system_prompt": "en_recaption"},
                          max_position_embeddings=6 + 64 * 64 + overhead + n)
    assert max_prompt_tokens(tpl_cfg, 1024, 1024, tok) == n
    assert max_prompt_tokens(tpl_cfg, 1024, 1024) == n + overhead  # without a tokenizer: no template
    lay = build_request_layout(tpl_cfg, tok, prompt, 1024, 1024, 5.0)
    assert lay.rows[0].seq_len == tpl_cfg.max_position_embeddings and lay.prompt_tokens == n
    with pytest.raises(LayoutError, match=f"prompt is {n} tokens .* at most {n - 1} fit"):
        build_request_layout(tpl_cfg.replace(max_position_embeddings=tpl_cfg.max_position_embeddings - 1),
                             tok, prompt, 1024, 1024, 5.0)


@pytest.mark.parametrize("extra, field, valid", [
    ({"use_system_prompt": "en_fancy"}, "use_system_prompt", SYSTEM_PROMPT_MODES),
    ({"use_system_prompt": None, "bot_task": "paint"}, "bot_task", BOT_TASKS),
    ({"sequence_template": "chat"}, "sequence_template", SEQUENCE_TEMPLATES),
])
def test_an_unknown_mode_names_the_field_and_the_valid_values(extra, field, valid):
    cfg = HunyuanImage3Config.tiny()
    cfg = cfg.replace(extra=extra)
    with pytest.raises(ConfigError, match=field) as e:
        build_request_layout(cfg, ByteTokenizer(), "x", 32, 32, 5.0)
    assert e.value.field == field and all(repr(v) in str(e.value) for v in valid)


@pytest.mark.parametrize("kw, field", [
    (dict(drop_think="yes"), "drop_think"),
    (dict(use_system_prompt="custom"), "system_prompt"),
    (dict(use_system_prompt="custom", system_prompt=3), "system_prompt"),
])
def test_bad_settings_are_config_errors(kw, field):
    with pytest.raises(ConfigError) as e:
        TemplateSettings(**kw)
    assert e.value.field == field


def test_a_rewrite_mode_needs_the_ar_text(golden):
    _, tok, cfg = golden
    tpl = TemplateSettings(sequence_template="instruct", use_system_prompt="dynamic", bot_task="think")
    with pytest.raises(LayoutError, match="rewrite") as e:
        build_request_layout(cfg, tok, "a fox", 1024, 1024, 5.0, template=tpl)
    assert e.value.field == "bot_task"
    with pytest.raises(ConfigError, match="bot_task"):
        ar_prompt_pieces(TemplateSettings(), "a fox")
    with pytest.raises(ConfigError, match="</recaption>"):
        ar_stop_ids(ByteTokenizer(), 0)
    with pytest.raises(LayoutError, match="rewrite must be a string"):
        build_request_layout(cfg, tok, "a fox", 1024, 1024, 5.0, rewrite=3, template=tpl)


def test_a_templated_checkpoint_generates_end_to_end(tmp_path):
    """The settings in a checkpoint's config.json reach every row the engine builds (instruct rows
    carry text after <eoi>): the CLI runs a tiny model with a system prompt and the instruct template."""
    from PIL import Image

    from ditkv.entrypoints.cli import main
    from ditkv.models.hunyuan import HunyuanImage3Model, save_checkpoint
    from ditkv.models.hunyuan.checkpoint import load_model_config

    extra = {"use_system_prompt": "en_vanilla", "sequence_template": "instruct"}
    cfg = HunyuanImage3Config.tiny().replace(extra=extra)
    save_checkpoint(HunyuanImage3Model.from_config(cfg, seed=0), tmp_path / "ckpt")
    assert TemplateSettings.from_config(load_model_config(tmp_path / "ckpt")) == TemplateSettings(**extra)
    lay = build_request_layout(cfg, ByteTokenizer(), "a red circle", 64, 64, 5.0)
    after = list(b"</answer>\n\n")
    assert lay.rows[0].token_ids[-len(after) - 1:].tolist() == [cfg.eoi_token_id, *after]
    out = tmp_path / "x.png"
    assert main(["generate", "--model", str(tmp_path / "ckpt"), "--prompt", "a red circle", "--steps", "1",
                 "--no-progress", "--out", str(out)]) == 0
    assert Image.open(out).size == (64, 64)
