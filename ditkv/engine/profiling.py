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
