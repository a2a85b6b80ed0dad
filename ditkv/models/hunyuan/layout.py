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

Input images (image-conditioned generation, `images=`; release Instruct code, see vision.py and
docs/release-checkpoint.md): each image enters the user turn, right before the prompt, as

    <boi> <img_size> <img_ratio_k> <timestep> <img> x (h*w) [<joint_img_sep> <img> x N] <eoi>

the VAE latent tokens of its bucket (h x w cells, filled at timestep 0 through the image path) and, with
cond_image_type "vae_vit", the N = max_num_patches vision-encoder tokens. The latent block and the vision
block are each a full-attention span and each gets 2D positions as above (the vision block's first
gh*gw tokens on its gh x gw patch grid; its padding tokens keep their index). The uncond row keeps the
images unchanged (only the prompt becomes `<cfg>`), so both rows still share length, positions and spans.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ditkv.errors import LayoutError
from ditkv.models.family_api import check_input_image_count
from ditkv.models.hunyuan import buckets
from ditkv.models.hunyuan.config import HunyuanImage3Config
from ditkv.models.hunyuan.template import (FIXED, PROMPT, REWRITE, EncodedText, TemplateSettings, ar_prompt_pieces,
                                           image_row_pieces)
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
class CondImage:
    """One input image of a request: its preprocessed pixels and its slots (the same in every row)."""

    vae_pixels: torch.Tensor  # [1, 3, H, W] fp32 in [-1, 1]: resized and cropped to its bucket
    h: int  # latent rows
    w: int  # latent columns
    timestep_index: int  # its <timestep> slot (filled with timestep 0)
    vae_start: int  # first of its h*w latent tokens
    vit_patches: torch.Tensor | None = None  # [N, 3*p*p] fp32, zero-padded to N = max_num_patches
    vit_mask: torch.Tensor | None = None  # [N] int32: 1 for real patches
    vit_shape: tuple[int, int] | None = None  # patch grid (rows, cols)
    vit_start: int | None = None  # first of its N vision tokens
    # cond_token_attn_type "joint_full": one full-attention block over the latent tokens, the
    # <joint_img_sep> and the vision tokens (the release's joint_image_slices); "full": two blocks
    joint: bool = False
    # its content's digest (pixels, vision patches and mask), hashed the first time a key needs it
    # (`prefix_keys.content_digest`, at intake) and carried on the wire: no rank or later key hashes it again
    digest: bytes = b""

    @property
    def vit_len(self) -> int:
        return 0 if self.vit_patches is None else int(self.vit_patches.shape[0])

    def spans(self) -> list[tuple[int, int]]:
        vae_end = self.vae_start + self.h * self.w
        if self.vit_start is None:
            return [(self.vae_start, vae_end)]
        if self.joint:
            return [(self.vae_start, self.vit_start + self.vit_len)]
        return [(self.vae_start, vae_end), (self.vit_start, self.vit_start + self.vit_len)]


@dataclass(frozen=True, eq=False)
class RequestLayout:
    rows: list[RowInputs]
    h: int  # latent rows
    w: int  # latent columns
    cfg_factor: int  # 2 = (cond, uncond) rows, 1 = one row
    prompt_tokens: int = 0  # encoded prompt (+ rewrite) length; the template's fixed text is not counted
    images: tuple[CondImage, ...] = ()  # input images (image-conditioned generation), in request order

    @property
    def num_image_tokens(self) -> int:
        return self.h * self.w

    def cond_text_ids(self) -> list[int]:
        """The cond row's tokens before the output image's `<boi>` (`<bos>`, the templated prompt and any
        input images): what an AR stage prefills (`build_ar_head`) ahead of `<boi> <img_size> <img_ratio_k>`
        for its K/V to be the DiT's."""
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


