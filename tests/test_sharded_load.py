"""Sliced checkpoint loading: every TP/EP rank's model equals `shard_model(load_checkpoint(...))`
tensor for tensor, reads fewer bytes than the checkpoint holds, and bad folders fail naming the key."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from ditkv.errors import ConfigError
from ditkv.models.hunyuan import (
    HunyuanImage3Config,
    HunyuanImage3Model,
    load_checkpoint,
    save_checkpoint,
)
from ditkv.models.hunyuan.parallel_layers import shard_model
from ditkv.models.hunyuan.sharded_load import (
    ShardReadStats,
    load_checkpoint_shard,
    shard_key,
)

# the tiny preset has 2 KV heads (tp <= 2); "wide" has 4 (tp = 4) and a 2-expert shared MLP
CONFIGS = {
    "tiny": HunyuanImage3Config.tiny().replace(num_hidden_layers=2),
    "wide": HunyuanImage3Config.tiny().replace(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                                               attention_head_dim=16, num_shared_expert=2),
}
# (config, tp, ep): ep > 1 means expert parallel over the whole replica (ep = world size)
LAYOUTS = [("tiny", 2, 1), ("tiny", 2, 2), ("tiny", 1, 2), ("wide", 4, 1), ("wide", 4, 4), ("wide", 2, 2)]


def spec(rank: int, tp: int, ep: int):
    return SimpleNamespace(tp_rank=rank % tp, tp_size=tp, tp_group=None,
                           ep_rank=rank if ep > 1 else 0, ep_size=ep, ep_group=None)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each config saved in several safetensors files (64 KiB limit)."""
    out = {}
    for name, cfg in CONFIGS.items():
        model = HunyuanImage3Model.from_config(cfg, seed=3, zero_init_resblocks=False)
        folder = tmp_path_factory.mktemp(name)
        paths = save_checkpoint(model, folder, max_shard_bytes=64 << 10)
        assert len(paths) > 2
        out[name] = folder
    return out


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["stored", "bf16"])
@pytest.mark.parametrize("name,tp,ep", LAYOUTS, ids=[f"{c}-tp{t}-ep{e}" for c, t, e in LAYOUTS])
def test_shard_equals_shard_model_of_full_load(folders, name, tp, ep, dtype):
    full = load_checkpoint(folders[name], dtype=dtype)
    full_bytes = sum(t.numel() * t.element_size() for t in load_checkpoint(folders[name]).state_dict().values())
    for rank in range(max(tp, ep)):
        s = spec(rank, tp, ep)
        ref = dict(shard_model(copy.deepcopy(full), s).named_parameters())
        stats = ShardReadStats()
        model = load_checkpoint_shard(folders[name], s, dtype=dtype, stats=stats)
        got = dict(model.named_parameters())
        assert list(got) == list(ref)
        for key in ref:
            assert got[key].dtype == ref[key].dtype and torch.equal(got[key], ref[key]), key
        assert model._ditkv_sharded == shard_key(s)
        assert model.model.layers[0].mlp.gate.wg.weight.dtype == torch.float32  # router stays fp32
        assert 0 < stats.bytes_read < full_bytes
        if ep > 1:  # other ranks' experts are never read
            per = CONFIGS[name].num_experts // ep
            read = {int(k.split(".experts.")[1].split(".")[0]) for k in stats.keys_read if ".experts." in k}
            assert read == set(range(rank * per, (rank + 1) * per))


def test_tp2_rank_reads_about_its_share(folders):
    """tiny, tp=2: each rank reads the replicated tensors plus half of attention and experts."""
    sd = load_checkpoint(folders["tiny"]).state_dict()
    nbytes = lambda keys: sum(sd[k].numel() * sd[k].element_size() for k in keys)  # noqa: E731
    split = [k for k in sd if ".self_attn.qkv_proj." in k or ".self_attn.o_proj." in k
             or ".mlp.experts." in k or ".mlp.shared_mlp." in k]
    whole = [k for k in sd if k not in split]
    for rank in range(2):
        stats = ShardReadStats()
        load_checkpoint_shard(folders["tiny"], spec(rank, 2, 1), stats=stats)
        assert stats.bytes_read == nbytes(whole) + nbytes(split) // 2


def _copy_folder(src, dst):
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def _rewrite(folder, key, fn):
    """Apply `fn(state) ` to the safetensors file holding `key` (and drop a removed key from the index)."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    file = folder / index["weight_map"][key]
    state = load_file(str(file))
    fn(state)
    save_file(state, str(file), metadata={"format": "pt"})
    if key not in state:
        del index["weight_map"][key]
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("fault", ["missing", "shape"])
def test_bad_checkpoint_names_the_key(folders, tmp_path, fault):
    key = "model.layers.1.mlp.experts.3.down_proj.weight"
    folder = _copy_folder(folders["tiny"], tmp_path / "bad")
    if fault == "missing":
        _rewrite(folder, key, lambda st: st.pop(key))
    else:
        _rewrite(folder, key, lambda st: st.__setitem__(key, torch.zeros(7, 5)))
    # rank 0 of tp2-ep2 would not read expert 3's data: the check covers every key anyway
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_checkpoint_shard(folder, spec(0, 2, 2))
    with pytest.raises(ConfigError, match="missing key" if fault == "missing" else r"checkpoint shape \(7, 5\)"):
        load_checkpoint_shard(folder, spec(0, 2, 1))


def test_indivisible_layout_is_a_config_error(folders):
    with pytest.raises(ConfigError, match="num_key_value_heads=2"):
        load_checkpoint_shard(folders["tiny"], spec(0, 4, 1))
    with pytest.raises(ConfigError, match="num_experts=8"):
        load_checkpoint_shard(folders["tiny"], spec(0, 1, 3))


# ---- end to end: TP ranks of an mp engine load their shards of the bundled tiny model ---------
def test_tp2_engine_ranks_load_slices_and_match_one_rank():
    """No model bundle: each rank reads its slices of the bundled checkpoint; the memory plan runs
    the profile over the shards in lockstep; the image equals the single-rank one."""
    from ditkv.config import EngineConfig
    from ditkv.engine.engine import Engine
    from ditkv.engine.executor import ExecutorOptions
    from ditkv.engine.types import GenerationRequest
    from ditkv.models.loader import TINY_ASSET

    if not (TINY_ASSET / "config.json").is_file():
        pytest.skip("the bundled tiny checkpoint is not installed")
    base = dict(model="tiny", device="cpu", dtype="float32", attention_backend="torch", block_size=16,
                diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2)
    req = GenerationRequest(prompt="a yellow circle", height=32, width=32, steps=2, guidance_scale=2.0, seed=5)
    ref = Engine(EngineConfig(num_kv_blocks=32, profile_memory=False, **base))
    want = ref.generate(req)
    full_bytes = sum(p.numel() * p.element_size() for p in ref.executor.worker.model.parameters())
    ref.shutdown()
    opts = ExecutorOptions(heartbeat_interval_s=0.1, heartbeat_timeout_s=10.0, startup_timeout_s=120.0,
                           drain_timeout_s=20.0)
    e = Engine(EngineConfig(tensor_parallel_size=2, profile_memory=True, **base), executor_options=opts)
    try:
        assert e.executor.kind == "mp" and e.executor.world_size == 2
        assert all(0 < b < full_bytes for b in e.executor.rank_weight_bytes)
        out = e.generate(req)
        assert out.ok, out.error
        assert np.abs(out.image.astype(int) - want.image.astype(int)).max() <= 1
    finally:
        e.shutdown()
