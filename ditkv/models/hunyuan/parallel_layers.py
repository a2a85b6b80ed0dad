"""Tensor- and expert-parallel HunyuanImage-3 blocks, cut from a full model (Megatron style).

`shard_model(model, spec)` rewrites every decoder layer in place:
- `self_attn.qkv_proj`: column parallel, a `QKVProjection` over the rank's H/tp query heads and
  Hkv/tp KV heads (the attention callback then sees local heads only);
- `self_attn.o_proj`: `RowParallelLinear` over those heads' input columns, all-reduce over tp;
- `mlp`: `ParallelMoE`. The router stays replicated (fp32). Without expert parallel every expert
  and the shared expert are split along the intermediate dim (gate_and_up column parallel,
  down row parallel); with expert parallel each rank keeps whole experts
  `[ep_rank * E/P, (ep_rank + 1) * E/P)` and tokens travel to their experts' ranks by all-to-all.
  Either way the layer ends with one all-reduce over tp. The rank's experts run through the
  layer's `moe_impl` (layers.py): the per-expert loop, or one grouped GEMM per projection over
  the rank's stacked experts (or expert shards).

Parameter names are unchanged (`mlp.experts.{global id}` via a ModuleDict), so a rank's state
dict is a named slice of the release one; in the release grouped qkv layout a TP shard is even a
contiguous row range (the rank's KV groups).

`spec` is any object with tp_rank/tp_size/tp_group and ep_rank/ep_size/ep_group
(`ditkv.worker.parallel.ParallelContext`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ditkv.models.hunyuan.invariant import linear
from ditkv.models.hunyuan.layers import MoE, RoutedExperts, SwiGLU, combine_slots
from ditkv.models.hunyuan.qkv import QKVProjection


def _part(n: int, rank: int, size: int) -> slice:
    per = n // size
    return slice(rank * per, (rank + 1) * per)


def _param(t: torch.Tensor) -> nn.Parameter:
    # clone: keep only the shard alive once the full tensor is dropped
    return nn.Parameter(t.detach().clone().contiguous(), requires_grad=False)


def _all_to_all(t: torch.Tensor, group, out_splits=None, in_splits=None) -> torch.Tensor:
    rows = t.shape[0] if out_splits is None else sum(out_splits)
    out = t.new_empty((rows, *t.shape[1:]))
    dist.all_to_all_single(out, t.contiguous(), out_splits, in_splits, group=group)
    return out


# ------------------------------------------------------------------------ attention
def shard_qkv(qkv: QKVProjection, rank: int, size: int) -> QKVProjection:
    """Column-parallel slice: the rank's query heads and KV heads (split layout, GQA preserved).
    An FP8 weight's per-row scale is sliced with its rows."""
    h, hkv, d = qkv.num_heads, qkv.num_kv_heads, qkv.head_dim
    hl, kl = h // size, hkv // size
    with torch.device("meta"):
        out = QKVProjection(qkv.weight.shape[1], hl, kl, d)
    for name, t in qkv._parameters.items():
        q, k, v = t.split([h * d, hkv * d, hkv * d], dim=0)
        out._parameters[name] = _param(torch.cat([q[rank * hl * d:(rank + 1) * hl * d],
                                                  k[rank * kl * d:(rank + 1) * kl * d],
                                                  v[rank * kl * d:(rank + 1) * kl * d]]))
    return out


class RowParallelLinear(nn.Module):
    """Bias-free linear over an input-column shard; the partial outputs are summed over `group`.
    FP8: the per-output-channel `weight_scale` is whole (the columns split, not the rows), and each
    rank quantizes its own activation columns, so the sum matches one rank's only to a tolerance."""

    def __init__(self, weight: torch.Tensor, group, size: int, weight_scale: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = _param(weight)
        if weight_scale is not None:
            self.weight_scale = _param(weight_scale)
        self.group, self.size = group, size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, scale=self._parameters.get("weight_scale"))
        if self.size > 1:
            dist.all_reduce(y, group=self.group)
        return y


# ---------------------------------------------------------------------------- MLP
def shard_swiglu(m: SwiGLU, rank: int, size: int) -> SwiGLU:
    """Split the intermediate dim: both halves of gate_and_up (x1, x2) keep their pairing."""
    inter = m.down_proj.in_features
    sl = _part(inter, rank, size)
    with torch.device("meta"):
        out = SwiGLU(m.down_proj.out_features, sl.stop - sl.start)
    for name, t in m.gate_and_up_proj._parameters.items():  # weight (and an FP8 weight's per-row scale)
        if t is None:  # bias=None
            continue
        x1, x2 = t.split(inter, dim=0)
        out.gate_and_up_proj._parameters[name] = _param(torch.cat([x1[sl], x2[sl]]))
    down = m.down_proj._parameters
    out.down_proj.weight = _param(down["weight"][:, sl])
    if "weight_scale" in down:  # per output channel: the rows are not split
        out.down_proj.weight_scale = _param(down["weight_scale"])
    return out


