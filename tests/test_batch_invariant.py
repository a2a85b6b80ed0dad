"""Batch-invariant mode (`batch_invariant`, models/hunyuan/invariant.py): fixed-tiling kernels whose
every output row depends only on its own input row.

CPU: the Triton kernels run under the interpreter (`TRITON_INTERPRET=1`, set before triton is
imported) at tiny shapes: equal to torch within dtype tolerance, and bitwise row-invariant (a
prefix of the batch, the batch shifted by other rows, a token whose expert got more tokens). The
whole backbone with the mode routed through the kernels on CPU (`cpu=True`) proves the wiring: no
projection or GEMM reaches torch's matmul, and a request's tokens give the same bits alone or
packed. GPU (`-m gpu`, CUDA only): the same at release widths, and the engine scenario of
tests/test_cuda.py with the mode on (<= 1 level).
"""

from __future__ import annotations

import dataclasses
import os

import torch  # noqa: E402 - torch's import does not import triton

if not os.environ.get("DITKV_TRITON_GPU_TESTS") and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's import; CPU-only machines

import pytest  # noqa: E402

pytest.importorskip("triton")

from ditkv.models.hunyuan import invariant  # noqa: E402
from ditkv.models.hunyuan.layers import _rms_norm, _rope_rms_norm, rope_cos_sin  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
cpu_only = pytest.mark.skipif(not INTERPRET, reason="interpreter tests (TRITON_INTERPRET=1) are CPU-only")
gpu_only = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET,
                              reason="needs a CUDA device and compiled triton")


@pytest.fixture(autouse=True)
def _mode_off_after():
    yield
    invariant.set_batch_invariant(False)


def _kern():
    from ditkv.models.hunyuan import invariant_kernels

    return invariant_kernels


def _rand(shape, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device=device, dtype=dtype)


def _check_dense(dev, dtype, m, k, n, bias, tol):
    K = _kern()
    x, w = _rand((m, k), dtype, dev, 1), _rand((n, k), dtype, dev, 2) / k ** 0.5
    b = _rand((n,), dtype, dev, 3) if bias else None
    y = K.matmul(x, w, b)
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    assert y.dtype == dtype and y.shape == (m, n)
    torch.testing.assert_close(y.double(), ref, atol=tol, rtol=tol)
    assert _row_invariant(K.matmul, x, w, b) == []
    return y


