"""Compiled elementwise chains on CUDA (`EngineConfig.torch_compile`).

The norms, RoPE, the SwiGLU gate and the MoE combine are chains of ~6 memory-bound kernels each
(casts, powers, means, products). On CUDA `fused(fn)` runs `fn` as one torch.compile'd kernel: the
same math, fewer passes over memory. Elsewhere it runs `fn` eagerly, so CPU results never depend on
a compiler. The switch is process-wide: every process that runs a model sets it from its config.
"""

from __future__ import annotations

import torch

FUSE = {"on": True}
COMPILED: dict = {}  # fn -> its compiled form, made at the first CUDA call


def set_fused_elementwise(on: bool) -> None:
    """Turn the compiled CUDA chains on or off (off: eager kernels everywhere)."""
    FUSE["on"] = bool(on)


def fused(fn):
    def run(x: torch.Tensor, *args):
        if x.is_cuda and FUSE["on"] and not torch.compiler.is_compiling():
            compiled = COMPILED.get(fn)
            if compiled is None:
                compiled = COMPILED[fn] = torch.compile(fn, dynamic=True, fullgraph=True)
            return compiled(x, *args)
        return fn(x, *args)
    run.__doc__ = fn.__doc__
    return run
