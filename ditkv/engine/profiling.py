"""Startup memory profile: run one maximum-shape request before admitting traffic.

The profile measures the non-KV peak (weights + activations of the largest admitted request)
so the KV pool can take what is left of `gpu_memory_utilization` x device memory. On CUDA the
peak comes from the caching allocator's statistics; on CPU (no device memory) the analogue is
the process's peak resident set growth during the profile plus the weights, documented in
`ditkv.engine.sizing`. The same envelope is then enforced at admission.
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass

import torch

from ..errors import AdmissionError
from ..models.loader import param_bytes


@dataclass(frozen=True)
class Envelope:
    max_height: int
    max_width: int
    max_prompt_tokens: int

    def check(self, height: int, width: int, prompt_tokens: int) -> None:
        if height > self.max_height or width > self.max_width:
            raise AdmissionError(
                f"size {width}x{height} exceeds the profiled envelope {self.max_width}x{self.max_height}; "
                "request a smaller size or start the engine with larger max_image_height/max_image_width",
                field="size")
        if prompt_tokens > self.max_prompt_tokens:
            raise AdmissionError(
                f"prompt is {prompt_tokens} tokens, above the profiled max_prompt_tokens={self.max_prompt_tokens}; "
                "shorten the prompt or raise max_prompt_tokens", field="prompt")


def default_envelope(config, model_config) -> Envelope:
    """Release-size models: 1024x1024 and 1024-token prompts; pixel-codec (tiny) models: 128x128, 256."""
    ds = model_config.image_token_downsample
    side = 1024 if ds >= 16 else 32 * ds
    prompt = 1024 if ds >= 16 else 256
    return Envelope(config.max_image_height or side, config.max_image_width or side,
                    config.max_prompt_tokens or prompt)


@dataclass(frozen=True)
class ProfileResult:
    non_kv_bytes: int
    profile_kv_bytes: int
    seconds: float
    tokens: int


def _rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def max_shape_layout(model_config, tokenizer, envelope: Envelope):
    """The layout of the envelope's largest request, CFG on."""
    from ..models.family import family_of

    prompt_bytes = "a" * envelope.max_prompt_tokens  # byte-level worst case; BPE tokenizers give <= this
    ids = tokenizer.encode(prompt_bytes)[: envelope.max_prompt_tokens]
    prompt = tokenizer.decode(ids) if len(ids) < len(prompt_bytes) else prompt_bytes
    from .ar_plan import ARPlanner

    family = family_of(model_config)
    # a request may ask for any task (`bot_task`), and under `use_system_prompt: dynamic` each has its own
    # system prompt: the largest row of them all. A think/recaption row holds the AR's rewrite: its
    # tokens count in max_prompt_tokens (an empty one here)
    layouts = []
    for task in family.template.BOT_TASKS:
        plan = ARPlanner(model_config, tokenizer, task)
        kw = {"rewrite": ""} if plan.rewrites else {}
        layouts.append(family.request_layout(model_config, tokenizer, prompt, envelope.max_height, envelope.max_width,
                                             max(2.0, model_config.default_guidance), template=plan.template, **kw))
    return max(layouts, key=lambda lay: sum(r.seq_len for r in lay.rows))


def max_request_tokens(model_config, tokenizer, envelope: Envelope) -> int:
    """Query tokens of the largest admitted request's first step (all rows)."""
    return sum(r.seq_len for r in max_shape_layout(model_config, tokenizer, envelope).rows)


@torch.inference_mode()
def profile_max_shape(runner_dense, model, tokenizer, envelope: Envelope) -> ProfileResult:
    """Run one prefill step of the envelope's largest request (CFG on) on a dense runner.

    A runner with a `ParallelContext` (a sharded model) runs the rank's part: every rank of the
    replica must call this together, since the model's collectives pair up across ranks."""
    from ..models.family import family_of
    from ..worker.rows import PREFILL

    cfg = model.config
    layout = runner_dense.local_layout(max_shape_layout(cfg, tokenizer, envelope))  # a CFG-parallel rank runs only its own row
    dev = model.device
    weights = param_bytes(model)
    t0 = time.monotonic()
    base = 0
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    else:
        base = _rss_peak_bytes()
    cache = runner_dense.new_dense_cache(layout)
    # a request's own initial noise (seed 0): the ranks of a parallel profile feed their shards the same tokens
    x = family_of(cfg).initial_noise(cfg, layout.h, layout.w, 0, dev)
    runner_dense.forward_step("__profile__", layout, x, torch.tensor([1000.0], device=dev), PREFILL, True, cache)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        non_kv = torch.cuda.max_memory_allocated(dev) - cache.nbytes  # weights + activations at peak
    else:
        non_kv = weights + max(0, _rss_peak_bytes() - base - cache.nbytes)
    kv = cache.nbytes
    del cache
    return ProfileResult(int(non_kv), kv, time.monotonic() - t0, sum(r.seq_len for r in layout.rows))


