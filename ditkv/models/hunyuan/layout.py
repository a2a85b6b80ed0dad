"""Token layout of one text-to-image request (HunyuanImage-3.0).

Each row is
    <bos> text <boi> <img_size> <img_ratio_k> <timestep> [<guidance>] <img> x (h*w) <eoi> [text]
and a request has one row, or two (cond, uncond) when classifier-free guidance runs as two
branches. Both CFG rows have the same length, positions and spans, so one mask serves both.
The text is the prompt inside the model's prompt template (`template.py`: system prompt, role
markers, the AR stage's rewrite); with the default template it is just the prompt.

Positions (2D RoPE): a text or special token at index p has y = x = p. The h x w image that
starts at index L is centred in the index range [L, L + h*w):
    y = L + (h*w - h) // 2 + row,  x = L + (h*w - w) // 2 + col
and the tokens after it continue at L + h*w (= their index). The release computes the offset
as a float and truncates the result to int64; all terms are non-negative, so that is the
floor division used here (it only matters when h*(w-1) or w*(h-1) is odd).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ditkv.errors import LayoutError
from ditkv.models.hunyuan import buckets
from ditkv.models.hunyuan.config import HunyuanImage3Config
from ditkv.models.hunyuan.template import FIXED, PROMPT, REWRITE, EncodedText, TemplateSettings, image_row_pieces
from ditkv.models.hunyuan.tokenizer import TextTokenizer


@dataclass(frozen=True, eq=False)
class RowInputs:
    """Inputs of one logical KV row."""

    token_ids: torch.Tensor  # LongTensor[seq_len]; timestep/image slots hold their placeholder ids
    pos_y: torch.Tensor  # LongTensor[seq_len]
    pos_x: torch.Tensor  # LongTensor[seq_len]
    prefix_len: int  # tokens before <timestep>: stable across denoising steps
    target_len: int  # <timestep> [+ <guidance>] + h*w image tokens: rewritten every step
    seq_len: int  # the whole row: through <eoi> and any template text after it
    timestep_index: int  # == prefix_len
    image_start: int  # index of the first image token
    full_attn_spans: tuple[tuple[int, int], ...]  # bidirectional blocks: ((image_start, image_start+h*w),)
    guidance_index: int | None = None  # index of <guidance> when the config embeds guidance
    role: str = "cond"  # "cond" or "uncond"


@dataclass(frozen=True, eq=False)
class RequestLayout:
    rows: list[RowInputs]
    h: int  # latent rows
    w: int  # latent columns
    cfg_factor: int  # 2 = (cond, uncond) rows, 1 = one row
    prompt_tokens: int = 0  # encoded prompt (+ rewrite) length; the template's fixed text is not counted

    @property
    def num_image_tokens(self) -> int:
        return self.h * self.w

    def cond_text_ids(self) -> list[int]:
        """The cond row's tokens before `<boi>` (`<bos>` and the templated prompt): what an AR stage
        prefills ahead of `<boi> <img_size> <img_ratio_k>` for its K/V to be the DiT's."""
        row = self.rows[0]
        return row.token_ids[: row.prefix_len - 3].tolist()


