"""quack's varlen GEMM as the routed experts' FP8 GEMM (models/fp8_quack.py; skipped without an sm90 GPU
with quack-kernels): equal to torch's `_scaled_grouped_mm` with fast accumulation, the row gather in
its loads, empty experts, CUDA-graph replay with new routing, and the engine's choice rules."""

from __future__ import annotations

import pytest
import torch

from ditkv.errors import BackendError
from ditkv.models import fp8

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _quack_unusable():
    from ditkv.models import fp8_quack

    return fp8_quack.unusable(torch.device("cuda"))


needs_quack = pytest.mark.skipif(not torch.cuda.is_available() or _quack_unusable() is not None,
                                 reason="needs an sm90 GPU with quack-kernels (ditkv[fa4])")


def _case(tokens=300, experts=8, topk=2, k=256, n=384, empty=(3,), seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, generator=g)
    q, s = fp8.quantize_rows(x)
    logits = torch.rand(tokens, experts, device="cuda", generator=g)
    logits[:, list(empty)] = -1  # experts no slot goes to: empty segments
    ids = logits.topk(topk, dim=-1).indices.reshape(-1)
    order = ids.argsort(stable=True)
    ends = torch.bincount(ids, minlength=experts).cumsum(0).to(torch.int32)
    w, ws = fp8.quantize_weight(torch.randn(experts, n, k, device="cuda") * 0.05)
    return q, s, ends, w, ws, order // topk


def _torch_path(q, s, ends, w, ws, rows):
    if rows is not None:
        q, s = q.index_select(0, rows), s.index_select(0, rows)
    return torch._scaled_grouped_mm(q, w.transpose(1, 2), s.view(-1), ws, offs=ends, out_dtype=torch.bfloat16,
                                    use_fast_accum=True)


@needs_quack
@pytest.mark.parametrize("gather", [True, False])
def test_quack_grouped_fp8_gemm_equals_torch_with_fast_accumulation(gather):
    from ditkv.models import fp8_quack

    q, s, ends, w, ws, rows = _case()
    if not gather:  # slots already in expert order: the down projection's case
        q, s, rows = q.index_select(0, rows), s.index_select(0, rows), None
    got = fp8_quack.grouped_mm(q, s, ends, w, ws, torch.bfloat16, rows)
    want = _torch_path(q, s, ends, w, ws, rows)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    # same e4m3 operands, same fast accumulation: bit-equal at the release shapes (tools/gpu_quack_grouped.py);
    # the bound allows one bf16 rounding step of the output
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-3)


@needs_quack
def test_quack_grouped_fp8_gemm_replays_in_a_cuda_graph_with_new_routing():
    from ditkv.models import fp8_quack

    q, s, ends, w, ws, rows = _case()
    rows = rows.clone()
    fp8_quack.grouped_mm(q, s, ends, w, ws, torch.bfloat16, rows)  # compile and plan outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_quack.grouped_mm(q, s, ends, w, ws, torch.bfloat16, rows)
    q2, s2, ends2, _, _, rows2 = _case(seed=1, empty=(5,))
    for dst, src in ((q, q2), (s, s2), (ends, ends2), (rows, rows2)):
        dst.copy_(src)
    graph.replay()
    torch.testing.assert_close(out, _torch_path(q, s, ends, w, ws, rows), rtol=2**-7, atol=1e-3)


@needs_quack
def test_auto_picks_quack_with_fast_accumulation_and_torch_without():
    try:
        fp8.set_grouped_gemm("auto")
        assert fp8.grouped_gemm_impl("cuda") == "quack"
        fp8.set_fast_accum(False)
        assert fp8.grouped_gemm_impl("cuda") == "torch"
        fp8.set_grouped_gemm("quack")
        with pytest.raises(BackendError, match="fast accumulation"):
            fp8.grouped_gemm_impl("cuda")
    finally:
        fp8.set_fast_accum(True)
        fp8.set_grouped_gemm(None)
