"""Regenerate tests/fixtures/release_instruct_template.json: token ids of templated prompts WITH system
prompts, as the Instruct / Instruct-Distil code builds them.

The Instruct code (the fork github.com/suryatmodulus/HunyuanImage-3.0 @1ea1526) differs from the base code
(hunyuan.py; tools/make_template_fixture.py) where it picks the system prompt: its
`HunyuanImage3ForCausalMM.generate_image` (hunyuan_image_3/modeling_hunyuan_image_3.py) strips it, and after
a think/recaption step applies drop_think in its own way. So this script runs that method itself, unbound, on
a stand-in `self` that has the real pieces it calls: `preprocess_inputs` (-> the Instruct tokenizer's
`HunyuanImage3TokenizerFast.apply_chat_template`, tokenization_hunyuan_image_3.py), the image processor
(image_processor.py: the output size and ratio token), get_system_prompt (system_prompt.py). Stubbed:
`prepare_model_inputs` runs `preprocess_inputs` and records its output (for the image step it then stops the
call: the model is never run), and `generate` returns the prompt followed by a fixed generated text (the AR
stage's think/recaption). Nothing of the fork is copied into ditkv.

The tokenizer is a small byte-level BPE with the release special tokens (37 ratio tokens), trained here on
the system prompts and prompts and stored in the fixture. Each case is a generation_config (the base
checkpoint's defaults plus the case's settings) x prompt x image size (explicit "HxW", so no ratio is
predicted); recorded: the image step's cond and uncond rows, and for think/recaption the AR stage's input
ids, the generated text and the rewrite (`cot_text`) the image row got. ditkv's bot_task "think" (its AR
stage writes through `</recaption>`) is the Instruct code's "think_recaption"; its "think" stops the
rewrite at `</think>`, which ditkv does not do, so it is not a case here, nor "dynamic" with "think" (the
Instruct code's dynamic mode has no system prompt for "think_recaption").

    PYTHONPATH=/tmp/hi3_deps:/tmp/hi3_tv python tools/make_instruct_template_fixture.py --reference /tmp/ref_fork \\
        [--out tests/fixtures/release_instruct_template.json]
"""

import argparse
import importlib
import sys
import tempfile
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from make_edit_fixture import _load_reference
from make_template_fixture import _cfg_runs, _rle, write_rows_json

FORK = "suryatmodulus/HunyuanImage-3.0@1ea1526"
MODEL_VERSION = "HunyuanImage-3.0-Instruct"
NAMED = {"bos": "<|startoftext|>", "eos": "<|endoftext|>", "pad": "<pad>"}
SPECIALS = [*NAMED.values(), "<boi>", "<eoi>", "<img>", "<cfg>", "<timestep>", "<guidance>", "<img_size_1024>",
            *[f"<img_ratio_{k}>" for k in range(37)], "<joint_img_sep>", "<think>", "</think>", "<recaption>",
            "</recaption>", "<answer>", "</answer>", "<timestep_r>"]

PROMPTS = ["A red fox sitting in fresh snow at dawn, soft light",
           'A neon sign that reads "OPEN 24/7" above a small café, rainy night, reflections']
SIZES = [(1024, 1024), (768, 1280)]  # (height, width): buckets of both code families
CUSTOM = "  You draw exactly what the user asks for.\n"  # surrounding whitespace: stripped
THINK_GEN = ("The subject is a fox; the scene is calm.</think><recaption>A red fox sits in deep fresh snow, lit "
             "by low pink dawn light.</recaption>")
