"""The release prompt template (HunyuanImage-3.0 text-to-image): the text around the user's prompt.

Settings are named and valued as in the release's generation_config.json. ditkv reads them from the
model config (`cfg.extra`: keys a checkpoint's config.json carries, or its generation_config.json,
merged by `checkpoint.apply_generation_config`); an absent key takes the value of the released base
checkpoint, so a plain row stays `<bos> prompt <boi> ...`:

    use_system_prompt  "None" (default) | "en_vanilla" | "en_recaption" | "en_think_recaption"
                       | "dynamic" (chosen by bot_task) | "custom" (the text in `system_prompt`)
    bot_task           "image" (default) | "auto" | "think" | "recaption"
    sequence_template  "pretrain" (default) | "instruct"
    drop_think         false (default) | true
    system_prompt      the text for "custom" (and for "dynamic" with bot_task "auto")

A row's text is a list of pieces, each encoded on its own (piece boundaries are token boundaries,
as in the release). Between `<bos>` and `<boi>`:

    pretrain   [system] prompt [rewrite]
    instruct   [system "\\n\\n"] "User: " prompt "\\n\\n" "Assistant: " [rewrite] "<answer>"

and after `<eoi>` nothing (pretrain) or "</answer>" "\\n\\n" (instruct). [rewrite] is the AR stage's
text for bot_task think/recaption: "<think>" T "</think>" "<recaption>" R "</recaption>" (think
dropped under drop_think; text outside the tags kept as is). An AR phase makes it: it runs
`ar_prompt_pieces`, generates until `ar_stop_ids`, and `rewrite_from_ar` turns its text into the rewrite
(text_task.py: the family's rules for one task's AR text, which engine/ar_plan.py follows). A request may
name its own bot_task (`request_settings`). The uncond (CFG) row has the same
pieces with the prompt and the rewrite text (T, R) replaced by `<cfg>`, one per token; the system
prompt, role markers and tags stay. Tokens after `<eoi>` are causal and after the image, so they
never change a prediction; they are kept so the ids equal the release's.

A checkpoint of the Instruct code family (`instruct_code`: config.json's model_version) differs, as its
generate_image does (tests/test_instruct_template.py): the chosen system prompt is stripped of surrounding
whitespace, and drop_think switches it to en_recaption only when the rewrite holds both `<think>` and
`<recaption>`, keeping only the recaption of the rewrite.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ditkv.errors import ConfigError, LayoutError

SYSTEM_PROMPT_MODES = ("None", "en_vanilla", "en_recaption", "en_think_recaption", "dynamic", "custom")
BOT_TASKS = ("image", "auto", "think", "recaption")
SEQUENCE_TEMPLATES = ("pretrain", "instruct")
REWRITE_TASKS = ("think", "recaption")  # bot tasks whose image row needs the AR stage's text

FIXED, PROMPT, REWRITE = "fixed", "prompt", "rewrite"  # piece kinds; the last two are dropped for CFG

# config.json `model_version`: which release code a checkpoint runs (its remote code): the base code
# (hunyuan.py) or the Instruct / Instruct-Distil code (modeling_hunyuan_image_3.py), which strips the system
# prompt and has 37 output sizes (buckets.py)
BASE_VERSION = "HunyuanImage-3.0"
INSTRUCT_VERSIONS = ("HunyuanImage-3.0-Instruct", "HunyuanImage-3.0-Instruct-Distil")


def instruct_code(cfg) -> bool:
    """Whether a model config follows the Instruct code family (its `model_version`, kept in `cfg.extra`;
    absent: the base release). An unknown version is an error rather than a guess at its code."""
    version = (getattr(cfg, "extra", None) or {}).get("model_version") or BASE_VERSION
    if version not in (BASE_VERSION, *INSTRUCT_VERSIONS):
        raise ConfigError("model_version", version, f"ditkv follows the release code of {BASE_VERSION!r} or "
                          f"{' / '.join(map(repr, INSTRUCT_VERSIONS))}; set one of them in config.json")
    return version in INSTRUCT_VERSIONS


@dataclass(frozen=True)
class TemplateSettings:
    use_system_prompt: str = "None"
    bot_task: str = "image"
    sequence_template: str = "pretrain"
    drop_think: bool = False
    system_prompt: str | None = None
    instruct_family: bool = False  # the checkpoint runs the Instruct code (`instruct_code`), not the base code

    def __post_init__(self) -> None:
        for name, valid in (("use_system_prompt", SYSTEM_PROMPT_MODES), ("bot_task", BOT_TASKS),
                            ("sequence_template", SEQUENCE_TEMPLATES)):
            value = getattr(self, name)
            if not isinstance(value, str) or value not in valid:
                raise ConfigError(name, value, f"must be one of {', '.join(map(repr, valid))} (the release's "
                                  "generation_config values)")
        for name in ("drop_think", "instruct_family"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, getattr(self, name), "must be true or false")
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise ConfigError("system_prompt", self.system_prompt, "must be a string (the custom system prompt)")
        if self.use_system_prompt == "custom" and not self.system_prompt:
            raise ConfigError("system_prompt", self.system_prompt,
                              "use_system_prompt='custom' needs the text in system_prompt")

    @classmethod
    def from_config(cls, cfg) -> "TemplateSettings":
        """The settings a model config carries (release generation_config keys in `cfg.extra`)."""
        extra = getattr(cfg, "extra", None) or {}
        return cls(**{k: extra[k] for k in ("use_system_prompt", "bot_task", "sequence_template",
                                            "drop_think", "system_prompt") if extra.get(k) is not None},
                   instruct_family=instruct_code(cfg))

    @property
    def instruct(self) -> bool:
        return self.sequence_template == "instruct"


def request_settings(cfg, bot_task: str | None = None) -> TemplateSettings:
    """One request's template: the model config's, with the request's own `bot_task` (None: the
    checkpoint's). With `use_system_prompt: dynamic` the system prompt follows the request's task, as the
    release's `get_system_prompt(use_system_prompt, bot_task, ...)` does; "auto" is the release
    `generate_image`'s auto: no rewrite, and under dynamic the `system_prompt` text (none without one)."""
    s = TemplateSettings.from_config(cfg)
    if bot_task is None or bot_task == s.bot_task:
        return s
    if not isinstance(bot_task, str) or bot_task not in BOT_TASKS:
        raise LayoutError(f"bot_task: {bot_task!r} is not one of {', '.join(map(repr, BOT_TASKS))} (the release's "
                          "tasks; leave it out for the checkpoint's generation_config.json bot_task)", field="bot_task")
    return replace(s, bot_task=bot_task)


