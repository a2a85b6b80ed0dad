"""What one rank runs, shared by both executors: one whole request, or one step of the batch.

`run_request` installs the metadata snapshot, runs the denoising loop, and clears the request's
rows on every path before reporting (the scheduler frees blocks only after every rank reported).
Ranks of one group vote at each step boundary (all-reduce MAX of GO/STOP/ERROR), so an abort or a
rank-local exception stops every rank at the same step and no rank is left waiting in a collective
the others never enter. `run_batch_step` applies one `BatchStep` (drops, starts, one step), the
ranks agreeing by vote on failed starts and on a failed shared pass.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from .hooks import RankHooks
from .messages import ERROR, GO, STOP, BatchDone, BatchStep, Execute, RankStats, RequestDone
from ..worker.batch import PEER_STEP

log = logging.getLogger("ditkv.worker")
OUTPUT_RANK = 0  # the rank whose image is returned (every rank ends with the same latents)


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


# ---- one request on one rank ----------------------------------------------------------------
def layout_of(worker, msg: Execute):
    """The request's layout, rebuilt on the rank from the message (the engine's is not sent);
    input images travel in the message and reach the model's layout unchanged."""
    from .messages import unpack_images

    images = unpack_images(msg.images)
    if msg.prompt_ids is not None:  # AR-generated text: the ids, not a string
        from ..models.hunyuan.layout import build_request_layout
        from ..worker.worker import FixedPromptTokenizer

        tok = FixedPromptTokenizer(worker.tokenizer, msg.prompt_ids)
        layout = build_request_layout(worker.model.config, tok, "", msg.height, msg.width, msg.guidance,
                                      msg.negative_prompt, images=images)
        worker.runner.local_layout(layout)
        return layout
    if msg.rewrite is not None:  # a think/recaption rewrite: the image row holds the AR stage's text
        from ..models.hunyuan.layout import build_request_layout

        layout = build_request_layout(worker.model.config, worker.tokenizer, msg.prompt, msg.height, msg.width,
                                      msg.guidance, msg.negative_prompt, rewrite=msg.rewrite, images=images)
        worker.runner.local_layout(layout)
        return layout
    if images:
        return worker.layout(msg.prompt, msg.height, msg.width, msg.guidance, msg.negative_prompt, images=images)
    return worker.layout(msg.prompt, msg.height, msg.width, msg.guidance, msg.negative_prompt)


def run_request(worker, msg: Execute, *, rank: int = 0, layout=None, vote=None,
                on_step: Callable[[int], None] | None = None,
                check_stop: Callable[[], bool] | None = None, hooks: RankHooks | None = None,
                dense_import=None) -> RequestDone:
    """Run `msg` on this rank and report; never raises for a request-level failure.

    Each rank calls `vote` exactly once per step boundary while healthy (the start of every
    step, plus a final boundary after decoding) and exactly once more after its own failure,
    which pairs with the peers' next boundary: they learn of the error there and stop too.
    `hooks.at_step_boundary` runs at each boundary before the vote.
    """
    rid = msg.request_id
    vote = vote or (lambda flag: flag)
    st = {"boundary": 0, "agreed": GO, "stopped_at": None, "vote_broken": False}

    def cast(flag: int) -> int:
        try:
            return vote(flag)
        except BaseException:
            st["vote_broken"] = True  # the collective itself failed: voting again would hang
            raise

    def should_stop() -> bool:
        i = st["boundary"]
        st["boundary"] += 1
        if hooks is not None:
            hooks.at_step_boundary(rank, msg, i)
        agreed = cast(STOP if (check_stop is not None and check_stop()) else GO)
        if agreed != GO:
            st["agreed"], st["stopped_at"] = agreed, i
        return agreed != GO

    voted_final = False
    try:
        if layout is None:
            layout = layout_of(worker, msg)
        if msg.metadata is not None:
            worker.install(msg.metadata, request_id=rid)  # another request's snapshot binds nothing
        if callable(dense_import):  # legacy: the rank's heads of its receive slot
            dense_import = dense_import()
        img, rs = worker.execute(rid, layout, msg.steps, msg.guidance, msg.seed, msg.reuse_prefix,
                                 on_step=on_step, should_stop=should_stop, dense_import=dense_import)
        voted_final = True
        if cast(GO) == ERROR:  # a peer failed in the last step or while decoding
            return RequestDone(request_id=rid, rank=rank, status="stopped", stopped_at=msg.steps,
                               error="stopped: a peer rank failed")
        stats = RankStats(steps=rs.steps, prefix_tokens_reused=rs.prefix_tokens_reused,
                          tokens_computed=rs.tokens_computed, imported_tokens=rs.imported_tokens)
        out = rank == OUTPUT_RANK
        return RequestDone(request_id=rid, rank=rank, status="ok", stats=stats,
                           image=img.tobytes() if out else None, image_shape=tuple(img.shape) if out else None)
    except InterruptedError:
        peer = st["agreed"] == ERROR
        return RequestDone(request_id=rid, rank=rank, status="stopped", stopped_at=st["stopped_at"],
                           error="stopped: a peer rank failed" if peer else None)
    except Exception as e:
        log.exception("rank %d: request %s failed", rank, rid)
        if not voted_final and not st["vote_broken"]:
            try:
                cast(ERROR)  # let the peers stop at their next boundary with us
            except Exception:
                log.exception("rank %d: step-boundary vote failed", rank)
        return RequestDone(request_id=rid, rank=rank, status="error", error=f"{type(e).__name__}: {e}")
    finally:
        if msg.metadata is not None:
            worker.remove(rid, msg.metadata.generation)  # rows cleared before the engine frees blocks