LOOSE_GEN = "The subject is a fox.</think>\n<recaption>A red fox in snow.</recaption>"  # text between the tags
RECAPTION_GEN = "A detailed, objective description of the scene.</recaption>"
# (name, generation_config settings as ditkv reads them, the Instruct code's bot_task if another, generated text)
CASES = [
    ("instruct-vanilla", {"sequence_template": "instruct", "use_system_prompt": "en_vanilla"}, None, None),
    ("pretrain-vanilla", {"use_system_prompt": "en_vanilla"}, None, None),
    ("instruct-recaption-prompt", {"sequence_template": "instruct", "use_system_prompt": "en_recaption"}, None, None),
    ("instruct-think-recaption-prompt", {"sequence_template": "instruct", "use_system_prompt": "en_think_recaption"},
     None, None),
    ("instruct-dynamic-image", {"sequence_template": "instruct", "use_system_prompt": "dynamic", "bot_task": "image"},
     None, None),
    ("instruct-custom", {"sequence_template": "instruct", "use_system_prompt": "custom", "system_prompt": CUSTOM},
     None, None),
    ("pretrain-dynamic-auto-custom", {"use_system_prompt": "dynamic", "bot_task": "auto", "system_prompt": CUSTOM},
     None, None),
    ("instruct-custom-blank", {"sequence_template": "instruct", "use_system_prompt": "custom",
                               "system_prompt": " \n"}, None, None),
    ("instruct-none", {"sequence_template": "instruct"}, None, None),
    ("instruct-recaption", {"sequence_template": "instruct", "use_system_prompt": "dynamic", "bot_task": "recaption"},
     None, RECAPTION_GEN),
    ("instruct-recaption-drop", {"sequence_template": "instruct", "use_system_prompt": "en_think_recaption",
                                 "bot_task": "recaption", "drop_think": True}, None, RECAPTION_GEN),
    ("instruct-think", {"sequence_template": "instruct", "use_system_prompt": "en_think_recaption",
                        "bot_task": "think"}, "think_recaption", THINK_GEN),
    ("instruct-think-drop", {"sequence_template": "instruct", "use_system_prompt": "en_think_recaption",
                             "bot_task": "think", "drop_think": True}, "think_recaption", THINK_GEN),
    ("instruct-think-drop-loose", {"sequence_template": "instruct", "use_system_prompt": "en_think_recaption",
                                   "bot_task": "think", "drop_think": True}, "think_recaption", LOOSE_GEN),
]
DEFAULTS = {"use_system_prompt": "None", "bot_task": "image", "sequence_template": "pretrain",
            "drop_think": False, "system_prompt": None}  # the base checkpoint's generation_config


class _ImageStep(Exception):
    """Raised by the stand-in `prepare_model_inputs` once the image step's rows are built."""


def _stand_in(ref, tokenizer, image_proc, generated: str | None):
    """A `self` for the fork's generate_image: its own input code, a recording prepare_model_inputs and a
    generate that returns `generated` after the prompt."""
    cls = ref.HunyuanImage3ForCausalMM
    methods = {n: cls.__dict__[n] for n in ("generate_image", "preprocess_inputs", "check_inputs",
                                            "_validate_and_batchify_text", "_validate_and_batchify_image")}

    def prepare_model_inputs(self, **kw):
        for k in ("seed", "max_new_tokens"):
            kw.pop(k, None)
        out = self.preprocess_inputs(cfg_factor=2 if kw["mode"] == "gen_image" else 1, **kw)
        self.calls.append((kw, out["output"]))
        if kw["mode"] == "gen_image":
            raise _ImageStep
        return {"input_ids": out["output"].tokens, "batch_cond_images": None}

    def generate(self, input_ids, **kw):
        ids = torch.tensor([tokenizer.encode(generated, add_special_tokens=False)])
        return torch.cat([input_ids, ids], dim=1)

    Stand = type("StandIn", (), {**methods, "prepare_model_inputs": prepare_model_inputs, "generate": generate})
    self = Stand()
    self._tokenizer, self.image_processor, self.calls = tokenizer, image_proc, []
    self.config = image_proc.config
    return self


def _tokenizer(texts):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=900, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([*texts, "User: Assistant: \n\n"] * 2, trainer)
    return tok