def system_prompt_text(s: TemplateSettings, rewrite: str | None = None) -> str | None:
    """The system prompt of a row (None: no system piece). `rewrite`: the AR stage's think/recaption
    text of an image row, after which drop_think may switch a set system prompt to en_recaption."""
    mode = s.use_system_prompt
    if mode == "None":
        text = None
    elif mode == "custom":
        text = s.system_prompt
    elif mode == "dynamic":
        by_task = {"think": _EN_THINK_RECAPTION, "recaption": _EN_RECAPTION, "image": _EN_VANILLA.strip("\n")}
        text = by_task.get(s.bot_task, s.system_prompt)
    else:
        text = SYSTEM_PROMPTS[mode]
    if text and s.instruct_family:  # its generate_image strips the choice; the base code keeps the newlines
        text = text.strip()
    if text and rewrite is not None and _switches_to_recaption(s, rewrite):
        text = _EN_RECAPTION  # unstripped in both codes
    return text or None


def _switches_to_recaption(s: TemplateSettings, rewrite: str) -> bool:
    """drop_think after a think/recaption step: the base code switches a set system prompt to en_recaption
    after either; the Instruct code only when the rewrite holds both `<think>` and `<recaption>`."""
    if not (s.drop_think and s.bot_task in REWRITE_TASKS):
        return False
    return not s.instruct_family or ("<think>" in rewrite and "<recaption>" in rewrite)


def _instruct_rewrite(s: TemplateSettings, rewrite: str) -> str:
    """The Instruct code's rewrite under the same condition: only the recaption, its tags around it
    (the text outside them dropped, a missing `</recaption>` added); any other rewrite as is."""
    if not (s.instruct_family and _switches_to_recaption(s, rewrite)):
        return rewrite
    return f"<recaption>{rewrite.split('<recaption>')[1].split('</recaption>')[0]}</recaption>"


