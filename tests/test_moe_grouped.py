"""The grouped-GEMM MoE (one `torch._grouped_mm` per projection, routing on the device) against the
per-expert loop it replaces: same slots, same combine; no host sync; the stacked expert weights are
the experts' own storage; TP/EP keep their results. GPU-marked tests: bf16 on CUDA, no sync under
`set_sync_debug_mode`, CUDA graph capture and replay with new inputs.
"""

from __future__ import annotations

import copy
import os
import tempfile
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from ditkv.models.hunyuan.layers import (
    MoE,
    grouped_mm_fused,
    grouped_slot_outputs,
    loop_slot_outputs,
    resolve_moe_impl,
    set_moe_impl,
    sort_slots_by_expert,
    stack_experts,
)

needs_grouped_mm = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def make_moe(hidden=32, inter=16, experts=8, topk=2, seed=0, std=0.2, device="cpu", dtype=torch.float32):
    """A MoE with random weights (made on `device`: release sizes would take minutes on a CPU)."""
    torch.manual_seed(seed)
    with torch.device(device):
        moe = MoE(hidden, inter, experts, topk, num_shared=1)
        for p in moe.parameters():
            torch.nn.init.normal_(p, std=std)
    moe = moe.requires_grad_(False).to(dtype)
    moe.gate.float()  # routing in fp32, as the model keeps it
    return moe