@dataclass(frozen=True)
class ResidualReserve:
    """What the step cache's residual buffers may take, reserved out of the KV pool's budget at startup.

    `stored` is one request's state at most (`step_cache_config.state_bytes`: the front residual and
    `order + 1` middle terms); `working` is what one request holds during a step on top of it (the
    step's new front residual and its hidden after the front blocks); `transient` is the one-at-a-time
    peak of the step (a computed step's new Taylor terms beside the old ones, or the fp64 copy the
    metric takes of a front residual). Total = seqs x (stored + working) + transient."""

    order: int  # the TaylorSeer order reserved for (0 = plain reuse)
    seqs: int  # requests at once (max_num_seqs)
    stored: int
    working: int
    transient: int
    why: str

    @property
    def total(self) -> int:
        return self.seqs * (self.stored + self.working) + self.transient if self.seqs else 0


def requests_may_cache(config) -> bool:
    """Whether this engine admits a request's own `cache_config` (the intake's rule)."""
    from ..errors import ConfigError
    from .step_cache_intake import _check_engine

    try:
        _check_engine(config)
    except ConfigError:
        return False
    return True


def residual_reserve(config, model_config, tokenizer, dtype: torch.dtype) -> ResidualReserve:
    """The worst case over what a request may bring: requests may set their own `cache_config`, so
    TaylorSeer order 2 (`MAX_TAYLORSEER`) at the envelope's largest layout (CFG on) for every one of
    `max_num_seqs`; nothing where no request may cache (an engine that refuses a request's cache
    refuses its own too). The whole layout's rows are counted: a CFG-parallel rank holds fewer, a TP
    or Ulysses rank the whole hidden of each."""
    from ..step_cache_config import MAX_TAYLORSEER, state_bytes

    if not requests_may_cache(config):
        return ResidualReserve(0, 0, 0, 0, 0, "no step cache can run")
    order, why = MAX_TAYLORSEER, f"requests may bring a cache_config: TaylorSeer order {MAX_TAYLORSEER}"
    if tokenizer is None:  # the family's own (the tiny preset's): the prompt changes no image or target count
        from ..models.family import family_of

        tokenizer = family_of(model_config).load_frontend(None)[1]
    layout = max_shape_layout(model_config, tokenizer, default_envelope(config, model_config))
    image = len(layout.rows) * layout.num_image_tokens
    target = sum(r.target_len for r in layout.rows)
    hidden, size = model_config.hidden_size, torch.empty((), dtype=dtype).element_size()
    front, middle = image * hidden * size, target * hidden * size
    transient = max((order + 1) * middle, front * (1 + 8 // size))  # abs() then its fp64 copy
    return ResidualReserve(order, config.max_num_seqs, state_bytes(image, target, hidden, size, order),
                           front + middle, transient, f"{why}, {layout.h}x{layout.w} latents x {len(layout.rows)} rows")


def encoder_reserve(config, model_config, dtype: torch.dtype) -> tuple[int, str]:
    """(bytes, why) the DiT runner's encoder cache may hold (`worker/encoder_cache.py`): its bound in images
    (`encoder_cache_images`, with the prefix cache on) x the largest image's embedding tokens
    (`ModelFamily.input_image_tokens` at the envelope's size) x `hidden_size` in the model dtype."""
    from ..models.family import family_of

    n = config.encoder_cache_bound
    env = default_envelope(config, model_config)
    tokens = family_of(model_config).input_image_tokens(model_config, env.max_height, env.max_width) if n else 0
    size = torch.empty((), dtype=dtype).element_size()
    if not tokens:
        return 0, "no encoder cache" if not n else "the model takes no input images"
    return n * tokens * model_config.hidden_size * size, (f"encoder cache: {n} images x {tokens} tokens x "
                                                          f"{model_config.hidden_size} x {size} bytes")
