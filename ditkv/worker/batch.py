"""The running requests of one rank, advanced together one step per call: the only way a
denoising step runs in the engine (a request alone is a batch of one).

The engine admits requests between steps (`start`), runs one step of every running request
(`step`), and ends requests between steps (`drop`: an abort, or a peer's failure). In paged mode a
new request's prefill rows and the running requests' denoise rows share one backbone pass: the
packed tokens go through every projection and the MoE together, and the paged attention backends
take rows of any phase and length in one call. In dense_legacy mode each request steps over its
own contiguous cache (the engine runs one at a time there).

Requests in an AR phase run in the same step, before it: `ar` (`ar_batch.ARStepper`) keeps their AR
rows and runs one AR pass over the step's AR works.

Isolation: a request whose inputs are bad fails at `start` and never joins the batch; decoding
fails per request. Only an exception inside the shared forward (e.g. out of memory) fails every
request of that step; the stepper is empty and usable afterwards. Rows are removed on every path
(the scheduler frees the blocks only after the engine reported the request ended).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import MetadataError
from ..step_cache_config import parse as parse_cache
from .denoising import Denoising, RunStats

log = logging.getLogger("ditkv.worker")
PEER_STEP = "stopped: the batched step failed on a peer rank"


@dataclass
class StepOutcome:
    """A request that ended in this step: ok (with its image) or error."""

    request_id: str
    status: str  # "ok" | "error"
    image: np.ndarray | None = None
    stats: RunStats | None = None
    error: str | None = None


class BatchStepper:
    def __init__(self, worker):
        self.worker = worker
        self.running: dict[str, Denoising] = {}  # in join order: rows are packed in this order
        self._generation: dict[str, int | None] = {}
        self._ar = None

    @property
    def ar(self):
        """The rank's AR rows and pass (`ar_batch.ARStepper`), made on first use."""
        if self._ar is None:
            from .ar_batch import ARStepper

            self._ar = ARStepper(self.worker)
        return self._ar

    def start(self, request_id: str, layout, params, metadata=None, reuse_prefix: bool = True,
              dense_import=None) -> None:
        """Install the request's rows and make it part of the next step. Raises for bad input,
        with nothing left installed. `params`: its `SamplingParams` (steps, guidance, seed);
        `dense_import`: a dense_legacy request's imported prefix (`DenseImport`, or a zero-argument
        callable that fetches it)."""
        if request_id in self.running:
            raise ValueError(f"request {request_id!r} is already running on this rank")
        w = self.worker
        if metadata is not None:
            self._check_ar_pages(metadata)
            w.install(metadata, request_id)  # refuses another request's snapshot before binding it
        try:
            w.check_rows(request_id, layout)
            if callable(dense_import):  # legacy: the rank's heads of its receive slot
                dense_import = dense_import()
            self.running[request_id] = Denoising(w.runner, request_id, layout, params.steps, params.guidance,
                                                 params.seed, reuse_prefix, dense_import, request_cache(params))
        except BaseException:
            if metadata is not None:
                w.remove(request_id, metadata.generation)
            raise
        self._generation[request_id] = metadata.generation if metadata is not None else None

    def _check_ar_pages(self, metadata) -> None:
        """A DiT row never takes a page an AR row still writes (at the handover the AR row ends first)."""
        if self._ar is None or not self._ar.rows:
            return
        taken, held, bs = self._ar.blocks_in_use(), self._ar.pages_held(), metadata.block_size
        # a DiT row's shared (prefix-cache) pages may be an AR row's written pages; its own pages never are
        clash = sorted({b for row in metadata.rows for j, b in enumerate(row.block_ids)
                        if b in (taken if j < row.num_cached_tokens // bs else held)})
        if clash:
            raise MetadataError(f"request {metadata.request_id!r}: block ids {clash[:4]} belong to an AR row still "
                                "running on this rank; end its AR phase (end_ar) before its pages join a DiT row")

    def drop(self, request_id: str) -> bool:
        """End a running request between steps (cancel); clears its rows."""
        st = self.running.pop(request_id, None)
        if st is None:
            return False
        st.release()
        self.worker.remove(request_id, self._generation.pop(request_id))
        return True

    @property
    def batch_size(self) -> int:
        return len(self.running)

    @torch.inference_mode()
    def step(self, any_failed: Callable[[bool], bool] | None = None, decode: bool = True) -> list[StepOutcome]:
        """One denoising step of every running request; returns those that ended in it.

        `any_failed` (rank groups): told whether the shared pass failed on this rank, returns whether
        it failed on any rank, so every rank ends the same requests. `decode=False` (ranks other than
        the output rank): finished requests end "ok" without an image."""
        if not self.running:
            return []
        states = list(self.running.values())
        runner = self.worker.runner
        err = None
        try:
            velocities, tokens = runner.step(states)
        except Exception as e:  # the shared pass failed: no request of it can continue
            log.exception("batched step over %d requests failed", len(states))
            err = f"{type(e).__name__}: {e}"
        if any_failed is not None and any_failed(err is not None) and err is None:
            err = PEER_STEP
        if err is not None:
            return [self._end(st.request_id, StepOutcome(st.request_id, "error", error=err)) for st in states]
        done = []
        for st, v, n in zip(states, velocities, tokens):
            st.advance(v, n)
            if st.i == 1 and self.worker.rows is not None:  # its prefix pages are written: read-only now
                self.worker.rows.seal(st.request_id)
            if st.done:
                try:
                    img = self.worker.to_image(st.x) if decode else None
                    out = StepOutcome(st.request_id, "ok", image=img, stats=st.stats)
                except Exception as e:
                    log.exception("decoding request %s failed", st.request_id)
                    out = StepOutcome(st.request_id, "error", error=f"{type(e).__name__}: {e}")
                done.append(self._end(st.request_id, out))
        return done

    def _end(self, request_id: str, outcome: StepOutcome) -> StepOutcome:
        st = self.running.pop(request_id, None)
        if st is not None:
            st.release()
        self.worker.remove(request_id, self._generation.pop(request_id, None))
        return outcome


def request_cache(params):
    """A request's own `cache_config` from its `SamplingParams` (None: the engine's)."""
    own = getattr(params, "cache", None)
    return None if own is None else parse_cache(own)
