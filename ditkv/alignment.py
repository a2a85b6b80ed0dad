"""CPU tensors that feed BLAS start on a 64-byte boundary.

MKL (and oneDNN) choose their kernels by the operands' memory alignment as well as by shape and
instruction set: on an AMD EPYC with AVX-512, an M = 1 product whose weight starts 8 bytes off a
64-byte boundary rounds differently from the same product on an aligned copy. safetensors maps a
file and aligns its tensors to 8 bytes only, so a loaded checkpoint's weights sit 8, 32 or 56 bytes
off, and a loaded model computed other bits than the same model built in memory (torch's CPU
allocator aligns every allocation to 64 bytes). Every bit-identity claim of the CPU path (loaded =
built, solo = batched, AR prefix K/V = DiT prefix K/V, rank processes = one process) therefore needs
aligned operands, whatever produced them:

- weights: every loader ends with `align_module` (load_checkpoint, load_checkpoint_shard, load_vae,
  loader.load_model / load_model_shard), and so do the workers for a caller's model bundle;
- activations: `invariant.cpu_rows` gives each row of its left operand a 64-byte aligned start
  (`aligned_rows`), and the CPU attention tiles read aligned copies.

Only CPU tensors are touched: CUDA allocations are 256-byte aligned already.
"""

from __future__ import annotations

import torch
from torch import nn

CPU_ALIGNMENT = 64  # bytes: one cache line, the widest vector load (AVX-512) MKL specialises for


def is_aligned(t: torch.Tensor) -> bool:
    """True unless `t` is a non-empty CPU tensor whose first element is off a 64-byte boundary."""
    return t.device.type != "cpu" or t.numel() == 0 or t.data_ptr() % CPU_ALIGNMENT == 0


def aligned(t: torch.Tensor) -> torch.Tensor:
    """`t`, or an aligned copy of it (same values, strides and dtype) when it is misaligned. Under
    torch.compile it is `t`: a traced graph has no addresses, and the compiled CPU path makes no
    bit-identity claim (the eager one does)."""
    return t if torch.compiler.is_compiling() or is_aligned(t) else t.clone()


def misaligned(module: nn.Module) -> list[str]:
    """Names of the module's CPU parameters and buffers that are not 64-byte aligned."""
    return [name for name, t in _named_tensors(module) if not t.is_meta and not is_aligned(t)]


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer under every name it has (tied ones too)."""
    return list(module.named_parameters(remove_duplicate=False)) + \
        list(module.named_buffers(remove_duplicate=False))


@torch.no_grad()
def align_module(module: nn.Module) -> int:
    """Move every misaligned CPU parameter and buffer of `module` to an aligned copy, in place.

    The tensor objects stay (their storage is swapped through `.data`), so tied weights, module
    copies that share tensors (`loader.module_copy`) and callers holding a parameter all see the
    aligned copy. Returns how many storages were copied."""
    copies: dict[int, torch.Tensor] = {}  # one copy per misaligned tensor object, however often it appears
    for _, t in _named_tensors(module):
        if t.is_meta or is_aligned(t) or id(t) in copies:
            continue
        copies[id(t)] = t.data = t.data.clone()
    return len(copies)


def aligned_rows(x: torch.Tensor) -> torch.Tensor:
    """`x` [n, k] as a view whose every row starts on a 64-byte boundary: `x` itself when it
    already does, else a copy into a buffer whose row stride is rounded up to 64 bytes. An M = 1
    product of row i then sees the same alignment whatever i is and whatever buffer x came from."""
    n, k = x.shape
    if torch.compiler.is_compiling():  # as in `aligned`
        return x
    per_line = CPU_ALIGNMENT // x.element_size()
    stride = -(-k // per_line) * per_line
    if x.stride(1) == 1 and (n <= 1 or x.stride(0) % per_line == 0) and is_aligned(x):
        return x
    buf = x.new_empty(n, stride)
    buf[:, :k] = x
    return buf[:, :k]
