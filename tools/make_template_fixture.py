"""Regenerate tests/fixtures/release_template.json: token ids of templated prompts, made by the
release's own code.

The release builds a text-to-image row with `TokenizerWrapper.apply_chat_template`
(hunyuan_image_3/tokenizer_wrapper.py of github.com/Tencent-Hunyuan/HunyuanImage-3.0), choosing
the system prompt with `get_system_prompt` (hunyuan_image_3/system_prompt.py) the way
`HunyuanImage3ForCausalMM.generate_image` (hunyuan_image_3/hunyuan.py) does. This script imports
those two files from a checkout of the reference (nothing of them is copied into ditkv), runs them
on a small byte-level BPE tokenizer that has the release's special tokens (trained here, stored in
the fixture), and records, for each template setting x prompt x image size, the cond and uncond
rows of the image step (and the AR stage's input for think/recaption). tests/test_template.py
rebuilds the same rows with ditkv and compares the ids exactly.

    git clone https://github.com/Tencent-Hunyuan/HunyuanImage-3.0 /tmp/hi3
    pip install 'transformers<5' diffusers   # tool-time only: the reference imports them
    python tools/make_template_fixture.py --reference /tmp/hi3 [--out tests/fixtures/release_template.json]
"""

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

# what a real HunyuanImage-3 tokenizer defines: specials by name (bos/eos/pad named as in its
# tokenizer_config.json) and the template's tag tokens
NAMED = {"bos": "<|startoftext|>", "eos": "<|endoftext|>", "pad": "<pad>"}
SPECIALS = [*NAMED.values(), "<boi>", "<eoi>", "<img>", "<cfg>", "<timestep>", "<guidance>", "<img_size_1024>",
            *[f"<img_ratio_{k}>" for k in range(33)], "<joint_img_sep>",
            "<think>", "</think>", "<recaption>", "</recaption>", "<answer>", "</answer>"]

PROMPTS = [
    "A red fox sitting in fresh snow at dawn, soft light",
    'A neon sign that reads "OPEN 24/7" above a small café, rainy night, reflections',
]
SIZES = [(1024, 1024), (768, 1280)]  # (height, width): release buckets
THINK = ("<think>The subject is a fox; the scene is calm. Composition: centred, low angle.</think>"
         "<recaption>A red fox sits in deep fresh snow, lit by low pink dawn light.</recaption>")
