"""The engine run of `ditkv bench prefix` (docs/prefix-cache.md): each request of a case alone through a
cache-off and a cache-on `Engine` in turn (A/B in one process, the order swapped every request), on the
bundled tiny models (CPU fp32) or, with `--geometry release`, the release architecture on a device
(`prefix_release`).

Per request it times the whole wait to the first denoise step (`add_request`, layout and keys included,
to the end of the engine step that admits it and runs its first step), that first step alone, and, with
3 steps or more, the next step (a denoise step: the target's queries over every key). Two measures of
issue 36's "time saved over the shared share" come out of them (medians over the requests that can hit,
so a one-off kernel compile does not count):

- **first step**: the time saved to the first denoise step, over the share of the first step's query
  tokens the request did not compute (cache hits and pages a row took from its row 0). The target's
  queries and the step's fixed cost do not shrink with a hit, so this stays below 1 by construction;
- **prefix prefill**: the prefix's own part of the first step (first step less a denoise step, which
  runs the same target queries over the same keys), cache off, against the first step saved, over the
  share of the prefix tokens shared.
"""

from __future__ import annotations

import statistics
import time

import numpy as np


def _bundle(model: str, change):
    import torch

    from ..models.loader import load_model

    bundle = load_model(model, torch.device("cpu"), torch.float32)
    if change is not None:
        bundle[0].config = change(bundle[0].config)
    return bundle


def _engine(model: str, bundle, requests, cache: bool):
    from ..config import EngineConfig
    from ..engine.engine import Engine

    longest = max(len(r.prompt) for r in requests)
    return Engine(EngineConfig(model=model, device="cpu", dtype="float32", block_size=16, num_kv_blocks=4096,
                               diffusion_kv_max_rows_per_request=2, max_prompt_tokens=max(256, longest),
                               enable_prefix_caching=cache), model_bundle=bundle)


def _timed_step(eng, sync, done: dict) -> float:
    t0 = time.perf_counter()
    done.update({o.request_id: o for o in eng.step()})
    sync()
    return time.perf_counter() - t0


def _one_request(eng, r, sync) -> dict:
    done: dict = {}
    t0 = time.perf_counter()
    eng.add_request(r)
    first = _timed_step(eng, sync, done)  # admits it and runs its first step
    ttfs = time.perf_counter() - t0
    denoise = _timed_step(eng, sync, done) if r.steps >= 3 else None  # step 1: no decode in it
    done.update({o.request_id: o for o in eng.run_until_complete()})
    total = time.perf_counter() - t0  # the image is on the host by now
    o = done[r.request_id]
    if not o.ok:
        raise RuntimeError(f"bench request {r.request_id} failed: {o.error}")
    rows = eng.processor.process(r)[1].rows  # (untimed) the whole rows: the first step's tokens, off
    return {"ttfs_s": ttfs, "first_step_s": first, "denoise_step_s": denoise, "total_s": total, "image": o.image,
            "hit_tokens": o.stats.prefix_cache_hit_tokens, "shared_rows_tokens": o.stats.prefix_shared_rows_tokens,
            "tokens_computed": o.stats.tokens_computed, "row_tokens": sum(x.seq_len for x in rows),
            "prefix_tokens": sum(x.prefix_len for x in rows)}


def _ab(make_engine, requests, sync=lambda: None) -> tuple[list[dict], list[dict]]:
    """Each request through the cache-off engine and the cache-on one, in turn (A/B in one process,
    the order swapped every request): both see the same machine load."""
    engines = [make_engine(c) for c in (False, True)]
    out = ([], [])
    try:
        for i, r in enumerate(requests):
            for c in ((0, 1) if i % 2 == 0 else (1, 0)):
                out[c].append(_one_request(engines[c], r, sync))
    finally:
        for eng in engines:
            eng.shutdown()
    return out


def _setup(case, args):
    """(requests, engine factory cache -> Engine, device sync, what ran) for the case's engine run."""
    if args.geometry == "release":
        from . import prefix_release as pr

        _, change, requests = case.tiny(args, args.requests)
        bundle = pr.bundle(args, change)
        device = next(bundle[0].parameters()).device
        return requests, pr.engine_factory(args, bundle, requests), lambda: pr.sync(device), pr.describe(args, bundle)
    model, change, requests = case.tiny(args, args.requests)
    bundle = _bundle(model, change)
    return requests, lambda cache: _engine(model, bundle, requests, cache), lambda: None, {"geometry": "tiny",
                                                                                           "model": model}


