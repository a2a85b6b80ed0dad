"""DiT model runner: the denoising loop of one request on one rank.

Step 0 runs the `prefill` phase (the whole row from its first uncomputed token); steps >= 1 run
the `denoise` phase: only the target (timestep token + image tokens) is fed, its K/V overwrite
the target pages, and the retained prefix pages are read. With `reuse_prefix=False` every step
recomputes the whole row (the baseline the prefix reuse is measured against).

Imported prefixes (AR -> DiT transfer): in paged mode the rows' `num_computed_tokens` say how many
prefix tokens already sit in the pages; in dense mode a `DenseImport` (the legacy transfer's
received tensor) pre-fills the dense cache. Either way step 0 starts at the imported length.

Input images (image-conditioned generation): when a request starts (`Denoising`), each input image is
encoded once (`DiTRunner.condition`, `conditioning.py`): VAE latents from a posterior sample drawn with a CPU generator seeded by
the request's seed (images in order; the request's initial noise is then drawn from the same generator, as
the release does), embedded through the image path at timestep 0, and, with a vision encoder, its vision
tokens. Those embeddings fill the images' prefix slots when the prefix is computed (the prefill step; every
step without prefix reuse); denoise steps read the prefix K/V from the cache and never need them. When
every row imported the images' K/V (an AR stage encoded them), the DiT skips the encoders and only
advances the generator past the samples (`codec.skip_sample`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..attention.adapter import PagedAttentionAdapter
from ..attention.metadata import RowPhase
from ..attention.ulysses import UlyssesAttention
from ..errors import ConfigError, LayoutError
from ..models.hunyuan.layout import RequestLayout
from ..models.hunyuan.model import guidance_value
from ..models.hunyuan.sampler import cfg_combine, euler_step, flow_sigmas, initial_latents, release_noise
from .conditioning import CondEmbeds, encode_images, fill_image_slots
from .dense_cache import DenseAttention, DenseKVCache
from .parallel import ParallelContext, all_gather_cat
from .rows import DENOISE, PREFILL

log = logging.getLogger(__name__)


@dataclass
class RunStats:
    steps: int = 0
    prefix_tokens_reused: int = 0  # prefix tokens read from cache instead of recomputed
    tokens_computed: int = 0  # query tokens run through the backbone
    imported_tokens: int = 0  # prefix tokens that came from an AR transfer


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


@dataclass
class DenseImport:
    """Legacy transfer payload: `kv [num_layers, 2, P, Hkv, D]` (the cond row's prefix) and how many
    of those tokens each row takes (the uncond row shares only its first tokens with cond)."""

    kv: torch.Tensor
    tokens_per_row: list[int]

    def fill(self, cache: DenseKVCache) -> list[int]:
        for layer in range(len(cache.k)):
            for r, n in enumerate(self.tokens_per_row):
                cache.k[layer][r, :n] = self.kv[layer, 0, :n]
                cache.v[layer][r, :n] = self.kv[layer, 1, :n]
        return list(self.tokens_per_row)


class _RowView:
    """One row of a `DenseKVCache` as a one-row cache (views: writes land in the parent)."""

    def __init__(self, cache: DenseKVCache, r: int):
        self.k = [t[r:r + 1] for t in cache.k]
        self.v = [t[r:r + 1] for t in cache.v]


class RowwiseDenseAttention:
    """Dense attention for rows whose phase geometry differs (cond imported more prefix than
    uncond): one `DenseAttention` per row, outputs concatenated in packed order."""

    def __init__(self, cache: DenseKVCache, rows: list[RowPhase], scale: float, segments: bool = False):
        self.parts = [(rp.q_offset, rp.q_len,
                       DenseAttention(_RowView(cache, r), [RowPhase(0, rp.q_start, rp.q_len, rp.kv_len, rp.spans)],
                                      scale, segments))
                      for r, rp in enumerate(rows)]

    def __call__(self, layer, q, k, v):
        return torch.cat([att(layer, q[o:o + n], k[o:o + n], v[o:o + n]) for o, n, att in self.parts])


class Denoising:
    """One request's denoising state between steps: latents, step index, sigmas, statistics.
    The request-level loop (`DiTRunner.generate`) and step-level batching (`worker/batch.py`)
    advance it the same way, so a request's image does not depend on how it was run."""

    def __init__(self, runner: "DiTRunner", request_id: str, layout: RequestLayout, steps: int, guidance: float,
                 seed: int, reuse_prefix: bool = True, dense_imported: list[int] | None = None):
        cfg = runner.model.config
        self.request_id, self.steps, self.guidance, self.reuse_prefix = request_id, steps, guidance, reuse_prefix
        self.par = runner.par
        self.cfg_rows = len(layout.rows)  # request-level: 2 = CFG combine after every step
        self.layout = runner.local_layout(layout)
        # stats count the whole request; CFG-parallel ranks see equal-length rows (HunyuanImage-3)
        self.rows_factor = runner.par.cfg_size
        self.sig = flow_sigmas(steps, cfg.flow_shift)
        self.cond = None
        imported = ([r.num_computed_tokens for r in runner.rows.get(request_id).rows] if runner.paged
                    else list(dense_imported or [0] * len(self.layout.rows)))
        if layout.images:
            # the release: one generator per request seed draws the input images' VAE samples, then the noise
            g = torch.Generator(device="cpu").manual_seed(int(seed))
            if not (reuse_prefix and _skip_imported_images(runner, self.layout, imported, g)):
                self.cond = runner.condition(self.layout, g)
            self.x = release_noise((1, cfg.latent_channels, layout.h, layout.w), g).to(runner.device)
        else:
            self.x = initial_latents(cfg, layout.h, layout.w, seed, runner.device)
        self.i = 0
        self.stats = RunStats()
        if runner.paged:
            self.stats.imported_tokens = self.rows_factor * sum(imported)

    @property
    def done(self) -> bool:
        return self.i >= self.steps

    @property
    def phase(self) -> str:
        return DENOISE if (self.i > 0 and self.reuse_prefix) else PREFILL

    def timestep(self, device) -> torch.Tensor:
        return (self.sig[self.i] * 1000.0).reshape(1).to(device)

    def advance(self, v: torch.Tensor, tokens: int) -> None:
        """Apply this rank's velocity rows `v` of step `i` (`tokens` query tokens were computed)."""
        if self.phase == DENOISE:
            self.stats.prefix_tokens_reused += self.rows_factor * sum(row.prefix_len for row in self.layout.rows)
        self.stats.tokens_computed += self.rows_factor * tokens
        # CFG parallel: each rank has one branch; gathering in cfg-rank order gives [cond, uncond]
        v = all_gather_cat(v, self.par.cfg_group, self.par.cfg_size)
        v = cfg_combine(v[0:1], v[1:2], self.guidance) if self.cfg_rows == 2 else v[0:1]
        self.x = euler_step(self.x, v, self.sig[self.i], self.sig[self.i + 1])
        self.i += 1
        self.stats.steps += 1


def _skip_imported_images(runner: "DiTRunner", layout: RequestLayout, imported: list[int], g) -> bool:
    """When every row imported its input images' K/V (an AR stage computed them), the images are not
    encoded again: only `g` advances past their VAE samples, so the noise drawn next is the same. False
    (nothing drawn) when a row still has image slots to compute or the codec cannot skip."""
    end = max(b for im in layout.images for _, b in im.spans())
    if runner.codec is None or any(n < end for n in imported):
        return False
    for i, im in enumerate(layout.images):
        if not runner.codec.skip_sample(im.vae_pixels, g):
            assert i == 0, "a codec skips every image or none"
            return False
    return True


class DiTRunner:
    """With a `ParallelContext`: the model is already TP/EP-sharded; the runner keeps this cfg
    rank's rows (`local_layout`), shards the packed tokens for Ulysses, and exchanges velocities."""

    def __init__(self, model, backend=None, pool=None, rows=None, paged: bool = True,
                 parallel: ParallelContext | None = None, cuda_graphs: str = "off", dense_segments: bool = False,
                 codec=None):
        self.model, self.backend, self.pool, self.rows, self.paged = model, backend, pool, rows, paged
        self.codec = codec  # encodes input images (image-conditioned generation)
        self.dense_segments = dense_segments  # dense mode: fused SDPA per mask segment (DenseAttention)
        self.par = parallel or ParallelContext.single()
        cfg = model.config
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
        return guidance_value(self.model.config.default_guidance if guidance is None else guidance).to(self.device)

    def condition(self, layout: RequestLayout, generator: torch.Generator) -> CondEmbeds:
        """Encode the request's input images once (`conditioning.encode_images`)."""
        return encode_images(self.model, self.codec, layout.images, generator)

    def _step_inputs(self, layout: RequestLayout, spans: list[tuple[int, int]], x: torch.Tensor,
                     t: torch.Tensor, g: torch.Tensor | None = None, cond: CondEmbeds | None = None):
        """Packed hidden states and positions for query ranges `spans[r] = (lo, hi)` of each row;
        `g` (`guidance_input`) fills the `<guidance>` slot of distilled checkpoints, `cond` the input
        images' slots (needed whenever a range covers them)."""
        m, dev = self.model, self.device
        n = len(layout.rows)
        tt = t.expand(n)
        ts_emb = m.timestep_token(tt)  # [R, hidden]
        # distilled: one guidance value per request, its own embedder (not the timestep's)
        g_emb = m.guidance_token(g.expand(n)) if g is not None else None
        # every row (cond, uncond) sees the same latents and timestep: embed them once
        img = m.embed_image(x, t.reshape(1)).expand(n, -1, -1)  # [R, hw, hidden]
        hs, ys, xs = [], [], []
        for r, (row, (lo, hi)) in enumerate(zip(layout.rows, spans)):
            h = m.embed_tokens(row.token_ids[lo:hi].to(dev))
            ti, a = row.timestep_index, row.image_start
            if lo <= ti < hi:
                h[ti - lo] = ts_emb[r]
            gi = row.guidance_index
            if gi is not None and lo <= gi < hi:
                if g_emb is None:
                    raise ValueError("a <guidance> slot needs the request's guidance value (guidance_input)")
                h[gi - lo] = g_emb[r].to(h.dtype)
            i0, i1 = max(a, lo), min(a + layout.num_image_tokens, hi)
            if i0 < i1:
                h[i0 - lo:i1 - lo] = img[r, i0 - a:i1 - a].to(h.dtype)
            fill_image_slots(h, layout.images, lo, hi, cond)
            hs.append(h)
            ys.append(row.pos_y[lo:hi])
            xs.append(row.pos_x[lo:hi])
        return torch.cat(hs), torch.cat(ys).to(dev), torch.cat(xs).to(dev)

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
        """One backbone pass -> (velocity per row [R, C, h, w] fp32, query tokens computed).
        `guidance`: the request's guidance scale, for distilled checkpoints (None outside a request:
        the model's default); `cond`: its input images' embeddings (`condition`), when it has any."""
        spans = self._spans(request_id, layout, phase, first_step, dense_starts)
        g = self.guidance_input(layout, guidance)
        hidden, py, px = self._step_inputs(layout, spans, x, t, g, cond)
        attn = self._attention(request_id, layout, phase, spans, dense_cache, from_zero=not first_step)
        out = self._backbone(hidden, py, px, attn)
        return self._velocity(layout, spans, out, t), hidden.shape[0]

    def forward_batch(self, items: list[StepItem]) -> tuple[list[torch.Tensor], list[int]]:
        """One backbone pass over the rows of several requests (step-level batching, paged only):
        each request brings its own phase, latents and timestep; the rows are packed in item
        order, so the MoE and every projection see the whole batch. Returns the velocity per
        item ([R, C, h, w] fp32) and the query tokens computed per item."""
        if not self.paged:
            raise ValueError("step-level batching needs the paged KV cache (diffusion_kv_mode=paged_scheduler)")
        spans = [self._spans(it.request_id, it.layout, it.phase, it.first_step) for it in items]
        parts = [self._step_inputs(it.layout, sp, it.x, it.t,
                                   self.guidance_input(it.layout, it.guidance), it.cond)
                 for it, sp in zip(items, spans)]
        hidden, py, px = (torch.cat([p[i] for p in parts]) for i in range(3))
        meta = self.rows.batch_metadata([(it.request_id, it.phase, not it.first_step) for it in items], self.device)
        out = self._backbone(hidden, py, px, PagedAttentionAdapter(self.backend, self.pool, meta, self.scale))
        velocities, tokens, off = [], [], 0
        for it, sp, p in zip(items, spans, parts):
            n = p[0].shape[0]
            velocities.append(self._velocity(it.layout, sp, out[off:off + n], it.t))
            tokens.append(n)
            off += n
        return velocities, tokens

    def _backbone(self, hidden, py, px, attn) -> torch.Tensor:
        n = hidden.shape[0]
        if self.par.sp_size == 1:
            return self.model.backbone(hidden, py, px, attn)
        # Ulysses: backbone over this rank's contiguous token shard
        sp, r = self.par.sp_size, self.par.sp_rank
        shard = -(-n // sp)
        pad = shard * sp - n  # padding tokens: zero state at position 0, never attended
        hidden, py, px = (torch.cat([a, a.new_zeros(pad, *a.shape[1:])])[r * shard:(r + 1) * shard]
                          for a in (hidden, py, px))
        attn = UlyssesAttention(attn, self.par.sp_group, sp, n)
        return all_gather_cat(self.model.backbone(hidden, py, px, attn), self.par.sp_group, sp)[:n]

    @torch.inference_mode()
    def generate(self, request_id: str, layout: RequestLayout, steps: int, guidance: float, seed: int,
                 reuse_prefix: bool = True, on_step: Callable[[int], None] | None = None,
                 should_stop: Callable[[], bool] | None = None, dense_import: DenseImport | None = None):
        """Run the denoising loop; returns (latents [1, C, h, w] fp32, RunStats)."""
        if self.paged and dense_import is not None:
            raise ValueError("a dense KV import cannot be used in paged mode (the pages carry the prefix)")
        st = Denoising(self, request_id, layout, steps, guidance, seed, reuse_prefix,
                       dense_imported=None if dense_import is None else dense_import.tokens_per_row)
        layout, stats = st.layout, st.stats
        dense_cache = self.new_dense_cache(layout)
        dense_starts = None
        if not self.paged and dense_import is not None:
            # a head-sharded rank gets only its own KV-head range
            if dense_import.kv.shape[3] != self.num_kv_heads:
                raise ValueError(f"dense KV import holds {dense_import.kv.shape[3]} KV heads, this rank "
                                 f"{self.num_kv_heads}")
            if len(dense_import.tokens_per_row) != st.cfg_rows:
                raise ValueError(f"dense KV import covers {len(dense_import.tokens_per_row)} rows, the request "
                                 f"has {st.cfg_rows}")
            stats.imported_tokens = sum(dense_import.tokens_per_row)  # the whole request, as in paged mode
            if self.par.cfg_size > 1:  # a CFG rank fills only its own row (cond: all, uncond: the shared part)
                dense_import = DenseImport(dense_import.kv, [dense_import.tokens_per_row[self.par.cfg_rank]])
            dense_starts = dense_import.fill(dense_cache)
        while not st.done:
            if should_stop is not None and should_stop():
                raise InterruptedError(f"request {request_id!r} stopped at step {st.i}")
            phase, t = st.phase, st.timestep(self.device)
            if phase == DENOISE and self.step_graphs is not None:
                v = self.step_graphs.step(request_id, layout, st.x, t, guidance)
                n = sum(r.target_len for r in layout.rows)
            else:
                v, n = self.forward_step(request_id, layout, st.x, t, phase, st.i == 0, dense_cache, dense_starts,
                                         guidance, st.cond)
            st.advance(v, n)
            if on_step is not None:
                on_step(st.i - 1)
        return st.x, stats

    def _attention(self, request_id, layout, phase, spans, dense_cache, from_zero: bool):
        if self.paged:
            meta = self.rows.phase_metadata(request_id, phase, self.device, from_zero=from_zero)
            return PagedAttentionAdapter(self.backend, self.pool, meta, self.scale)
        rows, off = [], 0
        for row, (lo, hi) in zip(layout.rows, spans):
            kv_len = row.seq_len if phase == PREFILL else row.prefix_len + row.target_len
            rows.append(RowPhase(off, lo, hi - lo, kv_len, row.full_attn_spans))
            off += hi - lo
        if any((r.q_start, r.q_len, r.kv_len) != (rows[0].q_start, rows[0].q_len, rows[0].kv_len) for r in rows):
            return RowwiseDenseAttention(dense_cache, rows, self.scale, self.dense_segments)
        return DenseAttention(dense_cache, rows, self.scale, self.dense_segments)

    def _velocity(self, layout, spans, out, t):
        """Image-token outputs of every row -> velocity [R, C, h, w]."""
        hw, chunks, off = layout.num_image_tokens, [], 0
        for row, (lo, hi) in zip(layout.rows, spans):
            a = row.image_start - lo + off
            chunks.append(out[a:a + hw])
            off += hi - lo
        img = torch.stack(chunks)
        return self.model.final_layer_velocity(img, t.expand(len(chunks)), layout.h, layout.w).float()
