"""DiT model runner: one denoising step of one or several requests on one rank (`step`).

Step 0 runs the `prefill` phase (the whole row from its first uncomputed token); steps >= 1 run
the `denoise` phase: only the target (timestep token + image tokens) is fed, its K/V overwrite
the target pages, and the retained prefix pages are read. With `reuse_prefix=False` every step
recomputes the whole row (the baseline the prefix reuse is measured against).

`step` takes the requests' `Denoising` states (`denoising.py`): a step of paged requests is one
backbone pass over all their rows (a CUDA-graph replay when every one denoises and a graph is
usable), a dense_legacy request runs over its own contiguous cache. Input images' embeddings fill
their prefix slots whenever the prefix is computed (`conditioning.py`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import torch

from ..attention.adapter import PagedAttentionAdapter
from ..attention.metadata import RowPhase
from ..attention.ulysses import UlyssesAttention
from ..errors import ConfigError, LayoutError
from ..models.family import RequestLayout, family_of
from .conditioning import CondEmbeds, encode_images
from .dense_cache import DenseAttention, DenseKVCache
from .encoder_cache import EncoderCache
from .parallel import ParallelContext, all_gather_cat
from .denoising import Denoising
from .rows import DENOISE, PREFILL
from .step_inputs import Request as StepRequest, StepInputs, build as build_inputs, embed, velocities
from .step_cache import RequestCache
from .step_cache_graph import replay_cached
from .step_cache_pass import forward_cached
from ..step_cache_config import StepCacheConfig

log = logging.getLogger(__name__)


@dataclass
class StepItem:
    """One request's share of a batched step (`DiTRunner.forward_batch`)."""

    request_id: str
    layout: RequestLayout  # this rank's rows
    x: torch.Tensor  # latents [1, C, h, w] fp32
    t: torch.Tensor  # timestep [1]
    phase: str
    first_step: bool
    guidance: float | None = None  # the request's guidance scale (fills `<guidance>` of distilled checkpoints)
    cond: "CondEmbeds | None" = None  # its input images' embeddings (fill their prefix slots)
    cache: "RequestCache | None" = None  # its step-cache state (`step_cache.py`), None: every step computes
    step: int = 0  # its step index (the cache's warmup, mask and TaylorSeer count it)


class _RowView:
    """One row of a `DenseKVCache` as a one-row cache (views: writes land in the parent)."""

    def __init__(self, cache: DenseKVCache, r: int):
        self.k = [t[r:r + 1] for t in cache.k]
        self.v = [t[r:r + 1] for t in cache.v]


class RowwiseDenseAttention:
    """Dense attention for rows whose phase geometry differs (cond imported more prefix than
    uncond): one `DenseAttention` per row, outputs concatenated in packed order."""

    def __init__(self, cache: DenseKVCache, rows: list[RowPhase], scale: float, segments: bool = False,
                 fa4: bool = False):
        self.parts = [(rp.q_offset, rp.q_len,
                       DenseAttention(_RowView(cache, r), [RowPhase(0, rp.q_start, rp.q_len, rp.kv_len, rp.spans)],
                                      scale, segments, fa4=fa4))
                      for r, rp in enumerate(rows)]

    def __call__(self, layer, q, k, v):
        return torch.cat([att(layer, q[o:o + n], k[o:o + n], v[o:o + n]) for o, n, att in self.parts])


