"""A step's token budget (`max_num_batched_tokens`) at admission, with a request's expected prefix-cache
hit credited (docs/prefix-cache.md "Lookup and admission"). A mixin of `Scheduler`: it reads the
scheduler's `running`, `manager`, `max_batched_tokens` and `_ar_tokens`."""

from __future__ import annotations

from ..errors import LayoutError


class TokenBudgetMixin:
    def _fits_batch(self, req, admitted: list) -> bool:
        """The step's query tokens stay within `max_batched_tokens` with `req` added: the running
        requests' denoise tokens, the prefill of those admitted this tick (their real metadata) and
        `req`'s first step (`_first_step_tokens`: a hit it will begin with is credited)."""
        if self.max_batched_tokens is None:
            return True
        new = {r.request_id for r in admitted}
        used = sum(r.prefill_tokens if rid in new else r.denoise_tokens for rid, r in self.running.items())
        return used + self._ar_tokens + self._first_step_tokens(req) <= self.max_batched_tokens

    def _first_step_tokens(self, req) -> int:
        """`req.prefill_tokens`; for a request with prefix keys not reserved yet (plain, or an AR->DiT
        handover), without the shared pages its reservation would begin with were it made now
        (`expected_hit_tokens`: the cache's pages, then, plain only, row 0's). The reservation follows
        this check with no pool change between but preemptions, which only add cached pages, and takes
        its hits before it allocates (its own allocations cannot evict them), so it gets at least this
        credit. The check after a plain reservation (`schedule`) rolls back should that ever not hold;
        a handover cannot be rolled back (row 0 adopted the AR row's pages), and needs none."""
        plain = req.handover is None and not req.imports_kv and not req.adopt and req.cache_hit_tokens is None
        handover = req.handover is not None and req.cache_hit_tokens is None
        if self.manager is None or not req.prefix_keys or not (plain or handover):
            return req.prefill_tokens
        try:
            lead = self.manager.expected_hit_tokens(req.rows, req.prefix_keys, req.handover)
        except LayoutError:  # keys that do not fit the rows: no credit; the reservation reports the error
            return req.prefill_tokens
        done = req.handover or (0,) * len(req.rows)
        return sum(r.seq_len - max(c, n) for r, c, n in zip(req.rows, done, lead))
