"""The CPU bit-identity claims, checked in one process under whatever ISA settings it was started
with (tests/test_bit_identity_matrix.py runs it once per setting: ATEN_CPU_CAPABILITY and
MKL_ENABLE_INSTRUCTIONS are read at process start). Prints one JSON object: claim -> "ok" or what
differed. Every claim compares bits, never a tolerance:

- operands: `cpu_rows` and the attention tiles give the bits of aligned operands when x, the
  weight, q, k or v sit 8, 16, 32 or 48 bytes off a 64-byte boundary (views into a larger buffer);
- loaded_vs_built: a model saved to sharded safetensors and loaded again (tensors mapped 8-byte
  aligned) computes the built model's velocity; every loaded CPU parameter is 64-byte aligned;
- offset_weights: a model whose every weight is an offset view computes the aligned model's velocity
  once a worker holds it, and writes the same image through the engine;
- solo_vs_batched: three requests batched in one engine give their images alone;
- ar_batched: three requests with sampled AR text batched in one engine give their texts and images alone;
- ar_vs_dit_kv: the AR runner's prefix K/V equals the DiT prefill's prefix K/V;
- ranks_vs_one (with --ranks): two rank processes that each load a saved checkpoint and run the
  whole model give the images of one process running the built model.

Run: python tests/bit_identity_probe.py [--ranks]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ditkv.alignment import CPU_ALIGNMENT, misaligned  # noqa: E402
from ditkv.attention.torch_backend import TorchBackend, tiled_limit_attention  # noqa: E402
from ditkv.config import EngineConfig  # noqa: E402
from ditkv.core.metadata import DiffusionKVMetadata, RowMetadata  # noqa: E402
from ditkv.engine.engine import Engine  # noqa: E402
from ditkv.engine.types import GenerationRequest  # noqa: E402
from ditkv.models.hunyuan import (HunyuanImage3Config, HunyuanImage3Model, build_request_layout,  # noqa: E402
                                  load_checkpoint, save_checkpoint)
from ditkv.models.hunyuan.codec import PixelCodec  # noqa: E402
from ditkv.models.hunyuan.invariant import cpu_rows  # noqa: E402
from ditkv.models.hunyuan.layout import image_tail_ids  # noqa: E402
from ditkv.models.hunyuan.tokenizer import ByteTokenizer  # noqa: E402
from ditkv.worker.ar_runner import ARRunner  # noqa: E402
from ditkv.worker.dit_runner import DiTRunner  # noqa: E402
from ditkv.worker.page_pool import PagePool  # noqa: E402
from ditkv.worker.rows import PREFILL, WorkerRows  # noqa: E402

OFFSETS = (8, 16, 32, 48)  # bytes off a 64-byte boundary: safetensors gives 8, 32 and 56
BS = 16
PROMPT = "a small green triangle above a red square"
PROMPTS = ["a large blue square", "a small red circle in the top left", "a green triangle"]


def offset_copy(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """A copy of `t` (contiguous) that starts `nbytes` after a 64-byte boundary: a view into a larger buffer."""
    es = t.element_size()
    buf = torch.empty(t.numel() + 2 * CPU_ALIGNMENT // es, dtype=t.dtype)
    start = (-buf.data_ptr() % CPU_ALIGNMENT + nbytes) // es
    view = buf[start:start + t.numel()].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % CPU_ALIGNMENT == nbytes
    return view


def offset_model(model: torch.nn.Module) -> torch.nn.Module:
    """`model`'s every floating parameter moved to a view at one of OFFSETS, in turn (in place)."""
    with torch.no_grad():
        for i, p in enumerate(p for p in model.parameters() if p.numel() > 1):
            p.data = offset_copy(p.data, OFFSETS[i % len(OFFSETS)])
    return model


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def check_operands() -> str:
    for k, n in ((64, 48), (96, 160), (128, 384)):  # 96 * 4 bytes: rows of x 32 bytes apart
        x, w = _rand(37, k, seed=1), _rand(n, k, seed=2) / k ** 0.5
        ref = cpu_rows(x, w)
        for off in OFFSETS:
            if not torch.equal(cpu_rows(offset_copy(x, off), w), ref):
                return f"cpu_rows: x {off} bytes off (k={k}, n={n}) changed the bits"
            if not torch.equal(cpu_rows(x, offset_copy(w, off)), ref):
                return f"cpu_rows: weight {off} bytes off (k={k}, n={n}) changed the bits"
    q, kv = _rand(1, 70, 4, 32, seed=3), _rand(2, 1, 200, 2, 32, seed=4)
    lim = torch.randint(1, 201, (1, 70), generator=torch.Generator().manual_seed(5))
    ref = tiled_limit_attention(q, kv[0], kv[1], lim, 0.2, 10)
    for off in OFFSETS:
        got = tiled_limit_attention(offset_copy(q, off), offset_copy(kv[0], off), offset_copy(kv[1], off), lim, 0.2, 10)
        if not torch.equal(got, ref):
            return f"attention tiles: q/k/v {off} bytes off changed the bits"
    return "ok"