def image_grid(height: int, width: int, downsample: int) -> tuple[int, int]:
    """Pixel size -> latent grid (h, w), with errors naming the offending argument."""
    for name, value in (("height", height), ("width", width)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise LayoutError(f"{name}={value!r} must be a positive integer number of pixels", field="size")
        if value % downsample:
            raise LayoutError(
                f"{name}={value} must be a multiple of {downsample} (pixels per latent cell); "
                f"try {max(downsample, round(value / downsample) * downsample)}", field="size"
            )
    return height // downsample, width // downsample


def ratio_index(height: int, width: int, num_ratio_tokens: int) -> int:
    """Index k of `<img_ratio_k>`: the release resolution bucket of nearest height/width
    (`buckets.py`, verified against the release code); 0 for a model with one ratio token."""
    return 0 if num_ratio_tokens == 1 else buckets.ratio_index(height, width)


def build_positions(seq_len: int, image_start: int, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pos_y, pos_x) LongTensors [seq_len] for a row with one h x w image at `image_start`."""
    pos_y = torch.arange(seq_len, dtype=torch.long)
    pos_x = pos_y.clone()
    n = h * w
    end = image_start + n
    if end > seq_len:
        raise LayoutError(f"image [{image_start}, {end}) runs past seq_len={seq_len}")
    rows = torch.arange(h, dtype=torch.long).repeat_interleave(w)
    cols = torch.arange(w, dtype=torch.long).repeat(h)
    pos_y[image_start:end] = image_start + (n - h) // 2 + rows
    pos_x[image_start:end] = image_start + (n - w) // 2 + cols
    return pos_y, pos_x


def _fixed_tokens(cfg: HunyuanImage3Config, h: int, w: int) -> int:
    """Row length without the prompt: bos, boi, size, ratio, timestep, [guidance], image, eoi."""
    return 6 + int(cfg.use_guidance_token) + h * w


def max_prompt_tokens(cfg: HunyuanImage3Config, height: int, width: int,
                      tokenizer: TextTokenizer | None = None) -> int:
    """Longest prompt (in tokens) that fits `max_position_embeddings` at this image size; with a
    tokenizer, net of the model's prompt template text (without it: the default, empty template)."""
    h, w = image_grid(height, width, cfg.image_token_downsample)
    overhead = 0
    if tokenizer is not None:
        text = _template_text(TemplateSettings.from_config(cfg), tokenizer, "", "")
        overhead = text.count(FIXED) + len(text.tail)
    return cfg.max_position_embeddings - _fixed_tokens(cfg, h, w) - overhead


def _template_text(tpl: TemplateSettings, tokenizer: TextTokenizer, prompt: str,
                   rewrite: str | None) -> EncodedText:
    return EncodedText.encode(tokenizer, *image_row_pieces(tpl, prompt, rewrite))


def build_request_layout(
    cfg: HunyuanImage3Config,
    tokenizer: TextTokenizer,
    prompt: str,
    height: int,
    width: int,
    guidance_scale: float,
    negative_prompt: str | None = None,
    *,
    rewrite: str | None = None,
    template: TemplateSettings | None = None,
) -> RequestLayout:
    """Build the row(s) of a text-to-image request.

    `template`: the prompt template settings (default: the model config's, `template.py`);
    `rewrite`: the AR stage's think/recaption text, for the bot tasks that need it.

    CFG runs as two rows when guidance_scale > 1 and the config does not embed guidance as a
    token. The uncond row replaces each prompt (and rewrite) token with `<cfg>`, one for one; the
    template's fixed text stays. A `negative_prompt` is encoded and fitted to exactly the prompt's
    token count: truncated when longer, right-padded with `<cfg>` when shorter (`<cfg>` is what the
    model saw as "no text", so padding with it is the least informative filler). Rows therefore
    always share length, positions and spans; a long negative prompt with a short prompt loses its
    tail. (The release has no negative prompt for text-to-image: its uncond row is all `<cfg>`.)
    """
    if not isinstance(prompt, str):
        raise LayoutError(f"prompt must be a string, got {type(prompt).__name__}", field="prompt")
    if rewrite is not None and not isinstance(rewrite, str):
        raise LayoutError(f"rewrite must be a string, got {type(rewrite).__name__}", field="rewrite")
    h, w = image_grid(height, width, cfg.image_token_downsample)
    fixed = _fixed_tokens(cfg, h, w)
    if fixed > cfg.max_position_embeddings:
        raise LayoutError(
            f"height={height}, width={width} give {h * w} image tokens; the row needs {fixed} "
            f"positions but max_position_embeddings={cfg.max_position_embeddings}: use a smaller size",
            field="size",
        )
    tpl = template if template is not None else TemplateSettings.from_config(cfg)
    text = _template_text(tpl, tokenizer, prompt, rewrite)
    n_prompt, n_rewrite = text.count(PROMPT), text.count(REWRITE)
    allowed = cfg.max_position_embeddings - fixed - (text.count(FIXED) + len(text.tail)) - n_rewrite
    if n_prompt > allowed:
        extra = f" with the {tpl.bot_task} rewrite and the prompt template" if n_rewrite else ""
        raise LayoutError(
            f"prompt is {n_prompt} tokens but at {height}x{width}{extra} at most {allowed} fit "
            f"(max_position_embeddings={cfg.max_position_embeddings}): shorten the prompt", field="prompt"
        )
    cond_head = text.head_ids()
    bad = [i for i in cond_head + list(text.tail) if not 0 <= i < cfg.vocab_size]
    if bad:
        raise LayoutError(
            f"prompt encodes to id {bad[0]} outside vocab_size={cfg.vocab_size}: tokenizer/config mismatch",
            field="prompt",
        )

    cfg_factor = 2 if guidance_scale > 1.0 and not cfg.use_guidance_token else 1
    rows = [_row(cfg, cond_head, text.tail, height, width, h, w, "cond")]
    if cfg_factor == 2:
        neg = None if negative_prompt is None else [int(i) for i in tokenizer.encode(negative_prompt)]
        uncond_head = text.head_ids(uncond=True, cfg_id=cfg.cfg_token_id, negative=neg)
        rows.append(_row(cfg, uncond_head, text.tail, height, width, h, w, "uncond"))
    return RequestLayout(rows=rows, h=h, w=w, cfg_factor=cfg_factor, prompt_tokens=n_prompt + n_rewrite)


def _row(cfg: HunyuanImage3Config, text_ids: list[int], tail_ids: tuple[int, ...], height: int, width: int,
         h: int, w: int, role: str) -> RowInputs:
    ratio = cfg.img_ratio_token_id + ratio_index(height, width, cfg.num_ratio_tokens)
    head = [cfg.bos_token_id, *text_ids, cfg.boi_token_id, cfg.img_size_token_id, ratio]
    timestep_index = len(head)
    tail = [cfg.timestep_token_id]
    guidance_index = None
    if cfg.use_guidance_token:
        guidance_index = timestep_index + 1
        tail.append(cfg.guidance_token_id)
    image_start = timestep_index + len(tail)
    ids = head + tail + [cfg.img_token_id] * (h * w) + [cfg.eoi_token_id, *tail_ids]
    seq_len = len(ids)
    pos_y, pos_x = build_positions(seq_len, image_start, h, w)
    return RowInputs(
        token_ids=torch.tensor(ids, dtype=torch.long),
        pos_y=pos_y,
        pos_x=pos_x,
        prefix_len=timestep_index,
        target_len=len(tail) + h * w,
        seq_len=seq_len,
        timestep_index=timestep_index,
        image_start=image_start,
        full_attn_spans=((image_start, image_start + h * w),),
        guidance_index=guidance_index,
        role=role,
    )
