"""CUDA graphs of a denoise step with step caching: the step captured in three parts.

A cached step skips the middle layers, so one whole-step graph cannot serve it. The step is captured
as a front part (the embedding and layers [0, Fn)), a middle part (layers [Fn, N - Bn)) and a back part
(layers [N - Bn, N) and the velocities), each a `DenoiseStepGraph` of the batch's bucket. Between the
parts the host does what the eager pass (`step_cache_pass.forward_cached`) does with the same helpers:
it reads the front residual and decides per request (one device-to-host read, as eager), gathers the
computing requests' tokens, then stores their residuals or adds the cached ones'.

Bucket keys (`StepGraphs.part`):
- front and back: the whole-step bucket (`batch_key`) and the cuts (Fn, N - Bn);
- middle: the bucket of the requests that compute this step, in the batch's canonical order, with
  their own block-table width, and the cuts: a batch whose requests all compute replays the batch's
  middle; a step where some reuse their residual replays the middle of the others only, so a skipped
  request's layers neither read nor write its target K/V (the eager rule).
A lone request's parts are captured on first sight; a batch's (and a computing subset's) on the second,
as whole steps are. `StepGraphs` keeps at most 3 x `max_captures` parts, least recently used first out.

Every request of the batch with a cache must have the same cuts (requests without a cache compute every
step and fit any cuts); otherwise the step runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cuda_graph import batch_key, batch_width, bucket_key
from .rows import DENOISE
from .step_cache_pass import _Part, _decide, _reuse, _run_subset, _store


@dataclass(frozen=True)
class _Item:
    """What the decision helpers read of a request's step."""

    request_id: str
    layout: object  # RequestLayout
    guidance: float | None
    step: int
    phase: str = DENOISE
    first_step: bool = False


def replay_cached(graphs, states) -> list[torch.Tensor] | None:
    """The denoise step of `states` (every one denoising, some with a step cache) from part graphs ->
    velocity per request in `states` order, or None (run it eagerly)."""
    runner = graphs.runner
    cuts = {(st.cache.front_end, st.cache.back_start) for st in states if st.cache is not None}
    if len(cuts) != 1:
        return None
    cut = cuts.pop()
    order = sorted(range(len(states)), key=lambda j: bucket_key(states[j].layout, 0))
    sts = [states[j] for j in order]
    ids, layouts = [st.request_id for st in sts], [st.layout for st in sts]
    width = batch_width(runner, ids)
    key = (batch_key(layouts, width), cut)
    gs = [st.guidance for st in sts]
    if not graphs.worth_capturing(("front", key), len(sts)):
        return None
    num_layers = runner.model.config.num_hidden_layers
    front = graphs.part("front", key, ids, layouts, width, gs, range(0, cut[0]))
    back = graphs.part("back", key, ids, layouts, width, gs, range(cut[1], num_layers))
    xs, ts = [st.x for st in sts], [st.timestep(runner.device) for st in sts]
    hidden, h = front.replay(xs, ts)
    # graphs share one memory pool, and a middle part captured before this front part may reuse the
    # memory of the front's outputs: `hidden` is read before the middle replays, `h` is kept apart
    h = h.clone()
    parts = _parts(sts, front.inp, runner.device)
    _decide(runner, [p for p in parts if p.cache is not None], h, hidden, front.inp)
    run = [p for p in parts if not p.skip]
    if run:
        h = _middle(graphs, h, front.inp, run, len(parts), width, cut)
    _store(parts, h, cut[1])
    h = _reuse(h, [p for p in parts if p.skip])
    vs = back.replay(xs, ts, h=h)
    out = [None] * len(states)
    for j, v in zip(order, vs):
        out[j] = v
    return out


def _parts(sts, inp, device) -> list[_Part]:
    """Each request's packed token range; in a denoise step all of them are its rows' target tokens."""
    parts, off = [], 0
    for j, (st, shape) in enumerate(zip(sts, inp.shapes)):
        item = _Item(st.request_id, st.layout, st.guidance, st.i)
        parts.append(_Part(j, item, off, off + shape.tokens, torch.arange(off, off + shape.tokens, device=device),
                           st.cache))
        off += shape.tokens
    return parts


def _middle(graphs, h: torch.Tensor, inp, run: list[_Part], total: int, width: int, cut) -> torch.Tensor:
    """The middle layers over the requests in `run` (a graph; eagerly on a batch's first sight)."""
    runner = graphs.runner
    ids = [p.item.request_id for p in run]
    layouts = [p.item.layout for p in run]
    layers = range(cut[0], cut[1])
    everyone = len(run) == total
    sub_width = width if everyone else batch_width(runner, ids)
    key = (batch_key(layouts, sub_width), cut)
    if not graphs.worth_capturing(("middle", key), len(run)):
        return _run_subset(runner, h, inp, run, layers)
    mid = graphs.part("middle", key, ids, layouts, sub_width, [p.item.guidance for p in run], layers)
    if everyone:
        return mid.replay(h=h)  # read (stored, or copied into the back part) before any other replay
    idx = torch.cat([torch.arange(p.lo, p.hi) for p in run]).to(h.device)
    return h.index_copy(0, idx, mid.replay(h=h.index_select(0, idx)))
