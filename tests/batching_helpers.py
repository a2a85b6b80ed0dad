"""The GPU batching scenario shared by tests/test_cuda.py and tests/test_batch_invariant.py: the trained
tiny model in bf16, 3 requests alone (max_num_seqs=1) and together (max_num_seqs=3)."""

import torch


def solo_and_batched(backend: str, **engine_kw):
    """-> (solo images, batched images, the batched engine's captured step-graph keys or None)."""
    from ditkv.config import EngineConfig
    from ditkv.engine.engine import Engine
    from ditkv.engine.types import GenerationRequest
    from ditkv.models.loader import load_model

    bundle = load_model("tiny", torch.device("cuda"), torch.bfloat16)
    reqs = [GenerationRequest(prompt=p, height=64, width=64, steps=4, guidance_scale=4.0, seed=i, request_id=f"r{i}")
            for i, p in enumerate(["a large blue square", "a small red circle", "a green triangle in the top left"])]
    images, graphs = {}, None
    for seqs in (1, 3):
        cfg = EngineConfig(diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2,
                           block_size=64, num_kv_blocks=64, attention_backend=backend, device="cuda",
                           dtype="bfloat16", profile_memory=False, max_num_seqs=seqs, **engine_kw)
        e = Engine(cfg, model_bundle=bundle)
        try:
            for r in reqs:
                e.add_request(r)
            outs = {o.request_id: o for o in e.run_until_complete()}
            assert all(o.ok for o in outs.values()), [o.error for o in outs.values()]
            images[seqs] = [outs[r.request_id].image for r in reqs]
            if seqs == 3:
                assert max(e.batch_sizes) == 3
                sg = e.worker.runner.step_graphs
                graphs = None if sg is None else list(sg.graphs)
        finally:
            e.shutdown()
    return images[1], images[3], graphs
