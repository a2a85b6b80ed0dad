"""The batched step with step caching: front blocks for every row, a per-request decision, middle
blocks only for the requests that compute, back blocks for every row.

Requests may bring different Fn / Bn (a request's own `cache_config`), so the layers run in intervals
cut at every request's boundaries; an interval runs over the requests that do not skip it, packed in
batch order (a request's tokens are contiguous in the packed step), with attention metadata over
those requests only: a skipped layer neither reads nor writes the request's target K/V, and prefix
pages are never written in a denoise step. A cached request adds its middle residual (stored at its
last computed step, or its TaylorSeer extrapolation) where its back blocks start.

Every token's value depends on its own request's tokens only (the CPU path computes a row's products
independently of the batch), and each decision reads only its request's tokens, so a request gives
the same bits batched or alone. Under Ulysses each part gathers the whole hidden on every rank, so
the ranks decide on the same numbers; under CFG parallel each rank holds one row and the per-row
sums are all-reduced over the CFG group, so every rank takes the same branch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.adapter import PagedAttentionAdapter
from .parallel import all_reduce
from .rows import PREFILL
from .step_cache import RequestCache
from .step_inputs import embed, velocities


@dataclass
class _Part:
    """One request's share of the cached step."""

    j: int  # its index in the batch
    item: object  # StepItem
    lo: int  # its packed token range [lo, hi)
    hi: int
    target: torch.Tensor  # packed indices of its rows' target tokens (the middle residual's tokens)
    cache: RequestCache | None
    skip: bool = False  # this step reuses the middle residual
    front: torch.Tensor | None = None  # hidden after its front blocks, target tokens (computed steps)
    front_res: torch.Tensor | None = None  # its front residual [R, hw, hidden] (image tokens)


def forward_cached(runner, items) -> tuple[list[torch.Tensor], list[int]]:
    """`DiTRunner.forward_batch` when a request of the batch has a step cache."""
    inp = runner._inputs([(it.layout, runner._spans(it.request_id, it.layout, it.phase, it.first_step), it.guidance,
                           it.cond) for it in items])
    ts = [it.t for it in items]
    hidden = embed(runner.model, inp, [it.x for it in items], ts)
    parts = _parts(runner, items, inp)
    num_layers = runner.model.config.num_hidden_layers
    cuts = {0, num_layers}
    for p in parts:
        if p.cache is not None:
            cuts |= {p.cache.front_end, p.cache.back_start}
    cuts = sorted(cuts)
    full_attn = None
    h = hidden
    for a, b in zip(cuts, cuts[1:] + [None]):
        _decide(runner, [p for p in parts if p.cache is not None and p.cache.front_end == a], h, hidden, inp)
        h = _reuse(h, [p for p in parts if p.skip and p.cache.back_start == a])
        if b is None:  # the last cut: Bn = 0 requests got their residual just now
            break
        run = [p for p in parts if not (p.skip and p.cache.front_end <= a < p.cache.back_start)]
        if len(run) == len(parts):
            if full_attn is None:
                full_attn = _attention(runner, parts)
            h = runner._backbone(h, inp.buf["py"], inp.buf["px"], full_attn, range(a, b))
        elif run:
            h = _run_subset(runner, h, inp, run, range(a, b))
        _store(parts, h, b)
    return velocities(runner.model, h, inp, ts), [s.tokens for s in inp.shapes]


def _parts(runner, items, inp) -> list[_Part]:
    parts, off = [], 0
    for j, (it, shape) in enumerate(zip(items, inp.shapes)):
        spans = runner._spans(it.request_id, it.layout, it.phase, it.first_step)
        idx, row_off = [], off
        for row, (lo, hi) in zip(it.layout.rows, spans):
            start = row_off + row.prefix_len - lo
            idx.append(torch.arange(start, start + row.target_len))
            row_off += hi - lo
        parts.append(_Part(j, it, off, off + shape.tokens, torch.cat(idx).to(runner.device), it.cache))
        off += shape.tokens
    return parts


def _attention(runner, parts: list[_Part]):
    meta = runner.rows.batch_metadata([(p.item.request_id, p.item.phase, not p.item.first_step) for p in parts],
                                      runner.device)
    return PagedAttentionAdapter(runner.backend, runner.pool, meta, runner.scale)


def _decide(runner, parts: list[_Part], h: torch.Tensor, hidden: torch.Tensor, inp) -> None:
    """At the end of these requests' front blocks: keep their front residual and decide compute or reuse.
    Forced steps are known on every rank alike, so every rank enters the same all-reduce."""
    asks = []
    for p in parts:
        img = inp.buf[f"img{p.j}"]  # [R, hw] packed indices of its rows' image tokens
        p.front_res = h[img] - hidden[img]
        p.front = h[p.target]
        if not p.cache.forced(p.item.step, p.item.phase == PREFILL):
            asks.append(p)
    if not asks:
        return
    sums = torch.stack([p.cache.sums(p.front_res) for p in asks])  # [n, 2] fp64
    sums = all_reduce(sums, runner.par.cfg_group, runner.par.cfg_size).tolist()
    for p, (num, den) in zip(asks, sums):
        p.skip = p.cache.decide(num, den)
        if p.skip:
            p.front = None


def _reuse(h: torch.Tensor, parts: list[_Part]) -> torch.Tensor:
    """Cached requests: hidden after the middle = hidden after the front + the (extrapolated) residual."""
    if not parts:
        return h
    h = h.clone()  # earlier parts' views of `h` stay as they were
    for p in parts:
        h[p.target] = h[p.target] + p.cache.residual(p.item.step).to(h.dtype)
        p.cache.cached()
    return h


def _store(parts: list[_Part], h: torch.Tensor, layer_end: int) -> None:
    """Computed requests whose middle blocks end at `layer_end`: keep their residuals."""
    for p in parts:
        if p.cache is not None and not p.skip and p.cache.back_start == layer_end:
            p.cache.computed(p.item.step, p.front_res, h[p.target] - p.front)
            p.front = None


def _run_subset(runner, h: torch.Tensor, inp, run: list[_Part], layers: range) -> torch.Tensor:
    """Layers `layers` over the tokens of the requests in `run` only (packed in batch order)."""
    idx = torch.cat([torch.arange(p.lo, p.hi) for p in run]).to(h.device)
    sub = runner._backbone(h.index_select(0, idx), inp.buf["py"].index_select(0, idx),
                           inp.buf["px"].index_select(0, idx), _attention(runner, run), layers)
    return h.index_copy(0, idx, sub)
