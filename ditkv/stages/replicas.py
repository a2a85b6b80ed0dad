"""Where a stage graph's replicas run and which weights they get: one (model, tokenizer, codec) per
device that hosts an in-process replica (rank processes load their own shard on their own GPU), and
each replica's engine config and executor options as placed (`placement.py`)."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import replace

import torch

from ..engine.executor import ExecutorOptions
from ..models.family import family_of
from ..models.loader import load_model, resolve_device
from .placement import replica_devices
from .placement import world_size as stage_world_size


def norm_device(dev: torch.device) -> torch.device:
    """`cuda` -> `cuda:<current>`, so that it compares equal to a model's parameter device."""
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def bundle_on(bundle, name: str, device: torch.device, dtype: torch.dtype, quantization=None, ignored=()):
    """(model, tokenizer, codec) on `device`: the given bundle when it already lives there, a copy
    of its model when it lives elsewhere (AR and DiT on two GPUs), else a fresh load (`quantization`:
    what both stages on the device ask for; each stage quantizes its own copy otherwise)."""
    if bundle is None:
        return load_model(name, device, dtype, quantization, ignored)
    model, tok, codec = bundle
    if model.device == device and model.dtype == dtype:
        return bundle
    return family_of(model.config).move_model(copy.deepcopy(model), device, dtype).eval(), tok, codec


def replica_device(replica) -> torch.device:
    return norm_device(torch.device(replica.device))  # `cuda` / `auto`: the process's current GPU


def on_replica_device(replica):
    dev = replica_device(replica)
    return torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()


def replica_plan(spec, i: int, options) -> dict:
    """Replica `i` of a stage as placed (`stages/placement.py`): its engine config names its first
    rank's device (a single-rank replica runs in this process there); a replica of several ranks
    also gets every rank's device in its executor options (`ExecutorOptions.devices`)."""
    devs = replica_devices(spec, i)
    ranks = stage_world_size(spec) > 1
    opts = replace(options or ExecutorOptions(), devices=devs) if ranks else options
    return {"engine": replace(spec.engine, device=devs[0]), "options": opts, "ranks": ranks}


def replica_transfer(cfg, i: int, n: int):
    return cfg if n == 1 else replace(cfg, engine_id=f"{cfg.engine_id}-{i}")


def plan_replicas(graph, model_bundle, executor_options, dtype) -> tuple[dict, list]:
    """({"ar": [plan...], "dit": [plan...]}, the bundles loaded here). Weights only where a replica
    runs in this process (one copy per device); a device shared by both stages loads them quantized
    when both stages ask for the same quantization, else each stage quantizes its own copy."""
    ar, dit = graph.ar, graph.dit
    bundles: dict[torch.device, tuple] = {}

    def local_bundle(device: str):
        dev = norm_device(resolve_device(device))
        if dev not in bundles:
            base = model_bundle if model_bundle is not None else next(iter(bundles.values()), None)
            same = (ar.engine.quantization, ar.engine.quantization_ignored_layers) == \
                (dit.engine.quantization, dit.engine.quantization_ignored_layers)
            bundles[dev] = bundle_on(base, dit.engine.model, dev, dtype, *(
                (dit.engine.quantization, tuple(dit.engine.quantization_ignored_layers)) if same else ()))
        return bundles[dev]

    plan = {s.kind: [replica_plan(s, i, executor_options) for i in range(s.replicas)] for s in (ar, dit)}
    if ar.remote is not None:
        plan["ar"] = []  # no AR weights or pools here
    for kind in ("ar", "dit"):
        for p in plan[kind]:
            p["bundle"] = model_bundle if p["ranks"] else local_bundle(p["engine"].device)
    return plan, list(bundles.values())