# ---- step-level batching on one rank of a group ----------------------------------------------
PEER_START = "stopped: the request failed to start on a peer rank"


def run_batch_step(stepper, msg: BatchStep, *, rank: int = 0, vote=None) -> BatchDone:
    """Apply `msg` on this rank: drops, starts, one step. The ranks agree (two votes) on which starts
    failed and on whether the shared pass failed anywhere, so every rank keeps the same batch and
    enters the same collectives. Never raises for a request-level failure."""
    vote = vote or (lambda flag: flag)
    for rid in msg.drops:
        stepper.drop(rid)
    errors: dict[str, str] = {}
    for ex in msg.starts:
        try:
            stepper.start(ex.request_id, layout_of(stepper.worker, ex), ex.steps, ex.guidance, ex.seed,
                          ex.metadata, ex.reuse_prefix)
        except Exception as e:  # bad input of this request only
            log.warning("rank %d: request %s failed to start: %s", rank, ex.request_id, e)
            errors[ex.request_id] = f"{type(e).__name__}: {e}"
    if msg.starts:
        flags = vote([ERROR if ex.request_id in errors else GO for ex in msg.starts])
        for ex, f in zip(msg.starts, flags):
            if f != GO and ex.request_id not in errors:
                stepper.drop(ex.request_id)
                errors[ex.request_id] = PEER_START
    # a peer's failure is reported as "stopped", so the engine shows the failing rank's own error
    ended = [RequestDone(request_id=rid, rank=rank, status="stopped" if e == PEER_START else "error", error=e)
             for rid, e in errors.items()]
    failed = []

    def any_failed(mine: bool) -> bool:
        failed.append(mine)
        return vote(ERROR if mine else GO) != GO

    out = rank == OUTPUT_RANK
    for o in stepper.step(any_failed=any_failed, decode=out):
        s = o.stats
        stats = None if s is None else RankStats(steps=s.steps, prefix_tokens_reused=s.prefix_tokens_reused,
                                                 tokens_computed=s.tokens_computed, imported_tokens=s.imported_tokens)
        img = o.image
        status = "stopped" if o.status == "error" and o.error == PEER_STEP else o.status
        ended.append(RequestDone(request_id=o.request_id, rank=rank, status=status, error=o.error, stats=stats,
                                 image=img.tobytes() if img is not None else None,
                                 image_shape=tuple(img.shape) if img is not None else None))
    return BatchDone(request_id=msg.request_id, rank=rank, ended=ended,
                     error="the batched step failed on this rank" if any(failed) else None)

