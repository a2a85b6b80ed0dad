"""Stage placement reaches every replica: the device each rank binds (a pure function, checked
without a GPU), the per-replica plan of the orchestrator, rank processes reporting the device they
bound on CPU stages, and (GPU only) replica 1 of a 2-replica TP=2 stage on cuda:2 / cuda:3."""

import os

import pytest
import torch

from ditkv.engine.executor import ExecutorOptions
from ditkv.stages.orchestrator import Orchestrator
from ditkv.stages.replicas import replica_plan
from ditkv.stages.placement import rank_device, replica_devices
from ditkv.stages.graph import load_stage_graph
from ditkv.engine.types import GenerationRequest
from ditkv.worker.parallel import bind_device

EX = os.path.join(os.path.dirname(__file__), "..", "examples", "stages-8gpu.yaml")


def test_bind_device_takes_the_placement():
    assert bind_device("cuda", 0, 8, ["cuda:2", "cuda:3"]) == "cuda:2"
    assert bind_device("cuda", 1, 8, ["cuda:2", "cuda:3"]) == "cuda:3"
    assert bind_device("cpu", 1, 0, ["cpu", "cpu"]) == "cpu"


def test_bind_device_without_placement_keeps_the_old_rule():
    """The engine path (no stage file): rank % visible GPUs, $LOCAL_RANK, or the given local rank;
    an index in the config's device is ignored there, as before."""
    assert bind_device("cuda:1", 1, 8) == "cuda:1" and bind_device("cuda:1", 3, 2) == "cuda:1"
    assert bind_device("cuda", 0, 8, env_local_rank="5") == "cuda:5"
    assert bind_device("cuda", 0, 8, local_rank=6, env_local_rank="5") == "cuda:6"
    assert bind_device("auto", 1, 0) == "cpu" and bind_device("auto", 1, 4) == "cuda:1"
    assert bind_device("cuda", 1, 4, ["cuda", "cuda"]) == "cuda:1"  # bare cuda in a placement: old rule


def test_every_rank_of_the_8gpu_example_binds_its_placed_gpu():
    g = load_stage_graph(EX)
    for spec, first in ((g.ar, 0), (g.dit, 4)):
        for i in range(spec.replicas):
            devs = replica_devices(spec, i)
            for r in range(2):
                want = f"cuda:{first + 2 * i + r}"
                assert rank_device(spec, i, r) == want
                assert bind_device(spec.engine.device, r, 8, devs) == want  # what the rank process binds


def _graph(ar_replicas=2, ar_tp=1, dit_replicas=2, dit_tp=2, dev="cpu", connector="shm", ar_dev=None):
    return load_stage_graph({"stages": [
        {"stage_id": 0, "kind": "ar", "replicas": ar_replicas,
         "engine": {"model": "tiny", "device": ar_dev or dev, "block_size": 16, "num_kv_blocks": 64,
                    "tensor_parallel_size": ar_tp},
         "kv_transfer_config": {"kv_connector": connector, "engine_id": "ar", "kv_role": "kv_producer"}},
        {"stage_id": 1, "kind": "dit", "inputs": [0], "replicas": dit_replicas,
         "engine": {"model": "tiny", "device": dev, "block_size": 16, "diffusion_kv_mode": "paged_scheduler",
                    "diffusion_kv_max_rows_per_request": 2, "num_kv_blocks": 64, "tensor_parallel_size": dit_tp},
         "kv_transfer_config": {"kv_connector": connector, "engine_id": "dit", "kv_role": "kv_consumer",
                                "transfer_timeout": 30.0}}]})


