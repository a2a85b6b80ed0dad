"""Tensor / Ulysses / CFG / expert parallel produce the single-rank image (fp32 CPU, 2 gloo ranks).

Two spawned ranks are started once per module and serve jobs from a queue: each job builds a
parallel `DiTWorker` from the same tiny model, installs the same metadata snapshot (built once
here, sent unchanged to both ranks) and runs `runner.generate`; the parent compares rank 0's
latents (and rank 1's) with a single-rank run.
"""

from __future__ import annotations

import os
import queue
import tempfile
import traceback

import msgspec
import pytest
import torch
import torch.multiprocessing as mp

from ditkv.config import EngineConfig
from ditkv.core.kv_manager import DiffusionKVCacheManager
from ditkv.core.layout import RowLayout
from ditkv.core.metadata import DiffusionKVMetadata, encode_metadata
from ditkv.errors import ConfigError, LayoutError, MetadataError
from ditkv.models.hunyuan import (
    ByteTokenizer,
    HunyuanImage3Config,
    HunyuanImage3Model,
    PixelCodec,
    build_request_layout,
)
from ditkv.models.hunyuan.parallel_layers import shard_model
from ditkv.worker.parallel import ParallelContext, init_parallel, validate_parallel
from ditkv.worker.worker import DiTWorker
from ditkv.worker.denoising import denoise

NUM_BLOCKS, BS = 64, 16
_BUNDLES: dict = {}


def _bundle(device="cpu", dtype="float32"):
    """The tiny model (same weights everywhere), built once per process, device and dtype."""
    if (device, dtype) not in _BUNDLES:
        cfg = HunyuanImage3Config.tiny()
        model = HunyuanImage3Model.from_config(cfg, seed=1, zero_init_resblocks=False, device=device,
                                               dtype=getattr(torch, dtype))
        _BUNDLES[device, dtype] = (model, ByteTokenizer(), PixelCodec(cfg.image_token_downsample))
    return _BUNDLES[device, dtype]


def _config(mode: str, **kw) -> EngineConfig:
    paged = mode == "paged"
    kw = {"device": "cpu", "attention_backend": "torch", "dtype": "float32", **kw}
    return EngineConfig(diffusion_kv_mode="paged_scheduler" if paged else "dense_legacy",
                        diffusion_kv_max_rows_per_request=2 if paged else None, block_size=BS,
                        num_kv_blocks=NUM_BLOCKS if paged else None, profile_memory=False, **kw)


def _decode(meta_bytes: bytes) -> DiffusionKVMetadata:
    return msgspec.msgpack.decode(meta_bytes, type=DiffusionKVMetadata)


def _run(config, req, meta_bytes, parallel=None):
    """One request on one rank -> (latents, stats, worker)."""
    # a parallel worker moves its shard to its own device; the single-rank reference needs the bundle there
    device = "cpu" if config.device == "cpu" or parallel is not None else "cuda"
    if config.device != "cpu":  # cuDNN convs default to TF32: ~1e-3 noise that depends on batch shape
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    w = DiTWorker(config, num_blocks=NUM_BLOCKS if config.paged else None,
                  model_bundle=_bundle(device, config.dtype), parallel=parallel)
    layout = w.layout(req["prompt"], req["h"], req["w"], req["g"])
    if meta_bytes is not None:
        w.install(_decode(meta_bytes))
    x, stats = denoise(w.runner, "r", layout, req["steps"], req["g"], req["seed"])
    return x.cpu(), stats, w


def _rank_main(rank, world, init_method, inbox, outbox):
    torch.set_num_threads(1)
    while True:
        job = inbox.get()
        if job is None:
            return
        try:
            cfg = _config(job["mode"], **job["par"], **job.get("env", {}))
            ctx = init_parallel(cfg, rank, world, init_method, timeout_s=60)
            x, stats, w = _run(cfg, job["req"], job["meta"], ctx)
            info = {"pool_kv_heads": w.pool.num_kv_heads if w.pool else w.num_kv_heads,
                    "tokens_computed": stats.tokens_computed,
                    "prefix_tokens_reused": stats.prefix_tokens_reused,
                    "qkv_rows": w.model.model.layers[0].self_attn.qkv_proj.weight.shape[0],
                    "experts": len(w.model.model.layers[0].mlp.experts)}
            outbox.put((rank, True, (x, info)))
        except BaseException:  # report, keep serving (the parent restarts the pool on errors)
            outbox.put((rank, False, traceback.format_exc()))


