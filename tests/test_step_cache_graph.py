"""Step caching with CUDA graphs (`worker/step_cache_graph.py`), the host logic on CPU fp32: the parts
(`DenoiseStepGraph` front / middle / back) run uncaptured from their static buffers, exactly the code a
graph captures, and must give the eager pass's bits, batched and alone, with mixed cached and computed
requests; the bucket keys and the eager fallbacks are what the module says. The captured replay itself is
checked on a GPU (tools/gpu_step_cache_smoke.py)."""

import numpy as np

from ditkv.worker.cuda_graph import StepGraphs
from test_step_cache import INF, bundle, req, run, tiny_engine  # noqa: F401

SAME_CUTS = [  # Fn = 1, Bn = 0 for every request with a cache: one set of parts serves the batch
    {"type": "fbcache", "residual_threshold": INF, "warmup_steps": 1, "steps_mask": [4]},
    {"type": "fbcache", "residual_threshold": INF, "warmup_steps": 3, "max_continuous_cached_steps": 1,
     "taylorseer": 2},
    None,  # no cache: computes every step, fits any cuts
    {"type": "fbcache", "residual_threshold": 0.06, "warmup_steps": 1, "taylorseer": 1},  # the metric decides
]


def parted_engine(bundle, **kw):
    eng = tiny_engine(bundle, **kw)
    eng.worker.runner.step_graphs = StepGraphs(eng.worker.runner, capture=False)
    return eng


def test_parts_equal_the_eager_pass_batched_and_alone(bundle):
    reqs = [req(i, cache_config=c) for i, c in enumerate(SAME_CUTS)]
    eager = run(tiny_engine(bundle), reqs)
    eng = parted_engine(bundle)
    batched = run(eng, reqs)
    graphs = eng.worker.runner.step_graphs
    assert eng.batch_sizes.get(4, 0) == 8
    parts = {k[0] for k in graphs.parts}
    assert parts == {"front", "middle", "back"} and not graphs.graphs
    # the cached requests skip their middle while the others compute: a middle bucket of fewer requests
    assert {len(k[1][0][0]) for k in graphs.parts if k[0] == "middle"} - {4}
    alone = [run(parted_engine(bundle, max_num_seqs=1), [r])[0] for r in reqs]
    for e, b, a in zip(eager, batched, alone):
        assert e.stats.cached_steps == b.stats.cached_steps == a.stats.cached_steps
        assert np.array_equal(e.image, b.image) and np.array_equal(e.image, a.image)
    assert [o.stats.cached_steps for o in batched][:3] == [6, 3, 0]


def test_different_cuts_run_eagerly_and_equal_the_eager_pass(bundle):
    """Requests with different Fn / Bn in one batch: no parts (the step runs eagerly), same bits."""
    reqs = [req(0, cache_config=SAME_CUTS[0]),
            req(1, cache_config={"type": "dbcache", "Fn": 2, "Bn": 1, "residual_threshold": INF, "warmup_steps": 2})]
    eager = run(tiny_engine(bundle), reqs)
    eng = parted_engine(bundle)
    got = run(eng, reqs)
    graphs = eng.worker.runner.step_graphs
    assert eng.batch_sizes.get(2, 0) == 8
    assert all(len(k[1][0][0]) == 1 for k in graphs.parts)  # parts only for steps one request ran alone
    for e, g in zip(eager, got):
        assert np.array_equal(e.image, g.image) and e.stats.cached_steps == g.stats.cached_steps


def test_a_batch_is_captured_on_its_second_sight(bundle):
    graphs = StepGraphs(type("R", (), {"device": None})(), capture=False)
    key = ("front", "k")
    assert graphs.worth_capturing(key, 1)
    assert not graphs.worth_capturing(key, 2) and graphs.worth_capturing(key, 2)
