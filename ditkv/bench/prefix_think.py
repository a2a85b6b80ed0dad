"""Issue 36's think case: N AR-phase requests behind one shared system prompt through an engine with
the prefix cache on and off (docs/prefix-cache-ar.md).

Each setting builds its own engine over one model bundle, runs one warm-up request with the shared text
(it writes the pages the later requests hit, and warms the process alike in both settings), then adds
the N requests at once and runs them to completion. Measured per request: the time from its
`add_request` to the end of its first denoise step (its AR phase, the handover and its DiT prefill
included). The AR prefill tokens are the head tokens the engine sent to the ranks (`ARPhases.
head_tokens_fed`); the cache saves the hits'. Texts and images are compared bit for bit.

On the bundled tiny model (no think template) the shared text is prepended to each prompt and the AR
phase writes `max_new_tokens` of text (`ignore_eos`); with a checkpoint whose template has a system
prompt, pass `bot_task="think"` and `system=""`: the template's Instruct system prompt is the shared part.
"""

from __future__ import annotations

import statistics
import time

import msgspec
import numpy as np

SYSTEM = ("You are a careful illustrator. Think about the picture before you draw it: its subject, layout, "
          "colours and light, then describe it plainly. ") * 4
TAILS = ("a red fox in the snow", "a lighthouse at dusk", "two cats on a sofa", "a bowl of lemons",
         "a sailing boat", "a mountain village", "a robot reading", "a bicycle by a wall")


def _requests(n, system, size, steps, max_new_tokens, bot_task, seed0, image=None):
    """`image` (uint8 [H, W, 3]): every request edits it with one seed, so its pages (and the AR's VAE
    sample) are the same in all; without, each request draws its own seed."""
    from ..engine.types import GenerationRequest

    extra = {} if bot_task is None else {"bot_task": bot_task}
    if image is not None:
        extra["images"] = [image]
    return [GenerationRequest(prompt=system + TAILS[i % len(TAILS)] + (f" #{i}" if i >= len(TAILS) else ""),
                              request_id=f"think-{i}", seed=seed0 + (0 if image is not None else i), height=size,
                              width=size, steps=steps, guidance_scale=2.0, max_new_tokens=max_new_tokens,
                              ignore_eos=True, **extra)
            for i in range(n)]


def edit_image(size: int):
    """The one input image of the think-edits case: fixed noise, `size` pixels square."""
    return np.random.default_rng(7).integers(0, 256, (size, size, 3), dtype=np.uint8)


def _run(bundle, engine_kw: dict, cache: bool, warm, reqs) -> dict:
    from ..config import EngineConfig
    from ..engine.engine import Engine

    first: dict[str, float] = {}
    eng = Engine(EngineConfig(**engine_kw, enable_prefix_caching=cache), model_bundle=bundle,
                 on_step=lambda rid, i, steps: first.setdefault(rid, time.perf_counter()) if i == 0 else None)
    try:
        out = eng.generate(warm)
        if not out.ok:
            raise RuntimeError(f"the warm-up request failed: {out.error}")
        fed0 = eng.ar.head_tokens_fed
        added = {}
        for r in reqs:
            added[r.request_id] = time.perf_counter()
            eng.add_request(r)
        outs = {o.request_id: o for o in eng.run_until_complete()}
        bad = [o.error for o in outs.values() if not o.ok]
        if bad:
            raise RuntimeError(f"{len(bad)} requests failed: {bad[0]}")
        ttfs = [first[r.request_id] - added[r.request_id] for r in reqs]
        return {"ttfs_s": ttfs, "mean_ttfs_s": statistics.fmean(ttfs),
                "ar_prefill_tokens": eng.ar.head_tokens_fed - fed0,
                "hit_tokens": sum(outs[r.request_id].stats.prefix_cache_hit_tokens for r in reqs),
                "outs": [outs[r.request_id] for r in reqs]}
    finally:
        eng.shutdown()


def think_case(bundle=None, n: int = 16, system: str = SYSTEM, size: int = 32, steps: int = 2,
               max_new_tokens: int = 16, bot_task: str | None = None, max_num_seqs: int = 4,
               num_kv_blocks: int = 2048, seed: int = 0, edits: bool = False, **engine_kw) -> dict:
    """N think / AR requests behind `system`, cache on and off (module docstring). `bundle`: a loaded
    model bundle (default: the bundled tiny model on the CPU, fp32; tiny-edit with `edits`). `edits`:
    every request also edits one input image with one seed (`edit_image`), which the AR head holds
    before the text. Returns per setting the time to the first denoise step of each request and its
    mean, the AR prefill tokens and hit tokens; the AR prefill tokens saved, the mean speed-up (off /
    on) and whether every text and image is bit-identical."""
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1: the case measures requests with an AR phase")
    if bundle is None:
        import torch

        from ..models.loader import load_model

        bundle = load_model("tiny-edit" if edits else "tiny", torch.device("cpu"), torch.float32)
        engine_kw = {"device": "cpu", "dtype": "float32", **engine_kw}
    image = edit_image(size) if edits else None
    reqs = _requests(n, system, size, steps, max_new_tokens, bot_task, seed, image)
    warm = msgspec.structs.replace(_requests(1, system, size, steps, max_new_tokens, bot_task,
                                             seed if edits else seed + 1000, image)[0],
                                   prompt=system + "a warm-up", request_id="think-warm")
    longest = max(len(r.prompt) for r in reqs) + max_new_tokens + 64
    kw = {"block_size": 16, "num_kv_blocks": num_kv_blocks, "max_num_seqs": max_num_seqs,
          "max_image_height": size, "max_image_width": size, "max_prompt_tokens": longest, **engine_kw}
    res = {s: _run(bundle, kw, s == "on", warm, reqs) for s in ("off", "on")}
    same = all(a.revised_prompt == b.revised_prompt and np.array_equal(a.image, b.image)
               for a, b in zip(res["on"].pop("outs"), res["off"].pop("outs")))
    return {"case": "think-edits" if edits else "think", "n": n, "max_new_tokens": max_new_tokens,
            "cache_off": res["off"], "cache_on": res["on"],
            "ar_prefill_tokens_saved": res["off"]["ar_prefill_tokens"] - res["on"]["ar_prefill_tokens"],
            "speedup_mean_ttfs": res["off"]["mean_ttfs_s"] / res["on"]["mean_ttfs_s"], "bit_identical": same}