class DiTRunner:
    """With a `ParallelContext`: the model is already TP/EP-sharded; the runner keeps this cfg
    rank's rows (`local_layout`), shards the packed tokens for Ulysses, and exchanges velocities."""

    def __init__(self, model, backend=None, pool=None, rows=None, paged: bool = True,
                 parallel: ParallelContext | None = None, cuda_graphs: str = "off", dense_segments: bool = False,
                 dense_fa4: bool = False,
                 codec=None, step_cache: StepCacheConfig | None = None, encoder_cache_images: int = 0):
        """`encoder_cache_images`: how many input images' embeddings to keep across requests
        (`encoder_cache.EncoderCache`, ~40 MiB each at release size in bf16); 0 = no encoder cache."""
        self.model, self.backend, self.pool, self.rows, self.paged = model, backend, pool, rows, paged
        self.codec = codec  # encodes input images (image-conditioned generation)
        self.encoder_cache = EncoderCache(encoder_cache_images) if encoder_cache_images else None
        self.dense_segments = dense_segments  # dense mode: fused SDPA per mask segment (DenseAttention)
        self.dense_fa4 = dense_fa4  # ... each segment on flash-attn-4 instead (attention_backend fa4 on a GPU)
        self.par = parallel or ParallelContext.single()
        # the engine's cache_config (a request may bring its own); checked against the model's layers here
        self.step_cache = step_cache or StepCacheConfig()
        self.step_cache.check_model(model.config.num_hidden_layers)
        cfg = model.config
        self.family = family_of(cfg)
        self.scale = 1.0 / math.sqrt(cfg.attention_head_dim)
        self.num_kv_heads = cfg.num_key_value_heads // self.par.head_shards  # rank-local KV heads
        if paged and (pool is None or rows is None or backend is None):
            raise ValueError("paged mode needs a page pool, worker rows and a paged backend")
        self.step_graphs = self._step_graphs(cuda_graphs)

    def _step_graphs(self, mode: str):
        """Denoise steps replay a CUDA graph per shape bucket: `on` requires it, `auto` takes it
        where the step can be captured (and says why not on a GPU), `off` runs eagerly."""
        from .cuda_graph import StepGraphs, graph_unusable

        if mode == "off":
            return None
        why = graph_unusable(self)
        if why is None:
            return StepGraphs(self)
        if mode == "on":
            raise ConfigError("cuda_graphs", mode, f"{why}; or set cuda_graphs=auto/off")
        if self.device.type == "cuda":
            log.info("CUDA graphs off (cuda_graphs=auto): %s", why)
        return None

    @property
    def device(self):
        return self.model.device

    # ---- inputs -------------------------------------------------------------------------
    def guidance_input(self, layout: RequestLayout, guidance: float | None = None):
        """The number for the rows' `<guidance>` slots (`guidance_value`: 1000 x scale in bfloat16, as
        fp32 [1] on the device), or None when the rows have no such slot (every non-distilled model).
        `guidance`: the request's scale; None only for a step outside any request (profiling,
        benchmarks), which takes the model's `default_guidance`, what a request without one gets."""
        if all(row.guidance_index is None for row in layout.rows):
            return None
        scale = self.model.config.default_guidance if guidance is None else guidance
        return self.family.guidance_value(scale).to(self.device)

    def condition(self, layout: RequestLayout, generator: torch.Generator, skip: int = 0,
                  seed: int | None = None) -> CondEmbeds:
        """Encode the request's input images once (`conditioning.encode_images`), but for the first `skip`
        (their slots are in every row's pages already: only `generator` advances past them). With the
        encoder cache and the request's `seed` (what `generator` was seeded with), an image an earlier
        request encoded under the same key (`ModelFamily.input_image_keys`) is taken from the cache."""
        cache = self.encoder_cache if seed is not None else None
        keys = self.family.input_image_keys(layout, seed) if cache is not None else None
        return encode_images(self.model, self.codec, layout.images, generator, skip, cache, keys)

    def _inputs(self, parts) -> StepInputs:
        """The packed inputs of `parts`: (layout, query spans, guidance scale, input-image embeddings)
        per request (`step_inputs.build`, the one builder of every pass)."""
        return build_inputs([StepRequest(lay.rows, sp, lay.h, lay.w, self.guidance_input(lay, g), lay.images, cond)
                             for lay, sp, g, cond in parts], self.device)

    def local_layout(self, layout: RequestLayout) -> RequestLayout:
        """The rows this rank runs: all of them, or its CFG branch under CFG parallel."""
        if self.par.cfg_size == 1:
            return layout
        if len(layout.rows) != self.par.cfg_size:
            raise LayoutError(f"cfg_parallel_size={self.par.cfg_size} needs a CFG request with "
                              f"{self.par.cfg_size} rows (cond, uncond), got {len(layout.rows)}; use "
                              "guidance_scale > 1, or run this replica with cfg_parallel_size=1",
                              field="guidance_scale")
        return dataclasses.replace(layout, rows=[layout.rows[self.par.cfg_rank]])

    # ---- loop ---------------------------------------------------------------------------
    def new_dense_cache(self, layout: RequestLayout) -> DenseKVCache | None:
        """The model-owned contiguous cache of one request (dense_legacy only); pass the rank's
        `local_layout` under CFG parallel. KV heads are rank-local."""
        if self.paged:
            return None
        cfg = self.model.config
        return DenseKVCache(cfg.num_hidden_layers, len(layout.rows), layout.rows[0].seq_len,
                            self.num_kv_heads, cfg.attention_head_dim, self.model.dtype, self.device)

    def _spans(self, request_id: str, layout: RequestLayout, phase: str, first_step: bool,
               dense_starts: list[int] | None = None) -> list[tuple[int, int]]:
        """Query range (lo, hi) of each row this step: `prefill` on the first step starts after any
        imported prefix, on a later step it is the full-recompute baseline (the whole row);
        `denoise` is the target."""
        if phase != PREFILL:
            return [(row.prefix_len, row.prefix_len + row.target_len) for row in layout.rows]
        meta = self.rows.get(request_id) if self.paged else None
        if meta is not None and first_step:
            starts = [r.num_computed_tokens for r in meta.rows]
        elif dense_starts is not None and first_step:
            starts = list(dense_starts)
        else:
            starts = [0] * len(layout.rows)
        return [(s, row.seq_len) for s, row in zip(starts, layout.rows)]

    def forward_step(self, request_id: str, layout: RequestLayout, x: torch.Tensor, t: torch.Tensor,
                     phase: str, first_step: bool, dense_cache=None,
                     dense_starts: list[int] | None = None, guidance: float | None = None,
                     cond: CondEmbeds | None = None) -> tuple[torch.Tensor, int]:
        """One backbone pass of one request -> (velocity per row [R, C, h, w] fp32, query tokens
        computed); the pass `step` runs (benchmarks and tests call it with explicit inputs).
        `guidance`: the request's guidance scale, for distilled checkpoints (None outside a request:
        the model's default); `cond`: its input images' embeddings (`condition`), when it has any."""
        if not self.paged:
            return self._dense_step(request_id, layout, x, t, phase, first_step, dense_cache, dense_starts,
                                    guidance, cond)
        (v,), (n,) = self.forward_batch([StepItem(request_id, layout, x, t, phase, first_step, guidance, cond)])
        return v, n

    def _dense_step(self, request_id, layout, x, t, phase, first_step, dense_cache, dense_starts, guidance, cond):
        spans = self._spans(request_id, layout, phase, first_step, dense_starts)
        inp = self._inputs([(layout, spans, guidance, cond)])
        out = self._backbone(embed(self.model, inp, [x], [t]), inp.buf["py"], inp.buf["px"],
                             self._dense_attention(layout, phase, spans, dense_cache))
        return velocities(self.model, out, inp, [t])[0], inp.num_tokens

    def forward_batch(self, items: list[StepItem]) -> tuple[list[torch.Tensor], list[int]]:
        """One backbone pass over the rows of several requests (step-level batching, paged only):
        each request brings its own phase, latents and timestep; the rows are packed in item
        order, so the MoE and every projection see the whole batch. Returns the velocity per
        item ([R, C, h, w] fp32) and the query tokens computed per item."""
        if not self.paged:
            raise ValueError("step-level batching needs the paged KV cache (diffusion_kv_mode=paged_scheduler)")
        if any(it.cache is not None for it in items):
            return forward_cached(self, items)
        inp = self._inputs([(it.layout, self._spans(it.request_id, it.layout, it.phase, it.first_step), it.guidance,
                             it.cond) for it in items])
        meta = self.rows.batch_metadata([(it.request_id, it.phase, not it.first_step) for it in items], self.device)
        ts = [it.t for it in items]
        out = self._backbone(embed(self.model, inp, [it.x for it in items], ts), inp.buf["py"], inp.buf["px"],
                             PagedAttentionAdapter(self.backend, self.pool, meta, self.scale))
        return velocities(self.model, out, inp, ts), [s.tokens for s in inp.shapes]

    def _backbone(self, hidden, py, px, attn, layers: range | None = None) -> torch.Tensor:
        """`layers`: a contiguous range of decoder layers (None: all); step caching runs parts."""
        n = hidden.shape[0]
        if self.par.sp_size == 1:
            return self.model.backbone(hidden, py, px, attn, layers)
        # Ulysses: backbone over this rank's contiguous token shard
        sp, r = self.par.sp_size, self.par.sp_rank
        shard = -(-n // sp)
        pad = shard * sp - n  # padding tokens: zero state at position 0, never attended
        hidden, py, px = (torch.cat([a, a.new_zeros(pad, *a.shape[1:])])[r * shard:(r + 1) * shard]
                          for a in (hidden, py, px))
        attn = UlyssesAttention(attn, self.par.sp_group, sp, n)
        return all_gather_cat(self.model.backbone(hidden, py, px, attn, layers), self.par.sp_group, sp)[:n]

    def step(self, states: list[Denoising]) -> tuple[list[torch.Tensor], list[int]]:
        """One step of every request in `states` -> (velocity per request [R, C, h, w] fp32, query
        tokens computed per request). Paged: one pass over all their rows, or the replay of a
        captured graph when every request denoises; dense_legacy: each over its own cache."""
        graphs = self.step_graphs
        if graphs is not None and all(st.phase == DENOISE for st in states):
            cached = any(st.cache is not None for st in states)
            vs = replay_cached(graphs, states) if cached else graphs.replay(states)
            if vs is not None:
                return vs, [sum(r.target_len for r in st.layout.rows) for st in states]
        if not self.paged:
            outs = [self._dense_step(st.request_id, st.layout, st.x, st.timestep(self.device), st.phase,
                                     st.first_step, st.dense_cache, st.dense_starts, st.guidance, st.cond)
                    for st in states]
            return [v for v, _ in outs], [n for _, n in outs]
        return self.forward_batch([StepItem(st.request_id, st.layout, st.x, st.timestep(self.device), st.phase,
                                            st.first_step, st.guidance, st.cond, st.cache, st.i) for st in states])

    def _dense_attention(self, layout, phase, spans, dense_cache):
        rows, off = [], 0
        for row, (lo, hi) in zip(layout.rows, spans):
            kv_len = row.seq_len if phase == PREFILL else row.prefix_len + row.target_len
            rows.append(RowPhase(off, lo, hi - lo, kv_len, row.full_attn_spans))
            off += hi - lo
        if any((r.q_start, r.q_len, r.kv_len) != (rows[0].q_start, rows[0].q_len, rows[0].kv_len) for r in rows):
            return RowwiseDenseAttention(dense_cache, rows, self.scale, self.dense_segments, self.dense_fa4)
        return DenseAttention(dense_cache, rows, self.scale, self.dense_segments, fa4=self.dense_fa4)