RECAPTION = "<recaption>A detailed, objective description of the scene.</recaption>"
CUSTOM = "You draw exactly what the user asks for."
# (name, generation-config settings, the AR stage's rewrite text for the image row)
CASES = [
    ("release-default", {}, None),
    ("vanilla", {"use_system_prompt": "en_vanilla"}, None),
    ("recaption-prompt", {"use_system_prompt": "en_recaption"}, None),
    ("think-recaption-prompt", {"use_system_prompt": "en_think_recaption"}, None),
    ("dynamic-image", {"use_system_prompt": "dynamic", "bot_task": "image"}, None),
    ("dynamic-auto-custom", {"use_system_prompt": "dynamic", "bot_task": "auto", "system_prompt": CUSTOM}, None),
    ("custom", {"use_system_prompt": "custom", "system_prompt": CUSTOM}, None),
    ("instruct-none", {"sequence_template": "instruct"}, None),
    ("instruct-vanilla", {"sequence_template": "instruct", "use_system_prompt": "en_vanilla"}, None),
    ("pretrain-recaption", {"use_system_prompt": "dynamic", "bot_task": "recaption"}, RECAPTION),
    ("instruct-think", {"sequence_template": "instruct", "use_system_prompt": "dynamic", "bot_task": "think"},
     THINK),
    ("instruct-think-drop", {"sequence_template": "instruct", "use_system_prompt": "en_think_recaption",
                             "bot_task": "think", "drop_think": True}, THINK),
    ("instruct-recaption-loose", {"sequence_template": "instruct", "use_system_prompt": "en_recaption",
                                  "bot_task": "recaption"}, "Sure. " + RECAPTION + " Done."),
]
DEFAULTS = {"use_system_prompt": "None", "bot_task": "image", "sequence_template": "pretrain",
            "drop_think": False, "system_prompt": None}  # the base checkpoint's generation_config


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _tokenizer(system_prompts):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [*system_prompts, *PROMPTS, THINK, RECAPTION, CUSTOM, "User: Assistant: \n\n"] * 2
    trainer = trainers.BpeTrainer(vocab_size=900, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return tok


def _rle(ids):
    """ids with each run of 3 or more equal ids written as [id, count] (the image block)."""
    runs = []
    for i in ids:
        if runs and runs[-1][0] == i:
            runs[-1][1] += 1
        else:
            runs.append([i, 1])
    out = []
    for i, n in runs:
        out += [[i, n]] if n >= 3 else [i] * n
    return out


def _cfg_runs(cond, uncond, cfg_id):
    """The uncond row as [start, stop) runs where it holds <cfg> instead of the cond row's id."""
    assert len(cond) == len(uncond)
    diff = [i for i, (c, u) in enumerate(zip(cond, uncond)) if c != u]
    assert all(uncond[i] == cfg_id for i in diff)
    runs = []
    for i in diff:
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return runs


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reference", required=True, help="checkout of Tencent-Hunyuan/HunyuanImage-3.0")
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests/fixtures/release_template.json"))
    a = p.parse_args(argv)
    pkg = Path(a.reference) / "hunyuan_image_3"
    tw = _load(pkg / "tokenizer_wrapper.py", "release_tokenizer_wrapper")
    sp = _load(pkg / "system_prompt.py", "release_system_prompt")
    from transformers import PreTrainedTokenizerFast

    tok = _tokenizer([v[0] for v in sp.t2i_system_prompts.values()])
    with tempfile.TemporaryDirectory() as d:
        tok.save(f"{d}/tokenizer.json")
        hf = PreTrainedTokenizerFast(tokenizer_file=f"{d}/tokenizer.json",
                                     **{f"{k}_token": v for k, v in NAMED.items()})
    wrapper = tw.TokenizerWrapper(hf)
    group = tw.ResolutionGroup(base_size=1024)

    image_rows, ar_rows = [], []
    for name, settings, rewrite in CASES:
        s = {**DEFAULTS, **settings}
        # generate_image: the system prompt by mode; after a think/recaption step, drop_think
        # switches a set system prompt to en_recaption
        system = sp.get_system_prompt(s["use_system_prompt"], s["bot_task"], s["system_prompt"])
        # the long system prompts once (one prompt, one size): they dominate the fixture's size
        prompts, sizes = (PROMPTS[:1], SIZES[:1]) if system and len(system) > 1000 else (PROMPTS, SIZES)
        for prompt in prompts:
            if s["bot_task"] in ("think", "recaption"):  # the AR stage's input (mode gen_text)
                out = wrapper.apply_chat_template(
                    batch_prompt=[prompt], mode="gen_text", batch_system_prompt=[system], bot_task=s["bot_task"],
                    image_base_size=1024, sequence_template=s["sequence_template"], cfg_factor=1,
                    drop_think=s["drop_think"])["output"]
                ar_rows.append({"case": name, "settings": settings, "prompt": prompt,
                                "ids": out.tokens[0].tolist()})
            image_system = sp.t2i_system_prompts["en_recaption"][0] if (
                s["bot_task"] in ("think", "recaption") and s["drop_think"] and system) else system
            for height, width in sizes:
                tw_, th_ = group.get_target_size(width, height)
                base, ratio = group.get_base_size_and_ratio_index(width, height)
                info = tw.ImageInfo(image_type="gen_image", image_width=tw_, image_height=th_, token_width=tw_ // 16,
                                    token_height=th_ // 16, base_size=base, ratio_index=ratio)
                out = wrapper.apply_chat_template(
                    batch_prompt=[prompt], mode="gen_image", batch_gen_image_info=[info],
                    batch_system_prompt=[image_system], batch_cot_text=None if rewrite is None else [rewrite],
                    bot_task="auto", image_base_size=1024, sequence_template=s["sequence_template"], cfg_factor=2,
                    drop_think=s["drop_think"])["output"]
                img = out.gen_image_slices[0][0]
                cond, uncond = out.tokens[0].tolist(), out.tokens[1].tolist()
                image_rows.append({
                    "case": name, "settings": settings, "prompt": prompt, "rewrite": rewrite,
                    "height": height, "width": width,
                    "image_start": img.start, "image_stop": img.stop,
                    "timestep_index": int(out.gen_timestep_scatter_index[0, 0]),
                    "cond": _rle(cond), "uncond_cfg_runs": _cfg_runs(cond, uncond, wrapper.cfg_token_id),
                })
    fixture = {
        "source": "github.com/Tencent-Hunyuan/HunyuanImage-3.0 hunyuan_image_3/tokenizer_wrapper.py "
                  "(TokenizerWrapper.apply_chat_template) + system_prompt.py (get_system_prompt), run by "
                  "tools/make_template_fixture.py; a row is a list of ids, [id, count] standing for a run of "
                  "count ids",
        "named_specials": NAMED,
        "tokenizer_json": tok.to_str(),
        "image_rows": image_rows,
        "ar_rows": ar_rows,
    }
    write_rows_json(Path(a.out), fixture, ("image_rows", "ar_rows"))
    print(f"wrote {len(image_rows)} image rows, {len(ar_rows)} AR inputs to {a.out}")


def write_rows_json(path: Path, fixture: dict, row_keys) -> None:
    """The fixture as indented JSON, each list under `row_keys` one row per line (readable diffs
    without one line per id)."""
    text = json.dumps({k: v for k, v in fixture.items() if k not in row_keys}, indent=1, ensure_ascii=False)
    for key in row_keys:
        rows = ",\n  ".join(json.dumps(r, ensure_ascii=False, separators=(",", ":")) for r in fixture[key])
        text = text[:-2] + f',\n "{key}": [\n  {rows}\n ]\n}}'
    json.loads(text)  # still one valid document
    path.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