def run_engine(case, args) -> dict:
    requests, make, sync, what = _setup(case, args)
    _ab(make, requests[:1], sync)  # process warm-up (allocator, first calls, kernels), in engines of their own
    off, on = _ab(make, requests, sync)
    per = [{"request": i, "ttfs_off_s": a["ttfs_s"], "ttfs_on_s": b["ttfs_s"], "total_off_s": a["total_s"],
            "total_on_s": b["total_s"], "first_step_off_s": a["first_step_s"], "first_step_on_s": b["first_step_s"],
            "denoise_step_off_s": a["denoise_step_s"], "denoise_step_on_s": b["denoise_step_s"],
            "hit_tokens": b["hit_tokens"],
            "shared_rows_tokens": b["shared_rows_tokens"], "first_step_tokens_off": a["row_tokens"],
            "prefix_tokens": a["prefix_tokens"],
            "tokens_computed_off": a["tokens_computed"], "tokens_computed_on": b["tokens_computed"]}
           for i, (a, b) in enumerate(zip(off, on))]
    return {**what, "requests": len(per), "steps": requests[0].steps, "size": args.size,
            "bit_identical": all(np.array_equal(a["image"], b["image"]) for a, b in zip(off, on)),
            **summary(per), "per_request": per}


def _mean(rows, key):
    return statistics.fmean(r[key] for r in rows)


def _median(rows, key):
    return statistics.median(r[key] for r in rows)


def summary(per: list[dict]) -> dict:
    """Means (all requests, and the later ones) and the two saved-over-share measures (module doc)."""
    later = per[1:] or per  # the first request finds nothing cached
    skipped = lambda r: r["hit_tokens"] + r["shared_rows_tokens"]  # noqa: E731
    share = statistics.fmean(skipped(r) / r["first_step_tokens_off"] for r in later)
    saved_mean = 1 - _mean(later, "ttfs_on_s") / _mean(later, "ttfs_off_s")
    saved = 1 - _median(later, "ttfs_on_s") / _median(later, "ttfs_off_s")
    out = {"ttfs_mean_off_s": _mean(per, "ttfs_off_s"), "ttfs_mean_on_s": _mean(per, "ttfs_on_s"),
           "ttfs_ratio": _mean(per, "ttfs_off_s") / _mean(per, "ttfs_on_s"),
           "total_ratio": _mean(per, "total_off_s") / _mean(per, "total_on_s"),
           "ttfs_later_mean_off_s": _mean(later, "ttfs_off_s"), "ttfs_later_mean_on_s": _mean(later, "ttfs_on_s"),
           "ttfs_later_median_off_s": _median(later, "ttfs_off_s"),
           "ttfs_later_median_on_s": _median(later, "ttfs_on_s"),
           "hit_share_of_first_step": share, "time_saved": saved_mean,
           "time_saved_over_share": saved_mean / share if share else None,
           "time_saved_median": saved, "time_saved_over_share_median": saved / share if share else None}
    if all(r["denoise_step_off_s"] is not None for r in later):
        prefill = _median(later, "first_step_off_s") - _median(later, "denoise_step_off_s")
        saved_s = _median(later, "first_step_off_s") - _median(later, "first_step_on_s")
        pshare = statistics.fmean(skipped(r) / r["prefix_tokens"] for r in later)
        out |= {"denoise_step_median_off_s": _median(later, "denoise_step_off_s"),
                "denoise_step_median_on_s": _median(later, "denoise_step_on_s"),
                "first_step_median_off_s": _median(later, "first_step_off_s"),
                "first_step_median_on_s": _median(later, "first_step_on_s"),
                "prefix_prefill_off_s": prefill, "prefix_prefill_saved_s": saved_s, "shared_share_of_prefix": pshare,
                "prefix_prefill_saved_over_share": saved_s / prefill / pshare if prefill > 0 and pshare else None}
    return out
