"""One request's denoising state between steps, and the dense-legacy KV import it may start from.

A `Denoising` holds what a request carries from one step to the next: its latents, step index,
sigmas and statistics, its input images' embeddings and, in dense_legacy mode, its own contiguous
KV cache. Every step of every request runs through `DiTRunner.step` over a list of these (the
engine's `BatchStepper` keeps the running ones; `denoise` drives a single one to the end for tests
and benchmarks), so a request's image does not depend on what it shared its steps with.

Imported prefixes (AR -> DiT transfer) and prefix-cache hits: in paged mode the rows'
`num_computed_tokens` say how many prefix tokens already sit in the pages; in dense mode a `DenseImport` (the legacy transfer's
received tensor) pre-fills the request's dense cache. Either way step 0 starts at the imported length.

Input images: when a request starts, each input image is encoded once (`DiTRunner.condition`) from a
CPU generator seeded by the request's seed (images in order; the initial noise is then drawn from the
same generator, as the release does). The leading images whose slots every row already holds (an import
or a prefix-cache hit that covers them whole) are not encoded: only the generator advances past their
samples (`codec.skip_sample`), so the later images and the noise are the same; the rest are encoded (the
first step computes their slots from the hit's end on), or taken from the runner's encoder cache when an
earlier request encoded the same image with the same seed at the same index. When every image is covered,
nothing is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..models.family import RequestLayout, family_of
from .conditioning import skip_samples
from .dense_cache import DenseKVCache
from .parallel import all_gather_cat
from .rows import DENOISE, PREFILL
from .step_cache import new_request_cache


@dataclass
class RunStats:
    steps: int = 0
    prefix_tokens_reused: int = 0  # prefix tokens read from cache instead of recomputed
    tokens_computed: int = 0  # query tokens run through the backbone
    imported_tokens: int = 0  # prefix tokens that came from an AR transfer
    cached_steps: int = 0  # steps that reused the middle blocks' residual (step caching)
    encoder_cache_hits: int = 0  # input images taken from the runner's encoder cache (not encoded)
    encoder_cache_misses: int = 0  # input images encoded (and stored) while the encoder cache is on


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


class Denoising:
    def __init__(self, runner, request_id: str, layout: RequestLayout, steps: int, guidance: float,
                 seed: int, reuse_prefix: bool = True, dense_import: DenseImport | None = None,
                 cache_config=None):
        """`cache_config`: the request's step cache (`StepCacheConfig`; None: the runner's, the engine's)."""
        cfg = runner.model.config
        family = family_of(cfg)
        self.request_id, self.steps, self.guidance, self.reuse_prefix = request_id, steps, guidance, reuse_prefix
        self.par = runner.par
        self.cfg_rows = len(layout.rows)  # 2 = CFG combine after every step
        self.layout = runner.local_layout(layout)
        # stats count the whole request; CFG-parallel ranks see equal-length rows (HunyuanImage-3)
        self.rows_factor = runner.par.cfg_size
        self.sampler = family.sampler(cfg)
        self.sampler.set_timesteps(steps)
        self.stats = RunStats()
        self.dense_cache = runner.new_dense_cache(self.layout)  # dense_legacy: this request's own KV
        self.dense_starts = None
        if runner.paged:
            if dense_import is not None:
                raise ValueError("a dense KV import cannot be used in paged mode (the pages carry the prefix)")
            # tokens already in the pages: imported, or prefix-cache hits (those are not counted as imported)
            meta_rows = runner.rows.get(request_id).rows
            imported = [r.num_computed_tokens for r in meta_rows]
            self.stats.imported_tokens = self.rows_factor * sum(r.num_computed_tokens - r.num_cached_tokens
                                                                for r in meta_rows)
        elif dense_import is not None:
            imported = self._fill_dense(runner, dense_import)
        else:
            imported = [0] * len(self.layout.rows)
        self.cond = None
        if layout.images:
            # the release: one generator per request seed draws the input images' VAE samples, then the noise
            g = torch.Generator(device="cpu").manual_seed(int(seed))
            self.cond = _condition(runner, self.layout, imported if reuse_prefix else None, g, seed)
            if self.cond is not None and runner.encoder_cache is not None:
                self.stats.encoder_cache_hits = self.cond.reused
                self.stats.encoder_cache_misses = self.cond.encoded
            self.x = family.noise((1, cfg.latent_channels, layout.h, layout.w), g).to(runner.device)
        else:
            self.x = family.initial_noise(cfg, layout.h, layout.w, seed, runner.device)
        self.i = 0
        # its step-cache state lives here, beside its latents, and goes on every terminal path (`release`)
        self.cache = new_request_cache(runner.step_cache if cache_config is None else cache_config, steps,
                                       cfg.num_hidden_layers)
        if self.cache is not None and not runner.paged:
            raise ConfigError("cache_config", self.cache.config.type,
                              "step caching runs in the paged step; this rank runs dense_legacy: drop the "
                              "request's cache_config, or run the engine with diffusion_kv_mode=paged_scheduler")

    def release(self) -> None:
        """The request ended (finished, cancelled or failed): free its step-cache buffers."""
        if self.cache is not None:
            self.cache.release()

    def _fill_dense(self, runner, imp: DenseImport) -> list[int]:
        """Pre-fill the dense cache from a legacy import (a head-sharded rank gets only its KV-head
        range) -> the tokens every row of the request imported."""
        if imp.kv.shape[3] != runner.num_kv_heads:
            raise ValueError(f"dense KV import holds {imp.kv.shape[3]} KV heads, this rank {runner.num_kv_heads}")
        if len(imp.tokens_per_row) != self.cfg_rows:
            raise ValueError(f"dense KV import covers {len(imp.tokens_per_row)} rows, the request has {self.cfg_rows}")
        self.stats.imported_tokens = sum(imp.tokens_per_row)  # the whole request, as in paged mode
        every_row = list(imp.tokens_per_row)
        if self.par.cfg_size > 1:  # a CFG rank fills only its own row (cond: all, uncond: the shared part)
            imp = DenseImport(imp.kv, [imp.tokens_per_row[self.par.cfg_rank]])
        self.dense_starts = imp.fill(self.dense_cache)
        return every_row

    @property
    def done(self) -> bool:
        return self.i >= self.steps

    @property
    def phase(self) -> str:
        return DENOISE if (self.i > 0 and self.reuse_prefix) else PREFILL

    @property
    def first_step(self) -> bool:
        return self.i == 0

    def timestep(self, device) -> torch.Tensor:
        return self.sampler.timestep(self.i, device)

    def advance(self, v: torch.Tensor, tokens: int) -> None:
        """Apply this rank's velocity rows `v` of step `i` (`tokens` query tokens were computed)."""
        if self.phase == DENOISE:
            self.stats.prefix_tokens_reused += self.rows_factor * sum(row.prefix_len for row in self.layout.rows)
        self.stats.tokens_computed += self.rows_factor * tokens
        # CFG parallel: each rank has one branch; gathering in cfg-rank order gives [cond, uncond]
        v = all_gather_cat(v, self.par.cfg_group, self.par.cfg_size)
        v = self.sampler.guide(v[0:1], v[1:2] if self.cfg_rows == 2 else None, self.guidance)
        self.x = self.sampler.step(v, self.i, self.x)
        self.i += 1
        self.stats.steps += 1
        if self.cache is not None:
            self.stats.cached_steps = self.cache.cached_steps


