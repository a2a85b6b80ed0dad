"""In-process engine: scheduler + one worker, request-level execution.

Python API:
    engine = Engine(EngineConfig(...))
    rid = engine.add_request(GenerationRequest(prompt="a large blue square"))
    outputs = engine.run_until_complete()        # or engine.step() in your own loop
    engine.abort(rid); engine.shutdown()
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable

from ..config import EngineConfig
from ..core.kv_manager import DiffusionKVCacheManager
from ..core.scheduler import RequestStatus, Scheduler
from ..errors import AdmissionError, DitkvError
from ..models.loader import load_model, resolve_device, resolve_dtype
from ..worker.page_pool import bytes_per_block
from ..worker.worker import DiTWorker, resolve_steps_guidance
from .sizing import resolve_num_blocks
from .types import GenerationOutput, GenerationRequest, RequestStats

log = logging.getLogger("ditkv.engine")


class Engine:
    def __init__(self, config: EngineConfig, model_bundle=None,
                 on_step: Callable[[str, int, int], None] | None = None):
        self.config = config
        self.on_step = on_step
        device = resolve_device(config.device)
        bundle = model_bundle or load_model(config.model, device, resolve_dtype(config.dtype, device))
        model = bundle[0]
        self.manager = None
        num_blocks = None
        if config.paged:
            mc = model.config
            bpb = bytes_per_block(mc.num_hidden_layers, mc.num_key_value_heads, config.block_size,
                                  mc.attention_head_dim, model.dtype)
            non_kv = sum(p.numel() * p.element_size() for p in model.parameters())
            num_blocks, why = resolve_num_blocks(config, bpb, device, non_kv)
            max_len = config.max_model_len if config.max_model_len > 0 else num_blocks * config.block_size
            self.manager = DiffusionKVCacheManager(num_blocks, config.block_size,
                                                   config.diffusion_kv_max_rows_per_request, max_len)
            log.info("KV pool: %d blocks x %d tokens, %d bytes (%s)", num_blocks, config.block_size,
                     num_blocks * bpb, why)
        self.worker = DiTWorker(config, num_blocks=num_blocks, model_bundle=bundle)
        self.scheduler = Scheduler(self.manager, max_running=config.max_num_seqs)
        self._ids = itertools.count()
        self._params: dict[str, tuple] = {}
        self._stop: set[str] = set()
        self._outputs: list[GenerationOutput] = []

    @property
    def num_blocks(self) -> int | None:
        return self.manager.pool.num_blocks if self.manager else None

    # ---- intake -------------------------------------------------------------------------
    def add_request(self, req: GenerationRequest) -> str:
        """Validate and queue. Raises a client-safe `DitkvError` (bad input, can never fit)."""
        rid = req.request_id or f"req-{next(self._ids)}"
        steps, guidance = resolve_steps_guidance(self.worker.model.config, req.steps, req.guidance_scale)
        layout = self.worker.layout(req.prompt, req.height, req.width, guidance, req.negative_prompt)
        rows = [_row_layout(i, r) for i, r in enumerate(layout.rows)]
        self.scheduler.add_request(rid, rows, payload=(layout, steps, guidance, req.seed))
        return rid

    def abort(self, request_id: str) -> bool:
        """Cancel a waiting request now, a running one at its next step boundary."""
        req = self.scheduler.get(request_id)
        if req is None:
            return False
        if req.status is RequestStatus.RUNNING:
            self._stop.add(request_id)
            return True
        return self.scheduler.cancel(request_id, "aborted by client")

    # ---- loop ---------------------------------------------------------------------------
    def step(self) -> list[GenerationOutput]:
        out = self.scheduler.schedule()
        self._retire(out.finished)
        for req in out.admitted:
            self._run(req)
        self._retire(self.scheduler.take_finished())
        done, self._outputs = self._outputs, []
        return done

    def _run(self, req) -> None:
        rid = req.request_id
        layout, steps, guidance, seed = req.payload
        t0 = time.monotonic()
        try:
            if req.metadata is not None:
                self.worker.install(req.metadata)
            img, st = self.worker.execute(
                rid, layout, steps, guidance, seed,
                on_step=(lambda i: self.on_step(rid, i, steps)) if self.on_step else None,
                should_stop=lambda: rid in self._stop)
        except InterruptedError:
            self.scheduler.cancel(rid, "aborted by client")
            return
        except Exception as e:  # one request's failure never takes the engine down
            log.exception("request %s failed", rid)
            self.scheduler.finish(rid, error=f"{type(e).__name__}: {e}")
            return
        finally:
            self._stop.discard(rid)
        stats = RequestStats(queue_time_s=req.admit_time - req.arrival_time, run_time_s=time.monotonic() - t0,
                             blocks=req.metadata.num_blocks if req.metadata else 0,
                             prefix_tokens_reused=st.prefix_tokens_reused, tokens_computed=st.tokens_computed,
                             imported_tokens=st.imported_tokens, steps=st.steps)
        self._params[rid] = (img, stats)
        self.scheduler.finish(rid)

    def _retire(self, finished) -> None:
        for f in finished:
            if f.generation is not None:
                self.worker.remove(f.request_id, f.generation)  # clear rows; blocks already back in the pool
            img, stats = self._params.pop(f.request_id, (None, RequestStats()))
            status = {RequestStatus.FINISHED_OK: "ok", RequestStatus.FINISHED_CANCELLED: "cancelled"}.get(
                f.status, "error")
            self._outputs.append(GenerationOutput(request_id=f.request_id, status=status, error=f.error,
                                                  image=img, stats=stats))

    def run_until_complete(self) -> list[GenerationOutput]:
        outs: list[GenerationOutput] = []
        while self.scheduler.has_work():
            outs.extend(self.step())
        outs.extend(self.step())
        return outs

    def generate(self, req: GenerationRequest) -> GenerationOutput:
        rid = self.add_request(req)
        for o in self.run_until_complete():
            if o.request_id == rid:
                return o
        raise DitkvError(f"request {rid} produced no output")

    def shutdown(self) -> list[GenerationOutput]:
        out = self.scheduler.shutdown()
        self._retire(out.finished)
        done, self._outputs = self._outputs, []
        return done

    def stats(self) -> dict:
        s = {"waiting": self.scheduler.num_waiting, "running": self.scheduler.num_running}
        if self.manager:
            s.update(self.manager.stats())
        return s


def _row_layout(i, row):
    from ..core.layout import RowLayout

    return RowLayout(i, row.prefix_len, row.target_len, row.seq_len, tuple(row.full_attn_spans))


__all__ = ["Engine", "GenerationRequest", "GenerationOutput", "AdmissionError"]
