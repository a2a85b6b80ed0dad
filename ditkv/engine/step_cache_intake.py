"""A request's step cache at intake: its own `cache_config` (or the engine's) checked against the model's
layers, its steps and this engine, then carried to the ranks in its `SamplingParams.cache`.

Errors are client errors (`LayoutError` on field `cache_config`, HTTP 400) naming the key and the fix. A
warmup that covers every step is said (a log line), not refused: a distilled 8-step checkpoint may hit it.
"""

from __future__ import annotations

import logging

import msgspec

from ..errors import ConfigError, LayoutError
from ..step_cache_config import parse

log = logging.getLogger("ditkv.engine")


def step_cache_params(config, model_config, req, params):
    """`params` with the request's own step cache (unchanged when it brings none)."""
    own = getattr(req, "cache_config", None)
    try:
        if own is not None and not isinstance(own, dict):
            raise ConfigError("cache_config", own, "must be a JSON object, e.g. {\"type\": \"fbcache\"}")
        cache = parse(own) if own is not None else config.step_cache
        if own is not None and cache.active:
            _check_engine(config)
        cache.check_model(model_config.num_hidden_layers)
        note = cache.check_steps(params.steps)
    except ConfigError as e:
        raise LayoutError(f"{e.field}: {e.value!r} is invalid: {e.fix}", field="cache_config") from None
    if note:
        log.info("request %s: %s", req.request_id or "(new)", note)
    if own is None:
        return params
    return msgspec.structs.replace(params, cache=cache.to_wire())


def _check_engine(config) -> None:
    if not config.paged:
        raise ConfigError("cache_config", "a request's own", "step caching runs in the paged step; this engine "
                                                             "runs dense_legacy: drop the request's cache_config")
