"""Step caching in a stage graph (issue 35): the DiT stage's `engine.cache_config` runs over imported
prefixes (step 0 starts after the imported tokens), batched requests equal the same requests alone bit for
bit, and a request's own `cache_config` reaches the DiT stage."""

import numpy as np
import pytest
import torch
from stage_helpers import full
from test_stage_batching import graph as batching_graph

from ditkv.engine.types import GenerationRequest
from ditkv.models.loader import load_model
from ditkv.stages.orchestrator import Orchestrator

PROMPTS = ["a large blue square", "a small red circle in the top left", "a green triangle"]
CACHE = {"type": "fbcache", "residual_threshold": "inf", "warmup_steps": 1, "steps_mask": [3]}


@pytest.fixture(scope="module")
def bundle():
    return load_model("tiny", torch.device("cpu"), torch.float32)


def graph(max_num_seqs=1):
    """tests/test_stage_batching.py's AR -> DiT graph over the tiny model, its DiT stage caching."""
    return batching_graph(max_num_seqs, cache_config=CACHE)


def req(i, **kw):
    return GenerationRequest(prompt=PROMPTS[i], request_id=f"r{i}", height=32, width=32, steps=6,
                             guidance_scale=2.0, seed=i, **kw)


def run(max_num_seqs, bundle, reqs):
    orch = Orchestrator(graph(max_num_seqs), bundle)
    try:
        rids = [orch.submit(r) for r in reqs]
        outs = [orch.take(r, timeout=120) for r in rids]
        assert full(orch)
    finally:
        orch.shutdown()
    assert all(o.ok for o in outs), [o.error for o in outs]
    return outs


def test_stage_graph_caches_over_imported_prefixes(bundle):
    reqs = [req(0), req(1, cache_config={"type": "none"}), req(2, cache_config={**CACHE, "steps_mask": [2, 4]})]
    batched = run(3, bundle, reqs)
    alone = [run(1, bundle, [r])[0] for r in reqs]
    assert [o.stats.cached_steps for o in batched] == [4, 0, 3]
    assert all(o.stats.imported_tokens > 0 for o in batched)
    for b, a in zip(batched, alone):
        assert np.array_equal(b.image, a.image) and b.stats.cached_steps == a.stats.cached_steps


def test_a_bad_request_cache_is_refused_at_intake(bundle):
    """Checked against the DiT stage when the request arrives (a 400 naming cache_config), before any AR
    work; nothing is held and the graph goes on."""
    from ditkv.errors import LayoutError

    orch = Orchestrator(graph(), bundle)
    try:
        for bad, words in (({"type": "fbcache", "steps_mask": [9]}, "steps_mask"),
                           ({"type": "dbcache", "Fn": 2, "Bn": 2}, "Fn"), ({"type": "lru"}, "type")):
            with pytest.raises(LayoutError, match=words) as e:
                orch.submit(req(0, cache_config=bad))
            assert e.value.field == "cache_config"
        assert full(orch) and not orch._live
        assert orch.take(orch.submit(req(1)), timeout=120).ok
    finally:
        orch.shutdown()


def test_cache_config_flag_applies_to_the_dit_stage_of_a_stage_file():
    """`--cache-config JSON` with `--config STAGES.yaml` sets the DiT stages' cache, never the AR stage's
    (which has no steps)."""
    import argparse
    from pathlib import Path

    from ditkv.stages.graph import stage_graph_from_args

    stages = Path(__file__).resolve().parents[1] / "examples" / "stages-native.yaml"
    args = argparse.Namespace(config=str(stages), cache_config=dict(CACHE))
    graph = stage_graph_from_args(args, "ditkv serve")
    assert graph.dit.engine.cache_config["type"] == CACHE["type"]
    assert graph.ar.engine.cache_config is None
