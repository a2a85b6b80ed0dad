"""The engine's side of AR phases (issue 34): this step's AR work to the ranks, their sampled ids
back into each request's `ARText`, and the handover of a finished text to the DiT phase.

The scheduler plans (`core/ar_schedule.py`: chunks, decode tokens, pages, preemption); the ranks
feed and sample (`worker/ar_batch.py`); this module only moves tokens between them and, when a
text ends, builds the DiT rows from it (`ar_plan.ARPlanner`) and tells the scheduler which of the
AR row's pages row 0 adopts.

size=auto: the work that feeds `<boi> <img_size>` draws `<img_ratio_k>` greedily among the allowed ids
(the Instruct release's rule, docs/ar-phase.md "size=auto"), whatever the text's own settings; the
DiT rows are built at bucket k.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import NamedTuple

import msgspec

from ..core.kv_manager import blocks_for
from ..core.layout import RowLayout
from ..models.text_settings import to_wire
from .messages import ARWork

log = logging.getLogger("ditkv.engine")


@dataclass
class ARLive:
    """The engine's record of one request's AR phase (timings for its stats)."""
    start: float  # admitted into its AR phase (the first time)
    arrival: float  # added to the engine: time to first token counts from here, queueing included
    first_token: float | None = None
    end: float | None = None
    prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    revised: str | None = None
    size: tuple[int, int] | None = None  # size=auto: the (width, height) the AR phase chose


class ARExportJob(NamedTuple):
    """The payload's `ar` of an AR stage's pre-planned work (`Engine.add_ar_export`)."""
    images: object  # `HeadImages` of the head's input images, or None


class ExportedKV(NamedTuple):
    """What an AR stage's finished work left: the exported pages and the row's tokens."""
    row: object  # `ExportedRow`: key, block ids, generation
    token_ids: list[int]  # the whole row whose K/V the pages hold, in order
    generated_ids: list[int]  # the text drawn (no eos; a stop id kept)
    chosen: int | None = None  # size=auto: the ratio id drawn after the tail (not fed: the DiT's row holds it)
    stats: dict = {}  # the AR phase's `RequestStats` ar_* fields (prompt and text tokens, TTFT, seconds)


class ARPhases:
    def __init__(self, engine):
        self.engine = engine
        self.live: dict[str, ARLive] = {}
        self.exports: dict[str, ExportedKV] = {}  # finished AR-stage work, until the stage takes it
        self.head_tokens_fed = 0  # AR head tokens sent to the ranks (prefix-cache hits skip theirs): benches

    def works(self, out) -> list[ARWork]:
        """The ranks' part of this step: `ARWork`s of the scheduler's plan, in its order."""
        works = []
        for w in out.ar_work:
            req = w.request
            job = req.payload
            rid = req.request_id
            self.live.setdefault(rid, ARLive(time.monotonic(), req.arrival_time, prompt_tokens=len(req.ar.head)))
            cached = w.row.hit * self.engine.config.block_size
            first = w.plan.start == cached  # the row's first work: it starts after its cached pages
            self.head_tokens_fed += max(0, min(len(req.ar.head), w.plan.start + len(w.plan.token_ids)) - w.plan.start)
            allowed = None if w.plan.allowed is None else list(w.plan.allowed)
            text = job.text if allowed is None else job.text.override(do_sample=False)  # the size: greedily
            images = job.ar.images if first else None
            ids, start = list(w.plan.token_ids), w.plan.start
            if images is not None:  # the whole head from 0, for the ranks' check; they feed it from `cached`
                ids, start = list(req.ar.head[:start]) + ids, 0
            works.append(ARWork(request_id=rid, generation=w.row.generation, block_ids=list(w.row.block_ids),
                                token_ids=ids, start=start, sample=w.plan.sample,
                                sampling=to_wire(text) if w.plan.sample or first else None,
                                images=images, allowed=allowed, cached=cached))
        return works

    def update(self, out, reply) -> None:
        """The ranks ran `out.ar_work`: feed each request its sampled token; hand over finished texts.
        Called under the engine's lock."""
        sched = self.engine.scheduler
        for w in out.ar_work:
            req, rid = w.request, w.request.request_id
            if sched.get(rid) is not req or req.ar is None:
                continue  # ended (aborted) while the step ran
            if rid in reply.failed:
                sched.fail(rid, f"AR phase failed: {reply.failed[rid]}")
                continue
            req.ar.fed(w.plan)
            if req.ar.keys:  # its head's pages written on every rank: they may be shared now
                self.engine.manager.commit_ar(rid, req.ar.computed)
            if w.plan.sample:
                if rid not in reply.ids:
                    sched.fail(rid, "AR phase failed: the ranks returned no token")
                    continue
                req.ar.accept(reply.ids[rid])
                live = self.live[rid]
                if live.first_token is None:
                    live.first_token = time.monotonic()
            if req.ar.done and req.export is not None:
                self._export(req)  # an AR stage's work: its row goes to the ticket
            elif req.ar.done:
                self._hand_over(req)

    def _export(self, req) -> None:
        """An AR stage's work ended: the row's pages that hold its tokens go to its export key (the
        KV-export hook: the mirror of a DiT stage's import), the rest return; the request ends ok."""
        rid, tokens = req.request_id, list(req.ar.tokens)
        live = self.live[rid]
        live.end, live.generated_tokens, live.preemptions = time.monotonic(), len(req.ar.generated), req.ar.preemptions
        try:
            row = self.engine.scheduler.ar_exported(rid, blocks_for(len(tokens), self.engine.config.block_size))
        except Exception as e:  # a bug: this request fails (its AR row returns), the others go on
            log.exception("request %s: the export of its AR row failed", rid)
            self.engine.scheduler.fail(rid, f"{type(e).__name__}: {e}")
            return
        self.exports[rid] = ExportedKV(row, tokens, list(req.ar.generated), req.ar.chosen, _ar_stats(live))

    def _hand_over(self, req) -> None:
        """The text ended: build the DiT rows from it and tell the scheduler what row 0 adopts."""
        eng, rid, job = self.engine, req.request_id, req.payload
        live = self.live[rid]
        live.end, live.generated_tokens, live.preemptions = time.monotonic(), len(req.ar.generated), req.ar.preemptions
        try:
            planner = eng.processor.planner_for(job.request.bot_task)  # the request's template, as at intake
            tokens, request = req.ar.tokens, job.request
            if req.ar.chosen is not None:  # size=auto: the DiT draws the bucket the AR chose
                h, w = planner.chosen_size(job.ar, req.ar.chosen)
                request, live.size = msgspec.structs.replace(request, height=h, width=w), (w, h)
            layout, live.revised = planner.dit_layout(job.ar, request, job.params.guidance, tokens,
                                                      req.ar.generated)
            bs = eng.config.block_size
            computed = planner.imports(layout, tokens, bs, exact=not planner.rewrites)
            computed[1:] = [0] * (len(computed) - 1)  # only row 0 holds the AR's pages
            rows = RowLayout.of(layout)
            computed[0] = handover_cut(computed[0], eng.manager.ar_cached_pages(rid), bs, rows[0].full_attn_spans)
            adopt = min(blocks_for(computed[0], bs), blocks_for(rows[0].seq_len, bs))
            eng.check_layout(layout, request.height, request.width)
            req.payload = job._replace(layout=layout, request=request)
            # the DiT rows' keys: their pages past the AR's enter the cache after the first step
            keys = eng.prefix_keys(layout, job.params.seed) if req.ar.keys else None
            eng.scheduler.ar_finished(rid, rows, tuple(computed), adopt, keys)
        except Exception as e:
            log.info("request %s: its DiT rows after the AR text were refused: %s", rid, e)
            eng.scheduler.fail(rid, f"{type(e).__name__}: {e}")

    def stats_of(self, rid: str) -> dict:
        live = self.live.pop(rid, None)
        if live is None:
            return {}
        return {**_ar_stats(live), "auto_size": None if live.size is None else f"{live.size[0]}x{live.size[1]}",
                "revised_prompt": live.revised}


def handover_cut(computed: int, cached_pages: int, block_size: int, spans) -> int:
    """Row 0's tokens taken from the AR row at the handover, when its first `cached_pages` pages are
    prefix-cache pages (shared, read-only): never ending inside one of them, since the DiT writes from
    there on. Cut back to a page boundary, and before a full-attention span it would split; the DiT
    computes the cut tokens, and they are the AR's bytes (docs/prefix-cache-ar.md), so the image equals
    the cache off. Unchanged where the row's agreement covers the cached pages."""
    if cached_pages * block_size <= computed:
        return computed
    n = computed // block_size
    while n > 0 and any(a < n * block_size < b for a, b in spans):
        n -= 1
    return n * block_size


def _ar_stats(live) -> dict:
    end = live.end or time.monotonic()
    return {"ar_prompt_tokens": live.prompt_tokens, "ar_generated_tokens": live.generated_tokens,
            "ar_time_to_first_token_s": (live.first_token - live.arrival) if live.first_token else 0.0,
            "ar_seconds": end - live.start, "ar_preemptions": live.preemptions}
