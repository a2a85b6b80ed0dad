"""DiT model runner: the denoising loop of one request on one rank.

Step 0 runs the `prefill` phase (the whole row from its first uncomputed token); steps >= 1 run
the `denoise` phase: only the target (timestep token + image tokens) is fed, its K/V overwrite
the target pages, and the retained prefix pages are read. With `reuse_prefix=False` every step
recomputes the whole row (the baseline the prefix reuse is measured against).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..attention.adapter import PagedAttentionAdapter
from ..attention.metadata import RowPhase
from ..models.hunyuan.layout import RequestLayout
from ..models.hunyuan.sampler import cfg_combine, euler_step, flow_sigmas, initial_latents
from .dense_cache import DenseAttention, DenseKVCache
from .rows import DENOISE, PREFILL


@dataclass
class RunStats:
    steps: int = 0
    prefix_tokens_reused: int = 0  # prefix tokens read from cache instead of recomputed
    tokens_computed: int = 0  # query tokens run through the backbone
    imported_tokens: int = 0  # prefix tokens that came from an AR transfer


class DiTRunner:
    def __init__(self, model, backend=None, pool=None, rows=None, paged: bool = True):
        self.model, self.backend, self.pool, self.rows, self.paged = model, backend, pool, rows, paged
        cfg = model.config
        self.scale = 1.0 / math.sqrt(cfg.attention_head_dim)
        if paged and (pool is None or rows is None or backend is None):
            raise ValueError("paged mode needs a page pool, worker rows and a paged backend")

    @property
    def device(self):
        return self.model.device

    # ---- inputs -------------------------------------------------------------------------
    def _step_inputs(self, layout: RequestLayout, spans: list[tuple[int, int]], x: torch.Tensor,
                     t: torch.Tensor):
        """Packed hidden states and positions for query ranges `spans[r] = (lo, hi)` of each row."""
        m, dev = self.model, self.device
        n = len(layout.rows)
        tt = t.expand(n)
        ts_emb = m.timestep_token(tt)  # [R, hidden]
        img = m.embed_image(x.expand(n, -1, -1, -1), tt)  # [R, hw, hidden]
        hs, ys, xs = [], [], []
        for r, (row, (lo, hi)) in enumerate(zip(layout.rows, spans)):
            h = m.embed_tokens(row.token_ids[lo:hi].to(dev))
            ti, a = row.timestep_index, row.image_start
            if lo <= ti < hi:
                h[ti - lo] = ts_emb[r]
            if row.guidance_index is not None and lo <= row.guidance_index < hi:
                raise NotImplementedError("guidance-token (distilled) checkpoints are not wired yet")
            i0, i1 = max(a, lo), min(a + layout.num_image_tokens, hi)
            if i0 < i1:
                h[i0 - lo:i1 - lo] = img[r, i0 - a:i1 - a].to(h.dtype)
            hs.append(h)
            ys.append(row.pos_y[lo:hi])
            xs.append(row.pos_x[lo:hi])
        return torch.cat(hs), torch.cat(ys).to(dev), torch.cat(xs).to(dev)

    # ---- loop ---------------------------------------------------------------------------
    def new_dense_cache(self, layout: RequestLayout) -> DenseKVCache | None:
        """The model-owned contiguous cache of one request (dense_legacy only)."""
        if self.paged:
            return None
        cfg = self.model.config
        return DenseKVCache(cfg.num_hidden_layers, len(layout.rows), layout.rows[0].seq_len,
                            cfg.num_key_value_heads, cfg.attention_head_dim, self.model.dtype, self.device)

    def forward_step(self, request_id: str, layout: RequestLayout, x: torch.Tensor, t: torch.Tensor,
                     phase: str, first_step: bool, dense_cache=None) -> tuple[torch.Tensor, int]:
        """One backbone pass -> (velocity per row [R, C, h, w] fp32, query tokens computed).

        `prefill` on the first step starts after any imported prefix; `prefill` on a later step is
        the full-recompute baseline (rewrites the whole row)."""
        if phase == PREFILL:
            meta = self.rows.get(request_id) if self.paged else None
            if meta is not None and first_step:
                starts = [r.num_computed_tokens for r in meta.rows]
            else:
                starts = [0] * len(layout.rows)
            spans = [(s, row.seq_len) for s, row in zip(starts, layout.rows)]
        else:
            spans = [(row.prefix_len, row.prefix_len + row.target_len) for row in layout.rows]
        hidden, py, px = self._step_inputs(layout, spans, x, t)
        attn = self._attention(request_id, layout, phase, spans, dense_cache, from_zero=not first_step)
        out = self.model.backbone(hidden, py, px, attn)
        return self._velocity(layout, spans, out, t), hidden.shape[0]

    @torch.inference_mode()
    def generate(self, request_id: str, layout: RequestLayout, steps: int, guidance: float, seed: int,
                 reuse_prefix: bool = True, on_step: Callable[[int], None] | None = None,
                 should_stop: Callable[[], bool] | None = None):
        """Run the denoising loop; returns (latents [1, C, h, w] fp32, RunStats)."""
        cfg = self.model.config
        sig = flow_sigmas(steps, cfg.flow_shift)
        x = initial_latents(cfg, layout.h, layout.w, seed, self.device)
        stats = RunStats()
        dense_cache = self.new_dense_cache(layout)
        if self.paged:
            stats.imported_tokens = sum(r.num_computed_tokens for r in self.rows.get(request_id).rows)
        for i in range(steps):
            if should_stop is not None and should_stop():
                raise InterruptedError(f"request {request_id!r} stopped at step {i}")
            phase = DENOISE if (i > 0 and reuse_prefix) else PREFILL
            if phase == DENOISE:
                stats.prefix_tokens_reused += sum(row.prefix_len for row in layout.rows)
            t = (sig[i] * 1000.0).reshape(1).to(self.device)
            v, n = self.forward_step(request_id, layout, x, t, phase, i == 0, dense_cache)
            stats.tokens_computed += n
            v = cfg_combine(v[0:1], v[1:2], guidance) if len(layout.rows) == 2 else v[0:1]
            x = euler_step(x, v, sig[i], sig[i + 1])
            stats.steps += 1
            if on_step is not None:
                on_step(i)
        return x, stats

    def _attention(self, request_id, layout, phase, spans, dense_cache, from_zero: bool):
        if self.paged:
            meta = self.rows.phase_metadata(request_id, phase, self.device, from_zero=from_zero)
            return PagedAttentionAdapter(self.backend, self.pool, meta, self.scale)
        rows, off = [], 0
        for row, (lo, hi) in zip(layout.rows, spans):
            kv_len = row.seq_len if phase == PREFILL else row.prefix_len + row.target_len
            rows.append(RowPhase(off, lo, hi - lo, kv_len, row.full_attn_spans))
            off += hi - lo
        return DenseAttention(dense_cache, rows, self.scale)

    def _velocity(self, layout, spans, out, t):
        """Image-token outputs of every row -> velocity [R, C, h, w]."""
        hw, chunks, off = layout.num_image_tokens, [], 0
        for row, (lo, hi) in zip(layout.rows, spans):
            a = row.image_start - lo + off
            chunks.append(out[a:a + hw])
            off += hi - lo
        img = torch.stack(chunks)
        return self.model.final_layer_velocity(img, t.expand(len(chunks)), layout.h, layout.w).float()