def _own_storage(expert: SwiGLU) -> SwiGLU:
    """A whole expert kept by an EP rank: if its weights are rows of the full model's expert stack
    (a grouped forward ran before sharding), copy them out, or they would keep all E experts alive."""
    for lin in (expert.gate_and_up_proj, expert.down_proj):
        for name, w in lin._parameters.items():  # weight, and an FP8 weight's scale
            if w is not None and not w.is_meta and w.untyped_storage().nbytes() > w.numel() * w.element_size():
                lin._parameters[name] = _param(w)
    return expert


class ParallelMoE(RoutedExperts, nn.Module):
    """`MoE` over a TP group (and optionally an EP group); same routing, same result, same
    `moe_impl` (the loop or the grouped GEMM over this rank's experts or expert shards)."""

    def __init__(self, moe: MoE, spec) -> None:
        super().__init__()
        self.topk, self.gate = moe.topk, moe.gate
        self.num_experts = len(moe.experts)
        self.tp_rank, self.tp_size, self.tp_group = spec.tp_rank, spec.tp_size, spec.tp_group
        self.ep_rank, self.ep_size, self.ep_group = spec.ep_rank, spec.ep_size, spec.ep_group
        if self.ep_size > 1:
            self.per_rank = self.num_experts // self.ep_size
            own = range(self.ep_rank * self.per_rank, (self.ep_rank + 1) * self.per_rank)
            self.experts = nn.ModuleDict({str(e): _own_storage(moe.experts[e]) for e in own})  # whole experts
        elif self.tp_size > 1:
            self.experts = nn.ModuleList(shard_swiglu(e, self.tp_rank, self.tp_size) for e in moe.experts)
        else:
            self.experts = moe.experts
        shared = moe.shared_mlp
        self.shared_mlp = shard_swiglu(shared, self.tp_rank, self.tp_size) \
            if shared is not None and self.tp_size > 1 else shared
        self._init_routed(moe.moe_impl)

    def expert_list(self) -> list[nn.Module]:
        """Local experts in global-id order (EP: local id = global id - ep_rank * per_rank)."""
        if isinstance(self.experts, nn.ModuleDict):
            return list(self.experts.values())
        return list(self.experts)

    def _local(self, x: torch.Tensor) -> torch.Tensor:
        """Every expert here (whole, or an intermediate shard whose partial sum the all-reduce completes)."""
        weights, ids = self.gate(x, self.topk)
        return self.routed_output(x, weights, ids)

    def _dispatched(self, x: torch.Tensor) -> torch.Tensor:
        """Expert parallel: route this TP rank's token slice, send each (token, choice) slot to
        its expert's rank, run the local experts, send results back, weight and sum.
        The all-to-all splits are sized on the host, so this path syncs whatever `moe_impl` is."""
        n, d = x.shape
        bounds = [len(c) for c in torch.arange(n).tensor_split(self.tp_size)]
        lo = sum(bounds[:self.tp_rank])
        xs = x[lo:lo + bounds[self.tp_rank]]  # TP ranks hold the same tokens: split the work
        weights, ids = self.gate(xs, self.topk)
        flat = ids.reshape(-1)
        order = torch.argsort(flat // self.per_rank, stable=True)  # slots grouped by owner rank
        send = torch.bincount(flat // self.per_rank, minlength=self.ep_size)
        recv = _all_to_all(send, self.ep_group)
        sc, rc = send.tolist(), recv.tolist()
        tokens = _all_to_all(xs[order // self.topk], self.ep_group, rc, sc)
        rids = _all_to_all(flat[order], self.ep_group, rc, sc)
        local = self.expert_slots(tokens, rids - self.ep_rank * self.per_rank)
        back = _all_to_all(local, self.ep_group, sc, rc)
        slots = torch.empty_like(back)
        slots[order] = back
        routed = combine_slots(weights, slots, x.dtype)
        if self.tp_size == 1:
            return routed
        full = x.new_zeros(n, d)  # other slices arrive through the TP all-reduce (adding zeros is exact)
        full[lo:lo + routed.shape[0]] = routed
        return full

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._dispatched(x) if self.ep_size > 1 else self._local(x)
        if self.shared_mlp is not None:
            out = out + self.shared_mlp(x)
        if self.tp_size > 1:
            dist.all_reduce(out, group=self.tp_group)
        return out


# -------------------------------------------------------------------------- model
def shard_model(model, spec):
    """Keep this rank's shard of every decoder layer (in place); returns the model."""
    tp, ep = spec.tp_size, spec.ep_size
    if tp == 1 and ep == 1:
        return model
    for layer in model.model.layers:
        attn = layer.self_attn
        if tp > 1:
            qkv = attn.qkv_proj
            attn.qkv_proj = shard_qkv(qkv, spec.tp_rank, tp)
            cols = _part(qkv.num_heads * qkv.head_dim, spec.tp_rank, tp)
            attn.o_proj = RowParallelLinear(attn.o_proj.weight[:, cols], spec.tp_group, tp,
                                            attn.o_proj._parameters.get("weight_scale"))
        layer.mlp = ParallelMoE(layer.mlp, spec)
    return model
