"""DiT worker (one rank): model, physical page pool, rows, runner.

It installs the scheduler's metadata snapshots, checks them against the layouts it is given, and
decodes finished latents (the steps run in `batch.BatchStepper` over its runner); it never decides
capacity and never frees scheduler blocks.
"""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from ..attention.backend import select_backend
from ..config import EngineConfig
from ..errors import ConfigError, MetadataError
from ..models.family import RequestLayout, families, family_of
from ..alignment import align_module
from ..models.loader import load_model, module_copy, quantized, resolve_device, resolve_dtype
from .dit_runner import DiTRunner
from .page_pool import PagePool, bytes_per_block
from .parallel import ParallelContext, validate_parallel
from .rows import WorkerRows


class DiTWorker:
    """With `parallel` (a `ParallelContext` from `init_parallel`): the rank keeps only its TP/EP
    shard of the model (cut here from a full model, or loaded sliced and marked `_ditkv_sharded`
    by `load_checkpoint_shard`); the pool holds the rank-local KV heads; under CFG parallel the
    rank installs and runs only its own row of each snapshot."""

    def __init__(self, config: EngineConfig, num_blocks: int | None = None, model_bundle=None,
                 parallel: ParallelContext | None = None):
        self.config = config
        self.parallel = parallel or ParallelContext.single()
        self.device = self.parallel.device or resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        check_quantization(config, self.device)
        self.model, self.tokenizer, self.codec = model_bundle or load_model(
            config.model, self.device, self.dtype, config.quantization, tuple(config.quantization_ignored_layers))
        # a caller's bundle: quantize a copy (a loaded model is FP8 already, or stays as it is)
        self.model = quantized(self.model, config.quantization, tuple(config.quantization_ignored_layers),
                               copy=model_bundle is not None)
        mc = self.model.config
        self.family = family = family_of(mc)
        if config.quantization is None and family.quantization_of(self.model):  # a pre-quantized checkpoint
            check_quantization(config.replace(quantization=family.quantization_of(self.model)), self.device)
        sharded = family.shard_of(self.model)
        if sharded is not None:  # loaded sliced: check it is this rank's cut, never cut it again

            if sharded != family.shard_key(self.parallel):
                raise ConfigError("model", config.model,
                                  f"the model was loaded as the shard (tp_rank, tp_size, ep_rank, ep_size) = "
                                  f"{sharded}, this rank is {family.shard_key(self.parallel)}")
            validate_parallel(config, mc)
            self.model = _to_device(self.model, self.device)
        elif not self.parallel.is_single:
            validate_parallel(config, mc)
            # a caller's bundle is never cut in place: shard a copy whose modules are new but whose
            # unsharded tensors are shared (no memory doubling)
            model = module_copy(self.model) if model_bundle is not None else self.model
            self.model = _to_device(family.shard_model(model, self.parallel), self.device)
        # a caller's bundle, or a rank's cut (row slices are views at any offset): 64-byte aligned
        # CPU weights, so this rank computes the bits any other process would (models/alignment.py)
        align_module(self.model)
        self.num_kv_heads = mc.num_key_value_heads // self.parallel.head_shards
        self.backend = select_backend(attention_backend_for(config, self.device), self.device, paged=config.paged,
                                      block_size=config.block_size)
        self.pool = self.rows = None
        if config.paged:
            if num_blocks is None:
                raise ValueError("a paged worker needs num_blocks (sized by the engine)")
            self.pool = PagePool(num_blocks, mc.num_hidden_layers, self.num_kv_heads, config.block_size,
                                 mc.attention_head_dim, self.dtype, self.device)
            # row slots for every request that may run at once (step-level batching)
            self.rows = WorkerRows(num_blocks, config.block_size,
                                   config.diffusion_kv_max_rows_per_request * config.max_num_seqs)
        self.runner = DiTRunner(self.model, self.backend, self.pool, self.rows, paged=config.paged,
                                parallel=self.parallel, cuda_graphs=config.cuda_graphs,
                                # dense on a GPU: the fastest dense kernels, unless the torch
                                # backend's math was asked for (then dense and paged agree bit for bit)
                                dense_segments=self.device.type == "cuda" and config.attention_backend != "torch",
                                # dense_legacy with attention_backend fa4: the segments on flash-attn-4 (fair baseline)
                                dense_fa4=not config.paged and self.device.type == "cuda"
                                and config.attention_backend == "fa4",
                                codec=self.codec, step_cache=config.step_cache,
                                # reused embeddings only pay where prefix-cache hits end inside an image
                                encoder_cache_images=config.encoder_cache_bound)

    def bytes_per_block(self) -> int:
        """Bytes of one block in this rank's pool (rank-local KV heads)."""
        mc = self.model.config
        return bytes_per_block(mc.num_hidden_layers, self.num_kv_heads, self.config.block_size,
                               mc.attention_head_dim, self.dtype)

    # ---- preprocessing (model-owned; pure function of the request) ------------------------
    def layout(self, prompt: str, height: int, width: int, guidance: float,
               negative_prompt: str | None = None, images=None) -> RequestLayout:
        """The request's rows. `images`: input images (image-conditioned generation), a list of uint8 RGB
        numpy arrays [H, W, 3], at most the model's `max_input_images` (0: the model takes none; a request
        with images is then a LayoutError with field "image")."""
        layout = self.family.request_layout(self.model.config, self.tokenizer, prompt, height, width, guidance,
                                            negative_prompt, images=images)
        self.runner.local_layout(layout)  # CFG parallel without CFG rows: clear error at intake
        return layout

    # ---- metadata -----------------------------------------------------------------------
    def install(self, meta, request_id: str | None = None) -> bool:
        """`request_id`: the request this is installed for; another request's snapshot is refused."""
        if self.rows is None:
            raise MetadataError(f"request {meta.request_id!r}: paged metadata sent to a dense_legacy worker; "
                                "dense requests carry no paged metadata")
        return self.rows.install(self._local_rows(meta), request_id)

    def _local_rows(self, meta):
        """CFG parallel: the snapshot arrives unchanged on every rank; this rank binds only its row
        (request id and generation stay, so stale/conflict checks work as on one rank)."""
        cfg = self.parallel.cfg_size
        if cfg == 1:
            return meta
        if len(meta.rows) != cfg:
            raise MetadataError(f"request {meta.request_id!r}: cfg_parallel_size={cfg} needs {cfg} rows "
                                f"(cond, uncond), the snapshot has {len(meta.rows)}; use guidance_scale > 1 "
                                "or cfg_parallel_size=1")
        return msgspec.structs.replace(meta, rows=(meta.rows[self.parallel.cfg_rank],))

    def remove(self, request_id: str, generation: int | None = None) -> bool:
        return self.rows.remove(request_id, generation) if self.rows is not None else False

    # ---- execution ----------------------------------------------------------------------
    def check_rows(self, request_id: str, layout: RequestLayout) -> None:
        """Paged: the installed rows must be this request's layout (no metadata: an explicit
        error, never a dense run)."""
        if self.rows is None:
            return
        meta = self.rows.get(request_id)
        shape = [(r.prefix_len, r.target_len, r.seq_len, tuple(r.full_attn_spans)) for r in meta.rows]
        want = [(r.prefix_len, r.target_len, r.seq_len, tuple(r.full_attn_spans))
                for r in self.runner.local_layout(layout).rows]
        if shape != want:
            raise MetadataError(f"request {request_id!r}: installed rows {shape} do not match the request "
                                f"layout {want}")

    def to_image(self, latents: torch.Tensor) -> np.ndarray:
        """Final latents [1, C, h, w] -> uint8 RGB [H, W, 3] through the codec."""
        img = self.codec.decode(latents.to(self.dtype)).float().clamp(-1, 1)
        return ((img[0] + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()


def attention_backend_for(config: EngineConfig, device: torch.device) -> str:
    """The attention backend to select. With `batch_invariant` on CUDA only the Triton kernel is
    row-invariant (a program never spans two rows, its tiling is fixed by head_dim/dtype/page/GQA;
    SDPA and cuDNN split work by the batch's shape): `auto` means triton there, another choice is
    an error. Triton must be importable for the mode's kernels."""
    name = config.attention_backend
    if not config.batch_invariant or device.type != "cuda":
        return name
    why = next((w for w in (f.batch_invariant_unusable(device) for f in families()) if w), None)
    if why is not None:
        raise ConfigError("batch_invariant", True, why)
    if name not in ("auto", "triton"):
        raise ConfigError("attention_backend", name, "batch_invariant on CUDA needs the triton attention "
                                                     "backend (set attention_backend=triton or auto)")
    return "triton"


def check_quantization(config: EngineConfig, device: torch.device) -> None:
    """Refuse, naming the setting, an FP8 engine this device or mode cannot run."""
    if config.quantization is None or device.type != "cuda":
        return
    from ..models import fp8

    why = fp8.unusable(device)
    if why is not None:
        raise ConfigError("quantization", config.quantization, why)
    if resolve_dtype(config.dtype, device) != torch.bfloat16:
        raise ConfigError("quantization", config.quantization, f"FP8 on CUDA computes in bfloat16 (its GEMMs write "
                          f"bf16); dtype={config.dtype} asks for another: set dtype to bfloat16 or auto")
    if config.batch_invariant:
        raise ConfigError("batch_invariant", True, "batch-invariant mode has no fixed-tiling FP8 kernels on CUDA "
                          "(torch's FP8 GEMMs tile by batch size); drop one of batch_invariant and quantization=fp8")


def _to_device(model: torch.nn.Module, device) -> torch.nn.Module:
    """Move by replacing tensors (not `.to`, which would move tensors shared with the caller)."""
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is not None and p.device != device:
                mod._parameters[name] = torch.nn.Parameter(p.detach().to(device), requires_grad=False)
        for name, b in mod._buffers.items():
            if b is not None and b.device != device:
                mod._buffers[name] = b.to(device)
    return model
