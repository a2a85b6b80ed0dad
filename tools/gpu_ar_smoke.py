"""GPU smoke of the single engine's AR phase on the bundled tiny model (tools/gpu_ar.sh): three
requests batched vs alone, with and without batch_invariant; prints one JSON object."""

import json
import sys

import numpy as np
import torch

sys.path.insert(0, "tests")
from stage_helpers import tiny_bundle  # noqa: E402

from ditkv.config import EngineConfig  # noqa: E402
from ditkv.engine.engine import Engine  # noqa: E402
from ditkv.engine.types import GenerationRequest  # noqa: E402

PROMPTS = ["a large red circle", "blue", "a small green square on grey"]


def req(i):
    return GenerationRequest(prompt=PROMPTS[i], height=32, width=32, steps=2, guidance_scale=2.0, seed=10 + i,
                             max_new_tokens=6, temperature=1.0, top_k=0, top_p=1.0)


def run(bundle, reqs, graph_stats=False, **kw):
    eng = Engine(EngineConfig(device="cuda", block_size=16, num_kv_blocks=256, max_num_seqs=4, max_image_height=32,
                              max_image_width=32, max_prompt_tokens=96, **kw), model_bundle=bundle)
    try:
        ids = [eng.add_request(r) for r in reqs]
        outs = {o.request_id: o for o in eng.run_until_complete()}
        assert eng.manager.pool.num_free == eng.manager.pool.num_blocks
        if graph_stats:
            g = eng.executor.stepper.ar._graphs
            why = eng.executor.stepper.ar.graphs_off if g is False else None
            return [outs[i] for i in ids], ({"why": why} if not g else {"captures": g.captures, "replays": g.replays})
        return [outs[i] for i in ids]
    finally:
        eng.shutdown()


result = {}
model, tok, codec = tiny_bundle()
bundle = (model.to("cuda"), tok, codec)
for inv in (False, True):
    batched = run(bundle, [req(i) for i in range(3)], batch_invariant=inv)
    solo = [run(bundle, [req(i)], batch_invariant=inv)[0] for i in range(3)]
    result[f"batch_invariant={inv}"] = {
        "ok": [o.status for o in batched], "errors": [o.error for o in batched if not o.ok],
        "text_equal": [a.revised_prompt == b.revised_prompt for a, b in zip(batched, solo)],
        "image_max_diff": [int(np.abs(a.image.astype(int) - b.image.astype(int)).max()) if a.ok and b.ok else None
                           for a, b in zip(batched, solo)],
        "generated": [o.stats.ar_generated_tokens for o in batched]}
# decode CUDA graphs: the same tokens and images as the eager passes (long texts: captures happen). 3 rows
# replay the 4-row bucket (one padded row), 4 rows their own; then 3 rows under batch_invariant, where the
# padding cannot change a real row's bits
bf16 = (tiny_bundle()[0].to("cuda", torch.bfloat16), tok, codec)  # the grouped MoE (graph-safe) needs bf16


def graphs_vs_eager(n, **kw):
    reqs = [GenerationRequest(prompt=PROMPTS[i % 3] + " x" * (i // 3), height=32, width=32, steps=2,
                              guidance_scale=2.0, seed=10 + i, max_new_tokens=24, ignore_eos=True, temperature=1.0,
                              top_k=0, top_p=1.0) for i in range(n)]
    eager = run(bf16, reqs, cuda_graphs="off", dtype="bfloat16", **kw)
    graphed, stats = run(bf16, reqs, cuda_graphs="on", graph_stats=True, dtype="bfloat16", **kw)
    return {"ok": [o.status for o in graphed], "errors": [o.error for o in graphed if not o.ok],
            "text_equal": [a.revised_prompt == b.revised_prompt for a, b in zip(graphed, eager)],
            "image_max_diff": [int(np.abs(a.image.astype(int) - b.image.astype(int)).max())
                               if a.ok and b.ok else None for a, b in zip(graphed, eager)], **stats}


result["graphs"] = graphs_vs_eager(3)
result["graphs 4 rows"] = graphs_vs_eager(4)
result["graphs batch_invariant"] = graphs_vs_eager(3, batch_invariant=True)
result["gpu"] = torch.cuda.get_device_name(0)
print(json.dumps(result))
