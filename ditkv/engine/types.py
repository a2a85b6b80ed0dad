"""Public request / output types of the engine API."""

from __future__ import annotations

import msgspec


class GenerationRequest(msgspec.Struct, kw_only=True):
    prompt: str
    # pixels; both None is size=auto: the model picks one of its resolution buckets in the single engine's
    # AR phase, as the release's image_size="auto" (docs/ar-phase.md "size=auto")
    height: int | None = 64
    width: int | None = 64
    steps: int | None = None  # None = the model's default
    guidance_scale: float | None = None  # None = the model's default
    seed: int = 0
    negative_prompt: str | None = None
    request_id: str | None = None  # assigned by the engine when None
    # input images (editing / image-conditioned generation): decoded RGB, each a C-contiguous uint8
    # numpy array [H, W, 3]; None or [] = text-to-image. Front ends decode uploads with
    # `ditkv.entrypoints.images.decode_image`; `request_check.check_request` validates them, and the
    # model's `max_input_images` bounds their number (0: the model takes none).
    images: list | None = None
    # AR text (the single engine's AR phase, or a stage graph's AR stage): None = the stage's or the
    # checkpoint's default (`models.text_settings.TextSampling` has the meanings). With bot_task image
    # only max_new_tokens > 0 asks for text; think/recaption checkpoints always write it
    max_new_tokens: int | None = None  # in a stage graph, at most the AR stage's max_new_tokens
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    do_sample: bool | None = None
    ignore_eos: bool = False  # Python API: the text runs to max_new_tokens (benchmarks on random weights)
    # the prompt template's task (the release's generate_image bot_task): "image", "auto" (the release's:
    # no text; under use_system_prompt dynamic, the system_prompt text), "think" or "recaption" (the AR
    # phase writes the rewrite the image row holds); None: the checkpoint's generation_config.json
    bot_task: str | None = None
    # step caching for this request (a mapping, as the engine's `cache_config`; docs/step-cache.md): it
    # replaces the engine's for this request; None = the engine's; {"type": "none"} turns it off
    cache_config: dict | None = None


class RequestStats(msgspec.Struct, kw_only=True):
    queue_time_s: float = 0.0
    run_time_s: float = 0.0
    blocks: int = 0  # KV blocks held (paged mode)
    prefix_tokens_reused: int = 0
    tokens_computed: int = 0
    imported_tokens: int = 0
    # prefix tokens (all rows) whose pages came from the cross-request prefix cache: not computed
    # (apart from prefix_tokens_reused, the reuse across this request's own steps)
    prefix_cache_hit_tokens: int = 0
    # prefix tokens of rows > 0 whose pages are row 0's of the request (equal keys): computed once, by row 0
    prefix_shared_rows_tokens: int = 0
    # input images whose embeddings came from the DiT's encoder cache (not encoded; docs/prefix-cache.md)
    encoder_cache_hits: int = 0
    steps: int = 0
    # step caching: steps that ran the middle blocks vs steps that reused their residual (0, 0 without a cache
    # only when steps is 0: without a cache every step is computed)
    computed_steps: int = 0
    cached_steps: int = 0
    # the AR phase (text before the image; 0 without one). run_time_s is the DiT phase's time
    ar_prompt_tokens: int = 0  # tokens it prefilled before its text
    ar_generated_tokens: int = 0
    ar_time_to_first_token_s: float = 0.0  # from its arrival (queueing included) to its first sampled token
    ar_seconds: float = 0.0  # from its admission into the AR phase to the end of its text
    ar_preemptions: int = 0  # times its AR pages were taken back (it was recomputed from its prompt)
    auto_size: str | None = None  # size=auto: the WIDTHxHEIGHT the AR phase chose (None: the size was given)


class GenerationOutput(msgspec.Struct, kw_only=True):
    request_id: str
    status: str  # "ok" | "cancelled" | "error"
    error: str | None = None
    image: object = None  # uint8 numpy array [H, W, 3] when status == "ok"
    stats: RequestStats = msgspec.field(default_factory=RequestStats)
    revised_prompt: str | None = None  # the prompt the DiT drew: the user's + the AR stage's text, if any

    @property
    def ok(self) -> bool:
        return self.status == "ok"
