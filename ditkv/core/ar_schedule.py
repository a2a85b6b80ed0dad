"""The scheduler's AR phases (DESIGN.md "AR and DiT phases in one engine"), as a mixin of `Scheduler`.

A request with AR text (`SchedRequest.ar`, an `ARText`) is admitted into `ar_running` with pages for
its first chunk only. Every tick, oldest first:

1. **Handover.** A request whose text ended and whose DiT rows the engine built (`ar_finished`) gets
   its DiT reservation; row 0 adopts the AR row's agreeing pages (zero-copy: the pages change
   row, never owner), the rest of the AR row returns.
2. **AR work.** Every other AR request gets its next chunk or decode token under the step's token
   budget; its row grows a page at a time (a new generation, the table append-only).
3. **Admission** (`Scheduler.schedule`), only if nothing above stalled.

The DiT phase's pages wait until the AR phase ends (its text and so its rows are unknown before).

**Prefix cache** (docs/prefix-cache-ar.md): a text head's cached pages are the row's first pages at
admission (its first chunk starts after them); its full head pages are committed as they are written,
so a preempted row finds them again; at the handover the DiT rows carry their keys.

**Full pool, no deadlock.** When a request needs pages that are not free, the youngest AR-phase
request younger than it (decoding, prefilling or waiting for its handover) is preempted: its pages
return and it goes back to the head of the waiting queue to be recomputed from its head (the same
text: it is drawn again from the request's seed). DiT-phase requests are never preempted, and no
request is preempted for a younger one. So the oldest AR-phase request can always take every page
but those of DiT-phase requests, which finish without waiting for anything; admission checked that
one request alone (its whole AR row, then its DiT rows) fits the empty pool. A request that still
cannot get its pages waits (it "stalls"), and while one stalls nothing new is admitted.
"""

from __future__ import annotations

import time

import msgspec
from collections import OrderedDict
from dataclasses import dataclass

from ..errors import AdmissionError
from .ar_text import ARWorkPlan
from .kv_manager import ARRow


@dataclass
class ARStepWork:
    """One AR request's part of this step: feed `plan` into `row` (its table as of this step)."""
    request: object  # SchedRequest
    plan: ARWorkPlan
    row: ARRow


