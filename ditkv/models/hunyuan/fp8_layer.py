"""The FP8 decoder layer's fused path on CUDA: fewer passes over the residual stream.

The unfused layer reads and writes the [N, hidden] stream about a dozen times around its GEMMs: the
norm, then the projection's activation quantization, the residual add, the post-attention norm, the
MoE's quantization and the shared expert's own quantization of the same tokens, the MoE combine, the
add of the shared expert, the residual add. Here:

- input norm + QKV quantization: one pass (`fp8_kernels.add_rms_norm_quant`, no bf16 output);
- attention residual add + post-attention norm + MoE quantization: one pass, which also writes the
  normalised tokens the router reads;
- the routed and the shared experts share that one quantization;
- the MoE combine adds the shared expert's output and the residual in its pass (`combine_kernel`).

Same arithmetic as the unfused layer except the roundings the fused passes skip (documented in each
kernel). It applies only where every piece runs its CUDA FP8 kernel: FP8 QKV, shared expert and
grouped experts, the plain (single-rank) `MoE`, the fused elementwise switch on, batch-invariant mode
off; everything else (CPU reference, TP/EP layers, bf16 layers, `quantization_ignored_layers` that
keep one of these in bf16) runs the unfused layer.
"""

from __future__ import annotations

import torch

from .. import fp8
from . import invariant as _inv
from .fused import FUSE
from .layers import MoE

MAX_HIDDEN = 16384  # one Triton program per row (`fp8_kernels.MAX_BLOCK`)
FUSED = {"on": True}  # process-wide; off only to measure against (`bench step --no-fp8-layer-fusion`)


def set_fp8_layer_fusion(on: bool) -> None:
    FUSED["on"] = bool(on)


def applies(layer, h: torch.Tensor) -> bool:
    """Whether `layer` (a DecoderLayer) runs fused on `h` [N, hidden]."""
    if not (FUSED["on"] and FUSE["on"] and h.is_cuda and h.dtype == torch.bfloat16):
        return False
    if h.dim() != 2 or not h.is_contiguous():
        return False
    if _inv.active(h) or h.shape[1] > MAX_HIDDEN or not fp8._triton_importable():
        return False
    if any(n.weight.dtype != h.dtype for n in (layer.input_layernorm, layer.post_attention_layernorm)):
        return False
    attn, mlp = layer.self_attn, layer.mlp
    if type(mlp) is not MoE or mlp.shared_mlp is None:
        return False
    scaled = (attn.qkv_proj, mlp.shared_mlp.gate_and_up_proj, mlp.shared_mlp.down_proj)
    if any(m._parameters.get("weight_scale") is None for m in scaled):
        return False
    experts = mlp.expert_list()
    return bool(experts) and experts[0].gate_and_up_proj.weight.dtype == fp8.FP8 \
        and mlp.resolved_impl(h.device, h.dtype) == "grouped"


def layer_forward(layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn, index: int) -> torch.Tensor:
    """DecoderLayer.forward on the fused path: h + attn(norm(h)), then that + moe(norm(that)). The
    modules are still called as modules (their hooks run: `bench step` times the parts by them)."""
    from ..fp8_kernels import add_rms_norm_quant

    n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
    _, _, q, s = add_rms_norm_quant(h, None, n1.weight, n1.eps, write_y=False)
    a = layer.self_attn(fp8.QuantizedTokens(q, s, h.dtype), cos, sin, attn, index)
    h, y, q, s = add_rms_norm_quant(h, a.contiguous(), n2.weight, n2.eps)
    return layer.mlp(y, fp8.QuantizedTokens(q, s, y.dtype), residual=h)
