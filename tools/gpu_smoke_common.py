"""What the GPU smokes of the tiny model share (tools/gpu_ar_smoke.py, tools/gpu_step_cache_smoke.py): run
requests through one engine, and the same requests batched vs each alone."""

import numpy as np

from ditkv.config import EngineConfig
from ditkv.engine.engine import Engine


def run(bundle, reqs, inspect=None, **kw):
    """The outputs of `reqs` through one CUDA engine on the tiny model (every page back at the end);
    with `inspect`, also `inspect(engine)` taken before shutdown."""
    eng = Engine(EngineConfig(device="cuda", block_size=16, num_kv_blocks=256, max_num_seqs=4, max_image_height=32,
                              max_image_width=32, max_prompt_tokens=96, **kw), model_bundle=bundle)
    try:
        ids = [eng.add_request(r) for r in reqs]
        outs = {o.request_id: o for o in eng.run_until_complete()}
        assert eng.manager.pool.num_free == eng.manager.pool.num_blocks
        got = [outs[i] for i in ids]
        return got if inspect is None else (got, inspect(eng))
    finally:
        eng.shutdown()


def image_max_diff(a, b):
    return int(np.abs(a.image.astype(int) - b.image.astype(int)).max()) if a.ok and b.ok else None


def batched_vs_solo(bundle, reqs, fields, **kw) -> dict:
    """`reqs` batched and each alone: statuses, errors, `fields(batched, solo)` and the largest pixel gap."""
    batched = run(bundle, reqs, **kw)
    solo = [run(bundle, [r], **kw)[0] for r in reqs]
    return {"ok": [o.status for o in batched], "errors": [o.error for o in batched if not o.ok],
            **fields(batched, solo), "image_max_diff": [image_max_diff(a, b) for a, b in zip(batched, solo)]}
