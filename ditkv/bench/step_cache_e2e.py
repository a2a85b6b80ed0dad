"""`ditkv bench step --preset release --e2e-request --cached-fraction F[,F...]`: whole requests with a
forced step-cache fraction, and `--cache-none-ab`: an engine with `cache_config` unset against one
with `{"type": "none"}`. docs/step-cache.md.

A forced fraction F of N steps caches k = floor(F*N + 1/2) steps (at most N - 1: step 0, the prefill,
always computes). The N - k computed steps are spread evenly, step i*N // (N - k) for i < N - k (so
step 0 is one of them); the request brings `--cache-config` (default fbcache: its type, Fn, Bn and
taylorseer) with `residual_threshold` inf, `warmup_steps` 0, no `max_*` limit and those steps as its
`steps_mask`, so every other step is cached: exactly k. Fraction 0 is the baseline, a request with
`{"type": "none"}` (the plain step, every layer). All fractions run on one engine (its `cache_config`
is `--cache-config`), one request per fraction in turn, the order rotated every repeat, so drift hits
each alike.

Every step's end is marked (`on_step`): a CUDA event on a GPU (no sync, the steps run as served), the
host clock on a CPU. A step's time is its mark less the previous one; steps 1..N-2 are counted (step 0
holds the intake and the prefill, the last the VAE decode). `cached_step_cost` = the mean cached step
of fraction F / the mean step of the baseline (a full step), per repeat, then the median;
`fastest_cached_step_cost` = the fastest cached step / the fastest full step over all repeats (load
from other processes only slows a step, so on a shared host the fastest are the least disturbed).
"""

from __future__ import annotations

import statistics
import time

import torch

from .common import emit, machine
from .step_e2e import _engine, _request, _run_requests, prepare

_FORCED = {"residual_threshold": "inf", "warmup_steps": 0, "max_cached_steps": None,
           "max_continuous_cached_steps": None}


def parse_fractions(text: str | None) -> list[float]:
    if text is None:
        return []
    try:
        out = [float(f) for f in text.split(",") if f.strip()]
    except ValueError:
        out = []
    if not out or any(not 0.0 <= f < 1.0 for f in out):
        raise SystemExit(f"ditkv bench step: --cached-fraction {text!r}: give fractions in [0, 1), e.g. 0.3,0.5,0.7")
    return sorted(set(out) - {0.0})


