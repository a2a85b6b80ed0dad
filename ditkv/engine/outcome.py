"""One request's result on a replica, combined from every rank's report."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .messages import RankStats, RequestDone
from .rank_steps import OUTPUT_RANK


@dataclass
class Outcome:
    status: str  # "ok" | "stopped" | "error"
    error: str | None = None
    image: np.ndarray | None = None
    stats: RankStats | None = None
    stopped_at: int | None = None  # the step boundary where every rank stopped


def combine(done: dict[int, RequestDone], world_size: int) -> Outcome:
    """One outcome from every rank's report: the first rank error wins, then a stop (which every
    rank must report at the same step: the vote makes them agree, so a split is an error), else
    the output rank's image."""
    for r in sorted(done):
        d = done[r]
        if d.status == "error":
            return Outcome("error", f"rank {r}: {d.error}" if world_size > 1 else d.error)
    stopped = {r: d.stopped_at for r, d in sorted(done.items()) if d.status == "stopped"}
    if stopped:
        if len(stopped) != len(done) or len(set(stopped.values())) > 1:
            ends = {r: f"stopped at step {stopped[r]}" if r in stopped else done[r].status for r in sorted(done)}
            return Outcome("error", f"the ranks did not agree where the request ends: {ends}")
        first = done[min(stopped)]
        return Outcome("stopped", first.error, stopped_at=first.stopped_at)
    out = done[OUTPUT_RANK]
    img = np.frombuffer(out.image, dtype=np.uint8).reshape(out.image_shape).copy()
    return Outcome("ok", image=img, stats=out.stats)
