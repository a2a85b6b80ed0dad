"""Issue 25 item 6: the seed's reference topology in software, on CPU ranks (gloo).

`examples/stages-reference-cpu.yaml`: one AR replica with TP=2 and a byte budget, one DiT replica
with TP=2, expert parallel and a byte budget. The file loads, both pools are sized from their
budgets (blocks per rank = budget // one block of the rank's KV heads, checked against the pools the
rank processes allocated), and a request's image equals the one from the same graph without EP.
The ranks load their own shards of the bundled tiny checkpoint (the CLI's path: no model bundle).
"""

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml

from rank_hooks import RankTestHooks
from stage_helpers import full, no_segments, req, wait_for
from ditkv.config import EngineConfig
from ditkv.engine.frontend import load_frontend
from ditkv.engine.options import ExecutorOptions
from ditkv.errors import ConfigError
from ditkv.stages.graph import load_stage_graph
from ditkv.stages.orchestrator import Orchestrator

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CPU_FILE = EXAMPLES / "stages-reference-cpu.yaml"
GPU_FILE = EXAMPLES / "stages-reference.yaml"


def block_bytes(heads_per_rank: int, block_size: int, itemsize: int) -> int:
    """One block of one rank's pool, from the tiny model's config: layers x (K, V) x heads x tokens x dim."""
    mc = load_frontend(EngineConfig(model="tiny"), None)[0]
    return mc.num_hidden_layers * 2 * heads_per_rank * block_size * mc.attention_head_dim * itemsize


def reference_data() -> dict:
    with open(CPU_FILE) as f:
        return yaml.safe_load(f)


@dataclass
class RecordParallel(RankTestHooks):
    """Every rank writes its parallel layout (tp / ep size and rank) into `folder`, as `<stage>-<rank>.json`."""

    folder: str = ""

    def init_group(self, config, rank, world_size, init_method, options):
        ctx = super().init_group(config, rank, world_size, init_method, options)
        stage = "ar" if options.rank_service is not None else "dit"  # AR ranks host the AR runner service
        with open(os.path.join(self.folder, f"{stage}-{rank}.json"), "w") as f:
            json.dump({"tp_size": ctx.tp_size, "ep_size": ctx.ep_size, "ep_rank": ctx.ep_rank}, f)
        return ctx


def options(folder) -> ExecutorOptions:
    return ExecutorOptions(heartbeat_interval_s=0.1, heartbeat_timeout_s=20.0, startup_timeout_s=180.0,
                           drain_timeout_s=20.0, hooks=RecordParallel(folder=str(folder)))


def layouts(folder) -> dict:
    return {p.stem: json.loads(p.read_text()) for p in sorted(Path(folder).glob("*.json"))}


def test_the_reference_file_loads_with_ep_and_sizes_both_pools_from_their_budgets():
    g = load_stage_graph(CPU_FILE)
    ar, dit = g.ar.engine, g.dit.engine
    assert (g.ar.replicas, g.dit.replicas) == (1, 1)
    assert ar.tensor_parallel_size == dit.tensor_parallel_size == 2 and dit.enable_expert_parallel
    # fp32 on CPU, block 16, 1 of the tiny model's 2 KV heads per rank: 16 KiB per block
    per_block = block_bytes(1, 16, 4)
    assert per_block == 16384
    assert ar.kv_cache_memory_bytes == 2 << 20 and ar.num_kv_blocks == (2 << 20) // per_block == 128
    assert dit.kv_cache_memory_bytes == 1 << 20 and dit.num_kv_blocks == (1 << 20) // per_block == 64


def test_the_gpu_reference_file_sizes_on_a_host_without_its_gpus():
    """Per rank, bf16 and block 64: 32 KiB per tiny block; 2 GiB and 1 GiB -> 65536 and 32768 blocks."""
    g = load_stage_graph(GPU_FILE)
    per_block = block_bytes(1, 64, 2)
    assert g.dit.engine.enable_expert_parallel and g.ar.devices == [0, 1] and g.dit.devices == [2, 3]
    assert g.ar.engine.num_kv_blocks == (2 << 30) // per_block == 65536
    assert g.dit.engine.num_kv_blocks == (1 << 30) // per_block == 32768


