"""The checks every front end applies to a `GenerationRequest` before any work: the Python API,
`ditkv generate` and `ditkv serve` accept exactly the same inputs. Each error carries the field
it is about (`DitkvError.field`), which the HTTP server reports as `param`."""

from __future__ import annotations

import logging
import math

from ..errors import AdmissionError, ConfigError, LayoutError
from ..models.family import check_input_image_count
from ..models.text_settings import TextSampling

log = logging.getLogger("ditkv.request")

MAX_SEED = 2**63 - 1  # seeds are non-negative int64 (torch.Generator.manual_seed's range)
MAX_PROMPT_CHARS = 65536  # cheap cap before tokenising; the token limit is the model's
# input images (editing): engine-wide caps; front ends may set lower ones (`ditkv serve` flags), and
# the model's `max_input_images` bounds the count further (0 or absent: the model takes none)
MAX_INPUT_IMAGES = 8  # per request
MAX_INPUT_IMAGE_PIXELS = 4096 * 4096  # per decoded image (width x height)
MAX_INPUT_IMAGE_BYTES = 20 << 20  # per encoded upload (PNG/JPEG/WEBP file), checked where it is decoded


def check_request(req, max_steps: int) -> None:
    """Raise `LayoutError(field=...)` naming the first bad field of `req` (a GenerationRequest).
    Height and width None is size=auto: the AR phase (a single engine's, or a stage graph's AR stage)
    picks the size; whether the model can is the planner's question."""
    for name in ("prompt", "negative_prompt"):
        v = getattr(req, name)
        if v is None and name == "negative_prompt":
            continue
        if not isinstance(v, str):
            raise LayoutError(f"{name}: must be a string, got {type(v).__name__}", field=name)
        if len(v) > MAX_PROMPT_CHARS:
            raise LayoutError(f"{name}: {len(v)} characters, above the limit of {MAX_PROMPT_CHARS}", field=name)
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            raise LayoutError(f"{name}: must be valid Unicode text (no lone surrogates)", field=name) from None
    if not req.prompt.strip():
        raise LayoutError("prompt: must contain non-whitespace text", field="prompt")
    check_auto_size(req)
    for name in ("height", "width"):
        v = getattr(req, name)
        if v is None and req.height is None and req.width is None:
            continue  # size=auto
        if not _is_int(v) or v <= 0:
            raise LayoutError(f"{name}: {v!r} must be a positive integer number of pixels", field="size")
    if req.steps is not None and (not _is_int(req.steps) or not 1 <= req.steps <= max_steps):
        raise LayoutError(f"steps: {req.steps!r} must be an integer in 1..{max_steps} (max_steps)", field="steps")
    g = req.guidance_scale
    if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) or g < 0):
        raise LayoutError(f"guidance_scale: {g!r} must be a finite number >= 0 (<= 1 disables CFG)",
                          field="guidance_scale")
    if not _is_int(req.seed) or not 0 <= req.seed <= MAX_SEED:
        raise LayoutError(f"seed: {req.seed!r} must be an integer in 0..{MAX_SEED}", field="seed")
    check_images(getattr(req, "images", None))
    task = getattr(req, "bot_task", None)
    if task is not None and not isinstance(task, str):  # its values are the model family's (`ARPlanner`)
        raise LayoutError(f"bot_task: must be a string, got {type(task).__name__}", field="bot_task")
    try:
        TextSampling(**text_overrides(req))
    except ConfigError as e:  # the same words, as a client error on the request's field
        raise LayoutError(f"{e.field}: {e.fix} (got {e.value!r})", field=e.field) from None


def check_auto_size(req) -> None:
    """height and width None is size=auto: both or neither."""
    h, w = req.height, req.width
    if (h is None) != (w is None):
        name = "height" if h is None else "width"
        raise LayoutError(f"{name}: None with {'width' if name == 'height' else 'height'} given; give both, or "
                          "neither for size=auto (the model picks the size)", field="size")


TEXT_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "do_sample")


def text_overrides(req) -> dict:
    """The AR text settings a request gives (None: not given)."""
    return {k: getattr(req, k) for k in TEXT_FIELDS if getattr(req, k, None) is not None}


def request_sampling(req, defaults: TextSampling, cap: int | None = None) -> TextSampling:
    """A request's AR settings: its own, else `defaults` (a stage graph's: the stage's, then the
    checkpoint's); its seed seeds the text too. `cap`: a stage graph's AR stage max_new_tokens, which
    sizes the pages each job reserves (None: no cap, the single engine)."""
    s = defaults.override(**text_overrides(req), seed=req.seed)
    if cap is not None and s.max_new_tokens > cap:
        raise LayoutError(f"max_new_tokens: {s.max_new_tokens} is above the AR stage's max_new_tokens {cap}, which "
                          f"sizes its pages; ask for at most {cap}, or raise the stage's max_new_tokens",
                          field="max_new_tokens")
    return s


