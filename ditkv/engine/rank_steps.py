"""What one rank runs for every executor: one `BatchStep` (drops, AR ends, starts, the AR pass,
one step of the batch).

The ranks of a group agree by vote (all-reduce MAX of GO/ERROR flags) on which starts failed, on
which requests a rank-local check failed at this step boundary, and on whether the shared pass
failed anywhere (the DiT step and the AR pass each), and on which AR works were refused, so every
rank keeps the same batch and enters the same collectives. An abort is a
drop in the next `BatchStep`, which reaches every rank before that step. Rows are cleared on every
path before the rank reports (the scheduler frees blocks only after every rank reported).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..models.family import family_of
from ..worker.batch import PEER_STEP
from .hooks import RankHooks
from .messages import ERROR, GO, BatchDone, BatchStep, NewRequest, RankEnd, ar_head_of
from .outcome import OUTPUT_RANK, rank_end

log = logging.getLogger("ditkv.worker")
PEER_START = "stopped: the request failed to start on a peer rank"
PEER_CHECK = "stopped: the request failed a step-boundary check on a peer rank"


def group_vote() -> Callable:
    """Step-boundary agreement over the default process group (one flag, or a list of flags voted
    element-wise); identity without one."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return lambda flag: flag
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")

    def vote(flag):
        many = isinstance(flag, list)
        t = torch.tensor(flag if many else [flag], dtype=torch.int32, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [int(f) for f in t.tolist()] if many else int(t.item())

    return vote


def _start(stepper, new: NewRequest, legacy) -> None:
    layout = family_of(stepper.worker.model.config).layout_from_wire(new.layout)
    dense = None
    if new.legacy is not None:  # fetched inside `start`: a failure is this request's start error
        if legacy is None:
            raise ValueError(f"request {new.request_id!r} brings a legacy KV import, but this rank hosts no receiver")
        dense = lambda li=new.legacy: legacy(li)  # noqa: E731
    stepper.start(new.request_id, layout, new.params, new.metadata, new.reuse_prefix, dense)


def _agree(stepper, vote, rids: list[str], errors: dict[str, str], peer: str) -> None:
    """Vote on `rids` (ERROR for those in `errors`): a request that failed on a peer rank only is
    dropped here too and ends "stopped" with `peer`."""
    if not rids:
        return
    for rid, f in zip(rids, vote([ERROR if rid in errors else GO for rid in rids])):
        if f != GO and rid not in errors:
            stepper.drop(rid)
            errors[rid] = peer


def _boundary_checks(stepper, hooks: RankHooks, rank: int, vote) -> dict[str, str]:
    """`hooks.at_step_boundary` for every running request (only when the hooks define one, the same
    on every rank, so the vote is entered by all or none)."""
    if type(hooks).at_step_boundary is RankHooks.at_step_boundary:
        return {}
    rids = list(stepper.running)  # the vote pairs flags by position: the same order on every rank
    errors = {}
    for rid in rids:
        try:
            hooks.at_step_boundary(rank, rid, stepper.running[rid].i)
        except Exception as e:
            log.warning("rank %d: request %s failed at step %d: %s", rank, rid, stepper.running[rid].i, e)
            errors[rid] = f"{type(e).__name__}: {e}"
    for rid in errors:
        stepper.drop(rid)
    _agree(stepper, vote, rids, errors, PEER_CHECK)
    return errors


def _pass_vote(vote, failed: list[bool]) -> Callable[[bool], bool]:
    """`any_failed` of a shared pass: records whether it failed here, returns whether it failed anywhere."""
    def any_failed(mine: bool) -> bool:
        failed.append(mine)
        return vote(ERROR if mine else GO) != GO

    return any_failed


def _ar_pass(stepper, msg: BatchStep, vote, failed: list[bool]) -> tuple[list[int], list[tuple[str, str]]]:
    """The step's AR pass (`ARStepper.run`): the refused works and a failed pass voted like the starts
    and the DiT step. Returns `BatchDone`'s `ar_ids` and `ar_failed`."""
    if not msg.ar:
        return [], []

    def agree(refused: list[bool]) -> list[bool]:
        return [f != GO for f in vote([ERROR if r else GO for r in refused])]

    ids, errs = stepper.ar.run(msg.ar, any_failed=_pass_vote(vote, failed), agree=agree, head_of=ar_head_of)
    return ids, list(errs.items())


def run_batch_step(stepper, msg: BatchStep, *, rank: int = 0, vote=None, hooks: RankHooks | None = None,
                   legacy: Callable | None = None) -> BatchDone:
    """Apply `msg` on this rank: drops, AR ends, starts, the AR pass, the step-boundary checks, one
    step. Never raises for a request-level failure. `legacy(LegacyImport)`: the rank's dense import
    from its receive slot."""
    vote = vote or (lambda flag: flag)
    for rid in msg.drops:
        stepper.drop(rid)
        stepper.ar.end(rid)
    for rid in msg.ar_ends:  # before the starts: a DiT row may start on the pages this AR row leaves
        stepper.ar.end(rid)
    errors: dict[str, str] = {}
    for new in msg.starts:
        try:
            _start(stepper, new, legacy)
        except Exception as e:  # bad input of this request only
            log.warning("rank %d: request %s failed to start: %s", rank, new.request_id, e)
            errors[new.request_id] = f"{type(e).__name__}: {e}"
    _agree(stepper, vote, [new.request_id for new in msg.starts], errors, PEER_START)
    failed: list[bool] = []
    ar_ids, ar_failed = _ar_pass(stepper, msg, vote, failed)
    if hooks is not None:
        errors |= _boundary_checks(stepper, hooks, rank, vote)
    peers = (PEER_START, PEER_CHECK)
    ended = [RankEnd(request_id=rid, rank=rank, status="stopped" if e in peers else "error", error=e)
             for rid, e in errors.items()]
    ended += [rank_end(o, rank, PEER_STEP)
              for o in stepper.step(any_failed=_pass_vote(vote, failed), decode=rank == OUTPUT_RANK)]
    return BatchDone(request_id=msg.request_id, rank=rank, ended=ended, ar_ids=ar_ids, ar_failed=ar_failed,
                     error="the batched step failed on this rank" if any(failed) else None)
