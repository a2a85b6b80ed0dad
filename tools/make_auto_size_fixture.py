"""Regenerate tests/fixtures/release_auto_size.json: how the Instruct release code picks the output size when
`generate_image(..., image_size="auto")` (numbers and token ids only).

The Instruct code (hunyuan_image_3/modeling_hunyuan_image_3.py of the fork github.com/suryatmodulus/HunyuanImage-3.0
@1ea1526; docs/ar-phase.md "size=auto" has the line references) picks the size in one of two ways, and this
script runs both from a checkout of that fork (nothing of it is copied into ditkv):

  cases       bot_task "image": `generate_image` runs its img_ratio step on the tiny model of
              tools/make_edit_fixture.py (its config, its byte-level BPE tokenizer, every weight from
              `seeded_weights`), for the pretrain and the instruct sequence templates, without input images
              (`cases`) and with them (`image_cases`: `generate_image(..., image=[...])`, the step then has the
              images in its context, their VAE latents drawn from the seed's generator, and their ViT
              tokens): the step's input ids
              (the prompt's row up to `<boi> <img_size_B>`), the 37 ratio logits at its last position (read
              from lm_head), and the size the code then asks the image step for (caught at that call, which
              is not run);
  processors  the two logits processors that confine the draw, on logits set here (ties, a text token
              above every ratio token, an extra bucket on top), with the ratio ids of the fixture tokenizer
              and with ids where `<img_ratio_33..36>` sit below `<img_ratio_0>`: the img_ratio step's
              `SliceVocabLogitsProcessor` (image_processor.py) then the argmax that HF greedy decoding takes,
              and the rewrite path's `_ConditionalSliceVocabLogitsProcessor(force_greedy=True)` then argmax;
  rewrite     bot_task "recaption" with image_size "auto" (one generate call with stage transitions):
              `generate_image` runs with `generate` replaced by a scripted decoder: it applies the logits
              processors generate_image built (plus `_StageTransitionLogitsProcessor`, as the fork's
              `generate` appends it) to logits that make a fixed text end in `</recaption>`, then to set
              ratio logits; recorded: the prompt ids, the text, the tokens the transition forces, the ratio
              logits, the token drawn and the size generate_image then asks for.

    git --git-dir=<mirror of suryatmodulus/HunyuanImage-3.0> archive 1ea1526 hunyuan_image_3 utils \\
        | tar -x -C /tmp/ref_fork
    pip install --no-deps --target /tmp/hi3_deps transformers==4.56.2 huggingface_hub==0.35.3 \\
        tokenizers==0.22.1 diffusers==0.35.2 einops               # tool-time only; not ditkv dependencies
    pip install --no-deps --target /tmp/hi3_tv torchvision==0.28.0
    PYTHONPATH=/tmp/hi3_deps:/tmp/hi3_tv python tools/make_auto_size_fixture.py --reference /tmp/ref_fork \\
        [--out tests/fixtures/release_auto_size.json]

tests/test_auto_size.py checks ditkv's choice against it.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import make_edit_fixture as edit  # noqa: E402
from make_transformer_fixture import WEIGHT_RULE, seeded_weights  # noqa: E402

FORK = "suryatmodulus/HunyuanImage-3.0@1ea1526"
PROMPTS = {"pretrain": ["a red fox in the snow", "a lighthouse on a cliff at dusk"],
           "instruct": ["a red fox in the snow", "a tall glass of orange juice"]}
# bot_task image with input images: the img_ratio step sees them (VAE latents and ViT tokens); (h, w, seed) each
IMAGE_CASES = [("pretrain", "make the fox blue and add falling snow", [(70, 54, 11)]),
               ("instruct", "put the cat from the second picture on the sofa", [(64, 64, 12), (46, 66, 13)]),
               ("instruct", "a wider view of this street", [(40, 90, 14)])]
REWRITE_TEXT = "A fox stands in snow.</recaption>"  # what the scripted decoder writes after <recaption>
SEED = 7
MAX_POSITIONS = 4096  # the four extra buckets are absolute sizes (up to 3600 image tokens at 1280x720)


class _Stop(Exception):
    """Raised at the image step's call: the size is decided, nothing more is run."""


