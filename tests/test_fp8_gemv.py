"""The FP8 GEMV pass of AR decode (`models/fp8_gemv.py`): a few token rows through an FP8 projection,
and the routed experts slot by slot without the sort by expert, against the fp32 arithmetic of
`fp8.scaled_mm` (the codes' products summed in fp32, then both rowwise scales); each output row does
not depend on the other rows (batch-invariant, bit for bit).

CPU: the Triton interpreter (small shapes). GPU (`-m gpu`): the release's decode shapes against
`torch._scaled_mm` / the grouped path, and the MoE layer with the pass on and off.
"""

from __future__ import annotations

import os

import torch

if not os.environ.get("DITKV_TRITON_GPU_TESTS") and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's import (see test_triton_kernels.py)

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from ditkv.models import fp8  # noqa: E402
from ditkv.models.fp8_format import FP8, quantize_rows_ref  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
CPU = pytest.mark.skipif(not INTERPRET, reason="interpreter tests (TRITON_INTERPRET=1) are CPU-only")
gpu = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs a CUDA device")


def _weights(e, n, k, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    w8, ws = torch.empty(e, n, k, dtype=FP8), torch.empty(e, n)
    for i in range(e):
        q, s = quantize_rows_ref(torch.randn(n, k, generator=g))
        w8[i], ws[i] = q, s.view(-1)
    return w8.to(device), ws.to(device)


def _tokens(t, k, seed=1, device="cpu"):
    q, s = quantize_rows_ref(torch.randn(t, k, generator=torch.Generator().manual_seed(seed)) * 3)
    return q.to(device), s.to(device)


def _ref(q, s, w8, ws):
    """The arithmetic of `fp8.scaled_mm`: fp32 products of the codes, then the rowwise scales."""
    return (q.float() @ w8.float().t()) * s.float() * ws.float().view(1, -1)


@CPU
@pytest.mark.parametrize("t,n,k", [(1, 70, 300), (3, 32, 256), (4, 5, 513)])
def test_gemv_is_the_scaled_product(t, n, k):
    from ditkv.models.fp8_gemv import gemv

    w8, ws = _weights(1, n, k)
    q, s = _tokens(t, k)
    got = gemv(q, s, w8[0], ws[0], torch.float32)
    torch.testing.assert_close(got, _ref(q, s, w8[0], ws[0]), rtol=1e-5, atol=1e-4)


@CPU
def test_routed_slots_are_each_token_through_its_expert_and_do_not_depend_on_the_others():
    from ditkv.models.fp8_gemv import gemv

    w8, ws = _weights(5, 40, 300)
    q, s = _tokens(3, 300)
    ids = torch.tensor([4, 1, 0, 3, 4, 2])  # topk 2: slot j is token j // 2
    got = gemv(q, s, w8, ws, torch.float32, ids, topk=2)
    ref = torch.cat([_ref(q[j // 2:j // 2 + 1], s[j // 2:j // 2 + 1], w8[e], ws[e]) for j, e in enumerate(ids.tolist())])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    alone = gemv(q[1:2], s[1:2], w8, ws, torch.float32, ids[2:4], topk=2)
    assert torch.equal(alone, got[2:4])  # token 1's slots alone: bit for bit


@CPU
def test_bad_shapes_are_refused():
    from ditkv.models.fp8_gemv import gemv

    w8, ws = _weights(2, 8, 32)
    q, s = _tokens(1, 32)
    with pytest.raises(ValueError, match="weight stack"):
        gemv(q, s, w8[0], ws[0], torch.float32, torch.tensor([0]))
    with pytest.raises(ValueError, match="S <= tokens"):
        gemv(q, s, w8, ws, torch.float32, torch.tensor([0, 1, 0]), topk=2)
    with pytest.raises(ValueError, match=r"\[N, K\] weight"):
        gemv(q, s, w8, ws, torch.float32)


@CPU
def test_combine_reads_slots_in_order_without_an_inverse_map():
    """The decode pass's outputs are in slot order: the combine takes them without `inv` exactly as
    through an identity map."""
    from ditkv.models.hunyuan.combine_kernel import combine_gathered

    g = torch.Generator().manual_seed(2)
    w, y, res = torch.rand(3, 2, generator=g), torch.randn(6, 40, generator=g), torch.randn(3, 40, generator=g)
    got = combine_gathered(w, y, None, torch.float32, residual=res)
    assert torch.equal(got, combine_gathered(w, y, torch.arange(6), torch.float32, residual=res))
    torch.testing.assert_close(got, (y.view(3, 2, 40) * w[..., None]).sum(1) + res)


@CPU
@pytest.mark.parametrize("e,topk,k", [(16, 4, 300), (64, 8, 256), (5, 5, 40)])
def test_the_decode_router_is_the_router(e, topk, k):
    """One Triton pass for a few tokens: the ids of `Router.forward` (largest first) and its weights within
    fp32 summation order."""
    from ditkv.models.hunyuan.layers import Router
    from ditkv.models.hunyuan.router_kernel import route

    torch.manual_seed(e)
    r = Router(k, e)
    x = torch.randn(3, k)
    want_w, want_ids = r(x, topk)
    got_w, got_ids = route(x, r.wg.weight.detach(), topk)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="topk"):
        route(x, r.wg.weight.detach(), e + 1)


def test_the_switch_is_checked_and_cpu_never_takes_the_pass():
    before = fp8.GEMV["rows"]
    try:
        for bad in (-1, 1.5, True):
            with pytest.raises(ValueError, match="integer >= 0"):
                fp8.set_gemv_rows(bad)
        fp8.set_gemv_rows(8)
        assert not fp8.gemv_applies(torch.zeros(2, 4))  # the CPU reference path always
    finally:
        fp8.set_gemv_rows(before)


# ---- GPU: the release's decode shapes --------------------------------------------------------------------
@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 2, 4])
def test_gpu_gemv_matches_scaled_mm(t):
    """Against the exact arithmetic (fp32 products of the codes, on the GPU) within the bf16 output's rounding,
    and against `torch._scaled_mm` within its accumulation's; each row alone is bit for bit the same."""
    from ditkv.models.fp8_gemv import gemv

    w8, ws = _weights(1, 6144, 4096, device="cuda")
    q, s = _tokens(t, 4096, device="cuda")
    got = gemv(q, s, w8[0], ws[0], torch.bfloat16).float()
    exact = _ref(q, s, w8[0], ws[0])
    # bf16 rounding of each value, plus fp32 summation-order noise relative to the row's largest value
    bound = exact.abs() * 2 ** -8 + 1e-5 * exact.abs().amax(dim=1, keepdim=True)
    worst = ((got - exact).abs() / bound).max().item()
    assert worst <= 1, f"error {worst:.3g} x the bound (bf16 rounding + fp32 order)"
    cublas = torch._scaled_mm(q, w8[0].t(), scale_a=s, scale_b=ws[0].view(1, -1), out_dtype=torch.bfloat16).float()
    torch.testing.assert_close(got, cublas, rtol=2e-2, atol=1e-1 * exact.abs().mean().item())
    assert torch.equal(gemv(q[:1], s[:1], w8[0], ws[0], torch.bfloat16).float(), got[:1])


@gpu
@pytest.mark.gpu
def test_gpu_moe_layer_with_and_without_the_pass():
    """The MoE layer of FP8 experts at decode size: the GEMV pass (no sort) against the grouped path,
    within bf16 rounding; a graph replay equals the eager call bit for bit."""
    from ditkv.models.hunyuan.layers import MoE
    from ditkv.models.hunyuan.quantize import quantize_linear_

    torch.manual_seed(0)
    moe = MoE(1024, 512, 16, 4).to("cuda", torch.bfloat16)
    for name, m in moe.named_modules():
        if isinstance(m, torch.nn.Linear) and name.startswith(("experts.", "shared_mlp.")):
            quantize_linear_(m)
    moe.expert_stack.clear()
    x = torch.randn(3, 1024, device="cuda", dtype=torch.bfloat16)
    before = fp8.GEMV["rows"]
    try:
        fp8.set_gemv_rows(0)
        grouped = moe(x).float()
        fp8.set_gemv_rows(4)
        got = moe(x)
        g = torch.cuda.CUDAGraph()
        out = torch.empty_like(got)
        with torch.cuda.graph(g):
            out.copy_(moe(x))
        g.replay()
    finally:
        fp8.set_gemv_rows(before)
    torch.testing.assert_close(got.float(), grouped, rtol=3e-2, atol=3e-2)
    assert torch.equal(out, got)


@gpu
@pytest.mark.gpu
def test_gpu_decode_router_at_the_release_shape():
    from ditkv.models.hunyuan.layers import Router
    from ditkv.models.hunyuan.router_kernel import route

    torch.manual_seed(1)
    r = Router(4096, 64).to("cuda", torch.bfloat16)
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    before = fp8.GEMV["rows"]
    try:
        fp8.set_gemv_rows(0)
        want_w, want_ids = r(x, 8)
    finally:
        fp8.set_gemv_rows(before)
    got_w, got_ids = route(x, r.wg.weight, 8)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)
