"""Per-request step-cache state: the decision, the stored residuals and their TaylorSeer extrapolation.

One `RequestCache` lives beside each request's `Denoising` (its `cache`) and goes with it: every
terminal path (finish, cancel, failure) calls `release`, exactly where the request's rows are removed.

The decision (cache-dit's rule): after the front blocks, the request's front residual (front output
minus the step's input hidden, over the image tokens of all its CFG rows) is compared with the one of
its last computed step: sum|r_t - r_prev| / sum|r_prev| (the means' common count cancels) below
`residual_threshold` caches the step. Warmup steps, `steps_mask` steps, the first step, a prefill
and the `max_*` limits force a computed step. The sums are per row first, then added in row order,
so CFG-parallel ranks (one row each, all-reduced) decide exactly as one rank holding both.
"""

from __future__ import annotations

import math

import torch

from ..step_cache_config import StepCacheConfig


class Extrapolator:
    """The middle residual over the step index: plain reuse (order 0), or a Newton polynomial through
    the last `order + 1` computed steps (divided differences, so unevenly spaced computed steps are
    exact for polynomials up to `order`). Holds `order + 1` tensors at most."""

    def __init__(self, order: int = 0):
        self.order = order
        self.nodes: list[int] = []  # computed steps, newest first
        self.coefs: list[torch.Tensor] = []  # c0 = R(s0), c1 = R[s0, s1], c2 = R[s0, s1, s2]

    def add(self, step: int, r: torch.Tensor) -> None:
        new = [r]
        for k in range(min(self.order, len(self.coefs))):
            new.append((new[k] - self.coefs[k]) / float(step - self.nodes[k]))
        self.coefs = new
        self.nodes = ([step] + self.nodes)[:self.order + 1]

    def at(self, step: int) -> torch.Tensor:
        out = self.coefs[0]
        weight = 1.0
        for k in range(1, len(self.coefs)):
            weight *= float(step - self.nodes[k - 1])
            out = out + weight * self.coefs[k]
        return out

    @property
    def empty(self) -> bool:
        return not self.coefs

    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.coefs)


class RequestCache:
    """One request's step cache: counters, the last computed front residual, the middle residual."""

    def __init__(self, config: StepCacheConfig, steps: int, num_layers: int):
        config.check_model(num_layers)
        self.config, self.steps = config, steps
        self.num_layers = num_layers
        self.note = config.check_steps(steps)
        self.front_prev: torch.Tensor | None = None  # [R, hw, hidden] of the last computed step
        self.middle = Extrapolator(config.taylorseer or 0)
        self.cached_steps = self.computed_steps = self.run = 0  # run: cached steps in a row
        self.released = False
        self.last_ratio = math.nan  # the last metric (tests, logs)

    @property
    def front_end(self) -> int:
        return self.config.Fn

    @property
    def back_start(self) -> int:
        return self.num_layers - self.config.Bn

    def forced(self, step: int, prefill: bool) -> bool:
        """A step that computes whatever the metric says."""
        c = self.config
        return (prefill or self.front_prev is None or self.middle.empty or step < c.warmup_steps
                or (c.steps_mask is not None and step in c.steps_mask)
                or (c.max_cached_steps is not None and self.cached_steps >= c.max_cached_steps)
                or (c.max_continuous_cached_steps is not None and self.run >= c.max_continuous_cached_steps))

    def sums(self, front: torch.Tensor) -> torch.Tensor:
        """[sum|r_t - r_prev|, sum|r_prev|] fp64 of this rank's rows (`front` [R, hw, hidden]), per row
        then in row order."""
        num = (front - self.front_prev).abs().double().sum(dim=(1, 2))
        den = self.front_prev.abs().double().sum(dim=(1, 2))
        return torch.stack([_ordered_sum(num), _ordered_sum(den)])

    def decide(self, num: float, den: float) -> bool:
        """True: cache this step (metric below the threshold)."""
        self.last_ratio = num / den if den > 0 else math.inf
        return self.last_ratio < self.config.residual_threshold

    def computed(self, step: int, front: torch.Tensor, middle: torch.Tensor) -> None:
        """A computed step's residuals become the reference (front) and the reused part (middle)."""
        self.front_prev = front
        self.middle.add(step, middle)
        self.computed_steps += 1
        self.run = 0

    def cached(self) -> None:
        self.cached_steps += 1
        self.run += 1

    def residual(self, step: int) -> torch.Tensor:
        return self.middle.at(step)

    def nbytes(self) -> int:
        f = 0 if self.front_prev is None else self.front_prev.numel() * self.front_prev.element_size()
        return f + self.middle.nbytes()

    def release(self) -> None:
        """Free the buffers (every terminal path of the request calls this)."""
        self.front_prev = None
        self.middle = Extrapolator(0)
        self.released = True


def _ordered_sum(v: torch.Tensor) -> torch.Tensor:
    out = v[0]
    for x in v[1:]:
        out = out + x
    return out


def new_request_cache(config: StepCacheConfig | None, steps: int, num_layers: int) -> RequestCache | None:
    """The request's cache state, or None without an active cache."""
    if config is None or not config.active:
        return None
    return RequestCache(config, steps, num_layers)
