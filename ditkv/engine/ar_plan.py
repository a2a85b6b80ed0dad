"""What a request's AR phase prefills, and the DiT rows that follow from its text: one place for the
single engine (`Engine`, AR phase in its step loop) and a stage graph's orchestrator.

One planner per bot_task (`ARPlanner(cfg, tok, bot_task)`: the request's, None: the checkpoint's); its
template is the checkpoint's with that bot_task (`template.request_settings`), and every layout, head,
tail and stop id below follows it. What a task's text is, and the rules of the prompt template around
it (the rewrite's tags and stop ids, drop_think, `<answer>`), are the model family's (`text_task`).

- think / recaption (the release's `generate_image`): the AR prefills the release's AR input (the
  family's `ar_head(..., rewrite_input=True)`), writes until a stop id, then prefills the task's tail.
  The image row is rebuilt with the rewrite and takes the AR's K/V as far as its tokens agree
  (`importable_prefix`).
- bot_task image with `max_new_tokens` > 0 (a ditkv extension, pretrain template only): the AR
  prefills the cond row's text, and its text extends the prompt (`request_layout(..., prompt_ids=)`).
- bot_task auto: the release `generate_image`'s auto, which writes no text (`check_text` refuses it with
  text: the release's free "auto" text mode, where the model decides, is not served).
- no text: the AR prefills exactly the cond row's text (a stage graph's transfer).
- size=auto (a request without height and width, single engine): the tail stops at `<img_size>` and
  the AR draws `<img_ratio_k>` among `ARIntake.sizes`' ids; the DiT rows are built at bucket k
  (docs/ar-phase.md "size=auto"). Admission sizes the request at the bucket of the most image tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import msgspec
import torch

from ..errors import ConfigError, LayoutError
from ..models.family import family_of
from .messages import HeadImages, pack_images


def shared_prefix(a, b) -> int:
    """Length of the common leading tokens of two rows (LongTensors)."""
    n = min(len(a), len(b))
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0]) if diff.numel() else n


def importable_prefix(ar_ids, row, page: int = 1) -> int:
    """How much of the AR's K/V a DiT row imports: as far as its tokens agree with the AR's (causal:
    equal tokens up to p give equal K/V at p), never ending inside a full-attention block (an input
    image: its K/V depend on the whole block); and nothing when a row shares less than one page with
    the AR (the uncond row's lone `<bos>`): a whole page write would buy a few tokens the DiT computes
    in the same pass anyway."""
    n = shared_prefix(ar_ids, row.token_ids[:row.prefix_len])
    for a, b in row.full_attn_spans:
        if a < n < b:
            n = a
    return 0 if n < min(page, row.prefix_len) else n


class ARIntake(NamedTuple):
    layout: object  # the DiT layout when the text cannot change it, else the least one (empty rewrite)
    head: list[int]  # what the AR prefills before its text
    tail: list[int]  # what it prefills after
    images: HeadImages | None  # the head's input images (wire form), None: a text head
    image_spans: bool  # the head holds full-attention blocks: prefilled in one chunk
    sizes: tuple[tuple[int, int, int], ...] = ()  # size=auto: (height, width, ratio id) the AR may choose; () if not
    size: tuple[int, int] | None = None  # (height, width) of `layout`: the request's, or auto's largest bucket
    stop_ids: tuple[int, ...] = ()  # ids that end the text besides eos, kept (the request's rewrite's closing tags)


class ARPlanner:
    def __init__(self, model_config, tokenizer, bot_task: str | None = None):
        """`bot_task`: a request's own (a `LayoutError` on `bot_task` names the valid ones); None: the
        checkpoint's (its generation_config.json)."""
        self.cfg, self.tok = model_config, tokenizer
        self.family = family_of(model_config)
        self.template = self.family.template.request_settings(model_config, bot_task)
        self.task = self.family.text_task(model_config, tokenizer, self.template)  # the family's text rules
        self.rewrites = self.task.rewrites  # think / recaption: the image row holds the AR's text
        # whose bot_task it is, for the errors: a request's differs from the checkpoint's
        self.own = self.template != self.family.template.request_settings(model_config)

    @property
    def bot_task(self) -> str:
        return self.template.bot_task

    def _whose(self) -> str:
        return "the request's" if self.own else "the checkpoint's prompt template"

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end the AR's text besides eos (a rewrite's closing tags), kept in the text."""
        return self.task.stop_ids

    def check_text(self, max_new_tokens: int, where: str, task_where: str | None = None) -> None:
        """What the prompt template asks of the AR text (the family's rules); `where` names the setting
        in the error, and `task_where` (default `where`) the bot_task where the task itself is what cannot run."""
        tpl, task_where = self.template, task_where or where
        refusal = self.task.refusal(max_new_tokens, self._whose())
        if refusal is not None:
            on_task, fix = refusal
            raise ConfigError(task_where, tpl.bot_task, fix) if on_task else ConfigError(where, max_new_tokens, fix)
        if self.rewrites:
            try:
                _ = self.stop_ids  # a tokenizer without the closing tags: refused here, naming the fix
            except ConfigError as e:
                if not self.own:
                    raise
                raise ConfigError(task_where, tpl.bot_task, f"{e.fix}; or leave bot_task out") from e

    def auto_sizes(self, fits: Callable[[int, int], bool] | None = None) -> tuple[tuple[int, int, int], ...]:
        """size=auto: (height, width, ratio id) of each bucket the AR may choose, k in order: the family's
        (`auto_sizes`: a LayoutError on `size` for a model that cannot choose), those `fits(h, w)`."""
        sizes = tuple(self.family.auto_sizes(self.cfg))
        kept = tuple(s for s in sizes if fits is None or fits(s[0], s[1]))
        if not kept:
            from ..errors import LayoutError

            small = min(sizes, key=lambda s: max(s[0], s[1]))
            raise LayoutError(f"size: size=auto chooses among the model's {len(sizes)} sizes, and none fits this "
                              f"engine (its max_image_height x max_image_width); raise them to at least "
                              f"{small[0]} x {small[1]}, or pass a size", field="size")
        return kept

    def intake(self, req, guidance: float, fits: Callable[[int, int], bool] | None = None) -> ARIntake:
        """The AR head and tail of a request (size snapped, guidance resolved). A request without height
        and width is size=auto: `fits(height, width)` (the engine's envelope) bounds the buckets."""
        sizes, layout = (), None
        if req.height is None or req.width is None:
            sizes, layout = self._rows_fit(req, guidance, self.auto_sizes(fits))
            h, w, _ = max(sizes, key=self._grid)  # the first bucket of the most image tokens: `layout`'s
            req = msgspec.structs.replace(req, height=h, width=w)  # the largest rows: admission's bound
        intake = self._intake(req, guidance, layout)
        if not sizes:
            return intake._replace(size=(req.height, req.width))
        cut = len(self.family.image_tail_ids(self.cfg, req.height, req.width))
        tail = intake.tail[:len(intake.tail) - cut] + self.family.size_tail_ids(self.cfg)
        return intake._replace(tail=tail, sizes=sizes, size=(req.height, req.width))

    def _grid(self, size) -> int:
        d = self.cfg.image_token_downsample
        return (size[0] // d) * (size[1] // d)

    def _rows_fit(self, req, guidance: float, sizes):
        """(the buckets whose DiT rows fit the model's positions with this request's prompt and input images,
        the layout at the first of those with the most image tokens): a long prompt or several input images
        leave no room for the largest, and the AR may draw only the rest. The rest of a row does not depend
        on the bucket, so they are the buckets up to the most image tokens that fit (a binary search over the
        distinct counts); none fits: the smallest one's error."""
        counts = sorted({self._grid(s) for s in sizes})
        built: dict[int, object] = {}  # count -> its layout (the image preprocessing runs once per count)

        def error(n):  # None when the request's rows build at the first bucket of n image tokens
            h, w, _ = next(s for s in sizes if self._grid(s) == n)
            try:
                built[n] = self.layout(msgspec.structs.replace(req, height=h, width=w), guidance,
                                       **({"rewrite": ""} if self.rewrites else {}))
            except LayoutError as e:
                if e.field not in ("size", "prompt"):
                    raise
                return e
            return None

        if error(counts[-1]) is None:
            return sizes, built[counts[-1]]
        lo, hi = 0, len(counts) - 1  # counts[hi] does not fit; find the last that does
        if (e := error(counts[0])) is not None:
            raise e
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if error(counts[mid]) is None else (lo, mid)
        return tuple(s for s in sizes if self._grid(s) <= counts[lo]), built[counts[lo]]

    def layout(self, req, guidance: float, **kw):
        """The request's DiT rows in this planner's template (`kw`: the family's `rewrite=`, or `prompt_ids=`
        for a prompt given as ids)."""
        return self.family.request_layout(self.cfg, self.tok, req.prompt, req.height, req.width, guidance,
                                          req.negative_prompt, template=self.template, images=req.images, **kw)

    def _intake(self, req, guidance: float, layout=None) -> ARIntake:
        """`layout`: the DiT layout at `req`'s size if already built (size=auto's search built it)."""
        cfg, tok, fam = self.cfg, self.tok, self.family
        tail = self.task.tail_ids(req.height, req.width)
        if self.rewrites:
            # admission checks the row with an empty rewrite (the least it can be); the real one follows the text
            layout = layout or self.layout(req, guidance, rewrite="")
            head = fam.ar_head(cfg, tok, req.prompt, req.height, req.width, rewrite_input=True,
                               template=self.template, images=req.images).token_ids
        else:  # the AR prefills the cond row's templated text: its K/V are the DiT's
            layout = layout or self.layout(req, guidance)
            head = layout.cond_text_ids()
        images = None if not req.images else HeadImages(req.prompt, req.height, req.width, self.rewrites,
                                                         pack_images(req.images),
                                                         self.bot_task if self.own else None)  # the ranks' template
        spans = bool(req.images)
        return ARIntake(layout, list(head), list(tail), images, spans, stop_ids=self.stop_ids)

    def chosen_size(self, intake: ARIntake, token: int) -> tuple[int, int]:
        """(height, width) of the bucket whose ratio id the AR drew (size=auto)."""
        for h, w, i in intake.sizes:
            if i == token:
                return h, w
        raise ValueError(f"token {token} is none of the {len(intake.sizes)} ratio ids size=auto allows")

    def dit_layout(self, intake: ARIntake, req, guidance: float, token_ids: list[int], generated: list[int]):
        """(DiT layout, the text to report as `revised_prompt` or None) once the AR phase wrote
        `token_ids` (head, text, tail) with `generated` its text; `req` carries the size to draw (for
        size=auto, the chosen bucket)."""
        if self.rewrites:
            rewrite = self.task.rewrite(generated)
            return self.layout(req, guidance, rewrite=rewrite), rewrite
        if generated:  # the text extends the prompt
            ids = self.task.extended_prompt_ids(req.prompt, token_ids, len(intake.head), len(intake.tail))
            return self.layout(req, guidance, prompt_ids=ids), self.tok.decode(ids)
        if intake.sizes:  # the text is the cond row's; the size is the AR's choice
            return self.layout(req, guidance), None
        return intake.layout, None

    def imports(self, layout, token_ids: list[int], block_size: int, exact: bool) -> list[int]:
        """Tokens of each DiT row whose K/V the AR wrote. `exact`: the AR prefilled the cond row's own
        text, so its prefix must be the AR's tokens (anything else is a bug, refused); for size=auto the
        AR row stops before `<img_ratio_k>`, the row's last prefix token."""
        ar_ids = torch.tensor(token_ids, dtype=torch.long)
        cond = layout.rows[0]
        prefix = cond.token_ids[:cond.prefix_len].tolist()
        if exact and (token_ids != prefix[:len(token_ids)] or len(token_ids) < len(prefix) - 1):
            raise LayoutError("the AR prefix does not match the DiT layout's cond-row prefix")
        return [importable_prefix(ar_ids, r, block_size) for r in layout.rows]
