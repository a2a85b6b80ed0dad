"""Load one tensor-/expert-parallel rank's shard of a checkpoint folder, reading only its slices.

`load_checkpoint` + `shard_model` would hold the whole checkpoint on every rank first (80B for the
release MoE). Here the model is built on the meta device, `shard_model` cuts the module tree there
(no data), and each remaining parameter is filled from `safe_open(...).get_slice(key)` reads:

- `self_attn.qkv_proj.weight`: the rank's KV groups are one contiguous row range of the release
  grouped layout; read it, convert to the split layout of the local heads;
- `self_attn.o_proj.weight`: the columns of the rank's query heads;
- experts without EP and the shared MLP (under TP): rows `sl` of both gate_and_up halves and
  columns `sl` of down_proj, `sl` the rank's intermediate range;
- experts with EP: the rank's whole experts (other experts' tensors are never read);
- everything else (embeddings, norms, router, image modules): whole.

The result equals `shard_model(load_checkpoint(...), spec)` tensor for tensor (tests/test_sharded_load.py)
and is marked `_ditkv_sharded = shard_key(spec)` so `DiTWorker` does not cut it again.

FP8 (fp8_checkpoint.py): a pre-quantized folder's `weight_scale`s are read whole (they are small),
normalised to fp32 [out] (a per-tensor scale broadcast first), then cut like their weight's rows:
row-split weights (qkv, gate_and_up) take the same row ranges, column-split ones (o_proj,
down_proj under TP) the whole scale; so this too equals `shard_model(load_checkpoint(...))`.
Online (`quantization="fp8"` on an unquantized folder) each rank quantizes the slice it read, as it
reads it: rows of row-split weights get exactly the whole model's scales; a column-split weight's
scale is the rank's own (the amax over its columns), so there the rank's FP8 weights differ from
`shard_model` of a model quantized whole (a pre-quantized folder gives every rank the whole scale).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ditkv.errors import ConfigError
from ditkv.alignment import align_module
from ditkv.models.hunyuan import fp8_checkpoint as f8
from ditkv.models.hunyuan.checkpoint import (
    CONFIG_NAME,
    _check_keys_and_shapes,
    _weight_files,
    load_model_config,
    open_safetensors,
)
from ditkv.models.hunyuan.config import HunyuanImage3Config
from ditkv.models.hunyuan.model import HunyuanImage3Model
from ditkv.models.hunyuan.parallel_layers import _part, shard_model
from ditkv.models.hunyuan.qkv import grouped_to_split

log = logging.getLogger("ditkv.models")

# one read: (row slice, column slice) of a stored 2-D tensor; None = the whole dim
Read = tuple[slice | None, slice | None]


@dataclass
class ShardReadStats:
    """What one sharded load read: bytes of tensor data (stored dtype) and which keys."""
    bytes_read: int = 0
    checkpoint_bytes: int = 0  # every tensor of the checkpoint, for comparison
    keys_read: set[str] = field(default_factory=set)


def shard_of(model) -> tuple[int, int, int, int] | None:
    """The `shard_key` a model was loaded sliced as (`load_checkpoint_shard`), None for a whole model."""
    return getattr(model, "_ditkv_sharded", None)


def shard_key(spec) -> tuple[int, int, int, int]:
    """What a sharded model is cut for; `DiTWorker` compares it with its own `ParallelContext`."""
    return (spec.tp_rank, spec.tp_size, spec.ep_rank, spec.ep_size)


def _check_spec(cfg: HunyuanImage3Config, spec) -> None:
    tp, ep = spec.tp_size, spec.ep_size
    for name, n in (("num_attention_heads", cfg.num_attention_heads),
                    ("num_key_value_heads", cfg.num_key_value_heads)):
        if n % tp:
            raise ConfigError("tensor_parallel_size", tp, f"{name}={n} must be divisible by it")
    if ep > 1 and cfg.num_experts % ep:
        raise ConfigError("enable_expert_parallel", True,
                          f"num_experts={cfg.num_experts} is not divisible by the {ep} expert-parallel ranks")
    inter = cfg.moe_intermediate_size
    if tp > 1 and ep == 1 and inter % tp:  # experts are TP-split only without EP
        raise ConfigError("tensor_parallel_size", tp, f"moe_intermediate_size={inter} must be divisible by it")
    if tp > 1 and (inter * cfg.num_shared_expert) % tp:
        raise ConfigError("tensor_parallel_size", tp,
                          f"the shared expert's intermediate size {inter * cfg.num_shared_expert} must be "
                          "divisible by it")


def _reads(name: str, cfg: HunyuanImage3Config, spec) -> list[Read]:
    """The slices of stored tensor `name` that make up this rank's parameter `name` (concatenated
    along dim 0 in this order)."""
    tp, rank = spec.tp_size, spec.tp_rank
    if tp == 1:
        return [(None, None)]  # EP only: whole tensors (foreign experts have no parameter here)
    d = cfg.attention_head_dim
    if name.endswith(".self_attn.qkv_proj.weight"):
        kl = cfg.num_key_value_heads // tp
        group_rows = (cfg.num_attention_heads // cfg.num_key_value_heads + 2) * d
        return [(slice(rank * kl * group_rows, (rank + 1) * kl * group_rows), None)]
    if name.endswith(".self_attn.o_proj.weight"):
        return [(None, _part(cfg.num_attention_heads * d, rank, tp))]
    tp_split = ".mlp.shared_mlp." in name or (".mlp.experts." in name and spec.ep_size == 1)
    if tp_split:
        inter = cfg.moe_intermediate_size * (cfg.num_shared_expert if ".shared_mlp." in name else 1)
        sl = _part(inter, rank, tp)
        if name.endswith(".gate_and_up_proj.weight"):  # [x1; x2]: the same range of both halves
            return [(sl, None), (slice(inter + sl.start, inter + sl.stop), None)]
        if name.endswith(".down_proj.weight"):
            return [(None, sl)]
    return [(None, None)]


def _read(f, key: str, reads: list[Read], stats: ShardReadStats) -> torch.Tensor:
    sl = f.get_slice(key)
    parts = []
    for rows, cols in reads:
        if rows is None and cols is None:
            t = f.get_tensor(key)
        elif cols is None:
            t = sl[rows.start:rows.stop]
        else:
            t = sl[:, cols.start:cols.stop] if rows is None else sl[rows.start:rows.stop, cols.start:cols.stop]
        stats.bytes_read += t.numel() * t.element_size()
        parts.append(t)
    stats.keys_read.add(key)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def load_checkpoint_shard(folder: str | Path, spec, device: str | torch.device = "cpu",
                          dtype: torch.dtype | None = None,
                          stats: ShardReadStats | None = None, quantization: str | None = None,
                          ignored: tuple = ()) -> HunyuanImage3Model:
    """This rank's `shard_model(load_checkpoint(folder, device, dtype), spec)`, reading only its slices.

    `spec`: tp_rank/tp_size/tp_group, ep_rank/ep_size/ep_group (a `ParallelContext`); `stats`, when
    given, is filled with the bytes read. Same dtype rules, FP8 rules and key/shape validation as
    `load_checkpoint`. With `quantization="fp8"` on an unquantized folder each rank quantizes its own
    slices while reading them: a column-split weight (o_proj, down_proj under TP) then gets per-shard
    scales (see the module docstring); rows keep the whole model's.
    """
    folder = Path(folder)
    stats = stats if stats is not None else ShardReadStats()
    if not (folder / CONFIG_NAME).exists():
        raise ConfigError("checkpoint", str(folder), f"no {CONFIG_NAME}; is this a checkpoint folder?")
    cfg = load_model_config(folder)
    _check_spec(cfg, spec)
    with torch.device("meta"):
        model = HunyuanImage3Model(cfg)
    files = _weight_files(folder)
    plan = f8.plan_fp8(model, f8.read_headers(folder, files), quantization, ignored)
    _check_keys_and_shapes(model, folder, files, plan.stored_scale_keys())  # full shapes, headers only
    f8.apply_plan(model, plan)  # meta: FP8 structure first, so shard_model cuts the scales too
    model = shard_model(model, spec)  # meta: the sharded module tree, no data

    wanted = dict(model.named_parameters())
    file_of = {k: name for name, keys in files.items() for k in keys}
    by_file: dict[str, list[str]] = {}
    for key in wanted:
        if f8.module_of(key, f8.SCALE) not in plan.online:  # online scales come with their weight
            by_file.setdefault(file_of[key], []).append(key)
    stats.checkpoint_bytes += sum(os.path.getsize(folder / name) for name in files)
    for name in sorted(by_file):
        with open_safetensors(folder / name) as f:
            for key in by_file[name]:
                t = _read_rank_tensor(f, key, model, cfg, spec, plan, stats)
                if tuple(t.shape) != tuple(wanted[key].shape):  # pre-checked; guards the slice rules
                    raise ConfigError("checkpoint", str(folder / name),
                                      f"{key}: read {tuple(t.shape)} for this rank, expected "
                                      f"{tuple(wanted[key].shape)}")
                t = t.to(device=device)  # a stored scale came normalised from the read (before its slicing)
                for k, v in ({key: t} if key.endswith(f8.SCALE) else f8.prepare(key, t, plan, dtype)).items():
                    mod, leaf = k.rsplit(".", 1)
                    model.get_submodule(mod)._parameters[leaf] = nn.Parameter(v.contiguous(), requires_grad=False)
    leftover = [n for n, p in model.named_parameters() if p.is_meta] + \
        [n for n, b in model.named_buffers() if b.is_meta]
    if leftover:
        raise ConfigError("checkpoint", str(folder), f"weights never loaded: {leftover[:5]}")
    log.info("rank tp %d/%d ep %d/%d read %d of %d checkpoint bytes from %s", spec.tp_rank, spec.tp_size,
             spec.ep_rank, spec.ep_size, stats.bytes_read, stats.checkpoint_bytes, folder)
    model._ditkv_sharded = shard_key(spec)
    align_module(model)  # slices of mapped tensors keep their 8-byte alignment (alignment.py)
    return model.eval()


def _read_rank_tensor(f, key: str, model, cfg: HunyuanImage3Config, spec, plan: f8.Fp8Plan,
                      stats: ShardReadStats) -> torch.Tensor:
    """This rank's part of stored tensor `key`, in the local module's layout (qkv: split rows)."""
    mod, leaf = key.rsplit(".", 1)
    if leaf == "weight_scale":  # pre-quantized: whole scale, normalised (broadcast), then the weight's rows
        s = f.get_tensor(key)
        stats.bytes_read += s.numel() * s.element_size()
        stats.keys_read.add(key)
        t = f8.scale_rows(f8.normalise_scale(key, s, plan.stored[mod]), _reads(mod + ".weight", cfg, spec))
    else:
        t = _read(f, key, _reads(key, cfg, spec), stats)
    if mod.endswith(".self_attn.qkv_proj"):  # grouped on disk, split in memory (a weight's rows, its scale's)
        qkv = model.get_submodule(mod)
        t = grouped_to_split(t, qkv.num_heads, qkv.num_kv_heads, qkv.head_dim)
    return t