def _row_invariant(mm, x, w, b) -> list[str]:
    """The ways in which `mm(x, w, b)`'s rows change with the other rows of the batch ([] = none)."""
    y, m, bad = mm(x, w, b), x.shape[0], []
    for p in sorted({1, 2, 3, m // 2, m - 1} - {0}):  # a prefix of the batch: the same bits
        if not torch.equal(mm(x[:p], w, b), y[:p]):
            bad.append(f"prefix {p}")
    z = _rand((7, x.shape[1]), x.dtype, x.device, 4)  # the rows shifted by other rows (another tile position)
    if not torch.equal(mm(torch.cat([z, x]), w, b)[7:], y):
        bad.append("shifted by 7 rows")
    return bad


def _check_grouped(dev, dtype, counts, k, n, tol):
    """Per expert: equals x @ w[e].T; a token's row is the same when its expert gets more tokens."""
    K = _kern()
    e = len(counts)
    xs = [_rand((c, k), dtype, dev, 10 + i) for i, c in enumerate(counts)]
    w = _rand((e, n, k), dtype, dev, 5) / k ** 0.5
    ends = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
    y = K.grouped_matmul(torch.cat(xs), ends, w)
    for i, (x, part) in enumerate(zip(xs, y.split(counts))):
        torch.testing.assert_close(part.double(), x.double() @ w[i].double().T, atol=tol, rtol=tol)
    # more tokens for every expert, before and after each one's own: its rows keep their bits
    more = [torch.cat([_rand((3 + i, k), dtype, dev, 30 + i), x, _rand((2 * i + 1, k), dtype, dev, 50 + i)])
            for i, x in enumerate(xs)]
    counts2 = [m.shape[0] for m in more]
    y2 = K.grouped_matmul(torch.cat(more), torch.tensor(counts2, device=dev).cumsum(0).to(torch.int32), w)
    for i, (part, part2) in enumerate(zip(y.split(counts), y2.split(counts2))):
        assert torch.equal(part2[3 + i:3 + i + counts[i]], part), i
    return y


def _check_norms(dev, dtype, n, h, d):
    K = _kern()
    x, wt = _rand((n, d * h), dtype, dev, 6), _rand((d * h,), dtype, dev, 7)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    y = K.rms_norm(x, wt, 1e-6)
    torch.testing.assert_close(y.float(), _rms_norm(x, wt, 1e-6).float(), atol=tol, rtol=tol)
    assert torch.equal(K.rms_norm(x[:n // 2], wt, 1e-6), y[:n // 2])
    qkv = _rand((n, (h + 2) * d), dtype, dev, 8)
    q = qkv[:, :h * d].view(n, h, d)  # the strided view the model passes
    cos, sin = rope_cos_sin(torch.arange(n, device=dev), torch.arange(n, device=dev) % 5, d, 10000.0)
    y = K.rms_norm(q, wt[:d], 1e-6, cos, sin)
    torch.testing.assert_close(y.float(), _rope_rms_norm(q, cos, sin, wt[:d], 1e-6).float(), atol=tol, rtol=tol)
    assert torch.equal(K.rms_norm(q[1:4], wt[:d], 1e-6, cos[1:4], sin[1:4]), y[1:4])


# --------------------------------------------------------------------------- CPU (interpreter)
@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 48, 40, False), (20, 40, 24, True), (1, 16, 16, False)])
def test_matmul_matches_torch_and_is_row_invariant(dtype, shape):
    m, k, n, bias = shape
    _check_dense("cpu", dtype, m, k, n, bias, 1e-5 if dtype == torch.float32 else 3e-2)


@cpu_only
def test_the_invariance_check_catches_a_kernel_whose_rows_depend_on_other_rows():
    """The check above is not vacuous: the same kernel behind a per-tensor dynamic scale (as a
    per-tensor FP8 activation scale would be) makes each row depend on the batch's largest value."""
    K = _kern()

    def per_tensor_scaled(x, w, b):
        s = x.abs().amax().clamp_min(1e-12)
        return K.matmul((x / s).to(torch.bfloat16).float(), w, b) * s

    x, w = _rand((37, 48), torch.float32, seed=1), _rand((40, 48), torch.float32, seed=2) / 48 ** 0.5
    x[5] *= 8.0  # the batch's largest value sits in one row; prefixes without it scale differently
    assert _row_invariant(K.matmul, x, w, None) == []
    assert _row_invariant(per_tensor_scaled, x, w, None) != []


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [[3, 0, 10, 6], [1], [0, 17, 0, 0, 2]])
def test_grouped_matmul_matches_per_expert_and_is_token_invariant(dtype, counts):
    _check_grouped("cpu", dtype, counts, 40, 24, 1e-5 if dtype == torch.float32 else 3e-2)


@cpu_only
def test_grouped_matmul_empty_and_tile_map():
    K = _kern()
    w = torch.randn(3, 8, 16)
    assert K.grouped_matmul(torch.empty(0, 16), torch.zeros(3, dtype=torch.int32), w).shape == (0, 8)
    ends = torch.tensor([0, 20, 20, 21], dtype=torch.int32)  # rows: e1 has 20 (two tiles of 16), e3 one
    e, row0 = K.tile_map(ends, 16, 6)
    assert e.tolist() == [1, 1, 3, 4, 4, 4] and row0.tolist()[:3] == [0, 16, 20]


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_kernels_match_layers_and_are_row_invariant(dtype):
    _check_norms("cpu", dtype, 11, 3, 32)


def _tiny_model(layers: int = 2, dtype=torch.float32):
    from ditkv.models.hunyuan import HunyuanImage3Config, HunyuanImage3Model

    cfg = dataclasses.replace(HunyuanImage3Config.tiny(), num_hidden_layers=layers)
    return HunyuanImage3Model.from_config(cfg, seed=2, zero_init_resblocks=False).to(dtype)


def _row_attention(layer, q, k, v):
    """A stand-in for the paged attention that mixes no tokens: each query sees its own key only
    (the real kernel is row-local too; here only the projections and the MoE matter)."""
    g = q.shape[1] // v.shape[1]
    return v.repeat_interleave(g, dim=1) * torch.sigmoid((q * k.repeat_interleave(g, dim=1)).sum(-1, keepdim=True))


@cpu_only
@pytest.mark.parametrize("impl", ["loop", "grouped"])
def test_backbone_in_the_mode_uses_only_the_kernels_and_is_batch_invariant(monkeypatch, impl):
    """Through the mode (on CPU tensors, via the interpreter): no F.linear / matmul / grouped_mm is
    left in the packed pass, one request's tokens give the same bits alone and packed after another
    request's, and the result is the default path's within fp32 rounding."""
    if impl == "grouped" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    model = _tiny_model(1)
    model.set_moe_impl(impl)
    d = model.config.hidden_size
    a, b = _rand((13, d), torch.float32, seed=20), _rand((21, d), torch.float32, seed=21)
    pos = torch.arange(34)
    py, px = pos // 6, pos % 6
    with torch.inference_mode():
        want = model.backbone(a, py[:13], px[:13], _row_attention)
    invariant.set_batch_invariant(True, cpu=True)
    calls = {"mm": 0}
    real = _kern().matmul

    def counting(*args, **kw):
        calls["mm"] += 1
        return real(*args, **kw)

    def boom(*_a, **_k):
        raise AssertionError("a torch GEMM in the batch-invariant pass")
    monkeypatch.setattr(_kern(), "matmul", counting)
    for mod, name in ((torch.nn.functional, "linear"), (torch, "_grouped_mm"), (torch, "bmm"), (torch, "matmul")):
        if hasattr(mod, name):
            monkeypatch.setattr(mod, name, boom)
    with torch.inference_mode():
        alone = model.backbone(a, py[:13], px[:13], _row_attention)
        packed = model.backbone(torch.cat([b, a]), torch.cat([py[13:], py[:13]]), torch.cat([px[13:], px[:13]]),
                                _row_attention)
    assert calls["mm"] > 0
    assert torch.equal(packed[21:], alone)
    torch.testing.assert_close(alone, want, atol=1e-4, rtol=1e-4)


@cpu_only
def test_timestep_embedder_rows_are_invariant_in_the_mode():
    """A batched CUDA graph embeds every request's timestep rows at once: the same bits as one request's."""
    model = _tiny_model(1)
    invariant.set_batch_invariant(True, cpu=True)
    t = torch.tensor([900.0, 900.0, 400.0, 400.0, 100.0, 100.0])
    with torch.inference_mode():
        assert torch.equal(model.timestep_token(t)[2:4], model.timestep_token(t[2:4]))


def test_invariant_combine_traces_as_one_graph():
    """On CUDA the mode's combine runs torch.compile'd (dynamic shapes, fullgraph), like the default one."""
    from ditkv.models.hunyuan.invariant import _combine_slots
    from ditkv.models.hunyuan.layers import combine_slots

    compiled = torch.compile(_combine_slots, dynamic=True, fullgraph=True, backend="eager")
    for n in (7, 12):
        w = torch.softmax(_rand((n, 3), torch.float32, seed=n), -1)
        slots = _rand((3 * n, 16), torch.bfloat16, seed=n + 1)
        got = compiled(w, slots, torch.bfloat16)
        assert torch.equal(got, _combine_slots(w, slots, torch.bfloat16))
        torch.testing.assert_close(got.float(), combine_slots(w, slots, torch.bfloat16).float(), atol=1e-2, rtol=1e-2)


# ------------------------------------------------------------------------------ config and CPU
def test_config_flag_and_cli():
    import argparse

    from ditkv.config import EngineConfig
    from ditkv.entrypoints.engine_args import add_engine_arguments, config_from_args
    from ditkv.errors import ConfigError

    assert EngineConfig().batch_invariant is False
    with pytest.raises(ConfigError, match="batch_invariant"):
        EngineConfig(batch_invariant="yes")
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    for argv, want in (([], False), (["--batch-invariant"], True), (["--batch-invariant", "false"], False),
                       (["--batch-invariant", "true"], True)):
        assert config_from_args(p.parse_args(argv)).batch_invariant is want


def test_attention_backend_under_the_mode():
    """CUDA: only the Triton attention is row-invariant; auto means triton, torch/cudnn are refused.
    CPU: the backend is left alone (the CPU path is invariant already)."""
    from ditkv.config import EngineConfig
    from ditkv.errors import ConfigError
    from ditkv.worker.worker import attention_backend_for

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    cfg = EngineConfig(batch_invariant=True)
    assert attention_backend_for(cfg, cuda) == "triton" and attention_backend_for(cfg, cpu) == "auto"
    assert attention_backend_for(EngineConfig(attention_backend="triton", batch_invariant=True), cuda) == "triton"
    assert attention_backend_for(EngineConfig(attention_backend="torch"), cuda) == "torch"  # mode off
    for name in ("torch", "cudnn"):
        with pytest.raises(ConfigError, match="triton"):
            attention_backend_for(EngineConfig(attention_backend=name, batch_invariant=True), cuda)


def test_cpu_engine_accepts_the_flag_and_changes_nothing():
    import numpy as np

    from ditkv.config import EngineConfig
    from ditkv.engine.engine import Engine
    from ditkv.engine.types import GenerationRequest

    images = []
    for on in (False, True):
        cfg = EngineConfig(diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2, block_size=16,
                           num_kv_blocks=64, device="cpu", profile_memory=False, batch_invariant=on, max_num_seqs=2)
        e = Engine(cfg)
        assert invariant.STATE["on"] is on  # the process-wide setting follows the engine's config
        e.add_request(GenerationRequest(prompt="a red square", height=32, width=32, steps=2, guidance_scale=3.0,
                                        seed=1, request_id="r"))
        out = e.run_until_complete()
        e.shutdown()
        assert out[0].ok, out[0].error
        images.append(out[0].image)
    assert np.array_equal(images[0], images[1])


# ------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1028, 4096, 4096), (514, 4096, 1024), (257, 4096, 6144), (3 * 514, 3072, 4096),
                                   (600, 128, 256), (37, 4096, 64)])
