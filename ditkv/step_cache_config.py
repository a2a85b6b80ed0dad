"""`cache_config`: step caching of the DiT's middle blocks (first-block cache / DBCache, TaylorSeer).

A denoise step runs the front blocks (`Fn`) for every request, compares the front blocks' output
residual with the one of the request's last computed step, and, when it barely moved, skips the
middle blocks and adds their stored residual (or its TaylorSeer extrapolation) before the back
blocks (`Bn`). Where it is set: the engine's `cache_config` (a `--config` YAML mapping, a DiT
stage's `engine.cache_config`, `--cache-config JSON`) and a request's own `cache_config` (Python
API, the HTTP extra field), which replaces the engine's for that request. docs/step-cache.md.

Every error names the key and the fix (`ConfigError`); the model-dependent check (`check_model`) and
the step-dependent one (`check_steps`) run when the layer count and the request's steps are known.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

from .errors import ConfigError

CACHE_TYPES = ("none", "fbcache", "dbcache")
# cache-dit's DBCache default is F8B0; the first-block cache is F1B0 by definition
DEFAULT_BLOCKS = {"none": (1, 0), "fbcache": (1, 0), "dbcache": (8, 0)}
KEYS = ("type", "Fn", "Bn", "residual_threshold", "warmup_steps", "max_cached_steps",
        "max_continuous_cached_steps", "steps_mask", "taylorseer")


@dataclass(frozen=True)
class StepCacheConfig:
    type: str = "none"
    Fn: int = 1  # front blocks: run every step; their residual decides
    Bn: int = 0  # back blocks: run every step after the (computed or reused) middle
    residual_threshold: float = 0.08  # relative L1 change of the front residual below which a step is cached
    warmup_steps: int = 8  # the first steps always compute
    max_cached_steps: int | None = None  # cached steps per request at most (None: no bound)
    max_continuous_cached_steps: int | None = None  # cached steps in a row at most (None: no bound)
    steps_mask: tuple[int, ...] | None = None  # steps that always compute (cache-dit's computation mask)
    taylorseer: int | None = None  # None: reuse the middle residual; 1 or 2: extrapolate it over the step index

    @property
    def active(self) -> bool:
        return self.type != "none"

    def check_model(self, num_layers: int, field: str = "cache_config") -> None:
        """Fn + Bn must leave at least one middle block to skip."""
        if self.active and self.Fn + self.Bn >= num_layers:
            raise ConfigError(f"{field}.Fn", self.Fn,
                              f"Fn + Bn = {self.Fn} + {self.Bn} leaves no middle block of the model's {num_layers} "
                              f"layers to cache; make Fn + Bn at most {num_layers - 1}")

    def check_steps(self, steps: int, field: str = "cache_config") -> str | None:
        """A mask step outside [0, steps) is an error; returns a note when no step can be cached
        (warmup covers every step: a distilled 8-step checkpoint may hit it, so it is said, not refused)."""
        if not self.active:
            return None
        bad = [s for s in self.steps_mask or () if s >= steps]
        if bad:
            raise ConfigError(f"{field}.steps_mask", list(self.steps_mask),
                              f"step {bad[0]} is outside the request's steps [0, {steps}); list steps below {steps}")
        if self.warmup_steps >= steps:
            return (f"cache_config: warmup_steps={self.warmup_steps} >= steps={steps}, so no step of this request "
                    "is cached; lower warmup_steps to cache some")
        return None

    def to_wire(self) -> dict:
        if not self.active:  # its other fields mean nothing (and `parse` refuses them with type none)
            return {"type": "none"}
        d = asdict(self)
        if d["steps_mask"] is not None:
            d["steps_mask"] = list(d["steps_mask"])
        if math.isinf(d["residual_threshold"]):  # msgpack keeps inf, JSON would not: keep it a string
            d["residual_threshold"] = "inf"
        return d


# the highest TaylorSeer order a request may ask for: the startup reservation's worst case when requests
# can bring their own cache_config
MAX_TAYLORSEER = 2


def state_bytes(image_tokens: int, target_tokens: int, hidden: int, itemsize: int, order: int) -> int:
    """The most one request's stored step-cache state holds (`RequestCache.nbytes` never exceeds it):
    the front residual over its rows' image tokens plus `order + 1` middle-residual terms over its
    rows' target tokens (TaylorSeer order; 0 = plain reuse), all [tokens, hidden] in the model dtype."""
    return (image_tokens + (order + 1) * target_tokens) * hidden * itemsize