def check_images(images, max_images: int = MAX_INPUT_IMAGES, max_pixels: int = MAX_INPUT_IMAGE_PIXELS) -> None:
    """Input images must be a list of decoded RGB uint8 arrays [H, W, 3], at most `max_images`,
    each at most `max_pixels` pixels. (Decoding files and data URIs, with the byte limit, is the
    front ends' part: `ditkv.entrypoints.images`.)"""
    if images is None:
        return
    if not isinstance(images, (list, tuple)):
        raise LayoutError(f"image: images must be a list of RGB uint8 arrays [H, W, 3], got {type(images).__name__}",
                          field="image")
    if len(images) > max_images:
        raise LayoutError(f"image: {len(images)} input images, above the limit of {max_images} per request",
                          field="image")
    import numpy as np

    for i, a in enumerate(images):
        what = f"image[{i}]" if len(images) > 1 else "image"
        if not isinstance(a, np.ndarray) or a.dtype != np.uint8 or a.ndim != 3 or a.shape[2] != 3:
            got = (f"{a.dtype} array of shape {tuple(a.shape)}" if isinstance(a, np.ndarray) else type(a).__name__)
            raise LayoutError(f"{what}: must be a decoded RGB image, a uint8 array [H, W, 3]; got {got}",
                              field="image")
        h, w = int(a.shape[0]), int(a.shape[1])
        if h < 1 or w < 1:
            raise LayoutError(f"{what}: empty image ({w}x{h} pixels)", field="image")
        if h * w > max_pixels:
            raise LayoutError(f"{what}: {w}x{h} = {h * w} pixels, above the limit of {max_pixels}; downscale it",
                              field="image")


def check_image_support(req, model_config) -> None:
    """A request with input images needs a model that reads them: `max_input_images` on its
    config (0 or absent: text-to-image only) bounds how many."""
    check_input_image_count(len(getattr(req, "images", None) or ()), getattr(model_config, "max_input_images", 0) or 0)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_fits(rows, config, manager) -> None:
    """Refuse a request that can never run, naming the setting that bounds it: max_model_len
    (honoured in both modes; dense mode has no KV manager to check it) and the pool's size (the
    manager's own check would blame max_model_len, which -1 sets to the pool's length). Used by
    the engine and by the DiT stage of a stage graph. Whole rows, never less a prefix-cache hit: a
    hit is not guaranteed (its pages may be evicted before the request is admitted), and a request
    that could run only with one would then wait at the head for good, holding up the queue; the
    hit is credited at admission instead (`Scheduler._first_step_tokens`, the pages `reserve_request`
    allocates)."""
    longest, limit = max(r.seq_len for r in rows), config.max_model_len
    if limit > 0 and longest > limit:
        raise AdmissionError(f"request has a row of {longest} tokens > max_model_len={limit}; shorten the "
                             "prompt, lower the image size or raise max_model_len", field="size")
    if manager is None or len(rows) > manager.max_rows_per_request:
        return  # dense: no pool; too many rows: the manager names diffusion_kv_max_rows_per_request
    need, have = manager.required_blocks(rows), manager.pool.num_blocks
    if need > have:
        raise AdmissionError(
            f"request can never fit the KV pool: required_blocks={need} ({len(rows)} rows of up to {longest} "
            f"tokens, block_size={config.block_size}) > num_kv_blocks={have}; raise num_kv_blocks "
            "(or kv_cache_memory_bytes), or lower the image size or prompt length", field="size")


def check_max_steps(config, model_config) -> None:
    """A max_steps below the model's default step count would refuse every request that leaves
    `steps` out: a startup error rather than a per-request one."""
    default = model_config.default_steps
    if config.max_steps < default:
        raise ConfigError("max_steps", config.max_steps,
                          f"is below the model's default of {default} steps, so a request without 'steps' "
                          f"could never run; raise max_steps to at least {default}")


def snap_request(req, model_config):
    """`req` at the size the model generates: a release model (`image_base_size` set) snaps the
    requested size to its nearest resolution bucket, as the release does (models/hunyuan/buckets.py);
    other models keep the size. The output image has the generated size, so callers can tell."""
    import msgspec

    from ..models.family import family_of

    if getattr(model_config, "image_base_size", None) is None or req.height is None:  # None: size=auto
        return req
    height, width, _ = family_of(model_config).output_bucket(model_config, req.height, req.width)
    if (height, width) == (req.height, req.width):
        return req
    log.info("size %dx%d (width x height) snapped to the release bucket %dx%d", req.width, req.height, width, height)
    return msgspec.structs.replace(req, height=height, width=width)
