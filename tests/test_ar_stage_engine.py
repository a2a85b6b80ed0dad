"""A stage graph's AR stage is the engine's AR phase plus a KV export (stages/ar_side.py): jobs run
batched; a finished job's pages pass to an exported row keyed by its ticket until `release(ticket)`.

Batched equals alone (text and exported K/V, CPU fp32, bit for bit) and equals the serial `ARRunner`;
a cancel mid-text frees the job's pages; a release returns the exported pages; a stale release (an
older generation, another ticket of that id, a repeat) frees nothing; shutdown frees everything."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ditkv.attention.backend import select_backend
from ditkv.core.kv_manager import DiffusionKVCacheManager
from ditkv.errors import LayoutError
from ditkv.models.family import family_of
from ditkv.models.loader import load_model
from ditkv.models.text_settings import TextSampling
from ditkv.stages.ar_side import ARJob, ARReplica
from ditkv.stages.graph import ar_engine_from_dict
from ditkv.transfer.config import NATIVE, TransferConfig
from ditkv.transfer.ticket import TransferTicket
from ditkv.worker.ar_runner import ARRunner
from ditkv.worker.page_pool import PagePool

BS, BLOCKS = 16, 64
PROMPTS = ["a large red circle on a blue field", "two small squares", "a fox in the snow at night"]
SAMPLING = [TextSampling(max_new_tokens=7, temperature=1.0, seed=3),
            TextSampling(max_new_tokens=5, temperature=0.8, top_k=20, top_p=0.9, seed=11),
            TextSampling(max_new_tokens=6)]


@pytest.fixture(scope="module")
def bundle():
    return load_model("tiny", torch.device("cpu"), torch.float32)


def replica(bundle, **kw) -> ARReplica:
    spec = ar_engine_from_dict({**dict(model="tiny", device="cpu", dtype="float32", block_size=BS,
                                       num_kv_blocks=BLOCKS), **kw}, "stages[0].engine")
    return ARReplica(0, spec, TransferConfig(NATIVE, engine_id="ar", kv_role="kv_producer"), bundle)


def job(bundle, i: int, done: dict) -> ARJob:
    cfg, tok = bundle[0].config, bundle[1]
    head = [cfg.bos_token_id] + tok.encode(PROMPTS[i])
    return ARJob(f"r{i}", TransferTicket(f"r{i}", NATIVE), head, [cfg.boi_token_id], SAMPLING[i],
                 lambda j, res, err: done.__setitem__(j.request_id, (j, res, err)))


def kv(pool, table, n: int) -> torch.Tensor:
    pages = pool.kv[list(table)]  # [blocks, layers, 2, heads, bs, dim]
    return pages.permute(1, 2, 3, 0, 4, 5).reshape(*pages.shape[1:4], -1, pages.shape[-1])[..., :n, :].clone()


def run(r: ARReplica, jobs: list[ARJob], done: dict, steps: int = 500) -> None:
    for j in jobs:
        r.submit(j)
    for _ in range(steps):
        r.step()
        if all(j.request_id in done for j in jobs):
            return
    raise AssertionError(f"jobs did not finish: {sorted(done)}")


def exported(r: ARReplica, done: dict, rid: str):
    j, res, err = done[rid]
    assert err is None, err
    src = j.ticket.source
    assert len(src.block_ids) == -(-len(res.token_ids) // BS) and src.num_tokens == len(res.token_ids)
    return res.token_ids, res.generated_ids, kv(r.engine.worker.pool, src.block_ids, len(res.token_ids))


def full(r: ARReplica) -> bool:
    return r.blocks.num_free == r.blocks.num_blocks and r.num_leases == 0


def test_jobs_batched_equal_each_alone_and_the_serial_runner(bundle):
    alone = {}
    for i in range(len(PROMPTS)):
        r, done = replica(bundle), {}
        run(r, [job(bundle, i, done)], done)
        alone[f"r{i}"] = exported(r, done, f"r{i}")
        r.close()
    r, done = replica(bundle), {}
    try:
        run(r, [job(bundle, i, done) for i in range(len(PROMPTS))], done)
        assert max(r.engine.batch_sizes or {0: 0}) == 0  # AR work only: no DiT step ran
        for rid, (ids, gen, k) in alone.items():
            bids, bgen, bk = exported(r, done, rid)
            assert (bids, bgen) == (ids, gen), rid
            assert torch.equal(bk, k), rid
        assert r.stats()["leases"] == 3 and r.num_leases == 3
        for j, _, _ in done.values():
            r.release(j.ticket)
        r.step()
        assert full(r)
    finally:
        r.close()
    # the serial runner of the old AR stage: the same tokens and pages
    model, tok, codec = bundle
    c = model.config
    pool = PagePool(BLOCKS, c.num_hidden_layers, c.num_key_value_heads, BS, c.attention_head_dim, model.dtype,
                    torch.device("cpu"))
    runner = ARRunner(model, select_backend("auto", torch.device("cpu"), paged=True, block_size=BS), pool, codec)
    for i in range(len(PROMPTS)):
        j = job(bundle, i, {})
        res = runner.run(j.request_id, j.head_ids, j.tail_ids, list(range(BLOCKS)), j.sampling, c.eos_token_id,
                         sorted(family_of(c).banned_generation_ids(c)))
        ids, gen, k = alone[j.request_id]
        assert (res.token_ids, res.generated_ids) == (ids, gen)
        assert torch.equal(kv(pool, range(BLOCKS), len(ids)), k)


def test_cancel_mid_text_frees_the_pages_and_the_others_go_on(bundle):
    r, done = replica(bundle), {}
    try:
        a, b = job(bundle, 0, done), job(bundle, 1, done)
        r.submit(a)
        r.submit(b)
        for _ in range(3):  # the heads and a token or two: both rows hold pages
            r.step()
        assert r.engine.scheduler.num_ar == 2 and r.blocks.num_free < r.blocks.num_blocks
        r.cancel("r0")
        for _ in range(100):
            if "r1" in done:
                break
            r.step()
        assert done["r0"][1:] == (None, "cancelled") and a.ticket.source is None
        _, res, err = done["r1"]
        assert err is None and res is not None
        r.release(b.ticket)
        r.step()
        assert full(r)
    finally:
        r.close()


def test_release_returns_the_pages_and_a_stale_release_frees_nothing(bundle):
    r, done = replica(bundle), {}
    try:
        j = job(bundle, 0, done)
        run(r, [j], done)
        held = len(j.ticket.source.block_ids)
        assert r.blocks.num_blocks - r.blocks.num_free == held and r.num_leases == 1
        other = TransferTicket("r0", NATIVE)
        other.ticket_id = j.ticket.ticket_id  # another ticket object of that id: stale
        r.release(other)
        r.step()
        assert r.blocks.num_blocks - r.blocks.num_free == held
        r.release(j.ticket)
        r.step()
        assert full(r)
        r.release(j.ticket)  # repeated: nothing to free twice
        r.step()
        assert full(r)
    finally:
        r.close()


def exported_and_running(bundle):
    """A replica holding r0's exported row while r1 runs its AR phase."""
    r, done = replica(bundle), {}
    run(r, [job(bundle, 0, done)], done)
    r.submit(job(bundle, 1, done))
    r.step()  # r1 runs its AR phase
    return r, done