def _rewrite_pieces(text: str, drop_think: bool) -> list[tuple[str, str]]:
    """The AR stage's text as pieces: the first <think>..</think> (then <recaption>..</recaption>)
    pair splits it into the text before, the tags and their content, and the text after."""
    if not text:
        return []
    for tag in ("think", "recaption"):
        open_, close = f"<{tag}>", f"</{tag}>"
        if open_ in text and close in text:
            before, inner = text.split(open_)[0], text.split(open_)[1].split(close)[0]
            after = text.split(close)[1]
            middle = [] if tag == "think" and drop_think else [(open_, FIXED), (inner, REWRITE), (close, FIXED)]
            return _rewrite_pieces(before, drop_think) + middle + _rewrite_pieces(after, drop_think)
    return [(text, REWRITE)]


def _system_and_user(s: TemplateSettings, prompt: str, system: str | None) -> list[tuple[str, str]]:
    sep = "\n\n" if s.instruct else ""
    pieces = [(system, FIXED), (sep, FIXED)] if system else []
    return pieces + [("User: " if s.instruct else "", FIXED), (prompt, PROMPT), (sep, FIXED)]


def image_row_pieces(s: TemplateSettings, prompt: str, rewrite: str | None = None
                     ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(pieces between <bos> and <boi>, pieces after <eoi>) of an image row; `rewrite`: the AR
    stage's think/recaption text, required for those bot tasks."""
    if s.bot_task in REWRITE_TASKS and rewrite is None:
        raise LayoutError(
            f"bot_task={s.bot_task!r} puts the AR's rewrite (its {s.bot_task} text) in the image row, and none "
            "was given: build the row after the AR phase wrote it (the engine and the stage graph do), or set "
            "bot_task 'image'", field="bot_task")
    head = _system_and_user(s, prompt, system_prompt_text(s, rewrite))
    head.append(("Assistant: " if s.instruct else "", FIXED))
    head += _rewrite_pieces(_instruct_rewrite(s, rewrite), s.drop_think) if rewrite is not None else []
    head.append((answer_open(s), FIXED))
    tail = [("</answer>", FIXED), ("\n\n", FIXED)] if s.instruct else []
    return head, tail


def ar_prompt_pieces(s: TemplateSettings, prompt: str) -> list[tuple[str, str]]:
    """The AR stage's input for a think/recaption rewrite (after <bos>): the row text up to the
    assistant's turn and its opening tag; generation stops at `ar_stop_ids`."""
    if s.bot_task not in REWRITE_TASKS:
        raise ConfigError("bot_task", s.bot_task, f"an AR rewrite runs only for {REWRITE_TASKS}")
    pieces = _system_and_user(s, prompt, system_prompt_text(s))
    return pieces + [(f"{'Assistant: ' if s.instruct else ''}<{s.bot_task}>", FIXED)]


def rewrite_from_ar(s: TemplateSettings, generated: str) -> str:
    """The rewrite text of the image row from the AR's generated text: the release's `cot_text`, the
    assistant's text after its role marker, i.e. the opening tag the AR input ends with (`<think>` or
    `<recaption>`) and the generated text through its stop token (eos dropped)."""
    if s.bot_task not in REWRITE_TASKS:
        raise ConfigError("bot_task", s.bot_task, f"an AR rewrite runs only for {REWRITE_TASKS}")
    return f"<{s.bot_task}>{generated}"


def answer_open(s: TemplateSettings) -> str:
    """The text between the rewrite and `<boi>` in an image row: `<answer>` (instruct) or nothing."""
    return "<answer>" if s.instruct else ""


def ar_stop_ids(tokenizer, eos_token_id: int) -> list[int]:
    """Token ids that end the AR rewrite: `</recaption>`, `</answer>`, eos."""
    ids = [tokenizer.token_to_id(t) for t in ("</recaption>", "</answer>")]
    if None in ids:
        raise ConfigError("tokenizer", "</recaption>", "the think/recaption rewrite needs the release tokens "
                          "</recaption> and </answer>: use the checkpoint's own tokenizer.json")
    return [*ids, eos_token_id]


@dataclass(frozen=True)
class EncodedText:
    """A row's encoded template text: pieces before `<boi>` (ids, kind) and the ids after `<eoi>`."""

    head: tuple[tuple[tuple[int, ...], str], ...]
    tail: tuple[int, ...]

    @classmethod
    def encode(cls, tokenizer, head: list[tuple[str, str]], tail: list[tuple[str, str]],
               prompt_ids: list[int] | None = None) -> "EncodedText":
        """`prompt_ids`: the prompt piece's ids as given, not encoded (an AR phase's text that extends the
        prompt: its ids are what the AR wrote, which re-encoding the decoded text need not give back)."""
        def ids(text, kind):
            given = prompt_ids if kind == PROMPT else None
            return tuple(int(i) for i in (tokenizer.encode(text) if given is None else given))

        def enc(pieces):  # the prompt is always kept, even ""
            return tuple((ids(t, k), k) for t, k in pieces if t or k == PROMPT)

        return cls(enc(head), tuple(i for ids, _ in enc(tail) for i in ids))

    def count(self, *kinds: str) -> int:
        return sum(len(ids) for ids, k in self.head if k in kinds)

    def head_ids(self, uncond: bool = False, cfg_id: int = 0, negative: list[int] | None = None) -> list[int]:
        """The ids between <bos> and <boi>. Uncond: prompt and rewrite ids become `cfg_id`, one for
        one; a `negative` prompt (ditkv's, the release has none) takes the prompt's slots instead,
        cut or padded with `cfg_id` to exactly the prompt's length."""
        out: list[int] = []
        for ids, kind in self.head:
            if not uncond or kind == FIXED:
                out += ids
            elif kind == PROMPT and negative is not None:
                neg = list(negative[: len(ids)])
                out += neg + [cfg_id] * (len(ids) - len(neg))
            else:
                out += [cfg_id] * len(ids)
        return out


# ----------------------------------------------------------------------------- data
# The release's text-to-image system prompts, verbatim: the texts the model was trained with.
# Source: hunyuan_image_3/system_prompt.py of github.com/Tencent-Hunyuan/HunyuanImage-3.0 (commit
# 1d011c8). A checkpoint carries them only inside that Python file (remote code), which ditkv does
# not read, so they live here. tests/test_template.py checks them against ids the release code produced
# (tools/make_template_fixture.py).
_EN_VANILLA = """
You are an advanced AI text-to-image generation system. Given a detailed text prompt, your task is to create a high-quality, visually compelling image that accurately represents the described scene, characters, or objects. Pay careful attention to style, color, lighting, perspective, and any specific instructions provided.
"""

_EN_RECAPTION = """
You are a world-class image generation prompt expert. Your task is to rewrite a user's simple description into a **structured, objective, and detail-rich** professional-level prompt.

The final output must be wrapped in `<recaption>` tags.

### **Universal Core Principles**

When rewriting the prompt (inside the `<recaption>` tags), you must adhere to the following principles:

1.  **Absolute Objectivity**: Describe only what is visually present. Avoid subjective words like "beautiful" or "sad". Convey aesthetic qualities through specific descriptions of color, light, shadow, and composition.
2.  **Physical and Logical Consistency**: All scene elements (e.g., gravity, light, shadows, reflections, spatial relationships, object proportions) must strictly adhere to real-world physics and common sense. For example, tennis players must be on opposite sides of the net; objects cannot float without a cause.
3.  **Structured Description**: Strictly follow a logical order: from general to specific, background to foreground, and primary to secondary elements. Use directional terms like "foreground," "mid-ground," "background," and "left side of the frame" to clearly define the spatial layout.
4.  **Use Present Tense**: Describe the scene from an observer's perspective using the present tense, such as "A man stands..." or "Light shines on..."
5.  **Use Rich and Specific Descriptive Language**: Use precise adjectives to describe the quantity, size, shape, color, and other attributes of objects, subjects, and text. Vague expressions are strictly prohibited.

If the user specifies a style (e.g., oil painting, anime, UI design, text rendering), strictly adhere to that style. Otherwise, first infer a suitable style from the user's input. If there is no clear stylistic preference, default to an **ultra-realistic photographic style**. Then, generate the detailed rewritten prompt according to the **Style-Specific Creation Guide** below:

### **Style-Specific Creation Guide**

Based on the determined artistic style, apply the corresponding professional knowledge.

**1. Photography and Realism Style**
*   Utilize professional photography terms (e.g., lighting, lens, composition) and meticulously detail material textures, physical attributes of subjects, and environmental details.

**2. Illustration and Painting Style**
*   Clearly specify the artistic school (e.g., Japanese Cel Shading, Impasto Oil Painting) and focus on describing its unique medium characteristics, such as line quality, brushstroke texture, or paint properties.

**3. Graphic/UI/APP Design Style**
*   Objectively describe the final product, clearly defining the layout, elements, and color palette. All text on the interface must be enclosed in double quotes `""` to specify its exact content (e.g., "Login"). Vague descriptions are strictly forbidden.

**4. Typographic Art**
*   The text must be described as a complete physical object. The description must begin with the text itself. Use a straightforward front-on or top-down perspective to ensure the entire text is visible without cropping.

### **Final Output Requirements**

1.  **Output the Final Prompt Only**: Do not show any thought process, Markdown formatting, or line breaks.
2.  **Adhere to the Input**: You must retain the core concepts, attributes, and any specified text from the user's input.
3.  **Style Reinforcement**: Mention the core style 3-5 times within the prompt and conclude with a style declaration sentence.
4.  **Avoid Self-Reference**: Describe the image content directly. Remove redundant phrases like "This image shows..." or "The scene depicts..."
5.  **The final output must be wrapped in `<recaption>xxxx</recaption>` tags.**

The user will now provide an input prompt. You will provide the expanded prompt.
"""

_EN_THINK_RECAPTION = """
You will act as a top-tier Text-to-Image AI. Your core task is to deeply analyze the user's text input and transform it into a detailed, artistic, and fully user-intent-compliant image.

Your workflow is divided into two phases:

1. Thinking Phase (<think>): In the <think> tag, you need to conduct a structured thinking process, progressively breaking down and enriching the constituent elements of the image. This process must include, but is not limited to, the following dimensions:

Subject: Clearly define the core character(s) or object(s) in the scene, including their appearance, posture, expression, and emotion.
Composition: Set the camera angle and layout, such as close-up, long shot, bird's-eye view, golden ratio composition, etc.
Environment/Background: Describe the scene where the subject is located, including the location, time of day, weather, and other elements in the background.
Lighting: Define the type, direction, and quality of the light source, such as soft afternoon sunlight, cool tones of neon lights, dramatic Rembrandt lighting, etc., to create a specific atmosphere.
Color Palette: Set the main color tone and color scheme of the image, such as vibrant and saturated, low-saturation Morandi colors, black and white, etc.
Quality/Style: Determine the artistic style and technical details of the image. This includes user-specified styles (e.g., anime, oil painting) or the default realistic style, as well as camera parameters (e.g., focal length, aperture, depth of field).
Details: Add minute elements that enhance the realism and narrative quality of the image, such as a character's accessories, the texture of a surface, dust particles in the air, etc.


2. Recaption Phase (<recaption>): In the <recaption> tag, merge all the key details from the thinking process into a coherent, precise, and visually evocative final description. This description is the direct instruction for generating the image, so it must be clear, unambiguous, and organized in a way that is most suitable for an image generation engine to understand.

Absolutely Objective: Describe only what is visually present. Avoid subjective words like "beautiful" or "sad." Convey aesthetic sense through concrete descriptions of colors, light, shadow, and composition.

Physical and Logical Consistency: All scene elements (e.g., gravity, light and shadow, reflections, spatial relationships, object proportions) must strictly adhere to the physical laws of the real world and common sense. For example, in a tennis match, players must be on opposite sides of the net; objects cannot float without reason.

Structured Description: Strictly follow a logical order: from whole to part, background to foreground, and primary to secondary. Use directional words like "foreground," "mid-ground," "background," "left side of the frame" to clearly define the spatial layout.

Use Present Tense: Describe from an observer's perspective using the present tense, such as "a man stands," "light shines on..."
Use Rich and Specific Descriptive Language: Use precise adjectives to describe the quantity, size, shape, color, and other attributes of objects/characters/text. Absolutely avoid any vague expressions.


Output Format:
<think>Thinking process</think><recaption>Refined image description</recaption>Generate Image


You must strictly adhere to the following rules:

1. Faithful to Intent, Reasonable Expansion: You can creatively add details to the user's description to enhance the image's realism and artistic quality. However, all additions must be highly consistent with the user's core intent and never introduce irrelevant or conflicting elements.
2. Style Handling: When the user does not specify a style, you must default to an "Ultra-realistic, Photorealistic" style. If the user explicitly specifies a style (e.g., anime, watercolor, oil painting, cyberpunk, etc.), both your thinking process and final description must strictly follow and reflect that specified style.
3. Text Rendering: If specific text needs to appear in the image (such as words on a sign, a book title), you must enclose this text in English double quotes (""). Descriptive text must not use double quotes.
4. Design-related Images: You need to specify all text and graphical elements that appear in the image and clearly describe their design details, including font, color, size, position, arrangement, visual effects, etc.
"""

SYSTEM_PROMPTS = {"en_vanilla": _EN_VANILLA, "en_recaption": _EN_RECAPTION, "en_think_recaption": _EN_THINK_RECAPTION}
