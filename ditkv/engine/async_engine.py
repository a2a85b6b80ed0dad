"""asyncio front of `Engine`: one background thread owns the engine, coroutines await results.

    engine = AsyncEngine(EngineConfig(...))          # loads the model (blocking)
    out = await engine.add(GenerationRequest(...))   # GenerationOutput; DitkvError for bad requests
    task.cancel()                                    # cancelling the awaiting task aborts the request
    engine.shutdown()                                # cancel what is left, free every block, join

Why a thread and a command queue: the engine (scheduler, block pool, worker) is not thread-safe
and `step()` can run a whole request for seconds. Every engine call therefore happens on the
engine thread; coroutines only enqueue commands and await futures that the thread resolves
with `loop.call_soon_threadsafe`. While a request runs, the engine's `on_step` callback (called
between denoising steps, with no engine lock held) drains the queue, so new requests queue and
an abort of the running request takes effect at the next step boundary.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from ..config import EngineConfig
from .service import AsyncService, EngineClosedError
from .types import GenerationRequest

log = logging.getLogger("ditkv.async_engine")

__all__ = ["AsyncEngine", "EngineClosedError"]


class AsyncEngine(AsyncService):
    def __init__(self, config: EngineConfig, model_bundle=None, engine_factory=None):
        super().__init__()
        self.config = config
        self.info = {"mode": config.diffusion_kv_mode}
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._stopping = False  # engine thread only
        self._snapshot: dict = {"waiting": 0, "running": 0, "alive": False}
        self._ready = threading.Event()
        self._error: BaseException | None = None
        factory = engine_factory or _default_factory
        self._thread = threading.Thread(target=self._main, args=(factory, config, model_bundle),
                                        name="ditkv-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:  # construction failed: surface the engine's own error
            raise self._error

    # ---- public API (any thread / the event loop); add() is AsyncService's ------------------
    def _submit(self, req: GenerationRequest) -> None:
        self._cmds.put(("add", req))  # validated on the engine thread; errors resolve the future

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))

    def abort_all(self) -> None:
        """Cancel every queued and running request; their `add` calls return status 'cancelled'."""
        self._cmds.put(("abort_all",))

    def stats(self) -> dict:
        """Latest engine stats (waiting, running, KV blocks...) plus `alive` and `in_flight`;
        published by the engine thread, so reading never blocks on a running request."""
        return dict(self._snapshot, in_flight=self.num_in_flight, accepting=self.accepting)

    def shutdown(self, drain_timeout: float = 0.0) -> dict:
        """Stop accepting; give in-flight requests up to `drain_timeout` s to finish; cancel the
        rest; free every block; join the thread. Blocking and idempotent; returns final stats."""
        self._accepting = False
        self._wait_in_flight(drain_timeout)
        if self._thread.is_alive():
            self._cmds.put(("stop",))
            self._thread.join()
        return self.stats()

    # ---- engine thread ------------------------------------------------------------------
    def _main(self, factory, config, bundle) -> None:
        try:
            self._engine = factory(config, bundle, self._on_step)
            self._alive = True
            self._publish()
        except BaseException as e:  # noqa: BLE001 - re-raised in __init__
            self._error = e
            return
        finally:
            self._ready.set()
        try:
            self._loop()
        except Exception as e:  # an engine bug: fail every waiter instead of hanging them
            log.exception("engine thread failed")
            self._alive = False
            self._futures.fail_all(EngineClosedError(f"engine failed: {type(e).__name__}: {e}"))
        finally:
            self._alive = False
            self._accepting = False
            self._finish()

    def _loop(self) -> None:
        eng = self._engine
        while not self._stopping:
            handled = self._drain(block=not eng.scheduler.has_work())
            if self._stopping:
                break
            if handled or eng.scheduler.has_work():
                t0 = time.monotonic()
                outs = eng.step()
                self._publish()  # before waking waiters: they may read stats() right away
                self._deliver(outs)
                if not outs and time.monotonic() - t0 < 1e-3:
                    self._drain(block=True, timeout=0.005)  # nothing admissible yet: don't spin
            self._publish()

    def _drain(self, block: bool, timeout: float | None = None) -> int:
        """Run queued commands (blocking for the first one if `block`); returns how many ran."""
        n = 0
        while not self._stopping:
            try:
                cmd = self._cmds.get(block=block and n == 0, timeout=timeout if block else None)
            except queue.Empty:
                break
            self._run_cmd(cmd)
            n += 1
        return n

    def _run_cmd(self, cmd) -> None:
        kind = cmd[0]
        if kind == "add":
            req = cmd[1]
            try:
                self._engine.add_request(req)
            except Exception as e:  # bad/impossible request: the caller gets the engine's error
                if getattr(self._engine, "failed", None) is not None:
                    e = EngineClosedError(f"engine failed: {self._engine.failed}")
                self._futures.resolve(req.request_id, exc=e)
        elif kind == "abort":
            self._engine.abort(cmd[1])
        elif kind == "abort_all":
            for rid in self._futures.rids():
                self._engine.abort(rid)
        elif kind == "stop":
            self._stopping = True

    def _on_step(self, rid: str, i: int, total: int) -> None:
        """Engine callback between denoising steps of request `rid`. The engine holds no lock while
        a request runs, so commands run now: new requests queue (or fail validation) at once, and
        an abort of `rid` takes effect at the next step boundary."""
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            self._run_cmd(cmd)
        if self._stopping:
            self._engine.abort(rid)
        self._publish()

    def _deliver(self, outs) -> None:
        for out in outs:
            self._futures.resolve(out.request_id, out=out)

    def _finish(self) -> None:
        """Shutdown path on the engine thread: cancel everything, free every block."""
        try:
            outs = self._engine.shutdown()
            self._publish()
            self._deliver(outs)
        except Exception:
            log.exception("engine shutdown failed")
        # requests that never reached the engine (still queued as commands) end cancelled too
        self._futures.cancel_all("engine shut down before the request finished")
        try:
            self._publish()
        except Exception:
            log.exception("final engine stats failed")

    def _publish(self) -> None:
        s = dict(self._engine.stats())
        if s.get("failed"):  # the engine failed closed (e.g. a worker rank died): refuse new work
            self._alive = False
        s["alive"] = self._alive
        self._snapshot = s


def _default_factory(config, bundle, on_step):
    from .engine import Engine

    return Engine(config, model_bundle=bundle, on_step=on_step)