def test_gpu_matmul_invariant(dtype, shape):
    m, k, n = shape
    _check_dense("cuda", dtype, m, k, n, False, 2e-2 if dtype == torch.bfloat16 else 1e-3)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("counts", [[300, 0, 1, 129, 128, 700, 5, 64], [1] * 8])
def test_gpu_grouped_matmul_invariant(counts):
    _check_grouped("cuda", torch.bfloat16, counts, 4096, 1536, 2e-2)


@pytest.mark.gpu
@gpu_only
def test_gpu_norms_invariant():
    _check_norms("cuda", torch.bfloat16, 1028, 32, 128)


@pytest.mark.gpu
@gpu_only
def test_gpu_grouped_moe_in_a_cuda_graph_equals_eager():
    """The mode's MoE (router, grouped GEMM with its device-side tile map, combine) is capturable."""
    from ditkv.models.hunyuan.layers import MoE, set_moe_impl

    moe = MoE(256, 128, 16, 4).to("cuda", torch.bfloat16).eval()
    moe.gate.float()
    set_moe_impl(moe, "grouped")
    invariant.set_batch_invariant(True)
    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            moe(x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = moe(x)
        for seed in (1, 2):
            x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x))
            g.replay()
            assert torch.equal(y, moe(x))


@pytest.mark.gpu
@gpu_only
def test_gpu_batched_images_equal_solo_in_the_mode():
    """tests/test_cuda.py's scenario (trained tiny model, bf16, 3 requests, solo vs max_num_seqs=3,
    Triton attention, batched steps as CUDA graphs) with batch_invariant on: <= 1 level."""
    import numpy as np

    from batching_helpers import solo_and_batched

    solo, batched, graphs = solo_and_batched("triton", batch_invariant=True)
    assert graphs is not None and any(len(k) == 2 and len(k[0]) == 3 for k in graphs), graphs
    diffs = [np.abs(a.astype(int) - b.astype(int)) for a, b in zip(solo, batched)]
    print("batch_invariant solo vs batched: max levels", [int(d.max()) for d in diffs],
          "mean", [float(d.mean()) for d in diffs])
    assert max(int(d.max()) for d in diffs) <= 1