def computed_steps(steps: int, fraction: float) -> list[int]:
    """The steps that compute under a forced `fraction`: N - k of them, evenly spread, step 0 first."""
    cached = min(int(fraction * steps + 0.5), steps - 1)
    c = steps - cached
    return [i * steps // c for i in range(c)]


def forced_cache(base: dict, steps: int, fraction: float) -> dict:
    if fraction == 0:
        return {"type": "none"}
    return {**base, **_FORCED, "steps_mask": computed_steps(steps, fraction)}


class StepMarks:
    """The engine's `on_step`: every step's end, as a CUDA event (recorded on the stream, no sync) or
    the host clock on a CPU."""

    def __init__(self, device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: dict[str, dict[int, object]] = {}

    def __call__(self, rid: str, i: int, steps: int) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.setdefault(rid, {})[i] = ev
        else:
            self.marks.setdefault(rid, {})[i] = time.perf_counter()

    def step_seconds(self, rid: str, steps: int) -> dict[int, float]:
        """Seconds of steps 1..N-2 (call once the request is done: the events have completed)."""
        m = self.marks.pop(rid)
        if self.cuda:
            return {i: m[i - 1].elapsed_time(m[i]) / 1e3 for i in range(1, steps - 1)}
        return {i: m[i] - m[i - 1] for i in range(1, steps - 1)}


def _timed(engine, marks: StepMarks, args, image: int, steps: int, seed: int, device, cache: dict | None) -> dict:
    """One request (its own `cache`; None: the engine's), alone."""
    req = _request(args, image, steps, seed)
    req.cache_config = cache
    t0, t1, (out,) = _run_requests(engine, [req], device)
    per_step = marks.step_seconds(out.request_id, steps)
    mask = set((cache or {}).get("steps_mask") or range(steps))
    comp = [s for i, s in per_step.items() if i in mask]
    cached = [s for i, s in per_step.items() if i not in mask]
    return {"total_s": t1 - t0, "computed_steps": out.stats.computed_steps, "cached_steps": out.stats.cached_steps,
            "computed_step_s": statistics.fmean(comp) if comp else None,
            "cached_step_s": statistics.fmean(cached) if cached else None,
            "fastest_computed_step_s": min(comp, default=None), "fastest_cached_step_s": min(cached, default=None)}


def _median(runs: list[dict], key: str):
    vals = [r[key] for r in runs if r[key] is not None]
    return statistics.median(vals) if vals else None


def _alternate(engines: dict, marks: dict, args, image: int, steps: int, device, caches: dict) -> dict:
    """`--repeats` rounds, one request per variant each round, the order rotated every round."""
    names = list(caches)
    for name in names:  # warm-up: compile, capture, autotune; the full length, so that the mask fits
        _timed(engines[name], marks[name], args, image, steps, 0, device, caches[name])
    runs = {name: [] for name in names}
    for r in range(args.repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            runs[name].append(_timed(engines[name], marks[name], args, image, steps, 1 + r, device, caches[name]))
    return runs


def _summary(runs: list[dict], steps: int, full_step: list[float] | None) -> dict:
    out = {k: _median(runs, k) for k in ("total_s", "computed_step_s", "cached_step_s")}
    out["computed_steps"], out["cached_steps"] = runs[0]["computed_steps"], runs[0]["cached_steps"]
    for k in ("fastest_computed_step_s", "fastest_cached_step_s"):
        vals = [r[k] for r in runs if r[k] is not None]
        out[k] = min(vals) if vals else None
    if full_step is not None:
        costs = [r["cached_step_s"] / f for r, f in zip(runs, full_step) if r["cached_step_s"] is not None]
        out["cached_step_cost"] = statistics.median(costs) if costs else None
    out["runs"] = runs
    return out


def run_fractions(args, fractions: list[float], base: dict, parts, device, dtype, image: int, quantization,
                  steps: int, impl: str) -> dict:
    """The forced fractions (and the baseline) on one engine whose `cache_config` is `base`."""
    from ..models.hunyuan import ByteTokenizer
    from .step_release import _set_impl, build_model, free_device

    cfg, _, codec = parts
    model, build = build_model(cfg, device, dtype, quantization)
    _set_impl(model, impl)
    marks = StepMarks(device)
    e = _engine(args, (model, ByteTokenizer(), codec), device, image, quantization, 1, marks, cache_config=base)
    caches = {f: forced_cache(base, steps, f) for f in [0.0, *fractions]}
    try:
        runs = _alternate({f: e for f in caches}, {f: marks for f in caches}, args, image, steps, device, caches)
        graphs = e.worker.runner.step_graphs is not None
    finally:
        e.shutdown()
        del e
        free_device(device)
    full = [r["computed_step_s"] for r in runs[0.0]]
    table = {"0": _summary(runs[0.0], steps, None)}
    for f in fractions:
        s = _summary(runs[f], steps, full)
        # load from other processes only slows a step: the fastest steps are the least disturbed
        s["fastest_cached_step_cost"] = s["fastest_cached_step_s"] / table["0"]["fastest_computed_step_s"] \
            if s["fastest_cached_step_s"] else None
        want = steps - len(computed_steps(steps, f))
        if s["cached_steps"] != want:
            raise SystemExit(f"ditkv bench step: fraction {f}: {s['cached_steps']} steps cached, the mask wants {want}")
        s["speedup"] = table["0"]["total_s"] / s["total_s"]
        s["computed_step_vs_full"] = s["computed_step_s"] / table["0"]["computed_step_s"] \
            if s["computed_step_s"] else None
        s["steps_mask"] = caches[f]["steps_mask"]
        s["runs"] = s.pop("runs")  # the per-repeat detail last: a truncated print keeps the summary
        table[str(f)] = s
    return {"cache_config": base, "cuda_graphs": graphs, "build": build, "fractions": table}


def run_none_ab(args, parts, device, dtype, image: int, quantization, steps: int, impl: str) -> dict:
    """Two plain engines on the same weights, `cache_config` unset and `{"type": "none"}`, alternated:
    the step time ratio unset / none (the goal: >= 0.99)."""
    from ..models.hunyuan import ByteTokenizer
    from .step_release import _set_impl, build_model, free_device

    cfg, _, codec = parts
    model, _ = build_model(cfg, device, dtype, quantization)
    _set_impl(model, impl)
    bundle = (model, ByteTokenizer(), codec)
    names = {"unset": None, "none": {"type": "none"}}
    marks = {n: StepMarks(device) for n in names}
    engines = {n: _engine(args, bundle, device, image, quantization, 1, marks[n], cache_config=c)
               for n, c in names.items()}
    try:
        runs = _alternate(engines, marks, args, image, steps, device, {n: None for n in names})
    finally:
        for e in engines.values():
            e.shutdown()
        del engines
        free_device(device)
    out = {n: _summary(r, steps, None) for n, r in runs.items()}
    ratios = [u["computed_step_s"] / n["computed_step_s"] for u, n in zip(runs["unset"], runs["none"])]
    out["step_time_unset_over_none"] = statistics.median(ratios)
    out["fastest_step_unset_over_none"] = out["unset"]["fastest_computed_step_s"] / \
        out["none"]["fastest_computed_step_s"]
    return out


def report(args, result: dict) -> None:
    rows = []
    for f, s in result.get("fractions", {}).items():
        rows.append({"run": f"cached fraction {f}", "computed": s["computed_steps"], "cached": s["cached_steps"],
                     "total s": s["total_s"], "speedup": s.get("speedup", 1.0),
                     "computed step ms": _ms(s["computed_step_s"]), "cached step ms": _ms(s["cached_step_s"]),
                     "cached / full step": s.get("cached_step_cost"),
                     "fastest cached / full": s.get("fastest_cached_step_cost")})
    ab = result.get("none_ab")
    if ab:
        for name in ("unset", "none"):
            s = ab[name]
            rows.append({"run": f"cache_config {name}", "computed": s["computed_steps"], "cached": s["cached_steps"],
                         "total s": s["total_s"], "speedup": None, "computed step ms": _ms(s["computed_step_s"]),
                         "cached step ms": None, "cached / full step": None, "fastest cached / full": None})
    result["machine"] = machine()
    emit(result, args.json, rows, None)
    if ab and not args.json:
        print(f"step time, cache_config unset / {{\"type\": \"none\"}}: {ab['step_time_unset_over_none']:.4f} "
              f"(median of the repeats' ratios), fastest step {ab['fastest_step_unset_over_none']:.4f}")


def _ms(seconds):
    return None if seconds is None else 1e3 * seconds


def run(args) -> dict:
    """`--cached-fraction` / `--cache-none-ab`: whole requests, one at a time on one model."""
    quants, impl, device, dtype, image, steps, parts = prepare(args)
    if len(quants) > 1 or args.max_num_seqs != [1]:
        raise SystemExit("ditkv bench step: --cached-fraction / --cache-none-ab time one request at a time on one "
                         "model: drop --compare-bf16 and --max-num-seqs")
    if steps < 4:
        raise SystemExit("ditkv bench step: --cached-fraction / --cache-none-ab time steps 1..N-2 (step 0 holds the "
                         "prefill, the last the decode): give --e2e-steps 4 or more")
    fractions = parse_fractions(args.cached_fraction)
    result = {"preset": "release", "e2e_request": True, "shrink": args.shrink, "layers": args.layers, "image": image,
              "quantization": quants[0], "steps": steps, "moe_impl": impl, "device": str(device),
              "dtype": str(dtype).replace("torch.", ""), "repeats": args.repeats}
    if fractions:
        base = args.cache_wire or {"type": "fbcache"}
        result.update(run_fractions(args, fractions, base, parts, device, dtype, image, quants[0], steps, impl))
    if args.cache_none_ab:
        result["none_ab"] = run_none_ab(args, parts, device, dtype, image, quants[0], steps, impl)
    report(args, result)
    return result

