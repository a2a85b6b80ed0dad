"""AsyncEngine: the asyncio front of Engine (one engine thread, futures, cancellation = abort)."""

import asyncio
import threading

import pytest

from ditkv.config import EngineConfig
from ditkv.engine.async_engine import AsyncEngine, EngineClosedError
from ditkv.engine.types import GenerationRequest
from ditkv.errors import ConfigError, DitkvError

PAGED = dict(diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2, num_kv_blocks=64)


def _req(**kw):
    return GenerationRequest(**{"prompt": "a red circle", "height": 32, "width": 32, "steps": 2, **kw})


@pytest.fixture(scope="module")
def engine():
    eng = AsyncEngine(EngineConfig(**PAGED))
    yield eng
    eng.shutdown()


async def _until(pred, timeout=30.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_add_returns_image_and_frees_blocks(engine):
    out = asyncio.run(engine.add(_req()))
    assert out.ok and out.image.shape == (32, 32, 3) and out.stats.blocks > 0
    s = engine.stats()
    assert s["used_blocks"] == 0 and s["free_blocks"] == s["num_blocks"] == 64 and s["alive"]


def test_bad_request_raises_engine_error_and_engine_keeps_serving(engine):
    async def go():
        with pytest.raises(DitkvError, match="height"):
            await engine.add(_req(height=30))
        return await engine.add(_req(steps=1))

    assert asyncio.run(go()).ok


def test_concurrent_adds_from_one_loop(engine):
    async def go():
        return await asyncio.gather(*(engine.add(_req(seed=i)) for i in range(3)))

    outs = asyncio.run(go())
    assert [o.status for o in outs] == ["ok"] * 3
    assert len({o.request_id for o in outs}) == 3


def test_cancelling_the_task_aborts_running_and_waiting_requests(engine):
    async def go():
        running = asyncio.ensure_future(engine.add(_req(steps=200)))
        waiting = asyncio.ensure_future(engine.add(_req(steps=200, seed=1)))
        await _until(lambda: engine.stats()["running"] == 1 and engine.stats()["waiting"] == 1)
        assert engine.stats()["used_blocks"] > 0
        waiting.cancel()
        running.cancel()
        for t in (running, waiting):
            with pytest.raises(asyncio.CancelledError):
                await t
        await _until(lambda: engine.num_in_flight == 0 and engine.stats()["running"] == 0)
        # the engine serves the next request normally
        return await engine.add(_req(steps=1))

    assert asyncio.run(go()).ok
    s = engine.stats()
    assert s["used_blocks"] == 0 and s["waiting"] == 0 and s["free_blocks"] == s["num_blocks"]


def test_adds_from_several_threads_with_their_own_loops(engine):
    results = []

    def worker(i):
        results.append(asyncio.run(engine.add(_req(steps=1, seed=i))).status)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == ["ok", "ok"]


def test_construction_error_surfaces():
    with pytest.raises(ConfigError):
        AsyncEngine(EngineConfig(**PAGED).replace(diffusion_kv_max_rows_per_request=2, model="/nonexistent/dir"))


def test_shutdown_cancels_in_flight_and_refuses_new_work():
    eng = AsyncEngine(EngineConfig(**PAGED))

    async def go():
        running = asyncio.ensure_future(eng.add(_req(steps=200)))
        waiting = asyncio.ensure_future(eng.add(_req(steps=200, seed=1)))
        await _until(lambda: eng.stats()["running"] == 1)
        final = await asyncio.to_thread(eng.shutdown)
        outs = await asyncio.gather(running, waiting)
        with pytest.raises(EngineClosedError):
            await eng.add(_req())
        return final, outs

    final, outs = asyncio.run(go())
    assert [o.status for o in outs] == ["cancelled", "cancelled"]
    assert final["used_blocks"] == 0 and final["free_blocks"] == final["num_blocks"]
    assert not final["alive"] and not eng.accepting
    assert eng.shutdown()["used_blocks"] == 0  # idempotent