def parse(value, field: str = "cache_config") -> StepCacheConfig:
    """A mapping (YAML, a request), a JSON string (the CLI) or None (no cache) -> `StepCacheConfig`."""
    if value is None:
        return StepCacheConfig()
    if isinstance(value, StepCacheConfig):
        return value
    if isinstance(value, str):
        value = _json(value, field)
    if not isinstance(value, dict):
        raise ConfigError(field, value, "must be a mapping, e.g. {type: fbcache, residual_threshold: 0.08}")
    unknown = sorted(k for k in value if k not in KEYS)
    if unknown:
        raise ConfigError(f"{field}.{unknown[0]}", value[unknown[0]], f"unknown key; valid keys: {', '.join(KEYS)}")
    kind = value.get("type", "none")
    if kind not in CACHE_TYPES:
        raise ConfigError(f"{field}.type", kind, f"choose one of {', '.join(CACHE_TYPES)}")
    fn, bn = DEFAULT_BLOCKS[kind]
    if kind == "fbcache" and (value.get("Fn", 1), value.get("Bn", 0)) != (1, 0):
        raise ConfigError(f"{field}.type", kind, "the first-block cache is Fn=1 Bn=0; use type dbcache for other "
                                                 "front/back block counts")
    out = StepCacheConfig(
        type=kind,
        Fn=_int(value.get("Fn", fn), f"{field}.Fn", 1),
        Bn=_int(value.get("Bn", bn), f"{field}.Bn", 0),
        residual_threshold=_threshold(value.get("residual_threshold", 0.08), f"{field}.residual_threshold"),
        warmup_steps=_int(value.get("warmup_steps", 8), f"{field}.warmup_steps", 0),
        max_cached_steps=_bound(value.get("max_cached_steps"), f"{field}.max_cached_steps"),
        max_continuous_cached_steps=_bound(value.get("max_continuous_cached_steps"),
                                           f"{field}.max_continuous_cached_steps"),
        steps_mask=_mask(value.get("steps_mask"), f"{field}.steps_mask"),
        taylorseer=_taylor(value.get("taylorseer"), f"{field}.taylorseer"),
    )
    if not out.active and any(k != "type" for k in value):
        extra = next(k for k in value if k != "type")
        raise ConfigError(f"{field}.{extra}", value[extra], "means nothing with type none; set type fbcache or "
                                                            "dbcache, or drop it")
    return out


def _json(text: str, field: str):
    if text.strip().lower() == "none":
        return {"type": "none"}
    try:
        return json.loads(text)
    except ValueError as e:
        raise ConfigError(field, text, f"not valid JSON ({e}); e.g. '{{\"type\": \"fbcache\"}}'") from None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


MAX_COUNT = 1_000_000  # any step or layer count fits; bounds what a request carries to the ranks


def _int(v, name: str, least: int) -> int:
    if not _is_int(v) or not least <= v <= MAX_COUNT:
        raise ConfigError(name, v, f"must be an integer in {least}..{MAX_COUNT}")
    return v


def _bound(v, name: str) -> int | None:
    if v is None or (_is_int(v) and v == -1):  # -1: no bound, as cache-dit writes it
        return None
    if not _is_int(v) or not 0 <= v <= MAX_COUNT:
        raise ConfigError(name, v, f"must be an integer in 0..{MAX_COUNT}, or -1 / null for no bound")
    return v


def _threshold(v, name: str) -> float:
    if isinstance(v, str) and v.strip().lower() in ("inf", "infinity"):
        return math.inf
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) <= MAX_COUNT:
        v = float(v)  # a huge int would not convert
    if not isinstance(v, float) or math.isnan(v):
        raise ConfigError(name, v, "must be a number >= 0 (or inf: cache every step the limits allow)")
    if v < 0:
        raise ConfigError(name, v, "must be >= 0: it bounds a relative L1 change (0 caches nothing; 0.08 is "
                                   "cache-dit's default)")
    return float(v)


def _mask(v, name: str) -> tuple[int, ...] | None:
    if v is None:
        return None
    if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)) or not all(_is_int(s) for s in v) \
            or len(v) > MAX_COUNT or any(s > MAX_COUNT for s in v):
        raise ConfigError(name, v, "must be a list of step indices, e.g. [0, 1, 2, 10, 20]")
    neg = [s for s in v if s < 0]
    if neg:
        raise ConfigError(name, list(v), f"step {neg[0]} is negative; steps count from 0")
    return tuple(sorted(set(v)))


def _taylor(v, name: str) -> int | None:
    if v is None or v is False:
        return None
    if not _is_int(v) or v not in (1, 2):
        raise ConfigError(name, v, "must be 1 or 2 (the TaylorSeer order), or null for plain reuse")
    return v
