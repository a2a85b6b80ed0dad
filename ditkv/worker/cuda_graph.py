"""CUDA graphs of the paged denoise step, one per shape bucket (`cuda_graphs` in EngineConfig).

A bucket is what fixes every kernel's launch shape: the rows, each row's target length, the latent
size and the (padded) width of the block table. Anything that differs between requests of one
bucket (token ids, positions, block table, key limits, slot mapping) lives in static device
buffers that `load` refills before the request's first replay; the captured step reads only
those and the static `x` / `t`, so a replay needs no host work.

What a graph needs from the step (`graph_unusable` says which is missing):
- a `graph_safe` attention backend (Triton): its launch grid depends on the query count only, and
  it reads key lengths from the device (the torch backend slices keys by host-side lengths);
- a sync-free MoE: the grouped GEMM (`moe_impl` grouped) sizes expert batches on the device; the
  per-expert loop asks the host, which a graph cannot capture. `graph_safe_moe` offers a dense-routing
  form (every expert, exact up to summation order) for tests on devices without the grouped GEMM;
- one rank: the parallel modes exchange host-sized collectives.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict

import torch

from ..attention.adapter import PagedAttentionAdapter
from ..attention.metadata import PagedAttentionMetadata
from ..models.hunyuan.layers import MoE, RoutedExperts, stack_experts
from .rows import DENOISE

log = logging.getLogger(__name__)

GRAPH_MODES = ("auto", "on", "off")
MAX_CAPTURES = 8  # graphs kept at once; the least recently used one goes first


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
    """Route every MoE layer through `dense_route_moe` while the context is open (tests)."""
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    for m in moes:
        m.forward = (lambda mod: (lambda x: dense_route_moe(mod, x)))(m)
    try:
        yield
    finally:
        for m in moes:
            del m.forward


def graph_unusable(runner) -> str | None:
    """Why the denoise step of `runner` cannot be captured, or None when it can."""
    if runner.device.type != "cuda":
        return f"CUDA graphs need a CUDA device (this rank runs on {runner.device.type})"
    if runner.par.world_size > 1:
        return "CUDA graphs of the denoise step are single-rank only (the parallel modes use host-sized collectives)"
    if not runner.paged:
        return "the captured step is the paged denoise step; use diffusion_kv_mode=paged_scheduler"
    if not getattr(runner.backend, "graph_safe", False):
        return (f"attention backend {runner.backend.name!r} sizes its work from host-side lengths, which a "
                "graph would freeze at the first request of a bucket; use attention_backend=triton")
    for m in runner.model.modules():
        if isinstance(m, RoutedExperts) and m.resolved_impl(runner.device, runner.model.dtype) != "grouped":
            return ("the MoE runs its per-expert loop, which sizes expert batches on the host; the grouped "
                    "GEMM needs bf16 on sm90/sm100 (dtype=bfloat16)")
    return None


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class DenoiseStepGraph:
    """The captured denoise step of one bucket (`key`); `load` points it at a request."""

    def __init__(self, runner, request_id: str, layout, width: int | None = None, warmup: int = 2,
                 dense_route: bool = False, pool=None, guidance: float | None = None):
        why = graph_unusable(runner) if not dense_route else None
        if dense_route and runner.device.type != "cuda":
            why = "CUDA graphs need a CUDA device"
        if why:
            raise RuntimeError(why)
        self.runner = runner
        m, dev = runner.model, runner.device
        meta = runner.rows.get(request_id)
        self.width = width or _next_pow2(max(len(r.block_ids) for r in meta.rows))
        self.key = bucket_key(layout, self.width)
        self.owner = None
        inputs, pmeta = self._inputs(request_id, layout, guidance)
        self.buf = {k: v.clone() for k, v in inputs.items()}  # static: every replay reads these
        b = self.buf
        self.meta = PagedAttentionMetadata(
            rows=pmeta.rows, block_table=b["block_table"], cu_q=b["cu_q"], q_start=b["q_start"],
            kv_lens=b["kv_lens"], key_limit=b["key_limit"], slot_mapping=b["slot_mapping"],
            block_size=pmeta.block_size, max_q_len=pmeta.max_q_len, max_kv_len=pmeta.max_kv_len)
        self.attn = PagedAttentionAdapter(runner.backend, runner.pool, self.meta, runner.scale)
        self.h, self.w, self.n = layout.h, layout.w, len(layout.rows)
        self.x = torch.zeros(1, m.config.latent_channels, layout.h, layout.w, device=dev)
        self.t = torch.zeros(1, device=dev)
        self.owner = self._owner(request_id)
        if not dense_route:
            stack_experts(m)  # the grouped MoE reads stacked weights: stack before, never inside, capture
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), (graph_safe_moe(m) if dense_route else contextlib.nullcontext()):
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(warmup):  # compile kernels, settle the allocator
                    self.forward()
            torch.cuda.current_stream(dev).wait_stream(side)
            with torch.cuda.graph(self.graph, pool=pool):
                self.v = self.forward()

    def _owner(self, request_id: str):
        return request_id, self.runner.rows.get(request_id).generation

    def _inputs(self, request_id: str, layout, guidance: float | None = None) -> tuple[dict, PagedAttentionMetadata]:
        """This request's step inputs as device tensors of the bucket's shapes."""
        dev = self.runner.device
        rows = layout.rows
        spans = [(r.prefix_len, r.prefix_len + r.target_len) for r in rows]
        ts_idx, img_idx, g_idx, off = [], [], [], 0
        for r, (lo, hi) in zip(rows, spans):
            if r.guidance_index is not None and lo <= r.guidance_index < hi:
                g_idx.append(off + r.guidance_index - lo)  # distilled: the <guidance> slot
            ts_idx.append(off + r.timestep_index - lo)
            a = off + r.image_start - lo
            img_idx.append(torch.arange(a, a + layout.num_image_tokens))
            off += hi - lo
        meta = self.runner.rows.phase_metadata(request_id, DENOISE, dev)
        table = torch.zeros(meta.block_table.shape[0], self.width, dtype=torch.int32, device=dev)
        table[:, :meta.block_table.shape[1]] = meta.block_table  # unused entries: 0, never read
        guidance = {}
        if g_idx:  # the request's guidance value (1000 x scale in bf16), refilled by `load` like the ids
            guidance = {"g_idx": torch.tensor(g_idx, device=dev),
                        "g": self.runner.guidance_input(layout, guidance)}
        return guidance | {
            "ids": torch.cat([r.token_ids[lo:hi] for r, (lo, hi) in zip(rows, spans)]).to(dev),
            "py": torch.cat([r.pos_y[lo:hi] for r, (lo, hi) in zip(rows, spans)]).to(dev),
            "px": torch.cat([r.pos_x[lo:hi] for r, (lo, hi) in zip(rows, spans)]).to(dev),
            "ts_idx": torch.tensor(ts_idx, device=dev),
            "img_idx": torch.stack(img_idx).to(dev),  # [R, hw]
            "block_table": table, "cu_q": meta.cu_q, "q_start": meta.q_start, "kv_lens": meta.kv_lens,
            "key_limit": meta.key_limit, "slot_mapping": meta.slot_mapping,
        }, meta

    def load(self, request_id: str, layout, guidance: float | None = None) -> None:
        """Point the graph at `request_id` (same bucket): refill the static inputs."""
        owner = self._owner(request_id)
        if owner == self.owner:
            return
        if bucket_key(layout, self.width) != self.key:
            raise ValueError(f"request {request_id!r} is not in this graph's bucket {self.key}")
        inputs, _ = self._inputs(request_id, layout, guidance)
        for k, v in inputs.items():
            self.buf[k].copy_(v)
        self.owner = owner

    def forward(self) -> torch.Tensor:
        """The denoise step from the static buffers -> velocity per row [R, C, h, w] fp32."""
        m, b = self.runner.model, self.buf
        tt = self.t.expand(self.n)
        hidden = m.embed_tokens(b["ids"])
        hidden = hidden.index_copy(0, b["ts_idx"], m.timestep_token(tt).to(hidden.dtype))
        if "g_idx" in b:
            g = m.guidance_token(b["g"].expand(b["g_idx"].shape[0]))
            hidden = hidden.index_copy(0, b["g_idx"], g.to(hidden.dtype))
        img = m.embed_image(self.x, self.t).expand(self.n, -1, -1)  # rows share x and t: embed once
        hidden = hidden.index_copy(0, b["img_idx"].reshape(-1), img.reshape(-1, img.shape[-1]).to(hidden.dtype))
        out = m.backbone(hidden, b["py"], b["px"], self.attn)
        return m.final_layer_velocity(out[b["img_idx"]], tt, self.h, self.w).float()

    def replay(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        self.x.copy_(x)
        self.t.copy_(t.reshape(1))
        self.graph.replay()
        return self.v


def bucket_key(layout, width: int) -> tuple:
    return tuple(r.target_len for r in layout.rows), layout.h, layout.w, width


class StepGraphs:
    """The denoise-step graphs of one runner: captured on a bucket's first denoise step, replayed
    after; at most `max_captures` kept (least recently used evicted, its memory freed)."""

    def __init__(self, runner, max_captures: int = MAX_CAPTURES):
        self.runner, self.max_captures = runner, max_captures
        self.graphs: OrderedDict[tuple, DenoiseStepGraph] = OrderedDict()
        self.captures = self.replays = 0
        # one memory pool for every bucket: steps run one at a time on one stream and each
        # velocity is consumed before the next replay, so the graphs never need their
        # temporaries at once (the pool holds about one denoise step, not one per bucket)
        self.pool = torch.cuda.graph_pool_handle()

    def step(self, request_id: str, layout, x: torch.Tensor, t: torch.Tensor,
             guidance: float | None = None) -> torch.Tensor:
        meta = self.runner.rows.get(request_id)
        width = _next_pow2(max(len(r.block_ids) for r in meta.rows))
        key = bucket_key(layout, width)
        g = self.graphs.get(key)
        if g is None:
            while len(self.graphs) >= self.max_captures:
                self.graphs.popitem(last=False)
            g = DenoiseStepGraph(self.runner, request_id, layout, width, pool=self.pool, guidance=guidance)
            self.graphs[key] = g
            self.captures += 1
            log.info("captured the denoise step of bucket %s (%d graphs held)", key, len(self.graphs))
        else:
            self.graphs.move_to_end(key)
            g.load(request_id, layout, guidance)
        self.replays += 1
        return g.replay(x, t)