def ratio_token(cfg: HunyuanImage3Config, height: int, width: int) -> int:
    """The id of the output image's `<img_ratio_k>`: k of the code family's nearest bucket
    (`buckets.output_bucket`, verified against the release and Instruct code; 0 for a model with one
    ratio token); the Instruct extra buckets' ids come from its tokenizer."""
    k = buckets.output_bucket(cfg, height, width)[2]
    try:
        return buckets.ratio_token_id(k, cfg.img_ratio_token_id, cfg.img_ratio_extra_token_id)
    except ValueError as e:
        raise LayoutError(f"{width}x{height} is the Instruct code's extra bucket <img_ratio_{k}>, whose id is "
                          "unknown: put the checkpoint's tokenizer.json in the folder, or set "
                          f"img_ratio_extra_token_id in config.json ({e})", field="size") from e


def build_positions(seq_len: int, image_start: int, h: int, w: int,
                    more: tuple[tuple[int, int, int], ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """(pos_y, pos_x) LongTensors [seq_len] for a row with an h x w image at `image_start` and the grids
    `more` = ((start, h, w), ...) (input images: latent and vision blocks); every other token keeps y = x =
    its index."""
    pos_y = torch.arange(seq_len, dtype=torch.long)
    pos_x = pos_y.clone()
    for start, gh, gw in ((image_start, h, w), *more):
        n = gh * gw
        end = start + n
        if end > seq_len:
            raise LayoutError(f"image [{start}, {end}) runs past seq_len={seq_len}")
        rows = torch.arange(gh, dtype=torch.long).repeat_interleave(gw)
        cols = torch.arange(gw, dtype=torch.long).repeat(gh)
        pos_y[start:end] = start + (n - gh) // 2 + rows
        pos_x[start:end] = start + (n - gw) // 2 + cols
    return pos_y, pos_x


def _fixed_tokens(cfg: HunyuanImage3Config, h: int, w: int) -> int:
    """Row length without the prompt: bos, boi, size, ratio, timestep, [guidance], image, eoi."""
    return 6 + int(cfg.use_guidance_token) + h * w


def image_tail_ids(cfg: HunyuanImage3Config, height: int, width: int) -> list[int]:
    """`<boi> <img_size> <img_ratio_k>`: the tokens between the prompt and `<timestep>` (an AR stage
    prefills them after the prompt)."""
    return [cfg.boi_token_id, cfg.img_size_token_id, ratio_token(cfg, height, width)]


def size_tail_ids(cfg: HunyuanImage3Config) -> list[int]:
    """`<boi> <img_size>`: what the AR prefills after the text when the model picks the size itself
    (`size=auto`): it then draws `<img_ratio_k>` (`buckets.auto_sizes`)."""
    return [cfg.boi_token_id, cfg.img_size_token_id]


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
                   rewrite: str | None, prompt_ids: list[int] | None = None) -> EncodedText:
    return EncodedText.encode(tokenizer, *image_row_pieces(tpl, prompt, rewrite), prompt_ids=prompt_ids)


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
    images: list | None = None,
    prompt_ids: list[int] | None = None,
) -> RequestLayout:
    """Build the row(s) of a text-to-image request.

    `template`: the prompt template settings (default: the model config's, `template.py`);
    `rewrite`: the AR stage's think/recaption text, for the bot tasks that need it.
    `images`: input images (uint8 RGB arrays [H, W, 3]), at most `cfg.max_input_images`; each enters the
    user turn before the prompt (module docstring), in both CFG rows.
    `prompt_ids`: the prompt as token ids, used instead of encoding `prompt` (an AR phase's text that
    extends the prompt: the ids it wrote).

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
    conds = _cond_images(cfg, tokenizer, images, (height, width))
    fixed = _fixed_tokens(cfg, h, w) + sum(len(c[0]) for c in conds)
    if fixed > cfg.max_position_embeddings:
        raise LayoutError(
            f"height={height}, width={width} give {h * w} image tokens; the row needs {fixed} "
            f"positions but max_position_embeddings={cfg.max_position_embeddings}: use a smaller size",
            field="size",
        )
    tpl = template if template is not None else TemplateSettings.from_config(cfg)
    text = _template_text(tpl, tokenizer, prompt, rewrite, prompt_ids)
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
    (cond_ids, at) = _with_images(text, conds)
    placed = _placed(conds, at)
    rows = [_row(cfg, cond_ids, text.tail, height, width, h, w, "cond", placed)]
    if cfg_factor == 2:
        neg = None if negative_prompt is None else [int(i) for i in tokenizer.encode(negative_prompt)]
        uncond_ids, at_u = _with_images(text, conds, uncond=True, cfg_id=cfg.cfg_token_id, negative=neg)
        assert at_u == at  # the fixed text before the prompt is the same in both rows
        rows.append(_row(cfg, uncond_ids, text.tail, height, width, h, w, "uncond", placed))
    return RequestLayout(rows=rows, h=h, w=w, cfg_factor=cfg_factor, prompt_tokens=n_prompt + n_rewrite,
                         images=placed)


def _with_images(text: EncodedText, conds: list, **kw) -> tuple[list[int], int]:
    """(the head's text ids with the input images' ids right before the prompt, i.e. after the system
    prompt and the user role marker; the index in the row, after `<bos>`, where the images start)."""
    k = next((i for i, (_, kind) in enumerate(text.head) if kind == PROMPT), len(text.head))
    pre = EncodedText(text.head[:k], ()).head_ids(**kw)
    image_ids = [i for ids, _ in conds for i in ids]
    return pre + image_ids + EncodedText(text.head[k:], ()).head_ids(**kw), 1 + len(pre)


@dataclass(frozen=True, eq=False)
class ARHead:
    """What an AR stage prefills before it generates: `<bos>` and the templated text (the cond row's, or
    a rewrite's AR input) with the request's input images in their slots, their blocks full-attention
    spans with 2D positions exactly as in the image row; every other token has y = x = its index."""

    token_ids: list[int]
    pos_y: torch.Tensor  # LongTensor[len(token_ids)]
    pos_x: torch.Tensor
    spans: tuple[tuple[int, int], ...]  # the images' blocks
    images: tuple[CondImage, ...] = ()


def build_ar_head(cfg: HunyuanImage3Config, tokenizer: TextTokenizer, prompt: str, height: int, width: int, *,
                  rewrite_input: bool = False, template: TemplateSettings | None = None,
                  images: list | None = None) -> ARHead:
    """The AR head of a request: with `rewrite_input` the think/recaption AR input (`ar_prompt_pieces`:
    text up to the assistant's opening tag), else the cond row's text (`RequestLayout.cond_text_ids`).
    `height`/`width` (the output size) pick the input images' buckets as `build_request_layout` does,
    so the head's image tokens, slots and positions are the image row's."""
    tpl = template if template is not None else TemplateSettings.from_config(cfg)
    if rewrite_input:
        text = EncodedText.encode(tokenizer, ar_prompt_pieces(tpl, prompt), [])
    else:
        text = _template_text(tpl, tokenizer, prompt, None)
    conds = _cond_images(cfg, tokenizer, images, (height, width))
    ids, at = _with_images(text, conds)
    ids = [cfg.bos_token_id, *ids]
    placed = _placed(conds, at)
    more, spans = _image_blocks(placed)
    pos_y, pos_x = build_positions(len(ids), 0, 0, 0, more)
    return ARHead(ids, pos_y, pos_x, tuple(sorted(spans)), placed)


def _image_blocks(images: tuple[CondImage, ...]) -> tuple[tuple[tuple[int, int, int], ...], list[tuple[int, int]]]:
    """The input images' 2D grids `(start, h, w)` (latent and vision blocks) and full-attention spans."""
    more, spans = [], []
    for c in images:
        more.append((c.vae_start, c.h, c.w))
        if c.vit_start is not None:
            more.append((c.vit_start, *c.vit_shape))
        spans += c.spans()
    return tuple(more), spans


def _cond_images(cfg: HunyuanImage3Config, tokenizer: TextTokenizer, images, out_hw: tuple[int, int]) -> list:
    """Per input image: (its token ids, the CondImage with slots relative to its own first token)."""
    if images is None:
        return []
    if not isinstance(images, (list, tuple)):
        raise LayoutError(f"images must be a list of uint8 RGB arrays [H, W, 3], got {type(images).__name__}",
                          field="image")
    if not images:
        return []
    check_input_image_count(len(images), cfg.max_input_images)  # the engine's intake says the same
    from ditkv.models.hunyuan import vision

    vit = cfg.cond_image_type == "vae_vit"
    vcfg = vision.VisionConfig.from_extra(cfg.extra, cfg.hidden_size) if vit else None
    sep = None
    if vit:
        sep = _token_id(tokenizer, "<joint_img_sep>")
        sep = cfg.joint_img_sep_token_id if sep is None else sep
        if sep is None:
            raise LayoutError("input images need the <joint_img_sep> token: the tokenizer has none and config.json "
                              "sets no joint_img_sep_token_id", field="image")
    out = []
    for i, img in enumerate(images):
        img = vision.check_image(img, i)
        th, tw, k = vision.cond_bucket(img.shape[0], img.shape[1], cfg.image_base_size, out_hw)
        gh, gw = image_grid(th, tw, cfg.image_token_downsample)
        if cfg.num_ratio_tokens == 1:  # a model without ratio conditioning: one ratio token
            k = 0
        ratio = cfg.img_ratio_token_id + k if k < cfg.num_ratio_tokens else _token_id(tokenizer, f"<img_ratio_{k}>")
        if ratio is None:
            raise LayoutError(f"images[{i}] ({img.shape[1]}x{img.shape[0]}) maps to the release's extra size "
                              f"{tw}x{th}, whose <img_ratio_{k}> the tokenizer does not have: use the checkpoint's "
                              "tokenizer.json, or crop the image to another aspect ratio", field="image")
        ids = [cfg.boi_token_id, cfg.img_size_token_id, ratio, cfg.timestep_token_id] + [cfg.img_token_id] * (gh * gw)
        kw = {}
        if vit:
            patches, mask, shape = vision.vit_inputs(img, vcfg)
            kw = dict(vit_patches=patches, vit_mask=mask, vit_shape=shape, vit_start=len(ids) + 1,
                      joint=cfg.cond_token_attn_type == "joint_full")
            ids += [sep] + [cfg.img_token_id] * patches.shape[0]
        ids.append(cfg.eoi_token_id)
        out.append((ids, CondImage(vision.vae_pixels(img, (th, tw)), gh, gw, 3, 4, **kw)))
    return out


def _token_id(tokenizer, name: str) -> int | None:
    fn = getattr(tokenizer, "token_to_id", None)
    tid = fn(name) if fn is not None else None
    return None if tid is None else int(tid)


def _placed(conds: list, at: int) -> tuple[CondImage, ...]:
    """Slots made absolute: the first image's tokens start at index `at`, the others follow it."""
    out = []
    for ids, c in conds:
        vit = None if c.vit_start is None else c.vit_start + at
        out.append(dataclasses.replace(c, timestep_index=c.timestep_index + at, vae_start=c.vae_start + at,
                                       vit_start=vit))
        at += len(ids)
    return tuple(out)


def _row(cfg: HunyuanImage3Config, text_ids: list[int], tail_ids: tuple[int, ...], height: int, width: int,
         h: int, w: int, role: str, images: tuple[CondImage, ...] = ()) -> RowInputs:
    head = [cfg.bos_token_id, *text_ids, cfg.boi_token_id, cfg.img_size_token_id, ratio_token(cfg, height, width)]
    timestep_index = len(head)
    tail = [cfg.timestep_token_id]
    guidance_index = None
    if cfg.use_guidance_token:
        guidance_index = timestep_index + 1
        tail.append(cfg.guidance_token_id)
    image_start = timestep_index + len(tail)
    ids = head + tail + [cfg.img_token_id] * (h * w) + [cfg.eoi_token_id, *tail_ids]
    seq_len = len(ids)
    more, spans = _image_blocks(images)
    pos_y, pos_x = build_positions(seq_len, image_start, h, w, more)
    return RowInputs(
        token_ids=torch.tensor(ids, dtype=torch.long),
        pos_y=pos_y,
        pos_x=pos_x,
        prefix_len=timestep_index,
        target_len=len(tail) + h * w,
        seq_len=seq_len,
        timestep_index=timestep_index,
        image_start=image_start,
        full_attn_spans=tuple(sorted(spans + [(image_start, image_start + h * w)])),
        guidance_index=guidance_index,
        role=role,
    )