def covered_images(layout: RequestLayout, imported: list[int] | None) -> int:
    """How many leading input images have every slot (`<timestep>`, latent and vision tokens) before
    every row's first computed token (`imported`; None: the prefix is recomputed, none)."""
    if imported is None:
        return 0
    start, n = min(imported), 0
    for im in layout.images:
        if max([im.timestep_index + 1] + [b for _, b in im.spans()]) > start:
            break
        n += 1
    return n


def _condition(runner, layout: RequestLayout, imported: list[int] | None, g, seed: int | None = None):
    """The input images' embeddings, the covered ones (`covered_images`) skipped with `g` advanced past
    their samples; None when every image is covered and the codec could skip them all (nothing to encode).
    The rest come from the runner's encoder cache where it holds them (`seed`: part of their key; None: no cache)."""
    n = covered_images(layout, imported)
    if n == len(layout.images) and skip_samples(runner.codec, layout.images, g) == n:
        return None
    return runner.condition(layout, g, skip=n, seed=seed)


@torch.inference_mode()
def denoise(runner, request_id: str, layout: RequestLayout, steps: int, guidance: float, seed: int,
            reuse_prefix: bool = True, dense_import: DenseImport | None = None):
    """One request from its first step to its last through `DiTRunner.step`, alone (tests and
    benchmarks; the engine's `BatchStepper` runs the same steps) -> (latents [1, C, h, w] fp32, RunStats)."""
    st = Denoising(runner, request_id, layout, steps, guidance, seed, reuse_prefix, dense_import)
    try:
        while not st.done:
            (v,), (n,) = runner.step([st])
            st.advance(v, n)
    finally:
        st.release()
    return st.x, st.stats
