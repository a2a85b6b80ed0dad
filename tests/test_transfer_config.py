"""Transfer / stage-graph configuration errors are caught at startup with a message naming the fix."""

import copy

import pytest

from ditkv.stages.graph import load_stage_graph
from ditkv.errors import ConfigError
from ditkv.transfer.config import TransferConfig, transfer_from_stage

AR = {"stage_id": 0, "kind": "ar", "engine": {"model": "tiny", "device": "cpu", "block_size": 16},
      "kv_transfer_config": {"engine_id": "ar", "kv_role": "kv_producer"}}
DIT = {"stage_id": 1, "kind": "dit", "inputs": [0],
       "engine": {"model": "tiny", "device": "cpu", "diffusion_kv_mode": "paged_scheduler",
                  "diffusion_kv_max_rows_per_request": 2, "block_size": 16, "num_kv_blocks": 64},
       "kv_transfer_config": {"engine_id": "dit", "kv_role": "kv_consumer", "transfer_timeout": 60.0}}


def graph(**changes):
    g = {"stages": [copy.deepcopy(AR), copy.deepcopy(DIT)]}
    for path, value in changes.items():
        i, *keys = path.split("__")
        node = g["stages"][int(i[1:])]
        for k in keys[:-1]:
            node = node[k]
        if value is None:
            node.pop(keys[-1], None)
        else:
            node[keys[-1]] = value
    return g


def test_valid_graph_parses():
    g = load_stage_graph(graph())
    assert g.mode == "native" and g.dit.transfer.transfer_timeout == 60.0 and g.ar.replicas == 1


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), "60", True])
def test_bad_timeout(bad):
    with pytest.raises(ConfigError, match="transfer_timeout.*positive finite number of seconds"):
        TransferConfig("native", engine_id="x", kv_role="kv_consumer", transfer_timeout=bad)


def test_default_timeout_is_60s():
    assert TransferConfig("native", engine_id="x", kv_role="kv_both").transfer_timeout == 60.0


@pytest.mark.parametrize("role", ["producer", "", None, "kv_sender"])
def test_bad_role(role):
    with pytest.raises(ConfigError, match="kv_role.*kv_producer, kv_consumer, kv_both"):
        TransferConfig("native", engine_id="x", kv_role=role)


@pytest.mark.parametrize("eid", [None, "", "  "])
def test_missing_engine_id(eid):
    with pytest.raises(ConfigError, match="engine_id"):
        TransferConfig("legacy", engine_id=eid, kv_role="kv_producer")


def test_both_legacy_and_native_configured():
    stage = dict(DIT, legacy_kv_transfer={"engine_id": "dit", "kv_role": "kv_consumer"})
    with pytest.raises(ConfigError, match="configure exactly one"):
        transfer_from_stage(stage, "stages[1]")
    with pytest.raises(ConfigError, match="configure exactly one"):
        load_stage_graph({"stages": [AR, stage]})


def test_native_without_paged_mode():
    with pytest.raises(ConfigError, match="native KV transfer.*paged_scheduler"):
        load_stage_graph(graph(s1__engine__diffusion_kv_mode="dense_legacy",
                               s1__engine__diffusion_kv_max_rows_per_request=None,
                               s1__engine__num_kv_blocks=None))


def test_legacy_needs_dense_mode_and_same_path_on_both_stages():
    g = graph()
    for s in g["stages"]:
        s["legacy_kv_transfer"] = s.pop("kv_transfer_config")
    with pytest.raises(ConfigError, match="dense_legacy"):
        load_stage_graph(g)
    g2 = graph()
    g2["stages"][0]["legacy_kv_transfer"] = g2["stages"][0].pop("kv_transfer_config")
    with pytest.raises(ConfigError, match="same path"):
        load_stage_graph(g2)


def test_roles_must_match_the_edge():
    with pytest.raises(ConfigError, match="AR stage produces KV"):
        load_stage_graph(graph(s0__kv_transfer_config__kv_role="kv_consumer"))
    with pytest.raises(ConfigError, match="DiT stage consumes KV"):
        load_stage_graph(graph(s1__kv_transfer_config__kv_role="kv_producer"))
    assert load_stage_graph(graph(s0__kv_transfer_config__kv_role="kv_both"))


@pytest.mark.parametrize("stages", [
    [AR],
    [DIT, AR],
    [AR, dict(DIT, inputs=[])],
    [AR, DIT, dict(DIT, stage_id=2, inputs=[1])],
    [AR, dict(DIT, kind="ar", inputs=[0])],
])
def test_other_stage_graphs_rejected(stages):
    with pytest.raises(ConfigError, match=r"only the two-stage graph AR\(0\) -> DiT\(1\) is supported"):
        load_stage_graph({"stages": copy.deepcopy(stages)})


def test_misc_stage_errors():
    with pytest.raises(ConfigError, match="block_size"):
        load_stage_graph(graph(s0__engine__block_size=32))
    with pytest.raises(ConfigError, match="engine ids must differ"):
        load_stage_graph(graph(s1__kv_transfer_config__engine_id="ar"))
    with pytest.raises(ConfigError, match="same transport"):
        load_stage_graph(graph(s1__kv_transfer_config__kv_connector="mooncake"))
    with pytest.raises(ConfigError, match="replicas"):
        load_stage_graph(graph(s1__replicas=0))
    with pytest.raises(ConfigError, match="kv_connector"):
        load_stage_graph(graph(s1__kv_transfer_config__kv_connector="rdma"))
    with pytest.raises(ConfigError, match="needs kv_transfer_config"):
        load_stage_graph(graph(s1__kv_transfer_config=None))