def skewed_ids(slots: int, experts: int, seed: int) -> torch.Tensor:
    """Random expert ids that leave about half of the experts without a slot."""
    g = torch.Generator().manual_seed(seed)
    used = torch.randperm(experts, generator=g)[: max(1, experts // 2)]
    return used[torch.randint(len(used), (slots,), generator=g)]


# ------------------------------------------------------------------------- equality (CPU)
@needs_grouped_mm
@pytest.mark.parametrize("experts", [8, 64])
@pytest.mark.parametrize("topk", [1, 2, 8])
def test_grouped_slots_equal_loop_slots(experts, topk):
    torch.manual_seed(experts + topk)
    moe = make_moe(experts=experts, topk=topk)
    tokens = torch.randn(23, 32)
    ids = skewed_ids(23 * topk, experts, seed=topk)
    assert torch.bincount(ids, minlength=experts).eq(0).any()  # experts with zero tokens
    want = loop_slot_outputs(tokens, ids, list(moe.experts), topk)
    w13, w2 = moe.stacked_experts()
    got = grouped_slot_outputs(tokens, ids, w13, w2, topk)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@needs_grouped_mm
@pytest.mark.parametrize("experts,topk", [(8, 1), (8, 2), (8, 8), (64, 1), (64, 2), (64, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_moe_equals_loop_moe(experts, topk, dtype):
    moe = make_moe(experts=experts, topk=topk, dtype=dtype)
    x = torch.randn(41, 32).to(dtype)
    set_moe_impl(moe, "loop")
    want = moe(x)
    set_moe_impl(moe, "grouped")
    got = moe(x)
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16 CPU: both paths run the same per-group mm
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@needs_grouped_mm
def test_grouped_moe_with_no_tokens_and_one_token():
    moe = make_moe(experts=64, topk=8)
    moe.moe_impl = "grouped"
    assert moe(torch.randn(0, 32)).shape == (0, 32)
    x = torch.randn(1, 32)
    got = moe(x)
    moe.moe_impl = "loop"
    torch.testing.assert_close(got, moe(x), rtol=1e-6, atol=1e-6)


def test_sort_slots_by_expert_gives_stable_order_and_int32_ends():
    ids = skewed_ids(50, 16, seed=3)
    order, ends = sort_slots_by_expert(ids, 16)
    assert ends.dtype == torch.int32 and ends.shape == (16,)
    assert torch.equal(ends.long(), torch.bincount(ids, minlength=16).cumsum(0))
    assert torch.equal(order, torch.argsort(ids, stable=True))


# ---------------------------------------------------------------------- stacked weights
@needs_grouped_mm
def test_stack_is_the_experts_storage_and_names_are_unchanged():
    moe = make_moe(experts=8)
    keys = list(moe.state_dict())
    before = {k: v.clone() for k, v in moe.state_dict().items()}
    w13, w2 = moe.stacked_experts()
    assert list(moe.state_dict()) == keys  # checkpoint names load as before
    for k, v in moe.state_dict().items():
        assert torch.equal(v, before[k])
    assert w13.shape == (8, 32, 32) and w2.shape == (8, 32, 16)
    for e, expert in enumerate(moe.experts):  # views, not copies: no memory beyond the experts' own
        assert expert.gate_and_up_proj.weight.data_ptr() == w13[e].data_ptr()
        assert expert.down_proj.weight.data_ptr() == w2[e].data_ptr()
    assert moe.stacked_experts()[0] is w13  # current stack: reused, not rebuilt


@needs_grouped_mm
@pytest.mark.parametrize("assign", [False, True])
def test_loading_new_weights_reaches_the_grouped_path(assign):
    moe, other = make_moe(seed=0), make_moe(seed=1)
    x = torch.randn(17, 32)
    set_moe_impl(moe, "grouped")
    moe(x)  # stacked
    moe.load_state_dict(other.state_dict(), assign=assign)  # copy into the rows, or replace them
    set_moe_impl(other, "loop")
    torch.testing.assert_close(moe(x), other(x), rtol=1e-6, atol=1e-6)


@needs_grouped_mm
def test_cast_and_copy_restack_their_own_weights():
    moe = make_moe()
    x = torch.randn(9, 32)
    set_moe_impl(moe, "grouped")
    moe(x)
    twin = copy.deepcopy(moe)  # a copy starts without a stack and builds its own
    assert twin.expert_stack.w13 is None
    torch.testing.assert_close(twin(x), moe(x), rtol=0, atol=0)
    assert twin.expert_stack.w13.data_ptr() != moe.expert_stack.w13.data_ptr()
    moe.to(torch.bfloat16)
    assert moe.expert_stack.w13 is None  # .to() drops the old stack at once
    moe.gate.float()
    y = moe(x.bfloat16())
    assert moe.expert_stack.w13.dtype == torch.bfloat16 and y.dtype == torch.bfloat16


def test_stack_built_inside_inference_mode_stays_loadable():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch without _grouped_mm")
    moe = make_moe()
    moe.moe_impl = "grouped"
    with torch.inference_mode():
        moe(torch.randn(5, 32))
    assert not moe.expert_stack.w13.is_inference()
    moe.load_state_dict(make_moe(seed=2).state_dict())  # in-place copy outside inference mode


@needs_grouped_mm
def test_expert_parallel_rank_does_not_keep_the_full_stack_alive():
    from ditkv.models.hunyuan.parallel_layers import ParallelMoE

    moe = make_moe(experts=8)
    moe.stacked_experts()  # every expert weight is now a row of one [8, ...] tensor
    spec = types.SimpleNamespace(tp_rank=0, tp_size=1, tp_group=None, ep_rank=1, ep_size=2, ep_group=None)
    pm = ParallelMoE(moe, spec)
    for expert in pm.expert_list():  # experts 4..7, each in storage of its own size
        for w in (expert.gate_and_up_proj.weight, expert.down_proj.weight):
            assert w.untyped_storage().nbytes() == w.numel() * w.element_size()
    assert list(pm.experts) == ["4", "5", "6", "7"]


# ------------------------------------------------------------------- choosing the path
def test_auto_is_the_loop_on_cpu_and_grouped_only_where_fused():
    cpu = torch.device("cpu")
    assert not grouped_mm_fused(cpu, torch.bfloat16)
    assert resolve_moe_impl("auto", cpu, torch.float32, 4096, 3072) == "loop"
    assert resolve_moe_impl("loop", cpu, torch.float32, 4096, 3072) == "loop"
    moe = make_moe()
    assert set_moe_impl(moe, "auto") == 1 and moe.expert_stack.w13 is None  # auto on CPU: nothing stacked
    with pytest.raises(ValueError, match="choose one of"):
        set_moe_impl(moe, "fast")


@needs_grouped_mm
def test_grouped_with_unaligned_widths_is_a_clear_error():
    moe = make_moe(hidden=30, inter=6)  # fp32 rows must be multiples of 4 elements (16 bytes)
    moe.moe_impl = "grouped"
    with pytest.raises(ValueError, match="multiples of 4"):
        moe(torch.randn(3, 30))
    moe.moe_impl = "auto"
    assert moe(torch.randn(3, 30)).shape == (3, 30)  # auto: the loop


def test_model_setting_reaches_every_layer():
    from ditkv.models.hunyuan import HunyuanImage3Config, HunyuanImage3Model

    model = HunyuanImage3Model.from_config(HunyuanImage3Config.tiny().replace(num_hidden_layers=2))
    assert model.set_moe_impl("loop") == 2
    assert {layer.mlp.moe_impl for layer in model.model.layers} == {"loop"}


# ------------------------------------------------------------------------ no host sync
class NoHostSync(TorchDispatchMode):
    """Fails on ops that read device values on the host or size outputs from data."""

    SYNCING = ("aten::_local_scalar_dense", "aten::nonzero", "aten::bincount", "aten::unique", "aten::_unique",
               "aten::masked_select", "aten::repeat_interleave")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name.startswith(self.SYNCING):
            raise AssertionError(f"host sync: {func._schema.name}")
        return func(*args, **(kwargs or {}))


def _forbid_host_reads(monkeypatch):
    def boom(*_a, **_k):
        raise AssertionError("host read of a tensor")
    for name in ("tolist", "item", "cpu", "numpy"):  # tolist/cpu on a CPU tensor never dispatch
        monkeypatch.setattr(torch.Tensor, name, boom)


@needs_grouped_mm
def test_grouped_path_reads_nothing_on_the_host(monkeypatch):
    moe = make_moe(experts=64, topk=8)
    moe.moe_impl = "grouped"
    x = torch.randn(29, 32)
    moe.stacked_experts()
    _forbid_host_reads(monkeypatch)
    with NoHostSync():
        moe(x)
    moe.moe_impl = "loop"  # the detector does see the reference's sync
    with pytest.raises(AssertionError, match="host"), NoHostSync():
        moe(x)


@needs_grouped_mm
def test_grouped_moe_traces_as_one_graph():
    """Dynamo with fullgraph=True refuses `.item()`/`.tolist()` and data-dependent shapes (the
    grouped_mm meta kernel wants bf16, hence the dtype)."""
    moe = make_moe(experts=8, topk=2, dtype=torch.bfloat16)
    set_moe_impl(moe, "grouped")
    x = torch.randn(20, 32, dtype=torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(moe, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), moe(x), rtol=0, atol=0)


# ---------------------------------------------------------------------- TP / EP (2 ranks)
_CASES = {"tp2": (2, 1), "ep2": (1, 2), "tp2+ep2": (2, 2)}


def _parallel_rank(rank: int, world: int, init: str, out: str) -> None:
    from ditkv.models.hunyuan.parallel_layers import ParallelMoE

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        x = torch.randn(13, 32, generator=torch.Generator().manual_seed(5))
        want = make_moe(experts=8, topk=2)(x)  # one rank, the loop
        errors = {}
        for name, (tp, ep) in _CASES.items():
            for impl in ("loop", "grouped"):
                moe = make_moe(experts=8, topk=2)
                moe.moe_impl = impl
                spec = types.SimpleNamespace(tp_rank=rank if tp > 1 else 0, tp_size=tp, tp_group=dist.group.WORLD,
                                             ep_rank=rank if ep > 1 else 0, ep_size=ep, ep_group=dist.group.WORLD)
                pm = ParallelMoE(moe, spec)
                errors[name, impl] = ((pm(x) - want).abs().max().item(), pm.moe_impl,
                                      pm.expert_stack.w13 is not None)
        torch.save(errors, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@needs_grouped_mm
def test_tensor_and_expert_parallel_keep_their_results_with_either_impl():
    out = tempfile.mkdtemp(prefix="ditkv-moe-")
    init = "file://" + os.path.join(out, "store")
    mp.start_processes(_parallel_rank, args=(2, init, out), nprocs=2, start_method="spawn")
    for rank in range(2):
        errors = torch.load(os.path.join(out, f"rank{rank}.pt"))
        for (name, impl), (err, got_impl, stacked) in errors.items():
            assert got_impl == impl and stacked == (impl == "grouped"), (name, impl)
            assert err < 1e-5, (rank, name, impl, err)


# ------------------------------------------------------------------------------- GPU
def _cuda_moe(experts, topk, hidden=512, inter=256, seed=0):
    moe = make_moe(hidden, inter, experts, topk, seed=seed, std=0.05, device="cuda", dtype=torch.bfloat16)
    if not grouped_mm_fused(torch.device("cuda"), torch.bfloat16):
        pytest.skip("torch._grouped_mm has no fused kernel on this GPU (needs sm90/sm100)")
    return moe


@pytest.mark.parametrize("experts,topk,hidden,inter", [(8, 2, 512, 256), (64, 8, 512, 256), (64, 8, 4096, 3072)])
@pytest.mark.gpu
@needs_cuda
def test_cuda_grouped_matches_loop_bf16(experts, topk, hidden, inter):
    moe = _cuda_moe(experts, topk, hidden, inter)
    x = torch.randn(1000, hidden, device="cuda", dtype=torch.bfloat16)
    assert set_moe_impl(moe, "auto") == 1 and moe.resolved_impl(x.device, x.dtype) == "grouped"
    with torch.inference_mode():
        grouped = moe(x).float()
        moe.moe_impl = "loop"
        loop = moe(x).float()
        ref = copy.deepcopy(moe).float()  # fp32 copy of the same bf16 weights, the loop
        exact = ref(x.float())
    scale = exact.abs().max()
    err_grouped, err_loop = (grouped - exact).abs().max(), (loop - exact).abs().max()
    assert err_grouped <= 2 * err_loop + 1e-3 * scale, (err_grouped, err_loop, scale)
    torch.testing.assert_close(grouped, loop, rtol=2e-2, atol=2e-2 * scale.item())


@pytest.mark.gpu
@needs_cuda
def test_cuda_grouped_does_not_sync():
    moe = _cuda_moe(64, 8)
    set_moe_impl(moe, "grouped")
    x = torch.randn(777, 512, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        moe(x)  # warm-up: kernels loaded, workspace cached
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            moe(x)
            moe.moe_impl = "loop"
            with pytest.raises(RuntimeError):  # the reference's .tolist() is a sync
                moe(x)
        finally:
            torch.cuda.set_sync_debug_mode(0)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_captures_grouped_moe_and_replays_new_inputs():
    moe = _cuda_moe(64, 8)
    stack_experts(moe)  # auto on sm90 bf16 = grouped: stack before capture
    static_x = torch.randn(600, 512, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                moe(static_x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = moe(static_x)
        outputs = []
        for seed in range(3):
            x = torch.randn(600, 512, device="cuda", dtype=torch.bfloat16,
                            generator=torch.Generator(device="cuda").manual_seed(seed))
            static_x.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            want = moe(x)  # eager, same kernels
            torch.testing.assert_close(static_y, want, rtol=0, atol=0)
            outputs.append(static_y.clone())
    assert not torch.equal(outputs[0], outputs[1])  # new inputs, new routing, new outputs


def test_cpu_path_never_compiles():
    """The fused (torch.compile'd) elementwise chains are CUDA-only: a CPU forward runs the eager
    code, so CPU results never depend on a compiler (or its first-call cost)."""
    from ditkv.models.hunyuan.fused import COMPILED as _COMPILED
    from ditkv.models.hunyuan.layers import combine_slots, rms_norm, rope_rms_norm, silu_mul

    before = dict(_COMPILED)
    x = torch.randn(6, 4, 8)
    cos, sin = torch.ones(6, 1, 8), torch.zeros(6, 1, 8)
    torch.testing.assert_close(rope_rms_norm(x, cos, sin, torch.ones(8), 1e-6), rms_norm(x, torch.ones(8), 1e-6))
    assert silu_mul(torch.randn(5, 8)).shape == (5, 4)
    w = torch.softmax(torch.randn(3, 2), -1)
    slots = torch.randn(6, 4)
    want = (slots.view(3, 2, 4) * w[..., None]).sum(1)
    torch.testing.assert_close(combine_slots(w, slots, torch.float32), want)
    assert _COMPILED == before
def test_moe_residual_is_added_last_and_fused_only_arguments_are_refused_off_the_grouped_path():
    """`MoE.forward(x, residual=r)` is r + moe(x) (the unfused layer's order); pre-quantized tokens and
    combine addends belong to the grouped CUDA path (`fp8_layer.py`), and elsewhere are refused."""
    from ditkv.models.hunyuan.layers import MoE

    torch.manual_seed(0)
    moe = MoE(32, 16, num_experts=4, topk=2).eval()
    x, r = torch.randn(9, 32), torch.randn(9, 32)
    with torch.inference_mode():
        assert torch.equal(moe(x, residual=r), r + moe(x))
        w, ids = moe.gate(x, moe.topk)
        with pytest.raises(ValueError, match="grouped CUDA path"):
            moe.routed_output(x, w, ids, addends=(r, None))
