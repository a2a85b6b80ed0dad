"""Device placement of stage replicas (CPU-checkable logic only: nothing here touches a GPU)."""

import os

import pytest

from ditkv.stages.placement import replica_devices, stage_gpus
from ditkv.stages.graph import load_stage_graph
from ditkv.errors import ConfigError

EX = os.path.join(os.path.dirname(__file__), "..", "examples", "stages-8gpu.yaml")


def graph(ar=None, dit=None, ar_dev="cuda", dit_dev="cuda", ar_tp=2, dit_tp=2, replicas=2):
    def stage(i, kind, dev, tp, devices, role):
        s = {"stage_id": i, "kind": kind, "replicas": replicas,
             "engine": {"device": dev, "block_size": 16, "tensor_parallel_size": tp},
             "kv_transfer_config": {"kv_connector": "mooncake", "engine_id": kind, "kv_role": role}}
        if kind == "dit":
            s["inputs"] = [0]
            s["engine"].update(diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2)
        if devices is not None:
            s["devices"] = devices
        return s
    return load_stage_graph({"stages": [stage(0, "ar", ar_dev, ar_tp, ar, "kv_producer"),
                                        stage(1, "dit", dit_dev, dit_tp, dit, "kv_consumer")]})


def test_the_8gpu_example_places_issue_9s_topology():
    g = load_stage_graph(EX)
    assert g.ar.engine.tensor_parallel_size == g.dit.engine.tensor_parallel_size == 2
    assert g.ar.replicas == g.dit.replicas == 2 and g.mode == "native"
    assert [replica_devices(g.ar, i) for i in range(2)] == [["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]]
    assert [replica_devices(g.dit, i) for i in range(2)] == [["cuda:4", "cuda:5"], ["cuda:6", "cuda:7"]]


def test_base_device_rule():
    """Replica i of a stage with world size W uses cuda:(base + i*W + rank)."""
    g = graph(ar_dev="cuda:0", dit_dev="cuda:4")
    assert stage_gpus(g.ar) == [0, 1, 2, 3] and stage_gpus(g.dit) == [4, 5, 6, 7]
    assert replica_devices(g.dit, 1) == ["cuda:6", "cuda:7"]


@pytest.mark.parametrize("kw, match", [
    ({"ar": [0, 1, 2]}, "need 4 GPUs"),
    ({"dit": [4, 4, 5, 6]}, "twice"),
    ({"ar": [0, -1, 2, 3]}, "GPU indices"),
])
def test_bad_placements_fail_at_load(kw, match):
    with pytest.raises(ConfigError, match=match):
        graph(**kw)


def test_devices_on_a_cpu_stage_is_an_error():
    with pytest.raises(ConfigError, match="engine.device: cuda"):
        graph(ar=[0, 1, 2, 3], ar_dev="cpu", dit_dev="cpu")


def test_cpu_stages_have_no_gpus():
    g = graph(ar_dev="cpu", dit_dev="cpu")
    assert stage_gpus(g.ar) is None and replica_devices(g.ar, 1) == ["cpu", "cpu"]


@pytest.mark.parametrize("kw, shared", [({"ar": [0, 1, 2, 3], "dit": [3, 4, 5, 6]}, [3]),
                                       ({"ar_dev": "cuda:0", "dit_dev": "cuda:2"}, [2, 3])])
def test_overlapping_placements_load_with_a_paged_dit(kw, shared):
    """A paged DiT's pool is sized to fit next to the AR's (explicitly, or at startup capped by the GPU's
    free memory, engine/sizing.py), so overlapping GPUs load; `shared` are the GPUs both stages use."""
    g = graph(**kw)
    assert sorted(set(stage_gpus(g.ar)) & set(stage_gpus(g.dit))) == shared


def test_stages_share_a_gpu_only_with_a_paged_dit():
    """AR and DiT on one GPU (the one-H200 deployment): fine with a paged DiT, sized or not (an unsized
    pool is capped at startup by what the GPU has free after the AR stage); a dense_legacy DiT, whose
    caches grow per request, is refused."""
    def data(key="kv_transfer_config", **dit):
        return {"stages": [
            {"stage_id": 0, "kind": "ar", "engine": {"device": "cuda:0", "block_size": 16, "num_kv_blocks": 64},
             key: {"kv_connector": "cuda", "engine_id": "ar", "kv_role": "kv_producer"}},
            {"stage_id": 1, "kind": "dit", "inputs": [0],
             "engine": {"device": "cuda:0", "block_size": 16, **dit},
             key: {"kv_connector": "cuda", "engine_id": "dit", "kv_role": "kv_consumer"}}]}
    with pytest.raises(ConfigError, match=r"use the paged DiT"):
        load_stage_graph(data("legacy_kv_transfer", diffusion_kv_mode="dense_legacy"))
    paged = {"diffusion_kv_mode": "paged_scheduler", "diffusion_kv_max_rows_per_request": 2}
    for sized in ({}, {"num_kv_blocks": 256}, {"kv_cache_memory_bytes": 1 << 30}):
        g = load_stage_graph(data(**paged, **sized))
        assert stage_gpus(g.ar) == stage_gpus(g.dit) == [0]
