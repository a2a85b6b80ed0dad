"""GPU smoke of the single engine's AR phase on the bundled tiny model (tools/gpu_ar.sh): three
requests batched vs alone, with and without batch_invariant; prints one JSON object."""

import json
import sys

import torch

sys.path.insert(0, "tests")
from gpu_smoke_common import batched_vs_solo, image_max_diff, run  # noqa: E402
from stage_helpers import tiny_bundle  # noqa: E402

from ditkv.engine.types import GenerationRequest  # noqa: E402

PROMPTS = ["a large red circle", "blue", "a small green square on grey"]


def req(i):
    return GenerationRequest(prompt=PROMPTS[i], height=32, width=32, steps=2, guidance_scale=2.0, seed=10 + i,
                             max_new_tokens=6, temperature=1.0, top_k=0, top_p=1.0)


def texts(batched, solo):
    return {"text_equal": [a.revised_prompt == b.revised_prompt for a, b in zip(batched, solo)],
            "generated": [o.stats.ar_generated_tokens for o in batched]}


def graph_stats(eng):
    g = eng.executor.stepper.ar._graphs
    return {"why": eng.executor.stepper.ar.graphs_off} if not g else {"captures": g.captures, "replays": g.replays}


model, tok, codec = tiny_bundle()
bundle = (model.to("cuda"), tok, codec)
result = {f"batch_invariant={inv}": batched_vs_solo(bundle, [req(i) for i in range(3)], texts, batch_invariant=inv)
          for inv in (False, True)}
# decode CUDA graphs: the same tokens and images as the eager passes (long texts: captures happen). 3 rows
# replay the 4-row bucket (one padded row), 4 rows their own; then 3 rows under batch_invariant, where the
# padding cannot change a real row's bits
bf16 = (tiny_bundle()[0].to("cuda", torch.bfloat16), tok, codec)  # the grouped MoE (graph-safe) needs bf16


def graphs_vs_eager(n, **kw):
    reqs = [GenerationRequest(prompt=PROMPTS[i % 3] + " x" * (i // 3), height=32, width=32, steps=2,
                              guidance_scale=2.0, seed=10 + i, max_new_tokens=24, ignore_eos=True, temperature=1.0,
                              top_k=0, top_p=1.0) for i in range(n)]
    eager = run(bf16, reqs, cuda_graphs="off", dtype="bfloat16", **kw)
    graphed, stats = run(bf16, reqs, graph_stats, cuda_graphs="on", dtype="bfloat16", **kw)
    return {"ok": [o.status for o in graphed], "errors": [o.error for o in graphed if not o.ok],
            "text_equal": [a.revised_prompt == b.revised_prompt for a, b in zip(graphed, eager)],
            "image_max_diff": [image_max_diff(a, b) for a, b in zip(graphed, eager)], **stats}


result["graphs"] = graphs_vs_eager(3)
result["graphs 4 rows"] = graphs_vs_eager(4)
result["graphs batch_invariant"] = graphs_vs_eager(3, batch_invariant=True)
result["gpu"] = torch.cuda.get_device_name(0)
print(json.dumps(result))