def run_case(ref, hf, image_proc, settings, ref_task, generated, prompt, size):
    gen = {**DEFAULTS, **settings, "max_length": 1 << 20}
    if ref_task:
        gen["bot_task"] = ref_task
    self = _stand_in(ref, hf, image_proc, generated)
    self.generation_config = types.SimpleNamespace(**gen)
    try:
        # ditkv's `system_prompt` setting is the caller's argument (generate_image reads no config key for it)
        self.generate_image(prompt=prompt, image_size=f"{size[0]}x{size[1]}", seed=0,
                            system_prompt=gen["system_prompt"])
    except _ImageStep:
        pass
    (kw, out), ar = self.calls[-1], self.calls[:-1]
    cond, uncond = out.tokens[0].tolist(), out.tokens[1].tolist()
    img = out.gen_image_slices[0][0]
    row = {"settings": settings, "prompt": prompt, "height": size[0], "width": size[1],
           "image_start": img.start, "image_stop": img.stop,
           "timestep_index": int(out.gen_timestep_scatter_index[0, 0]),
           "cond": _rle(cond), "uncond_cfg_runs": _cfg_runs(cond, uncond, hf.cfg_token_id)}
    if generated is not None:
        assert len(ar) == 1 and ar[0][0]["mode"] == "gen_text"
        row.update(reference_bot_task=gen["bot_task"], generated=generated, rewrite=kw["cot_text"][0],
                   ar_ids=ar[0][1].tokens[0].tolist())
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reference", required=True, help="checkout of suryatmodulus/HunyuanImage-3.0 (commit 1ea1526)")
    p.add_argument("--out", default=str(ROOT / "tests/fixtures/release_instruct_template.json"))
    a = p.parse_args(argv)
    ref, tkz = _load_reference(Path(a.reference).resolve())
    sp = importlib.import_module("hunyuan_image_3.system_prompt")
    proc = importlib.import_module("hunyuan_image_3.image_processor")
    from hunyuan_image_3.configuration_hunyuan_image_3 import HunyuanImage3Config

    tok = _tokenizer([v[0] for v in sp.t2i_system_prompts.values()] + PROMPTS + [CUSTOM, THINK_GEN, RECAPTION_GEN])
    with tempfile.TemporaryDirectory() as d:
        tok.save(f"{d}/tokenizer.json")
        hf = tkz.HunyuanImage3TokenizerFast(tokenizer_file=f"{d}/tokenizer.json", model_version=MODEL_VERSION,
                                            **{f"{k}_token": v for k, v in NAMED.items()})
    config = HunyuanImage3Config(image_base_size=1024, vae_type="hunyuan-image-3-vae", vae_downsample_factor=[16, 16],
                                 patch_size=1, vit_type="siglip2-so400m-patch16-naflex",
                                 vit_processor={"patch_size": 16, "max_num_patches": 1024}, model_version=MODEL_VERSION)
    image_proc = proc.HunyuanImage3ImageProcessor(config)

    rows = []
    for name, settings, ref_task, generated in CASES:
        long = settings.get("use_system_prompt") in ("en_recaption", "en_think_recaption") or generated
        for prompt in PROMPTS[:1] if long else PROMPTS:  # the long system prompts once: the fixture's size
            for size in SIZES[:1] if long else SIZES:
                row = run_case(ref, hf, image_proc, settings, ref_task, generated, prompt, size)
                rows.append({"case": name, **row})
    fixture = {
        "source": f"{FORK} hunyuan_image_3/modeling_hunyuan_image_3.py HunyuanImage3ForCausalMM.generate_image "
                  "(+ preprocess_inputs, tokenization_hunyuan_image_3.py apply_chat_template, image_processor.py, "
                  "system_prompt.py) on a stand-in model, run by tools/make_instruct_template_fixture.py; a row is a "
                  "list of ids, [id, count] standing for a run of count ids",
        "model_version": MODEL_VERSION,
        "named_specials": NAMED,
        "tokenizer_json": tok.to_str(),
        "image_rows": rows,
    }
    write_rows_json(Path(a.out), fixture, ("image_rows",))
    print(f"wrote {len(rows)} image rows ({sum('ar_ids' in r for r in rows)} with an AR input) to {a.out}")


if __name__ == "__main__":
    main()
