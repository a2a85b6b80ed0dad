"""Building blocks of HunyuanImage-3.0's transformer: norms, 2D RoPE, SwiGLU / MoE (the image path's
blocks: `image_layers.py`).

Attribute names inside each block follow the release checkpoint (`mlp.0`, `in_layers.2`,
`emb_layers.1`, `out_layers.3`, `skip_connection`, `gate.wg`, ...), so state dicts load as is.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from .. import fp8
from . import invariant as _inv
from .expert_stack import ExpertStack
from .fused import FUSE as _FUSE
from .fused import fused as _fused

# ----------------------------------------------------------------------- norms
# On CUDA the elementwise chains below run torch.compile'd (`fused.py`); the CPU runs them eagerly.


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rope_rms_norm(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    return _rms_norm(apply_rope(x, cos, sin), weight, eps)


# batch-invariant mode: fixed-layout Triton row kernels instead (invariant.py)
rms_norm = _inv.dispatch(_fused(_rms_norm), _inv.rms_norm)
rope_rms_norm = _inv.dispatch(_fused(_rope_rms_norm), _inv.rope_rms_norm)  # release order: rotate, then normalise


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, statistics in fp32 (bf16 mean-of-squares loses digits)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


# ---------------------------------------------------------------------- 2D RoPE


def rope_cos_sin(
    pos_y: torch.Tensor, pos_x: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [N, 1, head_dim] (fp32) for 2D RoPE.

    The head_dim/2 inverse frequencies are taken in pairs: the first of each pair turns with
    the y position, the second with x. The half-size angle vector is repeated to head_dim
    (rotate-half layout). With y == x this is exactly ordinary 1D RoPE.
    """
    device = pos_y.device
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim))
    inv_freq = inv_freq.float().view(head_dim // 4, 2)
    pos = torch.stack([pos_y, pos_x], dim=-1).float()  # [N, 2]
    angles = (pos[:, None, :] * inv_freq[None]).reshape(pos.shape[0], head_dim // 2)
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, H, D] with precomputed tables; math in fp32, result in x's dtype."""
    x32 = x.float()
    return (x32 * cos + rotate_half(x32) * sin).to(x.dtype)


def rope_2d(x: torch.Tensor, pos_y: torch.Tensor, pos_x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """2D rotary embedding of x [N, H, D] at positions (pos_y[N], pos_x[N])."""
    cos, sin = rope_cos_sin(pos_y, pos_x, x.shape[-1], theta)
    return apply_rope(x, cos, sin)


# ---------------------------------------------------------------- MLP and MoE


class SwiGLU(nn.Module):
    """Fused `gate_and_up_proj`: first half is x1 ("up"), second half x2 is gated: down(x1*silu(x2))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_and_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor, quantized: fp8.QuantizedTokens | None = None) -> torch.Tensor:
        """`quantized`: x already quantized for an FP8 gate_and_up_proj (the fused FP8 layer)."""
        if quantized is not None:
            x12 = quantized.matmul(self.gate_and_up_proj)
        else:
            x12 = _inv.run(self.gate_and_up_proj, x)
        down = self.down_proj
        scale = down._parameters.get("weight_scale")
        if scale is not None and x.is_cuda:  # FP8: the gate and the down projection's quantization in one pass
            q, s = fp8.silu_mul_quant(x12.reshape(-1, x12.shape[-1]))
            return fp8.scaled_mm(q, s, down.weight, scale, x.dtype).view(*x.shape[:-1], -1)
        return _inv.run(down, silu_mul(x12))


def _silu_mul(x12: torch.Tensor) -> torch.Tensor:
    x1, x2 = x12.chunk(2, dim=-1)
    return x1 * F.silu(x2)


silu_mul = _fused(_silu_mul)  # [.., 2I] -> x1 * silu(x2) [.., I]


class Router(nn.Module):
    """`gate.wg`: hidden -> experts logits, always evaluated in fp32."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.wg = nn.Linear(hidden, num_experts, bias=False)

    def forward(self, x: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert ids [N, k] and their weights [N, k] (fp32, renormalised to sum 1)."""
        if _inv.active(x):
            return _inv.route(x, self.wg.weight, topk)
        if x.dim() == 2 and fp8.gemv_applies(x):  # a few tokens (decode): one Triton pass
            from .router_kernel import route

            return route(x.contiguous(), self.wg.weight, topk)
        logits = _inv.linear(x.float(), self.wg.weight.float())
        probs = logits.softmax(dim=-1)
        weights, experts = probs.topk(topk, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        return weights, experts


# ------------------------------------------------ routed experts: loop or grouped GEMM
#
# Both implementations compute, for every (token, choice) slot s, expert ids[s] on the slot's
# token, and then weight and sum a token's k slots in fp32 in the same order (`combine_slots`):
# - "loop", the reference: one SwiGLU call per expert that has tokens, sized on the host
#   (`.tolist()`): a host sync and 2-3 launches per expert;
# - "grouped": slots sorted by expert on the device, per-expert ends by `searchsorted`, ONE
#   `torch._grouped_mm` per projection over stacked [E, ...] weights. No host sync where the op
#   runs its fused kernel (CUDA sm90/sm100, bf16), so a CUDA graph can capture it.
# "auto" picks grouped exactly where it is fused, and the loop elsewhere (CPU, fp32, other GPUs).

MOE_IMPLS = ("auto", "loop", "grouped")


def check_moe_impl(impl: str) -> str:
    if impl not in MOE_IMPLS:
        raise ValueError(f"moe_impl={impl!r}: choose one of {', '.join(MOE_IMPLS)}")
    return impl


@functools.lru_cache(maxsize=None)
def _fused_grouped_mm_arch(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] in (9, 10)


def grouped_mm_fused(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs its fused CUTLASS kernel here: CUDA sm90/sm100, bf16.
    Elsewhere it falls back to a per-group loop that reads the offsets on the host (a sync)."""
    if not hasattr(torch, "_grouped_mm") or device.type != "cuda" or torch.version.hip or dtype != torch.bfloat16:
        return False
    return _fused_grouped_mm_arch(torch.cuda.current_device() if device.index is None else device.index)


def grouped_mm_unusable(hidden: int, inter: int, dtype: torch.dtype) -> str | None:
    """Why the grouped path cannot run these shapes, or None. The op wants both operands' row
    strides 16-byte aligned (K and N multiples of 16 / itemsize). `dtype` is the weights' (e4m3:
    `torch._scaled_grouped_mm`)."""
    if dtype == fp8.FP8 and not hasattr(torch, "_scaled_grouped_mm"):
        return f"this torch ({torch.__version__}) has no torch._scaled_grouped_mm"
    if not hasattr(torch, "_grouped_mm"):
        return f"this torch ({torch.__version__}) has no torch._grouped_mm"
    align = 16 // dtype.itemsize
    if hidden % align or inter % align:
        return f"hidden={hidden} and intermediate={inter} must be multiples of {align} for {dtype}"
    return None


def resolve_moe_impl(impl: str, device: torch.device, dtype: torch.dtype, hidden: int, inter: int) -> str:
    """Pick "loop" or "grouped" for experts of these shapes on this device (`dtype`: the weights';
    e4m3 runs the FP8 grouped GEMM). An explicit "grouped" that cannot run is an error (no silent
    fallback); "auto" falls back to the loop."""
    if check_moe_impl(impl) == "loop":
        return "loop"
    why = grouped_mm_unusable(hidden, inter, dtype)
    fused_here = fp8.grouped_fused(device) if dtype == fp8.FP8 else grouped_mm_fused(device, dtype)
    if dtype == fp8.FP8 and why is None and torch.device(device).type == "cpu":
        why = "the FP8 grouped GEMM runs on CUDA; the CPU runs the reference loop"
    if impl == "auto":
        return "grouped" if why is None and fused_here else "loop"
    if why is not None:
        raise ValueError(f"moe_impl='grouped' cannot run here: {why}; use 'loop' or 'auto'")
    return "grouped"


def loop_slot_outputs(tokens: torch.Tensor, ids: torch.Tensor, experts, topk: int = 1) -> torch.Tensor:
    """Reference: expert `ids[s]` on `tokens[s // topk]` for every slot s, one call per expert
    (`experts[e]`). Each slot is written exactly once: deterministic, no atomics."""
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids, minlength=len(experts)).tolist()  # the host sync
    out = tokens.new_empty(ids.shape[0], tokens.shape[1])
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        sel = order[start:start + c]
        x = tokens[sel // topk if topk > 1 else sel]
        out[sel] = experts[e](x)  # on the CPU one product per row (invariant.cpu_rows): batch-invariant
        start += c
    return out


def sort_slots_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots in expert order, each expert's cumulative end in that order as int32), on the device.

    The sort is stable, so within an expert the slots keep the loop's order; the ends come from
    `searchsorted` on the sorted ids (no bincount: on CUDA it sizes its output on the host)."""
    sorted_ids, order = torch.sort(ids, stable=True)
    experts = torch.arange(num_experts, device=ids.device, dtype=ids.dtype)
    return order, torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)


def grouped_swiglu_fp8(q: torch.Tensor, s: torch.Tensor, rows: torch.Tensor, ends: torch.Tensor, w13: torch.Tensor,
                       w2: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor], out_dtype) -> torch.Tensor:
    """`grouped_swiglu` in FP8 W8A8 over pre-quantized tokens (q, s), slot i being token rows[i]: the
    gate and the down projection's activation quantization fused (`fp8.silu_mul_quant`)."""
    x12 = fp8.scaled_grouped_mm(q, s, ends, w13, scales[0], out_dtype, rows)
    hq, hs = fp8.silu_mul_quant(x12)
    return fp8.scaled_grouped_mm(hq, hs, ends, w2, scales[1], out_dtype)


def grouped_swiglu(xs: torch.Tensor, ends: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Expert e's SwiGLU on rows [ends[e-1], ends[e]) of xs, for every e: one grouped GEMM per
    projection. w13 [E, 2I, H] and w2 [E, H, I] are stacked nn.Linear weights (out x in)."""
    if _inv.active(xs):
        return _inv.grouped_swiglu(xs, ends, w13, w2, silu_mul)
    x12 = torch._grouped_mm(xs, w13.transpose(1, 2), offs=ends)
    return torch._grouped_mm(silu_mul(x12), w2.transpose(1, 2), offs=ends)


def grouped_sorted_outputs(tokens: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                           topk: int = 1, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                           quantized: tuple[torch.Tensor, torch.Tensor] | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert outputs in expert order [S, H], inv [S]): slot s's output is row inv[s]. One grouped
    GEMM per projection, no host sync. With `scales` (e4m3 stacks): FP8 W8A8, the tokens quantized
    once before the k-fold gather (or already: `quantized` = (q, s) of `tokens`). Needs ids.shape[0] > 0."""
    order, ends = sort_slots_by_expert(ids, w13.shape[0])
    src = order // topk if topk > 1 else order
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.shape[0], device=order.device, dtype=order.dtype)
    if scales is not None:
        q, s = fp8.quantize_rows(tokens) if quantized is None else quantized
        return grouped_swiglu_fp8(q, s, src, ends, w13, w2, scales, tokens.dtype), inv
    return grouped_swiglu(tokens.index_select(0, src), ends, w13, w2), inv


def grouped_slot_outputs(tokens: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                         topk: int = 1, scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """What `loop_slot_outputs` computes, from stacked weights and with no host sync."""
    if ids.shape[0] == 0:  # a shape test, not a sync
        return tokens.new_empty(0, tokens.shape[1])
    y, inv = grouped_sorted_outputs(tokens, ids, w13, w2, topk, scales)
    # un-permute by a gather (slot s sits at position inv[s] of the expert order): each slot read
    # once, as index_copy_ would write it once, but the gather kernel is the faster of the two
    return y.index_select(0, inv)


def combine_slots(weights: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Token i's output: its k slots weighted by the fp32 routing weights, summed in fp32.

    CPU: one batched matmul. CUDA (fused): the same fp32 products and sums in one kernel that
    reads the bf16 slots once, instead of an fp32 copy of every slot first."""
    if _inv.active(weights):
        return _inv.combine_slots(weights, slots, dtype)
    if weights.is_cuda and _FUSE["on"]:
        return _weighted_sum(weights, slots, dtype)
    n, k = weights.shape
    return torch.bmm(weights.unsqueeze(1), slots.view(n, k, slots.shape[-1]).float()).squeeze(1).to(dtype)


@_fused
def _weighted_sum(weights: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    n, k = weights.shape
    return (slots.view(n, k, slots.shape[-1]).float() * weights.unsqueeze(-1)).sum(1).to(dtype)


class RoutedExperts:
    """Mixin of `MoE` and `ParallelMoE`: which implementation computes the expert slots
    (`moe_impl`), and the stacked weights the grouped one reads."""

    moe_impl: str = "auto"

    def _init_routed(self, moe_impl: str) -> None:
        self.moe_impl = check_moe_impl(moe_impl)
        self.expert_stack = ExpertStack()

    def expert_list(self) -> list[SwiGLU]:
        """Local experts; slot id i means `expert_list()[i]`."""
        return list(self.experts)

    def resolved_impl(self, device: torch.device, dtype: torch.dtype) -> str:
        """`dtype`: the tokens'. FP8 experts (e4m3 weights) take bf16 tokens."""
        w = self.expert_list()[0].gate_and_up_proj.weight
        if w.dtype == fp8.FP8:
            if dtype != torch.bfloat16:  # _scaled_grouped_mm writes bf16
                return "loop"
        elif dtype != w.dtype:  # both paths need matching dtypes; let the loop raise its usual error
            return "loop"
        return resolve_moe_impl(self.moe_impl, device, w.dtype, w.shape[1], w.shape[0] // 2)

    def routed_output(self, tokens: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                      quantized: fp8.QuantizedTokens | None = None, addends: tuple = ()) -> torch.Tensor:
        """The routed experts' combined output [N, H] for routing (weights, ids) [N, k]. Grouped on
        CUDA: the combine reads the expert-ordered outputs through the slot map in one Triton pass
        (`combine_kernel.py`), with no un-permuted copy of the k*N slots in between. The fused FP8
        layer (`fp8_layer.py`) hands its tokens already `quantized` and the (shared, residual)
        `addends` that combine pass adds; only that path takes them."""
        flat = ids.reshape(-1)
        if (tokens.is_cuda and _FUSE["on"] and not _inv.active(tokens) and flat.shape[0] > 0
                and fp8._triton_importable() and self.resolved_impl(tokens.device, tokens.dtype) == "grouped"):
            from .combine_kernel import combine_gathered

            w13, w2 = self.stacked_experts()
            scales = self.expert_stack.scales
            if scales is not None and fp8.gemv_applies(tokens):  # a few tokens (decode): no sort by expert
                from ..fp8_gemv import routed_swiglu

                q, s = fp8.quantize_rows(tokens) if quantized is None else quantized[:2]
                y = routed_swiglu(q, s, flat, w13, w2, scales, self.topk, tokens.dtype)
                return combine_gathered(weights, y, None, tokens.dtype, *addends)
            y, inv = grouped_sorted_outputs(tokens, flat, w13, w2, self.topk, self.expert_stack.scales,
                                            None if quantized is None else quantized[:2])
            return combine_gathered(weights, y, inv, tokens.dtype, *addends)
        if quantized is not None or addends:
            raise ValueError("pre-quantized tokens and combine addends need the grouped CUDA path (fp8_layer.applies)")
        return combine_slots(weights, self.expert_slots(tokens, flat, self.topk), tokens.dtype)

    def expert_slots(self, tokens: torch.Tensor, ids: torch.Tensor, topk: int = 1) -> torch.Tensor:
        """Expert `ids[s]` (local id) on `tokens[s // topk]` for every slot s."""
        experts = self.expert_list()
        if self.resolved_impl(tokens.device, tokens.dtype) == "grouped":
            w13, w2 = self.stacked_experts(experts)
            return grouped_slot_outputs(tokens, ids, w13, w2, topk, self.expert_stack.scales)
        return loop_slot_outputs(tokens, ids, experts, topk)

    def stacked_experts(self, experts: list[SwiGLU] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.compiler.is_compiling():  # traced code reads the stack prepared before compiling
            return self.expert_stack.w13, self.expert_stack.w2
        return self.expert_stack.get(self.expert_list() if experts is None else experts)

    def _apply(self, fn, *args, **kwargs):
        # .to()/.float()/...: the experts get new tensors; free the old stack now, not at the next step
        self.expert_stack.clear()
        return super()._apply(fn, *args, **kwargs)


class MoE(RoutedExperts, nn.Module):
    """Routed SwiGLU experts (top-k, no token dropping) plus an always-on shared expert."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, topk: int, num_shared: int = 1,
                 moe_impl: str = "auto") -> None:
        super().__init__()
        self.topk = topk
        self.gate = Router(hidden, num_experts)
        self.experts = nn.ModuleList(SwiGLU(hidden, intermediate) for _ in range(num_experts))
        # The release sizes the shared MLP as num_shared_expert experts fused into one.
        self.shared_mlp = SwiGLU(hidden, intermediate * num_shared) if num_shared > 0 else None
        self._init_routed(moe_impl)

    def forward(self, x: torch.Tensor, quantized: fp8.QuantizedTokens | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, hidden] -> the routed plus shared experts' output (+ `residual` when given).
        `quantized` (the fused FP8 layer, `fp8_layer.py`): x already quantized, for the grouped FP8
        experts and the shared expert alike; the combine then adds the shared output and the residual."""
        weights, experts = self.gate(x, self.topk)
        if quantized is not None:  # slot s = token s // k, choice s % k
            return self.routed_output(x, weights, experts, quantized, (self.shared_mlp(x, quantized), residual))
        out = self.routed_output(x, weights, experts)
        if self.shared_mlp is not None:
            out = out + self.shared_mlp(x)
        return out if residual is None else residual + out


def set_moe_impl(model: nn.Module, impl: str) -> int:
    """Set `moe_impl` on every MoE layer of `model` (`MoE` and `ParallelMoE`) and stack the
    weights of the layers that will run grouped now, rather than inside the first step (or a
    CUDA graph capture). Returns how many layers were set."""
    check_moe_impl(impl)
    layers = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    for m in layers:
        m.moe_impl = impl
    stack_experts(model)
    return len(layers)


def stack_experts(model: nn.Module) -> int:
    """Stack the expert weights of every MoE layer whose implementation resolves to grouped on
    its weights' own device and dtype; returns how many were (re)stacked or already current."""
    n = 0
    for m in model.modules():
        if not isinstance(m, RoutedExperts) or not m.expert_list():
            continue
        w = m.expert_list()[0].gate_and_up_proj.weight
        dtype = torch.bfloat16 if w.dtype == fp8.FP8 else w.dtype  # FP8 experts take bf16 tokens
        if not w.is_meta and m.resolved_impl(w.device, dtype) == "grouped":
            m.stacked_experts()
            n += 1
    return n