def test_shutdown_frees_exported_and_running_rows_and_ends_every_job(bundle):
    r, done = exported_and_running(bundle)
    r.submit(job(bundle, 2, done))  # still in the inbox
    r.close()
    assert done["r1"][1:] == (None, "AR stage shut down") and done["r2"][1:] == (None, "AR stage shut down")
    assert full(r)


def test_a_job_that_can_never_fit_fails_at_once(bundle):
    r, done = replica(bundle, num_kv_blocks=2), {}
    try:
        j = job(bundle, 0, done)
        run(r, [j], done)
        _, res, err = done["r0"]
        assert res is None and "KV pages" in err and full(r)
    finally:
        r.close()


def test_the_kv_manager_holds_exported_rows_with_generations():
    m = DiffusionKVCacheManager(10, 4, 1)
    row = m.reserve_ar("a", 10)
    row = m.grow_ar("a", 20)
    assert len(row.block_ids) == 5
    ex = m.export_ar("a", "t1", 3, 10)
    assert ex.block_ids == tuple(row.block_ids[:3]) and ex.generation > row.generation
    assert m.pool.num_free == 7 and m.num_ar_rows == 0 and m.num_exports == 1
    assert not m.release_export("t1", generation=row.generation)  # stale
    assert m.release_export("t1", generation=ex.generation) and m.pool.num_free == 10
    assert not m.release_export("t1")
    with pytest.raises(LayoutError, match="no AR row"):
        m.export_ar("a", "t2", 1, 1)
    m.reserve_ar("b", 4)
    m.export_ar("b", "t3", 1, 4)
    with pytest.raises(LayoutError, match="already held"):
        m.reserve_ar("c", 4) and m.export_ar("c", "t3", 1, 4)
    m.close()
    assert m.pool.num_free == 10 and m.num_exports == 0 and np.all(m.pool.ref_count == 0)


def test_a_failing_job_ends_alone_and_frees_its_pages(bundle):
    """A work the rank refuses (a token outside the vocabulary) fails that job only; the other's text
    and pages are those it has alone."""
    r, done = replica(bundle), {}
    try:
        alone, solo_done = replica(bundle), {}
        run(alone, [job(bundle, 1, solo_done)], solo_done)
        want = exported(alone, solo_done, "r1")
        alone.close()
        bad, good = job(bundle, 0, done), job(bundle, 1, done)
        bad.head_ids = bad.head_ids + [bundle[0].config.vocab_size + 5]
        run(r, [bad, good], done)
        _, res, err = done["r0"]
        assert res is None and "AR phase failed" in err and bad.ticket.source is None
        ids, gen, k = exported(r, done, "r1")
        assert (ids, gen) == want[:2] and torch.equal(k, want[2])
        r.release(good.ticket)
        r.step()
        assert full(r)
    finally:
        r.close()


def test_fail_closed_ends_every_job_and_keeps_exports_until_released(bundle):
    r, done = exported_and_running(bundle)
    r.engine.fail_closed("rank lost")  # what the engine does when its executor fails
    r.step()
    assert r.dead == "rank lost" and r.stats()["dead"]
    assert done["r1"][1] is None and "rank lost" in done["r1"][2]
    late = job(bundle, 2, done)
    r.submit(late)
    r.step()
    assert "failed closed" in done["r2"][2]
    assert r.num_leases == 1  # the producer may still read the exported pages: they wait for release
    r.release(done["r0"][0].ticket)  # r0, exported
    r.step()
    assert full(r)
    r.close()