class RankPool:
    def __init__(self, world: int = 2):
        ctx = mp.get_context("spawn")
        self.world = world
        init = "file://" + os.path.join(tempfile.mkdtemp(prefix="ditkv-pg-"), "store")
        self.inboxes = [ctx.Queue() for _ in range(world)]
        self.outbox = ctx.Queue()
        self.procs = [ctx.Process(target=_rank_main, args=(r, world, init, self.inboxes[r], self.outbox),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()

    def run(self, job, timeout=120):
        for q in self.inboxes:
            q.put(job)
        results, errors = {}, []
        for _ in range(self.world):
            try:
                rank, ok, val = self.outbox.get(timeout=timeout)
            except queue.Empty:
                errors.append(f"no answer within {timeout}s")
                break
            (results.__setitem__(rank, val) if ok else errors.append(f"rank {rank} failed:\n{val}"))
        if errors:  # a failed rank may leave its peer inside a collective: start fresh ranks
            self.close(wait=0)
            self.__init__(self.world)
            raise RuntimeError("\n".join(errors))
        return [results[r] for r in range(self.world)]

    def close(self, wait=5):
        for q in self.inboxes:
            q.put(None)
        for p in self.procs:
            p.join(timeout=wait)
            if p.is_alive():
                p.terminate()
                p.join()


@pytest.fixture(scope="module")
def pool():
    p = RankPool(2)
    yield p
    p.close()


def _meta(req) -> bytes:
    """The scheduler's snapshot for the request; a dummy reservation first makes block ids non-trivial."""
    mc = HunyuanImage3Config.tiny()
    layout = build_request_layout(mc, ByteTokenizer(), req["prompt"], req["h"], req["w"], req["g"])
    rows = [RowLayout(i, r.prefix_len, r.target_len, r.seq_len, tuple(r.full_attn_spans))
            for i, r in enumerate(layout.rows)]
    m = DiffusionKVCacheManager(NUM_BLOCKS, BS, 2)
    m.reserve_request("dummy", [RowLayout(0, 3, 20, 30, ())])
    return encode_metadata(m.reserve_request("r", rows))


CFG_REQ = dict(prompt="a large red circle", h=32, w=32, g=4.0, steps=3, seed=7)
ODD_REQ = dict(prompt="a blue square", h=32, w=32, g=1.0, steps=3, seed=3)  # 1 row, 83 / 65 tokens: SP pads

_REF: dict = {}


def _reference(mode, req, env):
    key = (mode, tuple(sorted(req.items())), tuple(sorted(env.items())))
    if key not in _REF:
        meta = _meta(req) if mode == "paged" else None
        _REF[key] = _run(_config(mode, **env), req, meta)[:2]
    return _REF[key]


def _check(pool, mode, par, req, expect_kv_heads, env=None, tol=1e-4):
    """Run `par` on the pool's ranks and compare every rank's latents with one rank's."""
    env = env or {}
    ref, ref_stats = _reference(mode, req, env)
    job = {"mode": mode, "par": par, "req": req, "meta": _meta(req) if mode == "paged" else None, "env": env}
    outs = pool.run(job)
    for rank, (x, info) in enumerate(outs):
        diff = (x - ref).abs().max().item()
        info["diff"] = diff
        assert diff < tol, f"{par} {mode} {env} rank {rank}: max |latent diff| {diff}"
        assert info["pool_kv_heads"] == expect_kv_heads
        assert info["tokens_computed"] == ref_stats.tokens_computed
        assert info["prefix_tokens_reused"] == ref_stats.prefix_tokens_reused > 0
    return outs


MODES = ["paged", "dense"]


@pytest.mark.parametrize("mode", MODES)
def test_tensor_parallel(pool, mode):
    outs = _check(pool, mode, dict(tensor_parallel_size=2), CFG_REQ, expect_kv_heads=1)
    full = HunyuanImage3Config.tiny()
    assert outs[0][1]["qkv_rows"] == full.qkv_rows // 2  # column-parallel shard
    assert outs[0][1]["experts"] == full.num_experts  # every expert, intermediate dim split


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("req", [CFG_REQ, ODD_REQ], ids=["cfg", "odd-no-cfg"])
def test_ulysses_sequence_parallel(pool, mode, req):
    outs = _check(pool, mode, dict(ulysses_degree=2), req, expect_kv_heads=1)
    assert outs[0][1]["qkv_rows"] == HunyuanImage3Config.tiny().qkv_rows  # weights replicated


@pytest.mark.parametrize("mode", MODES)
def test_cfg_parallel(pool, mode):
    _check(pool, mode, dict(cfg_parallel_size=2), CFG_REQ, expect_kv_heads=2)


@pytest.mark.parametrize("mode", MODES)
def test_tensor_parallel_with_expert_parallel(pool, mode):
    outs = _check(pool, mode, dict(tensor_parallel_size=2, enable_expert_parallel=True), CFG_REQ,
                  expect_kv_heads=1)
    assert outs[0][1]["experts"] == HunyuanImage3Config.tiny().num_experts // 2  # whole experts split


@pytest.mark.parametrize("par", [dict(ulysses_degree=2, enable_expert_parallel=True),
                                 dict(cfg_parallel_size=2, enable_expert_parallel=True)],
                         ids=["sp2-ep", "cfg2-ep"])
def test_expert_parallel_across_token_shards(pool, par):
    """EP over ranks holding different tokens: real all-to-all dispatch in both directions."""
    _check(pool, "paged", par, CFG_REQ, expect_kv_heads=1 if "ulysses_degree" in par else 2)


# ---- startup and request-time errors (no processes needed) -----------------------------------
@pytest.mark.parametrize("model_changes, par, field, match", [
    ({}, dict(tensor_parallel_size=3), "tensor_parallel_size", "num_attention_heads=4"),
    ({}, dict(ulysses_degree=4), "ulysses_degree", "num_key_value_heads=2"),
    (dict(num_key_value_heads=4, num_experts=6), dict(tensor_parallel_size=4, enable_expert_parallel=True),
     "enable_expert_parallel", "num_experts=6"),
    (dict(num_key_value_heads=4, moe_intermediate_size=130), dict(tensor_parallel_size=4),
     "tensor_parallel_size", "moe_intermediate_size=130"),
    (dict(use_guidance_token=True), dict(cfg_parallel_size=2), "cfg_parallel_size", "guidance"),
])
def test_unsupported_layouts_fail_at_startup(model_changes, par, field, match):
    mc = HunyuanImage3Config.tiny().replace(**model_changes)
    with pytest.raises(ConfigError, match=match) as e:
        validate_parallel(_config("paged", **par), mc)
    assert e.value.field == field


def test_world_size_must_match_config():
    with pytest.raises(ConfigError, match="world_size"):
        init_parallel(_config("paged", tensor_parallel_size=2), 0, 4, "file:///nonexistent")


def test_cfg_parallel_without_cfg_request_is_a_clear_error():
    # cfg rank 1 of 2: no collective runs before the checks, so no process group is needed
    ctx = ParallelContext(rank=1, world_size=2, cfg_rank=1, cfg_size=2)
    w = DiTWorker(_config("paged", cfg_parallel_size=2), num_blocks=NUM_BLOCKS, model_bundle=_bundle(),
                  parallel=ctx)
    with pytest.raises(LayoutError, match="cfg_parallel_size=2 needs a CFG request"):
        w.layout("a blue square", 32, 32, 1.0)
    with pytest.raises(MetadataError, match="cfg_parallel_size=2 needs 2 rows"):
        w.install(_decode(_meta(ODD_REQ)))
    meta = _decode(_meta(CFG_REQ))
    assert w.install(meta) and w.install(meta) is False  # re-send: no-op as on one rank
    assert w.rows.get("r").rows == (meta.rows[1],)  # only the uncond row is bound here
    newer = msgspec.structs.replace(meta, generation=meta.generation + 1)
    assert w.install(newer) and w.rows.get("r").generation == newer.generation


def test_shard_keeps_names_and_release_qkv_layout():
    """A TP shard's state dict is a named slice of the full one (release grouped qkv rows)."""
    full = _bundle()[0]
    import copy

    ref = full.state_dict()
    for rank in range(2):
        spec = ParallelContext(rank=rank, world_size=2, tp_rank=rank, tp_size=2)
        sd = shard_model(copy.deepcopy(full), spec).state_dict()
        assert set(sd) == set(ref)
        key = "model.layers.0.self_attn.qkv_proj.weight"
        rows = ref[key].shape[0] // 2
        assert torch.equal(sd[key], ref[key][rank * rows:(rank + 1) * rows])
        ep = ParallelContext(rank=rank, world_size=2, tp_rank=rank, tp_size=2, ep_rank=rank, ep_size=2)
        sd = shard_model(copy.deepcopy(full), ep).state_dict()
        expert_keys = {k for k in sd if ".experts." in k}
        assert expert_keys and expert_keys <= set(ref)
        assert all(int(k.split(".experts.")[1].split(".")[0]) // 4 == rank for k in expert_keys)


# ---- the same on two GPUs (NCCL); skipped without them ---------------------------------------
GPU_MODES = [dict(tensor_parallel_size=2), dict(ulysses_degree=2), dict(cfg_parallel_size=2),
             dict(tensor_parallel_size=2, enable_expert_parallel=True)]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("par", GPU_MODES, ids=["tp2", "sp2", "cfg2", "tp2-ep"])
def test_parallel_on_two_gpus(pool, par, backend):
    """fp32 with TF32 off: every mode matched one GPU within ~5e-6 on H200 (NCCL)."""
    env = dict(device="cuda", attention_backend=backend, dtype="float32")
    kv = 2 if par.get("cfg_parallel_size") else 1
    outs = _check(pool, "paged", par, CFG_REQ, kv, env)
    print(f"{par} {backend}: max |diff| rank0 {outs[0][1]['diff']:.2e} rank1 {outs[1][1]['diff']:.2e}")


# FP8 W8A8 (quantization=fp8): the reference is one rank quantized the same way. Ulysses and EP
# ranks quantize the same tokens with the same per-row scales as one rank: bit-equal (measured 0.0).
# CFG-parallel's fp32 noise (a row computed apart from its twin: the CFG combine and the image path
# see other shapes) can move a value across an e4m3 rounding boundary, which the next layers carry
# on (measured 4.8e-4 natively on AVX-512, 7.9e-3 with the AVX2 paths forced). TP's row-parallel
# projections (o_proj, down_proj) quantize each rank's activation columns with their own per-token
# scale, another rounding than one rank's whole-row scale (measured 0.019 / 0.021). Latents have
# std ~1; tiny model, 3 steps, 2026-12-01 (docs/quantization.md).
FP8 = {"quantization": "fp8"}
FP8_CFG_TOL, FP8_TP_TOL = 0.05, 0.05


@pytest.mark.parametrize("par,kv_heads,tol", [
    (dict(cfg_parallel_size=2), 2, FP8_CFG_TOL),
    (dict(ulysses_degree=2), 1, 1e-6),
    (dict(ulysses_degree=2, enable_expert_parallel=True), 1, 1e-6),
    (dict(tensor_parallel_size=2), 1, FP8_TP_TOL),
    (dict(tensor_parallel_size=2, enable_expert_parallel=True), 1, FP8_TP_TOL),
], ids=["cfg2", "sp2", "sp2-ep", "tp2", "tp2-ep"])
def test_fp8_parallel_matches_one_fp8_rank(pool, par, kv_heads, tol):
    outs = _check(pool, "paged", par, CFG_REQ, expect_kv_heads=kv_heads, env=FP8, tol=tol)
    print(par, "max |latent diff| vs one fp8 rank:", max(o[1]["diff"] for o in outs))
