"""Stage graph: a YAML file describing the AR and DiT stages, their replicas, parallel sizes and
the KV transfer between them. Only the two-stage graph AR(0) -> DiT(1) is supported; anything
else is rejected at startup with a message that says so. A DiT replica may span several ranks
(tensor_parallel_size / ulysses_degree / cfg_parallel_size > 1: one process per rank, optionally
expert parallel) over shm or mooncake; so may an AR replica (tensor_parallel_size > 1). Each stage has its own
`engine.device` (e.g. AR on cuda:0 and DiT on cuda:1 with kv_connector: cuda); both stages need
the same dtype and block_size.

    stages:
      - stage_id: 0
        kind: ar
        replicas: 1
        engine: {model: tiny, device: cpu, block_size: 16, num_kv_blocks: 512}
        max_new_tokens: 0            # optional AR text generation before the image tokens
        kv_transfer_config: {kv_connector: shm, engine_id: ar, kv_role: kv_producer}
      - stage_id: 1
        kind: dit
        inputs: [0]
        replicas: 1
        engine: {model: tiny, device: cpu, diffusion_kv_mode: paged_scheduler,
                 diffusion_kv_max_rows_per_request: 2, block_size: 16, num_kv_blocks: 512}
        kv_transfer_config: {kv_connector: shm, engine_id: dit, kv_role: kv_consumer,
                             transfer_timeout: 60.0}
    orchestrator: {max_inflight: 8}

`legacy_kv_transfer:` instead of `kv_transfer_config:` selects the legacy (contiguous copy) path;
it needs the DiT in `dense_legacy` mode. `remote: tcp://HOST:PORT` on the AR stage: the stage runs in
a separate `ditkv stage` server (`stages/remote_ar.py`). A relative `model:` folder is read from the
YAML file's own folder (`resolve_model_paths`); tiny and tiny-edit stay the bundled models' names.

Pool sizes, per stage and per rank: `num_kv_blocks`, or `kv_cache_memory_bytes` (a byte budget, turned
into blocks here at load by the single engine's rule, `graph_checks.size_pools`); an AR stage with neither gets
`graph_checks.AR_DEFAULT_KV_BLOCKS`. `enable_expert_parallel` on the DiT splits its experts across a multi-rank
replica (`examples/stages-reference-cpu.yaml`: AR TP=2, DiT TP=2 + EP, byte budgets).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path

from ..config import EngineConfig, load_yaml
from ..errors import ConfigError, is_finite_number
from ..models.text_settings import TextSampling
from ..transfer.config import LEGACY_KEY, NATIVE_KEY, TransferConfig, transfer_from_stage
from .graph_checks import check_edge, size_pools
from .placement import check_devices, world_size

log = logging.getLogger("ditkv.stages")
STAGE_KINDS = ("ar", "dit")
_TEXT_KEYS = ("temperature", "top_k", "top_p", "do_sample")  # the AR stage's text defaults (None: the checkpoint's)
_STAGE_KEYS = {"stage_id", "kind", "replicas", "inputs", "engine", "max_new_tokens", *_TEXT_KEYS, "bot_task", "devices",
               "remote", NATIVE_KEY, LEGACY_KEY}
_REMOTE_KEYS = ("address", "connect_timeout", "heartbeat_interval", "heartbeat_timeout")
_ADDRESS = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


# The AR stage's engine keys: an `EngineConfig` restricted to what an engine running AR phases only
# uses, with the AR stage's defaults. It always runs paged, one causal row per request, sized at load
# (`graph_checks.size_pools`: `num_kv_blocks`, or `kv_cache_memory_bytes` per rank, else
# AR_DEFAULT_KV_BLOCKS), never profiled.
AR_ENGINE_KEYS = ("model", "device", "dtype", "block_size", "num_kv_blocks", "kv_cache_memory_bytes",
                  "attention_backend", "tensor_parallel_size", "max_num_seqs", "torch_threads", "torch_compile",
                  "quantization", "quantization_ignored_layers")
AR_ENGINE_DEFAULTS = {"max_num_seqs": 16}  # AR jobs one replica runs at once, batched
AR_ENGINE_FIXED = {"diffusion_kv_mode": "paged_scheduler", "diffusion_kv_max_rows_per_request": 1,
                   "profile_memory": False}


def ar_engine_from_dict(data: dict, where: str) -> EngineConfig:
    """The AR stage's `engine:` mapping -> its `EngineConfig`; errors name `where`'s key."""
    unknown = sorted(set(data) - set(AR_ENGINE_KEYS))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}", data[unknown[0]],
                          f"unknown AR engine key; valid keys: {', '.join(sorted(AR_ENGINE_KEYS))}")
    for name in ("block_size", "num_kv_blocks", "kv_cache_memory_bytes", "tensor_parallel_size", "max_num_seqs",
                 "torch_threads"):  # the AR stage has no "0 = size automatically": no profile
        v = data.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(f"{where}.{name}", v, "must be a positive integer")
    try:
        return EngineConfig(**{**AR_ENGINE_DEFAULTS, **data, **AR_ENGINE_FIXED})
    except ConfigError as e:
        raise ConfigError(f"{where}.{e.field}", e.value, e.fix) from e


@dataclass
class RemoteSpec:
    """`remote:` of a separately deployed AR stage (`ditkv stage --config ... --stage 0 --bind ...`)."""

    address: str  # tcp://HOST:PORT of the stage server's ROUTER socket
    connect_timeout: float = 30.0  # the server must answer the hello within this (s)
    heartbeat_interval: float = 1.0  # both ways
    heartbeat_timeout: float = 10.0  # silence this long = the peer is lost

    @classmethod
    def from_value(cls, value, where: str) -> "RemoteSpec":
        data = {"address": value} if isinstance(value, str) else value
        if not isinstance(data, dict):
            raise ConfigError(where, value, "give the AR stage server's address, e.g. remote: tcp://10.0.0.5:7100, "
                                            f"or a mapping with {', '.join(_REMOTE_KEYS)}")
        unknown = sorted(set(data) - set(_REMOTE_KEYS))
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}", data[unknown[0]],
                              f"unknown remote key; valid keys: {', '.join(_REMOTE_KEYS)}")
        spec = cls(address=check_address(data.get("address"), f"{where}.address" if isinstance(value, dict) else where),
                   **{k: data[k] for k in _REMOTE_KEYS[1:] if k in data})
        for k in _REMOTE_KEYS[1:]:
            v = getattr(spec, k)
            if not is_finite_number(v) or v <= 0:
                raise ConfigError(f"{where}.{k}", v, "must be a positive number of seconds")
        if spec.heartbeat_timeout <= 2 * spec.heartbeat_interval:
            raise ConfigError(f"{where}.heartbeat_timeout", spec.heartbeat_timeout,
                              f"must exceed twice heartbeat_interval ({spec.heartbeat_interval})")
        return spec


def check_address(address, where: str) -> str:
    """`tcp://HOST:PORT` (HOST a name, an IPv4 address or a bracketed IPv6 one; PORT 1..65535)."""
    m = _ADDRESS.match(address) if isinstance(address, str) else None
    if m is None or not 0 < int(m.group(2)) < 65536:
        raise ConfigError(where, address, "use a ZeroMQ TCP address tcp://HOST:PORT with a port in 1..65535, "
                                          "e.g. tcp://10.0.0.5:7100")
    return address


@dataclass
class StageSpec:
    stage_id: int
    kind: str
    replicas: int
    inputs: list[int]
    engine: EngineConfig
    transfer: TransferConfig
    max_new_tokens: int = 0
    temperature: float | None = None  # None: the checkpoint's (generation_config.json; none there: greedy)
    top_k: int | None = None  # with top_p and do_sample: `models.text_settings.TextSampling`'s meanings
    top_p: float | None = None
    do_sample: bool | None = None
    bot_task: str | None = None  # AR only: the requests' default task (None: the checkpoint's; values: the family's)
    devices: list[int] | None = None  # GPU per rank, replica-major (`stages/placement.py`)
    remote: RemoteSpec | None = None  # AR only: the stage runs in a separate `ditkv stage` server


@dataclass
class StageGraph:
    ar: StageSpec
    dit: StageSpec
    max_inflight: int = 8

    @property
    def mode(self) -> str:
        return self.dit.transfer.mode


def resolve_model_paths(data: dict, path: str | Path) -> dict:
    """`data`, the YAML file at `path` (a stage file or an engine file), with every relative model
    folder read from the file's own folder, so the file means the same from any working directory.
    Bundled names (tiny, tiny-edit) stay names; absolute and ~ paths stay as written."""
    from ..models.loader import BUNDLED

    base = Path(os.path.abspath(path)).parent  # abspath: no "run/../conf" in messages, symlinks kept
    stages = data.get("stages")
    if isinstance(stages, list):  # anything else: load_stage_graph names the bad `stages:`
        sections = [s.get("engine") for s in stages if isinstance(s, dict)]
    else:
        sections = [data.get("engine", data)]
    for section in sections:
        model = section.get("model") if isinstance(section, dict) else None
        if isinstance(model, str) and model.strip() and model not in BUNDLED:  # other values: the field check
            section["model"] = str(base / Path(model).expanduser())
    return data


def load_stage_graph(source: str | Path | dict) -> StageGraph:
    data = source if isinstance(source, dict) else resolve_model_paths(load_yaml(source), source)
    stages = data.get("stages")
    if not isinstance(stages, list) or not stages:
        raise ConfigError("stages", stages, "must be a non-empty list of stage mappings")
    # the graph's shape first: a stage of an unsupported graph should not be judged field by field
    graph = [_shape(s, i) for i, s in enumerate(stages)]
    if graph != [(0, "ar", ()), (1, "dit", (0,))]:
        raise ConfigError("stages", graph,
                          "only the two-stage graph AR(0) -> DiT(1) is supported: stage 0 `kind: ar` with no "
                          "inputs, stage 1 `kind: dit` with `inputs: [0]`; other producer/consumer edges "
                          "are not implemented yet")
    ar, dit = [_stage(s, i) for i, s in enumerate(stages)]
    check_edge(ar, dit)
    size_pools(ar, dit)
    orch = data.get("orchestrator", {}) or {}
    if not isinstance(orch, dict) or set(orch) - {"max_inflight"}:
        raise ConfigError("orchestrator", orch, "must be a mapping with only `max_inflight`")
    inflight = orch.get("max_inflight", 8)
    if isinstance(inflight, bool) or not isinstance(inflight, int) or inflight < 1:
        raise ConfigError("orchestrator.max_inflight", inflight, "must be a positive integer")
    extra = sorted(set(data) - {"stages", "orchestrator"})
    if extra:
        raise ConfigError(extra[0], data[extra[0]], "unknown top-level key in a stage file "
                                                    "(valid: stages, orchestrator)")
    return StageGraph(ar, _one_process_consumer(ar, dit), inflight)


def _one_process_consumer(ar: StageSpec, dit: StageSpec) -> StageSpec:
    """The DiT stage's transfer config, told whether a producer can live in another process: not
    when both stages run single-rank replicas in this process (no remote AR), so its pool needs no
    CUDA IPC export (`Transport.register`)."""
    if ar.remote is None and world_size(ar) == 1 and world_size(dit) == 1:
        return replace(dit, transfer=replace(dit.transfer, ipc_export=False))
    return dit


def _shape(s, i: int):
    """(stage_id, kind, inputs) of one stage entry, for the graph check; the entry itself when it
    is not a mapping or its inputs are not a list (the graph check then names it as written)."""
    if not isinstance(s, dict):
        return s
    inputs = s.get("inputs", []) or []
    return (s.get("stage_id", i), s.get("kind"), tuple(inputs) if isinstance(inputs, list) else inputs)


def _stage(s, i: int) -> StageSpec:
    where = f"stages[{i}]"
    if not isinstance(s, dict):
        raise ConfigError(where, s, "must be a mapping")
    unknown = sorted(set(s) - _STAGE_KEYS)
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}", s[unknown[0]],
                          f"unknown stage key; valid keys: {', '.join(sorted(_STAGE_KEYS))}")
    kind = s.get("kind")
    if kind not in STAGE_KINDS:
        raise ConfigError(f"{where}.kind", kind, "choose 'ar' or 'dit'")
    replicas = s.get("replicas", 1)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ConfigError(f"{where}.replicas", replicas, "must be a positive integer")
    inputs = s.get("inputs", [])
    if not isinstance(inputs, list):
        raise ConfigError(f"{where}.inputs", inputs, "must be a list of stage ids")
    engine = s.get("engine", {}) or {}
    if not isinstance(engine, dict):
        raise ConfigError(f"{where}.engine", engine, "must be a mapping of engine fields")
    if kind == "ar":
        eng = ar_engine_from_dict(engine, f"{where}.engine")
    else:
        eng = EngineConfig.from_dict(engine, source=f"{where}.engine")
        # batching (max_num_seqs > 1) runs in the DiT stage as in a single engine (the stage is an
        # `Engine` with a KV-import hook). Only the legacy path cannot batch: it needs dense_legacy,
        # which `EngineConfig` already refuses with max_num_seqs > 1.
    transfer = transfer_from_stage(s, where)
    if transfer is None:
        raise ConfigError(f"{where}.{NATIVE_KEY}", None,
                          f"each stage needs {NATIVE_KEY} (native page transfer) or {LEGACY_KEY} (legacy)")
    max_new = s.get("max_new_tokens", 0)
    text = {k: s[k] for k in _TEXT_KEYS if s.get(k) is not None}
    if kind == "dit" and ("max_new_tokens" in s or text):
        key = next(iter(text), "max_new_tokens")
        raise ConfigError(f"{where}.{key}", s.get(key), "text generation settings belong to the AR stage")
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 0:
        raise ConfigError(f"{where}.max_new_tokens", max_new, "must be an integer >= 0")
    task = s.get("bot_task")  # its values are the model family's: the orchestrator checks them at startup
    if task is not None and (kind == "dit" or not isinstance(task, str)):
        raise ConfigError(f"{where}.bot_task", task, "a string, on the AR stage only (its requests' default task)")
    try:
        TextSampling(**text)
    except ConfigError as e:  # the same rule as generation_config.json and requests, named by its place here
        raise ConfigError(f"{where}.{e.field}", e.value, e.fix) from None
    remote = None
    if s.get("remote") is not None:
        if kind != "ar":
            raise ConfigError(f"{where}.remote", s["remote"], "only the AR stage (stage 0) can run as a separate "
                                                              "server for now; run the DiT stage in this process "
                                                              "(remove `remote`)")
        remote = RemoteSpec.from_value(s["remote"], f"{where}.remote")
    sid = s.get("stage_id", i)
    if "temperature" in text:
        text["temperature"] = float(text["temperature"])
    spec = StageSpec(sid, kind, replicas, list(inputs), eng, transfer, max_new, **text, bot_task=task, remote=remote)
    spec.devices = check_devices(where, s.get("devices"), spec)
    return spec


# --config STAGES.yaml on the command line: the few engine flags that apply to every stage
STAGE_OVERRIDES = ("model", "device", "dtype", "max_steps", "torch_threads", "torch_compile", "cuda_graphs",
                   "batch_invariant", "cache_config")
# the AR stage has no denoising loop nor batches (nor steps to cache)
DIT_ONLY = ("max_steps", "cuda_graphs", "batch_invariant", "cache_config")


def stage_graph_from_args(args: argparse.Namespace, prog: str):
    """`--config STAGES.yaml` (a `stages:` section) + the few engine flags that apply to every
    stage -> a validated `StageGraph`. Other engine flags are refused: they are per stage."""
    data = resolve_model_paths(load_yaml(args.config), args.config)  # before --model, a cwd path, goes in
    for f in fields(EngineConfig):
        v = getattr(args, f.name, None)
        if v is None:
            continue
        if f.name not in STAGE_OVERRIDES:
            raise SystemExit(f"{prog}: error: --{f.name.replace('_', '-')} cannot override a stage "
                             f"file; set it under the stage's engine: section in {args.config}")
        stages = data.get("stages")
        for st in stages if isinstance(stages, list) else ():  # load_stage_graph names a bad `stages:`
            if not isinstance(st, dict) or (f.name in DIT_ONLY and st.get("kind") == "ar"):
                continue
            engine = st.get("engine") or {}
            if isinstance(engine, dict):  # anything else: load_stage_graph names the bad `engine:`
                st["engine"] = {**engine, f.name: v}
    return load_stage_graph(data)