def built_model(seed: int = 3) -> HunyuanImage3Model:
    return HunyuanImage3Model.from_config(HunyuanImage3Config.tiny(), seed=seed, zero_init_resblocks=False).eval()


def dit_velocity(model) -> torch.Tensor:
    """The prefill velocity of PROMPT's CFG rows through the paged DiT runner (the serving path)."""
    c = model.config
    layout = build_request_layout(c, ByteTokenizer(), PROMPT, 32, 32, 3.0)
    pool = PagePool(32, c.num_hidden_layers, c.num_key_value_heads, BS, c.attention_head_dim)
    rows = WorkerRows(32, BS, 2)
    nb = [-(-r.seq_len // BS) for r in layout.rows]
    ids = [tuple(range(sum(nb[:i]), sum(nb[:i + 1]))) for i in range(len(nb))]
    rows.install(DiffusionKVMetadata("r", 1, BS, tuple(
        RowMetadata(i, r.prefix_len, r.target_len, r.seq_len, r.full_attn_spans, ids[i])
        for i, r in enumerate(layout.rows))))
    x = _rand(1, c.latent_channels, layout.h, layout.w, seed=6)  # one latent, every CFG row
    with torch.inference_mode():
        v, _ = DiTRunner(model, TorchBackend(), pool, rows).forward_step(
            "r", layout, x, torch.tensor([900.0]), PREFILL, True)
    return v


def check_loaded_vs_built() -> str:
    built = built_model()
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(built, tmp, max_shard_bytes=3_000_000)
        loaded = load_checkpoint(tmp)
        bad = misaligned(loaded)
        if bad:
            return f"{len(bad)} loaded parameters not 64-byte aligned, e.g. {bad[:3]}"
        if not torch.equal(dit_velocity(loaded), dit_velocity(built)):
            return "the loaded checkpoint's velocity differs from the built model's"
    return "ok"


def _engine_image(bundle, prompt=PROMPT, **engine) -> np.ndarray:
    eng = Engine(_config(**engine), model_bundle=bundle)
    try:
        return eng.generate(GenerationRequest(prompt=prompt, height=32, width=32, steps=3, seed=0)).image
    finally:
        eng.shutdown()


def _config(**kw) -> EngineConfig:
    base = dict(device="cpu", dtype="float32", diffusion_kv_mode="paged_scheduler",
                diffusion_kv_max_rows_per_request=2, block_size=BS, num_kv_blocks=64, attention_backend="torch")
    return EngineConfig(**{**base, **kw})


def _bundle(model):
    return model, ByteTokenizer(), PixelCodec(model.config.image_token_downsample)


def check_offset_weights() -> str:
    aligned_v, aligned_img = dit_velocity(built_model()), _engine_image(_bundle(built_model()))
    shifted = offset_model(built_model())
    if not misaligned(shifted):
        return "the probe failed to misalign the weights"
    img = _engine_image(_bundle(shifted))  # the worker aligns the caller's bundle in place
    if misaligned(shifted):
        return f"the worker left {len(misaligned(shifted))} weights misaligned"
    if not np.array_equal(img, aligned_img):
        return "offset weights changed the engine's image"
    if not torch.equal(dit_velocity(shifted), aligned_v):
        return "offset weights changed the velocity"
    return "ok"


def _requests(steps=(3, 4, 5)):
    return [GenerationRequest(prompt=PROMPTS[i], request_id=f"r{i}", seed=i, height=32, width=32, steps=s)
            for i, s in enumerate(steps)]


def _images(eng: Engine, batched: bool) -> dict:
    outs = {}
    for r in _requests():
        if batched:
            eng.add_request(r)
        else:
            outs[r.request_id] = eng.generate(r)
    if batched:
        outs = {o.request_id: o for o in eng.run_until_complete()}
    return {k: o.image for k, o in outs.items()}


def check_solo_vs_batched(bundle) -> str:
    eng = Engine(_config(max_num_seqs=3), model_bundle=bundle)
    try:
        solo, batched = _images(eng, False), _images(eng, True)
        if max(eng.batch_sizes) != 3:
            return f"the three requests never ran together (batch sizes {sorted(set(eng.batch_sizes))})"
    finally:
        eng.shutdown()
    bad = [k for k in solo if not np.array_equal(solo[k], batched[k])]
    return f"batched images differ from solo: {bad}" if bad else "ok"


def _texts(eng: Engine, batched: bool) -> dict:
    reqs = [GenerationRequest(prompt=PROMPTS[i], request_id=f"t{i}", seed=i, height=32, width=32, steps=2,
                              max_new_tokens=3 + 2 * i, ignore_eos=True, temperature=1.0, top_k=0, top_p=1.0)
            for i in range(3)]
    if batched:
        for r in reqs:
            eng.add_request(r)
        outs = {o.request_id: o for o in eng.run_until_complete()}
    else:
        outs = {r.request_id: eng.generate(r) for r in reqs}
    return {k: (o.revised_prompt, o.image) for k, o in outs.items()}


def check_ar_batched(bundle) -> str:
    """Three requests with sampled AR text (the AR phase's batched pass, `worker/ar_batch.py`) give
    the texts and images they give alone."""
    eng = Engine(_config(max_num_seqs=3, num_kv_blocks=96), model_bundle=bundle)
    widths, queue = [], eng.executor.queue_ar
    eng.executor.queue_ar = lambda works: (widths.append(len(works)), queue(works))[1]
    try:
        solo = _texts(eng, False)
        widths.clear()
        batched = _texts(eng, True)
    finally:
        eng.shutdown()
    if max(widths, default=0) != 3:
        return f"the three AR rows never ran in one pass (works per step {sorted(set(widths))})"
    if len({t for t, _ in solo.values()}) != 3:
        return "the texts are not distinct: the check would not see a mix-up"
    bad = [k for k in solo if solo[k][0] != batched[k][0] or not np.array_equal(solo[k][1], batched[k][1])]
    return f"batched AR texts or images differ from solo: {bad}" if bad else "ok"


def check_ar_vs_dit_kv() -> str:
    model = built_model()
    c, tok = model.config, ByteTokenizer()
    layout = build_request_layout(c, tok, PROMPT, 32, 32, 3.0)
    cond = layout.rows[0]
    pool = PagePool(32, c.num_hidden_layers, c.num_key_value_heads, BS, c.attention_head_dim)
    ARRunner(model, TorchBackend(), pool).run("r", [c.bos_token_id] + tok.encode(PROMPT),
                                              image_tail_ids(c, 32, 32), list(range(4)))
    dpool = PagePool(32, c.num_hidden_layers, c.num_key_value_heads, BS, c.attention_head_dim)
    rows = WorkerRows(32, BS, 2)
    nb = -(-cond.seq_len // BS)
    rows.install(DiffusionKVMetadata("r", 1, BS, (RowMetadata(0, cond.prefix_len, cond.target_len, cond.seq_len,
                                                              cond.full_attn_spans, tuple(range(10, 10 + nb))),)))
    one_row = type(layout)(rows=[cond], h=layout.h, w=layout.w, cfg_factor=1)
    with torch.inference_mode():
        DiTRunner(model, TorchBackend(), dpool, rows).forward_step(
            "r", one_row, _rand(1, c.latent_channels, layout.h, layout.w, seed=7), torch.tensor([900.0]), PREFILL, True)
    p, hd = cond.prefix_len, c.attention_head_dim

    def prefix(kv, first):
        return kv[first:first + 4].permute(1, 2, 3, 0, 4, 5).reshape(c.num_hidden_layers, 2, -1, 4 * BS, hd)[..., :p, :]

    ar, dit = prefix(pool.kv, 0), prefix(dpool.kv, 10)
    if not ar.abs().sum() > 0:
        return "the AR runner wrote no K/V"
    return "ok" if torch.equal(ar, dit) else f"AR prefix K/V differs from the DiT's (max {(ar - dit).abs().max():.3g})"


def check_ranks_vs_one(bundle) -> str:
    """Two rank processes that each load a sharded checkpoint themselves (mapped, misaligned
    tensors) give the images of one process running the built model."""
    from rank_hooks import hooked_options

    one = _images(Engine(_config(max_num_seqs=3), model_bundle=bundle), True)
    opts = hooked_options(replicate_ranks=2, heartbeat_interval_s=0.1, heartbeat_timeout_s=20.0,
                          startup_timeout_s=120.0, drain_timeout_s=20.0)
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(bundle[0], tmp, max_shard_bytes=3_000_000)
        eng = Engine(_config(max_num_seqs=3, model=tmp), executor="mp", executor_options=opts)
        try:
            ranks = _images(eng, True)
        finally:
            eng.shutdown()
    bad = [k for k in one if not np.array_equal(one[k], ranks[k])]
    return f"two rank processes differ from one process: {bad}" if bad else "ok"


def main() -> None:
    torch.manual_seed(0)
    bundle = _bundle(built_model(seed=1))
    results = {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "operands": check_operands(),
        "loaded_vs_built": check_loaded_vs_built(),
        "offset_weights": check_offset_weights(),
        "solo_vs_batched": check_solo_vs_batched(bundle),
        "ar_batched": check_ar_batched(bundle),
        "ar_vs_dit_kv": check_ar_vs_dit_kv(),
    }
    if "--ranks" in sys.argv:
        results["ranks_vs_one"] = check_ranks_vs_one(bundle)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