def test_replica_plan_places_single_and_multi_rank_replicas():
    """Pure: no model, no GPU. Single-rank replica i runs in-process on its own GPU; a multi-rank
    replica's rank devices travel in its executor options."""
    g = _graph(dev="cuda:2", ar_dev="cuda:0", connector="mooncake")
    ar1 = replica_plan(g.ar, 1, None)
    assert ar1["engine"].device == "cuda:1" and not ar1["ranks"] and ar1["options"] is None
    dit1 = replica_plan(g.dit, 1, ExecutorOptions(heartbeat_interval_s=0.5))
    assert dit1["ranks"] and dit1["options"].devices == ["cuda:4", "cuda:5"]
    assert dit1["options"].heartbeat_interval_s == 0.5 and dit1["engine"].device == "cuda:4"
    assert g.dit.engine.device == "cuda:2"  # the stage's own config is left alone


OPTS = ExecutorOptions(heartbeat_interval_s=0.1, heartbeat_timeout_s=10.0, startup_timeout_s=120.0,
                       drain_timeout_s=20.0)


def test_cpu_ranks_report_the_placed_device_and_serve():
    """2 AR replicas (in-process) + 2 DiT replicas x TP=2 (rank processes) on CPU: every rank bound
    the device the placement gave it, the orchestrator loaded no weights for the rank stage, and a
    request per DiT replica completes."""
    orch = Orchestrator(_graph(), None, executor_options=OPTS).start()
    try:
        for i, d in enumerate(orch.dit):
            ex = d.ranks.executor
            assert ex.opts.devices == replica_devices(orch.graph.dit, i) == ["cpu", "cpu"]
            assert ex.rank_devices == ["cpu", "cpu"]
        outs = orch.run([GenerationRequest(prompt="a red circle", height=32, width=32, steps=2,
                                           guidance_scale=2.0, seed=s) for s in range(2)], concurrency=2)
        assert [o.status for o in outs] == ["ok", "ok"], [o.error for o in outs]
        assert all(o.image is not None and o.image.shape[:2] == (32, 32) for o in outs)
    finally:
        orch.shutdown()


def test_rank_stage_without_bundle_loads_no_weights_in_the_orchestrator():
    """AR TP=2 and DiT TP=2 (both stages in rank processes): only config + tokenizer here."""
    import ditkv.stages.replicas as mod

    calls = []
    orig = mod.bundle_on
    mod.bundle_on = lambda *a, **k: calls.append(a) or orig(*a, **k)
    try:
        orch = Orchestrator(_graph(ar_replicas=1, ar_tp=2, dit_replicas=1), None, executor_options=OPTS)
    finally:
        mod.bundle_on = orig
    try:
        assert calls == [] and orch.ar[0].model is None
        assert orch.model_config.num_key_value_heads == 2 and orch.tokenizer is not None
        assert orch.ar[0].ranks.executor.rank_devices == ["cpu", "cpu"]
    finally:
        orch.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four GPUs")
def test_gpu_replica_1_of_a_tp2_stage_binds_cuda_2_and_3():
    from dataclasses import replace

    from ditkv.engine.executor import MultiprocExecutor

    spec = load_stage_graph(EX).ar  # AR replicas x TP=2 on GPUs 0-3: replica 1 is on 2, 3
    devs = replica_devices(spec, 1)
    cfg = replace(spec.engine, num_kv_blocks=16)
    ex = MultiprocExecutor(cfg, None, replace(OPTS, devices=devs))
    try:
        assert ex.rank_devices == ["cuda:2", "cuda:3"]
    finally:
        ex.shutdown()


def test_rank_file_cleanup_covers_the_cuda_notice_socket(tmp_path):
    """A killed rank of a `cuda` stage leaves its notice socket (no shm segment): it is removed."""
    from types import SimpleNamespace

    from ditkv.stages.remote_ranks import remove_rank_files
    from ditkv.transfer.transport import RegionInfo

    sock = tmp_path / "notices.sock"
    sock.write_text("")
    region = RegionInfo("cuda", f"ipc://{sock}", "pool", "123:tok:", 64)
    remove_rank_files([SimpleNamespace(region=region), None])
    assert not sock.exists()