def run_reference(data, folder, reqs):
    """Serve `reqs` on the graph of `data`; returns the outputs, the pools and the ranks' layouts."""
    orch = Orchestrator(load_stage_graph(data), executor_options=options(folder)).start()
    try:
        a, d = orch.ar[0], orch.dit[0]
        pools = {"ar": (a.blocks.num_blocks, [s.region.nbytes for s in a.ranks.sources]),
                 "dit": (d.manager.pool.num_blocks, [c.dest.region.nbytes for c in d.consumers]),
                 "dit_heads": [(c.head_lo, c.head_hi) for c in d.consumers]}
        outs = orch.run(reqs, concurrency=len(reqs))
        assert all(o.ok for o in outs), [o.error for o in outs]
        assert wait_for(lambda: full(orch))
        snap = orch.transfers.snapshot()
        assert snap["transfers"] == len(reqs) and snap["failures"] == 0
    finally:
        orch.shutdown()
    assert full(orch) and no_segments(orch)
    return outs, pools, layouts(folder)


def test_the_reference_topology_serves_the_image_of_the_graph_without_ep(tmp_path):
    reqs = [req(0), req(1, "a small blue square in the top left corner", 3.0)]
    without = reference_data()
    del without["stages"][1]["engine"]["enable_expert_parallel"]
    (tmp_path / "ep").mkdir()
    (tmp_path / "tp").mkdir()
    outs, pools, ranks = run_reference(reference_data(), tmp_path / "ep", reqs)
    ref, ref_pools, ref_ranks = run_reference(without, tmp_path / "tp", reqs)

    # both pools hold what their budgets buy, on every rank: blocks x one block of the rank's KV heads
    per_block = block_bytes(1, 16, 4)
    assert pools["ar"] == ((2 << 20) // per_block, [128 * per_block] * 2) == (128, [2 << 20] * 2)
    assert pools["dit"] == ((1 << 20) // per_block, [64 * per_block] * 2) == (64, [1 << 20] * 2)
    assert pools["dit_heads"] == [(0, 1), (1, 2)]  # EP splits experts, not KV heads
    assert ref_pools == pools
    # expert parallel is on in the DiT ranks (the whole replica: ep = tp = 2), nowhere else
    no_ep = {"tp_size": 2, "ep_size": 1, "ep_rank": 0}
    assert ranks == {"ar-0": no_ep, "ar-1": no_ep, "dit-0": {"tp_size": 2, "ep_size": 2, "ep_rank": 0},
                     "dit-1": {"tp_size": 2, "ep_size": 2, "ep_rank": 1}}
    assert ref_ranks["dit-0"]["ep_size"] == ref_ranks["dit-1"]["ep_size"] == 1
    diffs = [int(np.abs(o.image.astype(int) - r.image.astype(int)).max()) for o, r in zip(outs, ref)]
    print("max pixel difference, EP vs TP only, per request:", diffs)
    # EP computes each expert whole on one rank where TP sums two halves of it: another fp32
    # summation order, so the bound is the TP tests' one pixel level (measured: identical images)
    assert max(diffs) <= 1
    for o, r in zip(outs, ref):
        assert o.image.std() > 0  # a drawn image, not a blank one
        assert o.stats.imported_tokens == r.stats.imported_tokens > 0
        assert o.stats.tokens_computed == r.stats.tokens_computed


def edited(ar=None, dit=None, drop=()):
    """The reference file with engine fields changed (`drop`: (stage, key) pairs removed)."""
    data = reference_data()
    for i, changes in enumerate((ar or {}, dit or {})):
        data["stages"][i]["engine"].update(changes)
    for i, key in drop:
        del data["stages"][i]["engine"][key]
    return data


@pytest.mark.parametrize("data, field, match", [
    (edited(ar={"num_kv_blocks": 64}), "stages[0].engine.kv_cache_memory_bytes", "set one of num_kv_blocks"),
    (edited(dit={"kv_cache_memory_bytes": 1000}), "stages[1].engine.kv_cache_memory_bytes",
     "one block needs 16384 bytes"),
    (edited(ar={"kv_cache_memory_bytes": -1}), "stages[0].engine.kv_cache_memory_bytes", "positive integer"),
    (edited(ar={"kv_cache_memory_bytes": "2GiB"}), "stages[0].engine.kv_cache_memory_bytes", "positive integer"),
    (edited(dit={"kv_cache_memory_bytes": 1 << 60}), "stages[1].engine.kv_cache_memory_bytes",
     "lower kv_cache_memory_bytes"),
    (edited(dit={"tensor_parallel_size": 1}), "stages[1].engine.enable_expert_parallel", "tensor_parallel_size"),
    (edited(ar={"model": "/nonexistent/model"}, dit={"model": "/nonexistent/model"}), "stages[0].engine.model",
     "folder"),
    (edited(ar={"device": "tpu"}, dit={"device": "tpu"}), "stages[0].engine.device", "not a device name"),
], ids=["both-sizes", "below-one-block", "negative", "string", "beyond-memory", "ep-one-rank",
        "no-model", "bad-device"])
def test_bad_pool_sizes_and_ep_name_the_field_and_the_fix(data, field, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_stage_graph(data)
    assert e.value.field == field


def test_an_unsized_paged_dit_stage_sizes_its_pool_at_startup_as_a_single_engine_does():
    """Neither num_kv_blocks nor a byte budget: the DiT's engine plans its pool when it starts
    (gpu_memory_utilization of the device's memory minus the weights and the profiled peak; on CPU the
    device is the host-memory analogue, sizing.CPU_MEMORY_ANALOGUE_BYTES), and the graph serves."""
    from ditkv.engine.sizing import CPU_MEMORY_ANALOGUE_BYTES
    from ditkv.models.loader import param_bytes

    data = {"stages": [
        {"stage_id": 0, "kind": "ar", "engine": {"model": "tiny", "device": "cpu", "block_size": 16,
                                                 "num_kv_blocks": 64},
         "kv_transfer_config": {"kv_connector": "shm", "engine_id": "ar", "kv_role": "kv_producer"}},
        {"stage_id": 1, "kind": "dit", "inputs": [0],
         "engine": {"model": "tiny", "device": "cpu", "block_size": 16, "diffusion_kv_mode": "paged_scheduler",
                    "diffusion_kv_max_rows_per_request": 2, "gpu_memory_utilization": 0.5},
         "kv_transfer_config": {"kv_connector": "shm", "engine_id": "dit", "kv_role": "kv_consumer"}}]}
    g = load_stage_graph(data)
    assert g.dit.engine.num_kv_blocks is None and g.dit.engine.kv_cache_memory_bytes is None
    orch = Orchestrator(g)
    try:
        d = orch.dit[0]
        n = d.manager.pool.num_blocks
        model = d.worker.model
        assert n * d.worker.bytes_per_block() <= 0.5 * CPU_MEMORY_ANALOGUE_BYTES - param_bytes(model)
        assert n >= 16  # a 64x64 CFG request fits with room to spare
        out = orch.generate(req(0), timeout=60)
        assert out.ok, out.error
    finally:
        orch.shutdown()
    assert full(orch)


def test_a_byte_budget_on_the_legacy_dense_dit_is_refused():
    data = edited(dit={"diffusion_kv_mode": "dense_legacy"})
    for st in data["stages"]:
        st["legacy_kv_transfer"] = st.pop("kv_transfer_config")
    with pytest.raises(ConfigError, match="dense_legacy") as e:
        load_stage_graph(data)
    assert e.value.field == "stages[1].engine.kv_cache_memory_bytes"
    del data["stages"][1]["engine"]["kv_cache_memory_bytes"]
    assert load_stage_graph(data).ar.engine.num_kv_blocks == 128  # the AR's pool is still sized from its budget


def test_an_ar_stage_sized_neither_way_keeps_its_default_pool():
    g = load_stage_graph(edited(drop=[(0, "kv_cache_memory_bytes")]))
    assert g.ar.engine.num_kv_blocks == 1024 and g.ar.engine.kv_cache_memory_bytes is None
