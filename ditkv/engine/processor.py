"""The engine's front end: a public request in, what the ranks run out, once per request.

`Processor.process` checks the request, snaps its size to the model's buckets, resolves steps and
guidance against the model's defaults, builds the token layout (the tokenizer, the prompt
template and the input images' preprocessing run here and nowhere else) and returns one
`SamplingParams`. The engine queues the result; the ranks receive the layout and the params in
`NewRequest` and never tokenize. A stage graph's orchestrator runs the same intake (`Processor(...,
stage=StageText(...))`): its AR stage always runs, and the stage's max_new_tokens, which sizes the AR
pages, caps every request's text (`text_sampling`).

A request's `bot_task` (None: the checkpoint's) picks its template: the layout, the AR head, tail
and stop ids, whether it writes text, and the handover all follow it (`planner_for`: one
`ARPlanner` per bot_task, made once).

A request without height and width is size=auto: it always has an AR phase (even without text),
which draws the size (`ar_plan.ARPlanner.intake`); the engine's envelope bounds the buckets it may
choose (`fits`). In a stage graph the AR stage draws it (its own paged engine) and the DiT stage's envelope
bounds the choice.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ..errors import ConfigError, LayoutError
from ..models.family import family_of
from ..models.text_settings import TextSampling, checkpoint_sampling
from .ar_plan import ARIntake, ARPlanner
from .frontend import images_kw
from .messages import SamplingParams
from .request_check import check_image_support, check_request, request_sampling, snap_request, text_overrides
from .types import GenerationRequest


class Processed(NamedTuple):
    request: GenerationRequest  # as generated: its size snapped to the model's buckets
    layout: object  # the model family's request layout (with AR text: the least it can be)
    params: SamplingParams
    ar: ARIntake | None = None  # its AR phase (head, tail), None: no AR text
    text: TextSampling | None = None  # how the AR text is drawn (with the request's seed)


class StageText(NamedTuple):
    """What a stage graph's AR stage sets for its requests' text (the single engine has none)."""
    cap: int  # the AR stage's max_new_tokens: it sizes each job's pages, so it caps every request's text
    defaults: TextSampling  # the stage's settings over the checkpoint's
    bot_task: str | None = None  # the task of requests without their own (None: the checkpoint's)


class Processor:
    def __init__(self, config, model_config, tokenizer, envelope=None, stage: StageText | None = None):
        """`envelope` (`profiling.Envelope`): the largest size this engine draws, which bounds what
        size=auto may choose (None: any bucket). `stage`: the intake of a stage graph's orchestrator
        (`config` is then its DiT stage's engine config); a `LayoutError` on `bot_task` names a bad
        `stage.bot_task`'s valid values."""
        self.config, self.model_config, self.tokenizer = config, model_config, tokenizer
        self.family = family_of(model_config)
        self.stage = stage
        self.planner = ARPlanner(model_config, tokenizer)  # the checkpoint's bot_task
        self._planners = {None: self.planner, self.planner.bot_task: self.planner}
        if stage is not None:  # None asks for the requests' default task: the stage's
            self._planners[None] = self.planner_for(stage.bot_task)
        self.text_defaults = checkpoint_sampling(model_config) if stage is None else stage.defaults
        self.fits = None if envelope is None else \
            (lambda h, w: h <= envelope.max_height and w <= envelope.max_width)

    def process(self, req: GenerationRequest) -> Processed:
        """Raises a client-safe `LayoutError` naming the field for bad input."""
        check_request(req, self.config.max_steps)
        planner = self.planner_for(req.bot_task)
        text = self.text_sampling(req, planner)
        check_image_support(req, self.model_config)
        if req.height is None:
            text = self.auto_size_text(req, text)
        req = snap_request(req, self.model_config)
        steps, guidance = resolve_steps_guidance(self.model_config, req.steps, req.guidance_scale,
                                                 self.config.max_steps)
        params = SamplingParams(steps=steps, guidance=guidance, seed=req.seed)
        if text is not None:
            intake = planner.intake(req, guidance, self.fits)
            check_cfg_rows(intake.layout, self.config.cfg_parallel_size)
            return Processed(req, intake.layout, params, intake, text)
        own = {} if planner is self.planner else {"template": planner.template}  # else called as before
        layout = self.layout(req.prompt, req.height, req.width, guidance, req.negative_prompt,
                             images=req.images or None, **own)
        return Processed(req, layout, params)

    def planner_for(self, bot_task: str | None) -> ARPlanner:
        """The `ARPlanner` of a request's bot_task (None: the default, the stage's else the checkpoint's); a
        `LayoutError` on `bot_task` names the valid values. Made once per task: the handover asks again."""
        planner = self._planners.get(bot_task)
        if planner is None:
            planner = self._planners[bot_task] = ARPlanner(self.model_config, self.tokenizer, bot_task)
        return planner

    def text_sampling(self, req: GenerationRequest, planner: ARPlanner | None = None) -> TextSampling | None:
        """The request's AR text settings (`text_sampling` below), or None when it has no AR phase: in the
        single engine a request without text (an image or auto task that asks for none); a stage graph's
        AR stage always runs."""
        planner = planner or self.planner_for(req.bot_task)
        s = text_sampling(req, planner, self.text_defaults, None if self.stage is None else self.stage.cap)
        if s.max_new_tokens <= 0 and not planner.rewrites:
            unused = [k for k in text_overrides(req) if k != "max_new_tokens"]  # 0 asks for no text: nothing unused
            if unused:  # a setting for text this request does not write would be silently unused
                name = unused[0]
                raise LayoutError(f"{name}: this request writes no AR text (bot_task {planner.bot_task} and "
                                  f"max_new_tokens 0), so {name} would be unused; set max_new_tokens > 0 for text "
                                  f"before the image, or remove {name}", field=name)
            if self.stage is None:
                return None
        if self.stage is not None:  # the AR stage runs every request (its prefill, maybe no text)
            return s
        if self.config.diffusion_kv_mode != "paged_scheduler":
            raise LayoutError("max_new_tokens: AR text needs diffusion_kv_mode paged_scheduler (the AR phase writes "
                              "the pool's pages; dense_legacy has none); use the paged mode or drop the AR text",
                              field="max_new_tokens")
        return s

    @property
    def auto_size_default(self) -> bool:
        """Whether a request without a size should be size=auto (the checkpoint's generation config says so);
        the front ends ask (`ditkv generate`, /v1/images/generations)."""
        return self.family.auto_size_default(self.model_config) and self.auto_size_error() is None

    def auto_size_error(self) -> str | None:
        """Why this engine cannot let the model pick the size (None: it can)."""
        if self.stage is None and self.config.diffusion_kv_mode != "paged_scheduler":  # an AR stage is always paged
            return "size=auto needs diffusion_kv_mode paged_scheduler"
        try:
            self.planner.auto_sizes(self.fits)
        except LayoutError as e:
            return str(e)
        return None

    def auto_size_text(self, req: GenerationRequest, text: TextSampling | None) -> TextSampling:
        """size=auto (height and width None): the AR phase draws the size, so the request has one even
        without text (then its settings draw nothing: the size is drawn greedily)."""
        if self.stage is None and self.config.diffusion_kv_mode != "paged_scheduler":
            raise LayoutError("size: size=auto has the AR phase pick the size, which needs diffusion_kv_mode "
                              "paged_scheduler (the AR phase writes the pool's pages); use the paged mode or pass "
                              "height and width", field="size")
        self.planner.auto_sizes(self.fits)  # a model that cannot choose, or no bucket fits: said now
        return text if text is not None else self.text_defaults.override(max_new_tokens=0, seed=req.seed)

    def layout(self, prompt: str, height: int, width: int, guidance: float, negative_prompt: str | None = None,
               images=None, **template):
        """The request's rows from the model family's preprocessing (`template`: a request's own template,
        `template=`; none: the checkpoint's); refuses at intake what the ranks would refuse (a cfg-parallel
        replica needs the two CFG rows)."""
        layout = self.family.request_layout(self.model_config, self.tokenizer, prompt, height, width, guidance,
                                            negative_prompt, **images_kw(images), **template)
        check_cfg_rows(layout, self.config.cfg_parallel_size)
        return layout


def text_sampling(req: GenerationRequest, planner: ARPlanner, defaults: TextSampling,
                  cap: int | None = None) -> TextSampling:
    """A request's AR text settings: its own, else `defaults`, seeded with its seed, checked against its
    task (`ARPlanner.check_text`). A think/recaption request always writes text; any other writes only
    what it asks, except the checkpoint's image task on the pretrain template in a stage graph.
    `cap`: a stage graph's AR stage max_new_tokens, which sizes its pages: the most any request writes,
    and the default of a rewrite and of that image task (its text extends the prompt). None (the single
    engine): no cap, and a rewrite's default is `defaults`' (the request's, else the checkpoint's)."""
    if cap is not None and planner.rewrites and cap == 0:  # a request's own task (the default's: at startup)
        raise LayoutError(f"bot_task: {planner.bot_task!r} writes the rewrite in the AR stage, whose "
                          "max_new_tokens is 0 (it sizes the AR pages); raise stages[0].max_new_tokens, or leave "
                          "bot_task out", field="bot_task")
    if planner.rewrites or (cap is not None and planner.task.extends_prompt and not planner.own):
        default = defaults.max_new_tokens if cap is None else cap
    else:  # text only if the request asks
        default = 0
    s = request_sampling(req, defaults.override(max_new_tokens=default), cap)
    try:
        planner.check_text(s.max_new_tokens, "max_new_tokens", "bot_task" if planner.own else None)
    except ConfigError as e:
        field = e.field if e.field in ("max_new_tokens", "bot_task") else "max_new_tokens"
        raise LayoutError(f"{field}: {e.fix}", field=field) from e
    return s


def check_cfg_rows(layout, cfg_parallel_size: int) -> None:
    """At intake, what the ranks would refuse: a cfg-parallel replica runs the two CFG rows."""
    cfg = cfg_parallel_size
    if cfg > 1 and len(layout.rows) != cfg:
        raise LayoutError(f"cfg_parallel_size={cfg} needs a CFG request with {cfg} rows (cond, uncond), "
                          f"got {len(layout.rows)}; use guidance_scale > 1, or cfg_parallel_size=1",
                          field="guidance_scale")


def resolve_steps_guidance(model_config, steps, guidance, max_steps: int | None = None) -> tuple[int, float]:
    """A request's steps and guidance scale: the model's defaults where it gave none, checked."""
    steps = model_config.default_steps if steps is None else steps
    guidance = model_config.default_guidance if guidance is None else guidance
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise LayoutError(f"steps={steps!r} must be a positive integer", field="steps")
    if max_steps is not None and steps > max_steps:
        raise LayoutError(f"steps={steps} is above max_steps={max_steps}; lower steps or raise max_steps",
                          field="steps")
    if not isinstance(guidance, (int, float)) or isinstance(guidance, bool) or not math.isfinite(guidance) \
            or guidance < 0:
        raise LayoutError(f"guidance_scale={guidance!r} must be a finite number >= 0 (<= 1 disables CFG)",
                          field="guidance_scale")
    return steps, float(guidance)
