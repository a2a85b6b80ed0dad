"""`ditkv bench step --preset release --compare-backend B`: the denoise step on the main
`--attention-backend` against backend B, same model, same run.

Separate runs of one backend each differ by more than the effect a faster attention kernel has on
a whole step (attention is ~13 % of it), so the two engines are built side by side on the same
weights and timed in alternation, eager and (where the step captures) as the engine's CUDA graph;
the ratio is main / B per round, and the report gives every round's ratio and their median.
"""

from __future__ import annotations

import statistics
import types

import torch

from .step_parts import _time

ROUNDS = 3


def compare_backends(args, model, cfg, device, image: int, quantization, other: str, make_engine) -> dict:
    """Time the main backend (`args.backend`) and `other` in alternation; ratios main / other.
    `make_engine(args, model, cfg, device, image, quantization)` -> (engine, request id, layout): the
    release bench's own engine builder, handed in (this module stays below step_release)."""
    from ..worker.cuda_graph import DenoiseStepGraph, graph_unusable
    from ..worker.rows import DENOISE, PREFILL

    model.set_moe_impl("auto")  # the engine's choice, as its graphs run
    t, x, sides = torch.tensor([500.0], device=device), None, []
    try:
        for name in (args.backend, other):
            e, rid, layout = make_engine(types.SimpleNamespace(**{**vars(args), "backend": name}), model, cfg,
                                             device, image, quantization)
            runner = e.worker.runner
            if x is None:  # one latent for both sides
                g = torch.Generator(device=device).manual_seed(0)
                x = torch.randn(1, cfg.latent_channels, layout.h, layout.w, device=device, generator=g)
            with torch.inference_mode():
                runner.forward_step(rid, layout, x, t, PREFILL, True, None)  # the prefix pages, once
                graph = None if graph_unusable(runner) else DenoiseStepGraph(runner, rid, layout)
            eager = (lambda r=runner, i=rid, lay=layout: r.forward_step(i, lay, x, t, DENOISE, False, None))
            replay = None if graph is None else (lambda gr=graph: gr.replay(x, t))
            sides.append({"engine": e, "name": e.worker.backend.name, "eager": eager, "replay": replay,
                          "eager_ms": [], "graph_ms": []})
        with torch.inference_mode():
            for _ in range(ROUNDS):
                for s in sides:
                    s["eager_ms"].append(_time(s["eager"], device, args.repeats) * 1e3)
                    if s["replay"] is not None:
                        s["graph_ms"].append(_time(s["replay"], device, args.repeats) * 1e3)
        for s in sides:
            s["calls"] = dict(getattr(s["engine"].worker.backend, "calls", {}))
    finally:
        for s in sides:
            s["engine"].shutdown()
    return _report(sides)


def _report(sides: list[dict]) -> dict:
    main, other = sides
    out = {"main": main["name"], "other": other["name"], "rounds": ROUNDS,
           "attention_calls": {main["name"]: main["calls"], other["name"]: other["calls"]}}
    for kind in ("eager", "graph"):
        a, b = main[f"{kind}_ms"], other[f"{kind}_ms"]
        if not a:
            out[kind] = None
            continue
        ratios = [x / y for x, y in zip(a, b)]
        out[kind] = {"main_ms": a, "other_ms": b, "ratios": ratios, "ratio_median": statistics.median(ratios)}
    return out
