"""Issue 34 item 3 (the two-stage GPU memory): a region is exported through CUDA IPC only when a
process other than its own may write it. torch keeps an exported allocation alive until a consumer
process releases it, so a pool that no other process ever opened outlived the stage graph (20 GiB
of pools still allocated after shutdown on an H100, tools/gpu_stage_memory.py)."""

import gc

import pytest
import torch

from ditkv.errors import ConfigError
from ditkv.stages.graph import load_stage_graph
from ditkv.transfer.config import transfer_from_stage


def graph(ar_engine=None, remote=None, connector="shm"):  # the flag is the graph's, whatever the connector
    ar = {"stage_id": 0, "kind": "ar", "engine": {"block_size": 16, **(ar_engine or {})},
          "kv_transfer_config": {"kv_connector": connector, "engine_id": "ar", "kv_role": "kv_producer"}}
    if remote:
        ar["remote"] = remote
    return {"stages": [ar, {"stage_id": 1, "kind": "dit", "inputs": [0], "engine": {"block_size": 16},
                            "kv_transfer_config": {"kv_connector": connector, "engine_id": "dit",
                                                   "kv_role": "kv_consumer"}}]}


def test_one_process_graph_exports_nothing():
    g = load_stage_graph(graph())
    assert g.dit.transfer.ipc_export is False
    assert g.ar.transfer.ipc_export is True  # unused: a producer's regions are never exported


@pytest.mark.parametrize("ar_engine, remote", [({"tensor_parallel_size": 2}, None),
                                               (None, {"address": "tcp://127.0.0.1:5999"})])
def test_a_producer_in_another_process_needs_the_export(ar_engine, remote):
    assert load_stage_graph(graph(ar_engine, remote)).dit.transfer.ipc_export is True


def test_ipc_export_is_not_a_yaml_key():
    with pytest.raises(ConfigError, match="unknown transfer key"):
        transfer_from_stage({"kv_transfer_config": {"kv_connector": "cuda", "engine_id": "d",
                                                    "kv_role": "kv_consumer", "ipc_export": False}}, "stages[1]")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_unexported_region_is_freed_with_its_pool():
    from ditkv.transfer.connector import transfer_pool
    from ditkv.transfer.cuda_transport import CudaTransport
    from ditkv.worker.page_pool import PagePool

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    pool = PagePool(64, 2, 2, 16, 64, torch.bfloat16, "cuda")
    ptr = pool.kv.data_ptr()
    transfer_pool(pool, "cuda")
    assert pool.kv.data_ptr() == ptr  # a device pool stays where it is: no second copy
    t = CudaTransport()
    quiet = t.register("pool", pool.kv, export=False)
    assert quiet.handle.split(":", 2)[2] == ""
    loud = CudaTransport()
    other = torch.zeros(1 << 20, device="cuda")
    assert loud.register("other", other).handle.split(":", 2)[2] != ""  # exported: opened across processes
    t.close()
    loud.close()
    del pool, quiet, t
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - base <= other.numel() * 4  # the unexported pool is gone
