"""Engine configuration: defaults, validation and YAML stage files (CLI flags: entrypoints/engine_args.py).

Every validation error names the field, the bad value and the fix (`ConfigError`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from pathlib import Path

from .errors import ConfigError

KV_MODES = ("dense_legacy", "paged_scheduler")
FP8_GROUPED_GEMMS = ("auto", "torch", "quack")  # fp8_grouped_gemm (models/fp8.py)
ATTENTION_BACKENDS = ("auto", "torch", "torch-segments", "triton", "cudnn", "fa4")
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("fp8",)

# 64 tokens per block: one block is one KV tile of the Triton kernel on H200 (BLOCK_N = 64), and at
# 1024x1024 (~4.1k-token rows) the last partial block wastes < 1% of a row.
DEFAULT_BLOCK_SIZE = 64


# keys earlier versions accepted, and what to do instead
REMOVED_KEYS = {
    "step_execution": "every engine runs step by step now (a request alone is a batch of one); drop the key",
}


@dataclass
class EngineConfig:
    model: str = "tiny"
    device: str = "auto"
    dtype: str = "auto"
    # the scheduler-managed paged KV cache is the default everywhere (Python API, `ditkv generate`,
    # `ditkv serve`, stage files): these two defaults are the only place that says so. dense_legacy
    # (a contiguous cache per request) stays selectable. 2 rows = CFG's cond + uncond; a one-row
    # request (no CFG, distilled models) fits in the same limit.
    diffusion_kv_mode: str = "paged_scheduler"
    diffusion_kv_max_rows_per_request: int | None = 2
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_memory_bytes: int | None = None  # None/0 = size from gpu_memory_utilization
    num_kv_blocks: int | None = None  # explicit pool size in blocks (tests, benchmarks)
    gpu_memory_utilization: float = 0.9
    max_model_len: int = -1  # -1 = fit to the pool
    # cross-request prefix cache over the paged pool (docs/prefix-cache.md): full prefix pages are
    # kept under a block identity and reused by later requests. None = on in paged mode (as vLLM);
    # false = today's behaviour exactly. dense_legacy has no pool: true is refused there.
    enable_prefix_caching: bool | None = None
    # with the prefix cache on, the DiT runner keeps the embeddings of this many input images (the last
    # used) across requests, so a hit ending inside an image's slots does not encode it again
    # (worker/encoder_cache.py; ~40 MiB per release image in bf16, reserved in the startup memory plan:
    # `profiling.encoder_reserve`). 0 = off. Its keys read the digest the front end computed once.
    encoder_cache_images: int = 4
    # continuous batching (paged mode): up to max_num_seqs requests run together, joining and leaving
    # between denoising steps; one step's query tokens stay within max_num_batched_tokens (None = no
    # bound beyond max_num_seqs). Every engine runs step by step: a request alone is a batch of one.
    max_num_seqs: int = 1
    max_num_batched_tokens: int | None = None
    max_steps: int = 200  # largest accepted denoising step count per request (CLI, API and server)
    # torch intra-op threads of every process of an engine or stage graph (rank processes, stage
    # servers, the orchestrator). One fixed number: fp32 sums on CPU round differently with another
    # thread count, so a host-dependent default would break bit-identical results across processes.
    torch_threads: int = 1
    attention_backend: str = "auto"
    # denoise steps replay a CUDA graph per shape bucket: auto = where the step can be captured
    # (one CUDA rank, paged, Triton attention, grouped-GEMM MoE), on = required, off = eager
    cuda_graphs: str = "auto"
    # on CUDA, run the norm / RoPE / SwiGLU-gate / MoE-combine elementwise chains as torch.compile'd
    # kernels (same math, fewer passes over memory); false = eager kernels. Process-wide setting.
    torch_compile: bool = True
    # batch-invariant mode: on CUDA the projections, router, expert GEMMs and norms of the packed pass
    # run fixed-tiling Triton kernels, so a request's image does not depend on what it was batched
    # with (slower; models/hunyuan/invariant.py). The CPU path is invariant already: no change there.
    batch_invariant: bool = False
    # fp8: W8A8 e4m3 for every linear of the decoder layers (per-channel weight scales, dynamic
    # per-token activation scales), quantized while loading; a pre-quantized checkpoint is FP8
    # whatever this says. quantization_ignored_layers: module-name patterns kept in the model dtype.
    quantization: str | None = None
    quantization_ignored_layers: list = dataclasses.field(default_factory=list)
    # fp8 on CUDA: the GEMMs' reduced-precision accumulation (use_fast_accum), 5-11 % faster GEMMs for
    # more error (docs/quantization.md). None = on, as vLLM's FP8 kernels on Hopper accumulate (its CUTLASS
    # FP8FastAccum schedules, Triton's sm90 FP8 dot default); false turns it off. Process-wide (models/fp8)
    fp8_fast_accum: bool | None = None
    # fp8 on CUDA: the routed experts' grouped GEMM. auto (None) = quack's varlen GEMM (ditkv[fa4], sm90, fast
    # accumulation) where it runs, else torch's _scaled_grouped_mm; torch / quack force one (models/fp8_quack.py)
    fp8_grouped_gemm: str | None = None
    # startup profile envelope: the largest request admitted (None = the model's default)
    max_image_height: int | None = None
    max_image_width: int | None = None
    max_prompt_tokens: int | None = None
    # run the max-shape profile request at startup and size the paged pool from what its peak leaves.
    # None (auto) = where the device's memory is measured (CUDA). The CPU pool is sized against a fixed
    # host-memory analogue (engine/sizing.py), where the profile's RSS high-water mark adds only noise,
    # and its prefill was a quarter of the CPU main job's time; true runs it there too.
    profile_memory: bool | None = None
    # parallelism inside one stage replica (ranks = tensor x ulysses x cfg)
    tensor_parallel_size: int = 1
    ulysses_degree: int = 1
    cfg_parallel_size: int = 1
    enable_expert_parallel: bool = False
    # step caching of the DiT's middle blocks (first-block cache / DBCache, TaylorSeer): a mapping with
    # `type` none | fbcache | dbcache and its settings (step_cache_config.py, docs/step-cache.md); None = none.
    # A request's own `cache_config` replaces it for that request.
    cache_config: dict | None = None

    def __post_init__(self):
        self.validate()

    @property
    def world_size(self) -> int:
        """Ranks of one stage replica."""
        return self.tensor_parallel_size * self.ulysses_degree * self.cfg_parallel_size

    @property
    def paged(self) -> bool:
        return self.diffusion_kv_mode == "paged_scheduler"

    @property
    def prefix_caching(self) -> bool:
        """Whether the engine runs the prefix cache (the setting, resolved). Unset: on in paged mode,
        CFG parallel included (there a DiT row's keys name the CFG rank whose pool holds its pages:
        engine/prefix_ranks.py)."""
        return self.paged and self.enable_prefix_caching is not False

    @property
    def encoder_cache_bound(self) -> int:
        """Input images the DiT runner's encoder cache holds: `encoder_cache_images` with the prefix cache
        on (its keys are the page keys' image digests), else 0 (no encoder cache)."""
        return self.encoder_cache_images if self.prefix_caching else 0

    def validate(self) -> None:
        # model and device become paths / torch devices later: a YAML number or list must fail here
        for name in ("model", "device"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v.strip():
                raise ConfigError(name, v, "must be a non-empty string (model: 'tiny' or a checkpoint folder; "
                                           "device: auto, cpu, cuda or cuda:N)")
        if self.diffusion_kv_mode not in KV_MODES:
            raise ConfigError("diffusion_kv_mode", self.diffusion_kv_mode, f"choose one of {', '.join(KV_MODES)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError("attention_backend", self.attention_backend,
                              f"choose one of {', '.join(ATTENTION_BACKENDS)}")
        if self.cuda_graphs not in ("auto", "on", "off"):
            raise ConfigError("cuda_graphs", self.cuda_graphs, "choose one of auto, on, off")
        if self.dtype not in DTYPES:
            raise ConfigError("dtype", self.dtype, f"choose one of {', '.join(DTYPES)}")
        rows = self.diffusion_kv_max_rows_per_request
        if rows is not None and (not _is_int(rows) or rows <= 0):
            raise ConfigError("diffusion_kv_max_rows_per_request", rows,
                              "must be a positive integer (2 for CFG, 1 without)")
        if self.paged and rows is None:
            raise ConfigError("diffusion_kv_max_rows_per_request", rows,
                              "paged_scheduler needs the per-request row limit; set it to 2 for CFG "
                              "(cond + uncond) or 1 without CFG")
        self._validate_sizes()
        self._validate_switches()

    def _validate_sizes(self) -> None:
        """Pool, lengths, batching and envelope numbers."""
        if not _is_int(self.block_size) or self.block_size <= 0 or self.block_size % 16:
            raise ConfigError("block_size", self.block_size, "must be a positive multiple of 16 (e.g. 16, 64, 256)")
        if self.kv_cache_memory_bytes is not None and (not _is_int(self.kv_cache_memory_bytes)
                                                       or self.kv_cache_memory_bytes < 0):
            raise ConfigError("kv_cache_memory_bytes", self.kv_cache_memory_bytes,
                              "must be a byte count >= 0 (0 or unset = size automatically)")
        if self.num_kv_blocks is not None and (not _is_int(self.num_kv_blocks) or self.num_kv_blocks <= 0):
            raise ConfigError("num_kv_blocks", self.num_kv_blocks, "must be a positive integer or unset")
        g = self.gpu_memory_utilization
        # the range test first: it rejects inf/nan, and isfinite would overflow on a huge YAML int
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 < g <= 1 or not math.isfinite(g):
            raise ConfigError("gpu_memory_utilization", g, "must be in (0, 1], e.g. 0.9")
        if not _is_int(self.max_model_len) or (self.max_model_len <= 0 and self.max_model_len != -1):
            raise ConfigError("max_model_len", self.max_model_len, "must be > 0, or -1 to fit the KV pool")
        if not _is_int(self.max_num_seqs) or self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs", self.max_num_seqs, "must be an integer >= 1")
        if not _is_int(self.max_steps) or self.max_steps < 1:
            raise ConfigError("max_steps", self.max_steps, "must be an integer >= 1 (largest accepted steps)")
        b = self.max_num_batched_tokens
        if b is not None and (not _is_int(b) or b < 1):
            raise ConfigError("max_num_batched_tokens", b, "must be a positive integer, or unset for no bound")
        if not _is_int(self.torch_threads) or not 1 <= self.torch_threads <= 1024:
            raise ConfigError("torch_threads", self.torch_threads,
                              "must be an integer in 1..1024 (the same in every process of a stage graph)")
        for name in ("max_image_height", "max_image_width", "max_prompt_tokens"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v <= 0):
                raise ConfigError(name, v, "must be a positive integer, or unset for the model's default")

    def _validate_switches(self) -> None:
        """Booleans, quantization, parallel sizes, and the combinations dense mode refuses."""
        if not isinstance(self.torch_compile, bool):
            raise ConfigError("torch_compile", self.torch_compile, "must be true or false")
        if not isinstance(self.batch_invariant, bool):
            raise ConfigError("batch_invariant", self.batch_invariant, "must be true or false")
        p = self.enable_prefix_caching
        if p is not None and not isinstance(p, bool):
            raise ConfigError("enable_prefix_caching", p, "must be true or false (or unset: on in paged mode)")
        if p and not self.paged:
            raise ConfigError("enable_prefix_caching", p, "needs the paged KV cache (diffusion_kv_mode="
                              "paged_scheduler); dense_legacy has no shared pool to cache in")
        n = self.encoder_cache_images
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError("encoder_cache_images", n, "must be an integer >= 0 (input images whose embeddings "
                              "the DiT keeps across requests; 0 = off, default 4)")
        self._validate_quantization()
        self._validate_cache()
        if self.profile_memory is not None and not isinstance(self.profile_memory, bool):
            raise ConfigError("profile_memory", self.profile_memory,
                              "must be true or false (or unset: auto, on CUDA only)")
        for name in ("tensor_parallel_size", "ulysses_degree", "cfg_parallel_size"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ConfigError(name, v, "must be an integer >= 1 (1 = off)")
        if self.cfg_parallel_size > 2:
            raise ConfigError("cfg_parallel_size", self.cfg_parallel_size,
                              "CFG has two branches (cond, uncond): use 1 or 2")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ConfigError("enable_expert_parallel", self.enable_expert_parallel, "must be true or false")
        # dense mode runs one request per forward: a knob that promises batching is refused, never ignored
        b = self.max_num_batched_tokens
        if not self.paged:
            for name, on in (("max_num_seqs", self.max_num_seqs > 1), ("max_num_batched_tokens", b is not None)):
                if on:
                    raise ConfigError(name, getattr(self, name),
                                      "step-level batching needs the paged KV cache; set "
                                      "diffusion_kv_mode=paged_scheduler (dense_legacy runs one request at a time)")

    @property
    def step_cache(self):
        """The parsed `cache_config` (`step_cache_config.StepCacheConfig`; type none when unset)."""
        from .step_cache_config import parse

        return parse(self.cache_config)

    def _validate_cache(self) -> None:
        from .step_cache_config import parse

        if self.cache_config is not None and not isinstance(self.cache_config, dict):
            raise ConfigError("cache_config", self.cache_config, "must be a mapping, e.g. {type: fbcache} "
                                                                 "(on the command line: --cache-config JSON)")
        if not parse(self.cache_config).active:
            return
        if not self.paged:
            raise ConfigError("cache_config", self.cache_config, "step caching runs in the paged step "
                                                                 "(diffusion_kv_mode=paged_scheduler); dense_legacy "
                                                                 "has none: switch the mode or drop cache_config")

    def _validate_quantization(self) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError("quantization", self.quantization,
                              f"choose one of {', '.join(QUANTIZATIONS)}, or leave it unset (the checkpoint's dtype)")
        ign = self.quantization_ignored_layers
        if isinstance(ign, str) or not isinstance(ign, (list, tuple)) or \
                not all(isinstance(p, str) and p.strip() for p in ign):
            raise ConfigError("quantization_ignored_layers", ign,
                              "must be a list of module-name patterns, e.g. ['model.layers.0.*', '*.shared_mlp.*']")
        if ign and self.quantization is None:
            raise ConfigError("quantization_ignored_layers", ign, "only means something with quantization=fp8; "
                                                                  "set it, or drop the list")
        if self.fp8_fast_accum is not None and not isinstance(self.fp8_fast_accum, bool):
            raise ConfigError("fp8_fast_accum", self.fp8_fast_accum, "must be true or false (or unset: on)")
        if self.fp8_fast_accum and self.quantization is None:
            raise ConfigError("fp8_fast_accum", True, "only means something with quantization=fp8; set it, or "
                                                      "drop fp8_fast_accum")
        if self.fp8_grouped_gemm not in (None, *FP8_GROUPED_GEMMS):
            raise ConfigError("fp8_grouped_gemm", self.fp8_grouped_gemm, "must be " + ", ".join(FP8_GROUPED_GEMMS))
        if self.fp8_grouped_gemm in ("torch", "quack") and self.quantization is None:
            raise ConfigError("fp8_grouped_gemm", self.fp8_grouped_gemm, "only means something with "
                                                                         "quantization=fp8; set it, or drop it")

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict, source: str = "config") -> "EngineConfig":
        names = {f.name for f in fields(cls)}
        for key, why in REMOVED_KEYS.items():
            if key in data:
                raise ConfigError(key, data[key], f"in {source} was removed: {why}")
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(unknown[0], data[unknown[0]],
                              f"unknown key in {source}; valid keys: {', '.join(sorted(names))}")
        return cls(**data)

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def load_yaml(path: str | Path) -> dict:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError("config", str(path), "file not found; pass an existing stage YAML")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:  # unreadable (permissions, I/O)
        raise ConfigError("config", str(path), f"cannot read the file ({e.strerror or e})") from e
    except UnicodeDecodeError as e:
        raise ConfigError("config", str(path), f"not UTF-8 text ({e.reason} at byte {e.start}); "
                                               "pass a YAML text file") from e
    except (yaml.YAMLError, ValueError) as e:  # ValueError: an integer past Python's 4300-digit limit
        raise ConfigError("config", str(path), f"not valid YAML ({_one_line(e)})") from e
    if data is None:  # an empty (or comments-only) file used to pass as "no settings": say so instead
        raise ConfigError("config", str(path), "file is empty; put engine fields or a stages: section "
                                               "in it, or drop --config")
    if not isinstance(data, dict):
        raise ConfigError("config", str(path), f"the YAML top level must be a mapping of fields, "
                                               f"got a {type(data).__name__}")
    _check_keys(data, str(path))
    return data


def _check_keys(node, where: str, seen: set[int] | None = None) -> None:
    """Every mapping key is a string: YAML allows `1:` or `null:`, which the field checks cannot name
    (and sorting a mix of key types to list unknown keys would fail)."""
    if not isinstance(node, (dict, list)):
        return
    seen = set() if seen is None else seen
    if id(node) in seen:  # YAML anchors can make a node contain itself
        raise ConfigError("config", where, "a node refers to itself (YAML anchor loop); write the values out")
    seen.add(id(node))
    for k, v in (node.items() if isinstance(node, dict) else enumerate(node)):
        if isinstance(node, dict) and not isinstance(k, str):
            raise ConfigError("config", where, f"key {k!r} ({type(k).__name__}) is not a field name; "
                                               "keys must be strings")
        _check_keys(v, where, seen)
    seen.discard(id(node))  # a node shared by two anchors (no loop) is fine


def _one_line(e: Exception) -> str:
    """A parser's multi-line message (yaml marks the spot on extra lines) as one line."""
    return " ".join(str(e).split())


def engine_section(data: dict) -> dict:
    """The engine fields of a stage file: top-level keys, or those under `engine:`."""
    section = data.get("engine", data)
    if not isinstance(section, dict):
        raise ConfigError("engine", section, "must be a mapping of engine fields")
    return {k: v for k, v in section.items() if k not in ("stages", "transfer", "engine")}


def is_stage_file(path) -> bool:
    """A YAML with a `stages:` section describes a stage graph, not one engine."""
    return "stages" in load_yaml(path)
