"""How the requests of one batch step ended on a replica, and what its AR pass drew, combined from
every rank's report."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..worker.ar_batch import PEER_PASS, PEER_REFUSED
from ..worker.batch import StepOutcome
from .messages import BatchDone, RankEnd, RankStats

OUTPUT_RANK = 0  # the rank whose image is returned (every rank ends with the same latents)


def rank_end(o: StepOutcome, rank: int, peer_error: str) -> RankEnd:
    """One rank's `StepOutcome` on the wire: a peer's failure (`peer_error`) is "stopped", so the
    replica reports the failing rank's own error."""
    s, img = o.stats, o.image
    stats = None if s is None else RankStats(steps=s.steps, prefix_tokens_reused=s.prefix_tokens_reused,
                                             tokens_computed=s.tokens_computed, imported_tokens=s.imported_tokens,
                                             cached_steps=s.cached_steps, encoder_cache_hits=s.encoder_cache_hits)
    status = "stopped" if o.status == "error" and o.error == peer_error else o.status
    return RankEnd(request_id=o.request_id, rank=rank, status=status, error=o.error, stats=stats,
                   image=img.tobytes() if img is not None else None,
                   image_shape=tuple(img.shape) if img is not None else None)


def combine(done: dict[int, RankEnd], world_size: int) -> StepOutcome:
    """One request's end from every rank's report: the first rank error wins; ranks that only
    stopped for a peer without any rank failing is a protocol error; else the output rank's image."""
    rid = next(iter(done.values())).request_id
    for r in sorted(done):
        d = done[r]
        if d.status == "error":
            return StepOutcome(rid, "error", error=f"rank {r}: {d.error}" if world_size > 1 else d.error)
    if any(d.status != "ok" for d in done.values()):
        ends = {r: done[r].status for r in sorted(done)}
        return StepOutcome(rid, "error", error=f"the ranks did not agree how the request ended: {ends}")
    out = done[OUTPUT_RANK]
    img = None if out.image is None else np.frombuffer(out.image, dtype=np.uint8).reshape(out.image_shape).copy()
    return StepOutcome(rid, "ok", image=img, stats=out.stats)


def step_outcomes(replies: dict[int, BatchDone], world_size: int) -> list[StepOutcome]:
    """The requests that ended in one `BatchStep`, from every rank's `BatchDone`. Raises
    `ValueError` when the ranks disagree on which requests ended (the votes make them agree, so a
    split is a protocol bug)."""
    per_req: dict[str, dict[int, RankEnd]] = {}
    for r, rep in replies.items():
        for d in rep.ended:
            per_req.setdefault(d.request_id, {})[r] = d
    out = []
    for rid, done in per_req.items():
        if len(done) != world_size:
            raise ValueError(f"ranks disagree on the end of request {rid!r}: only ranks {sorted(done)} reported it")
        out.append(combine(done, world_size))
    return out


@dataclass
class ARReply:
    """The AR results of one step."""

    ids: dict[str, int] = field(default_factory=dict)  # request id -> sampled token id (works that drew)
    failed: dict[str, str] = field(default_factory=dict)  # request id -> error (refused, or the pass failed)


def ar_reply(replies: dict[int, BatchDone], works: list, world_size: int) -> ARReply:
    """The step's AR results from every rank's `BatchDone` (`works`: the step's `ARWork`s): the ids of
    the output rank; a work failed on any rank is failed, with the first rank's own error (a peer's
    "stopped" only where no rank gave its own). Raises `ValueError` for a report of another length."""
    out, own = ARReply(), set()  # own: the requests whose error is a rank's own, not a peer's stop
    for r in sorted(replies):
        for rid, err in replies[r].ar_failed:
            if rid not in own and (rid not in out.failed or err not in (PEER_REFUSED, PEER_PASS)):
                out.failed[rid] = f"rank {r}: {err}" if world_size > 1 else err
                if err not in (PEER_REFUSED, PEER_PASS):
                    own.add(rid)
    ids = replies[OUTPUT_RANK].ar_ids if works else []
    if len(ids) != len(works):
        raise ValueError(f"rank {OUTPUT_RANK} reported {len(ids)} AR ids for {len(works)} works")
    for w, tok in zip(works, ids):
        if w.sample and tok >= 0 and w.request_id not in out.failed:
            out.ids[w.request_id] = tok
    return out