def build_fork(root: Path):
    """(fork module, tiny fork model, its HF tokenizer, the tokenizers.Tokenizer, the config) as
    tools/make_edit_fixture.py builds them."""
    ref, tkz = edit._load_reference(root)
    from hunyuan_image_3.configuration_hunyuan_image_3 import HunyuanImage3Config

    tok = edit.train_tokenizer()
    with tempfile.TemporaryDirectory() as d:
        tok.save(f"{d}/tokenizer.json")
        hf = tkz.HunyuanImage3TokenizerFast(tokenizer_file=f"{d}/tokenizer.json",
                                            model_version=edit.CONFIG["model_version"],
                                            **{f"{k}_token": v for k, v in edit.NAMED.items()})
    ids = {name: tok.token_to_id(name) for name in edit.SPECIALS}
    vocab = -(-tok.get_vocab_size(with_added_tokens=True) // 64) * 64
    config = HunyuanImage3Config(**dict(
        edit.CONFIG, max_position_embeddings=MAX_POSITIONS, vocab_size=vocab, bos_token_id=ids[edit.NAMED["bos"]], eos_token_id=ids[edit.NAMED["eos"]],
        pad_token_id=ids[edit.NAMED["pad"]], pad_id=ids[edit.NAMED["pad"]], image_token_id=ids["<img>"]))
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with edit._cpu_for_cuda_empty():
        model = ref.HunyuanImage3ForCausalMM(config).float().eval()
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.load_state_dict(seeded_weights(shapes), strict=True)
    model._tokenizer = hf
    return ref, model, hf, tok, config, shapes


def _settings(model, template: str, bot_task: str) -> None:
    g = model.generation_config
    g.sequence_template, g.drop_think, g.use_system_prompt, g.bot_task = template, False, "None", bot_task
    g.max_length = model.config.max_position_embeddings


def _spies(model, real, on_text):
    """`model.generate` whose text steps go to `on_text`, and `model.prepare_model_inputs` that catches the
    size generate_image hands its image step (and stops there): (size, ratio index) in `seen`."""
    seen = {}
    prepare = model.prepare_model_inputs

    def prepare_spy(*a, **k):
        if k.get("mode") == "gen_image":
            info = model.image_processor.build_gen_image_info(k["image_size"])
            seen["size"] = [int(info.image_height), int(info.image_width)]
            seen["ratio_index"] = int(info.ratio_index)
            raise _Stop
        return prepare(*a, **k)

    model.generate = lambda *a, **k: on_text(real, *a, **k)
    model.prepare_model_inputs = prepare_spy
    return seen


def _unspy(model) -> None:
    del model.generate, model.prepare_model_inputs


def run_case(model, hf, template: str, prompt: str, images=()) -> dict:
    """bot_task image, image_size auto: the img_ratio step on the model, its input and ratio logits. `images`:
    input images as (h, w, seed) of tools/make_edit_fixture.py's `make_image`, in the step's context."""
    from PIL import Image

    _settings(model, template, "image")
    pil = [Image.fromarray(edit.make_image(*spec)) for spec in images] or None
    last = {}
    hook = model.lm_head.register_forward_hook(lambda m, a, out: last.__setitem__("logits", out.detach()[0, -1]))
    rec = {}

    def on_text(real, *a, **k):
        rec["input_ids"] = [int(i) for i in k["input_ids"][0]]
        out = real(*a, **k)
        rec["drawn"] = int(out[0, -1])  # the img_ratio step appends the index in its sliced vocabulary
        return out

    seen = _spies(model, type(model).generate.__get__(model), on_text)
    try:
        with torch.no_grad():
            model.generate_image(prompt=prompt, image=pil, image_size="auto", bot_task="image", seed=SEED)
    except _Stop:
        pass
    finally:
        hook.remove()
        _unspy(model)
    ratio = [float(x) for x in last["logits"][hf.get_all_ratio_token_ids()]]
    top = sorted(ratio, reverse=True)
    return {"template": template, "prompt": prompt, "images": [list(i) for i in images],
            "input_ids": rec["input_ids"], "ratio_logits": ratio,
            "margin": top[0] - top[1], "drawn": rec["drawn"], "ratio_index": seen["ratio_index"],
            "size": seen["size"]}


def _logit_sets(vocab: int, ratio_ids: list[int]) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    sets = []
    for name in ("random", "text_token_on_top", "tie_3_20", "tie_5_34", "extra_35_on_top", "all_equal"):
        x = torch.randn(vocab, generator=g)
        if name == "text_token_on_top":
            x[ratio_ids[-1] + 1] = 50.0
        elif name == "tie_3_20":
            x[ratio_ids[3]] = x[ratio_ids[20]] = 9.0
        elif name == "tie_5_34":
            x[ratio_ids[5]] = x[ratio_ids[34]] = 9.0
        elif name == "extra_35_on_top":
            x[ratio_ids[35]] = 9.0
        elif name == "all_equal":
            x[ratio_ids] = 1.0
        sets.append((name, x))
    return sets


def processor_cases(ref, hf) -> list[dict]:
    """Both confining processors on set logits, with the fixture tokenizer's ratio ids and with ids where the
    four extra buckets' tokens sit below `<img_ratio_0>` (a tie then goes by id in the rewrite path)."""
    import importlib

    slicer = importlib.import_module("hunyuan_image_3.image_processor").SliceVocabLogitsProcessor
    vocab = 128
    layouts = {"fixture_tokenizer": (hf.start_ratio_token_id, hf.end_ratio_token_id + 1,
                                     list(hf.ratio_token_other_slices)),
               "extras_below": (60, 93, [(20, 24)])}
    out = []
    for lname, (start, end, other) in layouts.items():
        ratio_ids = list(range(start, end)) + [i for a, b in other for i in range(a, b)]
        size_id = 5  # stands for <img_size_B>, the rewrite path's trigger
        for name, x in _logit_sets(vocab, ratio_ids):
            ids = torch.tensor([[1, 2, size_id]])
            sliced = slicer(vocab_start=start, vocab_end=end, other_slices=other)(ids, x[None].clone())
            cond = ref.HunyuanImage3ForCausalMM._ConditionalSliceVocabLogitsProcessor(
                trigger_token_ids=[size_id], vocab_start=start, vocab_end=end, other_slices=other,
                force_greedy=True)(ids, x[None].clone())
            k_rewrite = ratio_ids.index(int(torch.argmax(cond[0])))
            out.append({"ratio_ids": lname, "case": name, "ratio_token_ids": ratio_ids,
                        "logits": [float(v) for v in x], "img_ratio_step_index": int(torch.argmax(sliced[0])),
                        "rewrite_path_index": k_rewrite})
    return out


def rewrite_flow(ref, model, hf, template: str, prompt: str) -> dict:
    """bot_task recaption, image_size auto: generate_image's one text call, decoded by a script."""
    _settings(model, template, "recaption")
    rec = {}
    g = torch.Generator().manual_seed(5)
    text = [int(i) for i in hf.encode(REWRITE_TEXT, add_special_tokens=False)]

    def on_text(real, *a, stage_transitions=None, final_stop_tokens=None, logits_processor=None, **k):
        procs = list(logits_processor or []) + [
            ref.HunyuanImage3ForCausalMM._StageTransitionLogitsProcessor(stage_transitions, 1)]
        ids = k["input_ids"].clone()
        rec.update(input_ids=[int(i) for i in ids[0]], stage_transitions=[[int(s), [int(t) for t in ts]]
                                                                          for s, ts in stage_transitions],
                   final_stop_tokens=[int(t) for t in final_stop_tokens])
        written = []
        while not written or written[-1] not in final_stop_tokens:
            scores = torch.randn(1, model.config.vocab_size, generator=g)
            if len(written) < len(text):
                scores[0, text[len(written)]] = 30.0  # the "model" writes the scripted text
            else:
                rec["ratio_logits"] = [float(scores[0, i]) for i in hf.get_all_ratio_token_ids()]
            for p in procs:
                scores = p(ids, scores)
            tok = int(torch.argmax(scores[0]))  # greedy, as the forced steps are whatever the settings
            written.append(tok)
            ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
        rec["written"] = written
        return ids

    seen = _spies(model, None, on_text)
    try:
        with torch.no_grad():
            model.generate_image(prompt=prompt, image_size="auto", bot_task="recaption", seed=SEED)
    except _Stop:
        pass
    finally:
        _unspy(model)
    return {"template": template, "prompt": prompt, "text_ids": text, **rec, "ratio_index": seen["ratio_index"],
            "size": seen["size"]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reference", required=True, help="checkout of suryatmodulus/HunyuanImage-3.0 (commit 1ea1526)")
    p.add_argument("--out", default=str(ROOT / "tests/fixtures/release_auto_size.json"))
    a = p.parse_args(argv)
    root = Path(a.reference).resolve()
    ref, model, hf, tok, config, shapes = build_fork(root)
    cases = [run_case(model, hf, t, pr) for t, prompts in PROMPTS.items() for pr in prompts]
    image_cases = [run_case(model, hf, t, pr, images) for t, pr, images in IMAGE_CASES]
    for c in cases + image_cases:
        print(f"{c['template']:8s} {len(c['images'])} images {c['prompt']!r}: ratio {c['ratio_index']} -> {c['size']} (margin {c['margin']:.3g})")
    procs = processor_cases(ref, hf)
    for c in procs:
        print(f"{c['ratio_ids']:17s} {c['case']:17s} img_ratio step k={c['img_ratio_step_index']}, "
              f"rewrite path k={c['rewrite_path_index']}")
    rewrites = [rewrite_flow(ref, model, hf, t, PROMPTS[t][0]) for t in ("pretrain", "instruct")]
    for r in rewrites:
        print(f"rewrite {r['template']}: forced after the text {r['stage_transitions']}, ratio {r['ratio_index']} "
              f"-> {r['size']}")
    out = {
        "source": f"{FORK} hunyuan_image_3/modeling_hunyuan_image_3.py HunyuanImage3ForCausalMM.generate_image "
                  "(image_size='auto'), image_processor.py SliceVocabLogitsProcessor, run by "
                  "tools/make_auto_size_fixture.py",
        "config": json.loads(config.to_json_string(use_diff=True)),
        "tokenizer_json": tok.to_str(),
        "named_specials": edit.NAMED,
        "weights": WEIGHT_RULE + " (every key: transformer, vae.*, vision_model.*, vision_aligner.*)",
        "weight_shapes": {k: list(v) for k, v in shapes.items()},
        "seed": SEED,
        "ratio_token_ids": [int(i) for i in hf.get_all_ratio_token_ids()],
        "buckets": [[int(r.h), int(r.w)] for r in model.image_processor.vae_reso_group.data],
        "cases": cases, "image_cases": image_cases, "processors": procs, "rewrites": rewrites,
    }
    Path(a.out).write_text(json.dumps(out, separators=(",", ":")) + "\n")
    print(f"-> {a.out} ({Path(a.out).stat().st_size / 1024:.1f} KiB)")


if __name__ == "__main__":
    main()
