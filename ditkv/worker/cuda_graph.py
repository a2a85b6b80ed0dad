"""CUDA graph of the paged denoise step of one installed request (fixed shapes).

Everything shape- or request-dependent (token ids, positions, image/timestep indices, the phase
metadata) is prepared on the device once; the captured step only reads the static `x` and `t`
buffers, so a replay with new latents and a new timestep needs no host work. MoE routing in
eager mode sizes its expert batches on the host (`.tolist()`), which a graph cannot capture; the
graph uses an equivalent dense-routing form (every expert, weighted by its renormalised top-k
gate, zero elsewhere), exact up to summation order.
"""

from __future__ import annotations

import contextlib

import torch

from ..attention.adapter import PagedAttentionAdapter
from ..models.hunyuan.layers import MoE
from .rows import DENOISE


def dense_route_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Host-sync-free MoE: same routing weights, every expert evaluated."""
    weights, experts = moe.gate(x, moe.topk)
    full = torch.zeros(x.shape[0], len(moe.experts), dtype=torch.float32, device=x.device)
    full.scatter_(1, experts, weights)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e, expert in enumerate(moe.experts):
        out += full[:, e:e + 1] * expert(x).float()
    out = out.to(x.dtype)
    if moe.shared_mlp is not None:
        out = out + moe.shared_mlp(x)
    return out


@contextlib.contextmanager
def graph_safe_moe(model):
    """Route every MoE layer through `dense_route_moe` while the context is open."""
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    for m in moes:
        m.forward = (lambda mod: (lambda x: dense_route_moe(mod, x)))(m)
    try:
        yield
    finally:
        for m in moes:
            del m.forward


class DenoiseStepGraph:
    def __init__(self, runner, request_id: str, layout, warmup: int = 2):
        if runner.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device")
        if runner.par.world_size > 1:
            raise RuntimeError("CUDA graphs of the denoise step are single-rank only (parallel modes use "
                               "collectives with host-side sizes); run with world_size 1")
        if not runner.paged:
            raise RuntimeError("the captured step is the paged denoise step; use diffusion_kv_mode=paged_scheduler")
        self.runner, self.layout = runner, layout
        m, dev = runner.model, runner.device
        rows = layout.rows
        spans = [(r.prefix_len, r.prefix_len + r.target_len) for r in rows]
        self.ids = torch.cat([r.token_ids[lo:hi] for r, (lo, hi) in zip(rows, spans)]).to(dev)
        self.py = torch.cat([r.pos_y[lo:hi] for r, (lo, hi) in zip(rows, spans)]).to(dev)
        self.px = torch.cat([r.pos_x[lo:hi] for r, (lo, hi) in zip(rows, spans)]).to(dev)
        ts_idx, img_idx, off = [], [], 0
        for r, (lo, hi) in zip(rows, spans):
            ts_idx.append(off + r.timestep_index - lo)
            a = off + r.image_start - lo
            img_idx.append(torch.arange(a, a + layout.num_image_tokens))
            off += hi - lo
        self.ts_idx = torch.tensor(ts_idx, device=dev)
        self.img_idx = torch.stack(img_idx).to(dev)  # [R, hw]
        meta = runner.rows.phase_metadata(request_id, DENOISE, dev)
        self.attn = PagedAttentionAdapter(runner.backend, runner.pool, meta, runner.scale)
        self.x = torch.zeros(1, m.config.latent_channels, layout.h, layout.w, device=dev)
        self.t = torch.zeros(1, device=dev)
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), graph_safe_moe(m):
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(warmup):  # compile kernels, settle the allocator
                    self.forward()
            torch.cuda.current_stream(dev).wait_stream(side)
            with torch.cuda.graph(self.graph):
                self.v = self.forward()

    def forward(self) -> torch.Tensor:
        """The denoise step from the static buffers -> velocity per row [R, C, h, w] fp32."""
        m, n = self.runner.model, len(self.layout.rows)
        tt = self.t.expand(n)
        hidden = m.embed_tokens(self.ids)
        hidden = hidden.index_copy(0, self.ts_idx, m.timestep_token(tt).to(hidden.dtype))
        img = m.embed_image(self.x.expand(n, -1, -1, -1), tt)
        hidden = hidden.index_copy(0, self.img_idx.reshape(-1), img.reshape(-1, img.shape[-1]).to(hidden.dtype))
        out = m.backbone(hidden, self.py, self.px, self.attn)
        return m.final_layer_velocity(out[self.img_idx], tt, self.layout.h, self.layout.w).float()

    def replay(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        self.x.copy_(x)
        self.t.copy_(t.reshape(1))
        self.graph.replay()
        return self.v