class ARPhaseMixin:
    ar_running: OrderedDict  # request id -> SchedRequest, oldest first

    def ar_finished(self, request_id: str, rows, computed: tuple[int, ...], adopt: int, prefix_keys=None) -> None:
        """The engine built the DiT rows of an AR request whose text ended: `computed` tokens per row
        are already in the pages (row 0's first `adopt` AR pages hold them). `prefix_keys`: the DiT rows'
        keys (prefix caching on): rows with nothing in the pages look up, every row commits after its
        first step (docs/prefix-cache-ar.md)."""
        from .layout import validate_rows

        req = self.ar_running[request_id]
        rows = tuple(rows)
        validate_rows(rows)
        self.manager.check_admissible(rows)  # AdmissionError: the rewritten rows can never fit
        req.rows, req.handover, req.adopt = rows, tuple(computed), adopt
        req.prefix_keys = prefix_keys

    def ar_exported(self, request_id: str, keep: int):
        """An AR stage's request whose AR row is complete: its first `keep` pages pass to its export
        key (`ExportedRow`, held until `release_export`), the rest return, and the request ends ok."""
        req = self.ar_running[request_id]
        row = self.manager.export_ar(request_id, req.export, keep, len(req.ar.tokens))
        self._terminate(req, self.FINISHED_OK, None)
        return row

    def _check_ar(self, ar, rows, computed) -> None:
        """An AR request needs the paged pool, no import, and its whole AR row plus its DiT rows in
        the empty pool (the no-deadlock rule in ar_schedule.py); an image head in one step."""
        if self.manager is None:
            raise AdmissionError("AR text needs diffusion_kv_mode=paged_scheduler (the AR phase writes the pool's "
                                 "pages); drop max_new_tokens or use the paged mode", field="max_new_tokens")
        if computed is not None or self.kv_import is not None:
            raise AdmissionError("a request with an AR phase cannot also import its prefix", field="max_new_tokens")
        bs, pool = self.manager.block_size, self.manager.pool.num_blocks
        # the text may lengthen every image row by up to max_new_tokens (a bound, not the exact rows)
        longest = [msgspec.structs.replace(r, seq_len=r.seq_len + ar.max_new_tokens) for r in rows]
        need = -(-ar.max_tokens() // bs) + self.manager.required_blocks(longest)
        if need > pool:
            raise AdmissionError(f"request needs {need} KV pages at most (an AR row of up to {ar.max_tokens()} "
                                 f"tokens, then its image rows) but the pool has {pool}; lower max_new_tokens, "
                                 "the prompt length or the image size, or give the pool more memory",
                                 field="max_new_tokens")
        limit = self.manager.max_model_len
        if limit is not None and ar.max_tokens() > limit:
            raise AdmissionError(f"the AR row can reach {ar.max_tokens()} tokens (prompt + max_new_tokens + the "
                                 f"image tokens' head) > max_model_len={limit}; lower max_new_tokens or shorten the "
                                 "prompt", field="max_new_tokens")
        if ar.whole_head and self.max_batched_tokens is not None and len(ar.head) > self.max_batched_tokens:
            raise AdmissionError(f"the AR prefill of a prompt with images is one chunk of {len(ar.head)} tokens, above "
                                 f"max_num_batched_tokens={self.max_batched_tokens}; raise it", field="image")

    def _ar_tick(self, admitted: list, ended: list) -> bool:
        """Handovers, then the AR work of this step (into `self._ar_work`). Returns whether a
        request stalled for pages (then nothing new is admitted)."""
        self._ar_work: list[ARStepWork] = []
        self._ar_tokens = 0
        self._tick_admitted = admitted
        stalled = False
        for req in list(self.ar_running.values()):
            if req.handover is None or req.request_id not in self.ar_running:
                continue
            if len(self.running) >= self.max_running or not self._fits_batch(req, admitted):
                break
            kw = {} if req.prefix_keys is None else {"prefix_keys": req.prefix_keys, "handover": True}
            meta = self._with_pages(req, ended, lambda r=req, kw=kw: self.manager.reserve_request(
                r.request_id, r.rows, r.handover, adopt=r.adopt, **kw), "handover")
            if meta is None:
                stalled = True
                break
            self.ar_running.pop(req.request_id)
            req.metadata, req.status = meta, self.RUNNING
            if req.prefix_keys is not None:  # the AR row's hit, then the other rows' (row 0's adopted pages are its)
                req.cache_hit_tokens = (req.ar.cache_hit,) + tuple(r.num_cached_tokens for r in meta.rows[1:])
            self.running[req.request_id] = req
            admitted.append(req)
            ended.append(req.request_id)  # the ranks forget its AR state before row 0 takes the pages
        for req in list(self.ar_running.values()):
            if req.request_id in self.ar_running and req.handover is None and not self._plan_ar(req, ended):
                stalled = True
        return stalled

    def _plan_ar(self, req, ended: list) -> bool:
        """Plan `req`'s next work; False when it stalled for pages."""
        plan = req.ar.work(self._budget_left())
        if plan is None:
            return True
        need = req.ar.tokens_after(plan)
        row = self._with_pages(req, ended, lambda: self.manager.grow_ar(req.request_id, need), "ar_row")
        if row is None:
            return False
        self._ar_work.append(ARStepWork(req, plan, row))
        self._ar_tokens += len(plan.token_ids)
        return True

    def _admit_ar(self, req) -> bool:
        """Admit a waiting AR request with pages for its first chunk (False: not now). Its head's cached
        pages (prefix cache) are its first pages, and its first chunk starts after them."""
        hit = self.manager.ar_hit(req.ar.keys, len(req.ar.head))
        if hit:
            req.ar.skip(len(hit) * self.manager.block_size)
        plan = req.ar.work(self._budget_left())
        row = None if plan is None else self.manager.reserve_ar(req.request_id, req.ar.tokens_after(plan),
                                                                req.ar.keys, hit)
        if row is None:
            if hit:
                req.ar.computed = req.ar.cache_hit = 0  # looked up again at the next try
            return False
        self.waiting.pop(req.request_id)
        req.status = self.AR
        if req.admit_time is None:
            req.admit_time = time.monotonic()
        self.ar_running[req.request_id] = req
        self._ar_work.append(ARStepWork(req, plan, row))
        self._ar_tokens += len(plan.token_ids)
        return True

    def _with_pages(self, req, ended: list, take, why: str):
        """`take()`, preempting younger AR requests (youngest first) while it finds no pages. `why`
        counts the preemptions by what needed the pages (`preempted_for`: handover / ar_row)."""
        got = take()
        while got is None:
            victim = self._youngest_after(req)
            if victim is None:
                return None
            self._preempt(victim, ended)
            self.preempted_for[why] = self.preempted_for.get(why, 0) + 1
            got = take()
        return got

    def _youngest_after(self, req):
        ids = list(self.ar_running)
        mine = ids.index(req.request_id) if req.request_id in ids else -1
        younger = ids[mine + 1:]
        return self.ar_running[younger[-1]] if younger else None

    def _preempt(self, victim, ended: list) -> None:
        """Recompute: the pages return, the request goes back to the head of the queue."""
        rid = victim.request_id
        self.ar_running.pop(rid)
        self.manager.free_ar(rid)
        self._ar_work = [w for w in self._ar_work if w.request is not victim]
        victim.ar.restart()
        victim.rows, victim.handover, victim.adopt, victim.prefix_keys = victim.intake_rows, None, 0, None
        victim.status = self.WAITING
        self.waiting[rid] = victim
        self.waiting.move_to_end(rid, last=False)
        ended.append(rid)
        self.num_preempted += 1

    def _budget_left(self) -> int | None:
        if self.max_batched_tokens is None:
            return None
        new = {r.request_id for r in self._tick_admitted}
        used = sum(r.prefill_tokens if rid in new else r.denoise_tokens for rid, r in self.running.items())
        return max(0, self.max_batched_tokens - used - self._ar_tokens)

    @property
    def ar_work(self) -> list[ARStepWork]:
        return self._ar_work
