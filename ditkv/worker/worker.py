"""DiT worker (one rank): model, physical page pool, rows, runner.

It installs the scheduler's metadata snapshots and runs requests; it never decides capacity and
never frees scheduler blocks.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..attention.backend import select_backend
from ..config import EngineConfig
from ..errors import LayoutError, MetadataError
from ..models.hunyuan.layout import RequestLayout, build_request_layout
from ..models.loader import load_model, resolve_device, resolve_dtype
from .dit_runner import DiTRunner, RunStats
from .page_pool import PagePool, bytes_per_block
from .rows import WorkerRows


class DiTWorker:
    def __init__(self, config: EngineConfig, num_blocks: int | None = None, model_bundle=None):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model, self.tokenizer, self.codec = model_bundle or load_model(config.model, self.device, self.dtype)
        mc = self.model.config
        self.backend = select_backend(config.attention_backend, self.device, paged=config.paged)
        self.pool = self.rows = None
        if config.paged:
            if num_blocks is None:
                raise ValueError("a paged worker needs num_blocks (sized by the engine)")
            self.pool = PagePool(num_blocks, mc.num_hidden_layers, mc.num_key_value_heads, config.block_size,
                                 mc.attention_head_dim, self.dtype, self.device)
            self.rows = WorkerRows(num_blocks, config.block_size, config.diffusion_kv_max_rows_per_request)
        self.runner = DiTRunner(self.model, self.backend, self.pool, self.rows, paged=config.paged)

    def bytes_per_block(self) -> int:
        mc = self.model.config
        return bytes_per_block(mc.num_hidden_layers, mc.num_key_value_heads, self.config.block_size,
                               mc.attention_head_dim, self.dtype)

    # ---- preprocessing (model-owned; pure function of the request) ------------------------
    def layout(self, prompt: str, height: int, width: int, guidance: float,
               negative_prompt: str | None = None) -> RequestLayout:
        return build_request_layout(self.model.config, self.tokenizer, prompt, height, width, guidance,
                                    negative_prompt)

    # ---- metadata -----------------------------------------------------------------------
    def install(self, meta) -> bool:
        if self.rows is None:
            raise MetadataError(f"request {meta.request_id!r}: paged metadata sent to a dense_legacy worker; "
                                "dense requests carry no paged metadata")
        return self.rows.install(meta)

    def remove(self, request_id: str, generation: int | None = None) -> bool:
        return self.rows.remove(request_id, generation) if self.rows is not None else False

    # ---- execution ----------------------------------------------------------------------
    def execute(self, request_id: str, layout: RequestLayout, steps: int, guidance: float, seed: int,
                reuse_prefix: bool = True, on_step=None, should_stop=None) -> tuple[np.ndarray, RunStats]:
        if self.rows is not None:
            meta = self.rows.get(request_id)  # paged without metadata: explicit error, no dense run
            shape = [(r.prefix_len, r.target_len, r.seq_len, tuple(r.full_attn_spans)) for r in meta.rows]
            want = [(r.prefix_len, r.target_len, r.seq_len, tuple(r.full_attn_spans)) for r in layout.rows]
            if shape != want:
                raise MetadataError(f"request {request_id!r}: installed rows {shape} do not match the request "
                                    f"layout {want}")
        latents, stats = self.runner.generate(request_id, layout, steps, guidance, seed, reuse_prefix,
                                              on_step, should_stop)
        img = self.codec.decode(latents.to(self.dtype)).float().clamp(-1, 1)
        u8 = ((img[0] + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
        return u8, stats


def resolve_steps_guidance(model_config, steps, guidance) -> tuple[int, float]:
    steps = model_config.default_steps if steps is None else steps
    guidance = model_config.default_guidance if guidance is None else guidance
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise LayoutError(f"steps={steps!r} must be a positive integer")
    if not isinstance(guidance, (int, float)) or isinstance(guidance, bool) or not math.isfinite(guidance) \
            or guidance < 0:
        raise LayoutError(f"guidance_scale={guidance!r} must be a finite number >= 0 (<= 1 disables CFG)")
    return steps, float(guidance)
