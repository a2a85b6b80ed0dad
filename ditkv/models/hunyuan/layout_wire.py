"""A `RequestLayout` on the wire: what the engine process sends its ranks instead of the prompt.

The front end builds each request's layout once (tokenizer, prompt template, input images'
preprocessing); ranks receive it in this form and never tokenize. Tensors travel as raw bytes with
their dtype and shape, so the rank's layout is the engine's bit for bit.
"""

from __future__ import annotations

import msgspec
import torch

from .layout import CondImage, RequestLayout, RowInputs


class WireTensor(msgspec.Struct, array_like=True):
    dtype: str  # torch dtype name without "torch."
    shape: tuple[int, ...]
    data: bytes


def pack_tensor(t: torch.Tensor) -> WireTensor:
    t = t.detach().cpu().contiguous()
    return WireTensor(str(t.dtype).removeprefix("torch."), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())


def unpack_tensor(w: WireTensor) -> torch.Tensor:
    dtype = getattr(torch, w.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {w.dtype!r} on the wire")
    return torch.frombuffer(bytearray(w.data), dtype=torch.uint8).view(dtype).reshape(w.shape)


def _opt(t):
    return None if t is None else pack_tensor(t)


def _unopt(w):
    return None if w is None else unpack_tensor(w)


class WireRow(msgspec.Struct, array_like=True):
    token_ids: list[int]
    pos_y: list[int]
    pos_x: list[int]
    prefix_len: int
    target_len: int
    seq_len: int
    timestep_index: int
    image_start: int
    full_attn_spans: list[tuple[int, int]]
    guidance_index: int | None
    role: str


class WireImage(msgspec.Struct, array_like=True):
    vae_pixels: WireTensor
    h: int
    w: int
    timestep_index: int
    vae_start: int
    vit_patches: WireTensor | None
    vit_mask: WireTensor | None
    vit_shape: tuple[int, int] | None
    vit_start: int | None
    joint: bool
    digest: bytes = b""  # its content digest, hashed once by the front end (empty: the receiver hashes)


class WireLayout(msgspec.Struct, array_like=True):
    rows: list[WireRow]
    h: int
    w: int
    cfg_factor: int
    prompt_tokens: int
    images: list[WireImage]


def to_wire(layout: RequestLayout) -> WireLayout:
    rows = [WireRow(r.token_ids.tolist(), r.pos_y.tolist(), r.pos_x.tolist(), r.prefix_len, r.target_len, r.seq_len,
                    r.timestep_index, r.image_start, [tuple(s) for s in r.full_attn_spans], r.guidance_index, r.role)
            for r in layout.rows]
    images = [WireImage(pack_tensor(c.vae_pixels), c.h, c.w, c.timestep_index, c.vae_start, _opt(c.vit_patches),
                        _opt(c.vit_mask), c.vit_shape, c.vit_start, c.joint, c.digest) for c in layout.images]
    return WireLayout(rows, layout.h, layout.w, layout.cfg_factor, layout.prompt_tokens, images)


def from_wire(w: WireLayout) -> RequestLayout:
    long = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    rows = [RowInputs(long(r.token_ids), long(r.pos_y), long(r.pos_x), r.prefix_len, r.target_len, r.seq_len,
                      r.timestep_index, r.image_start, tuple(tuple(s) for s in r.full_attn_spans), r.guidance_index,
                      r.role) for r in w.rows]
    images = tuple(CondImage(unpack_tensor(c.vae_pixels), c.h, c.w, c.timestep_index, c.vae_start,
                             _unopt(c.vit_patches), _unopt(c.vit_mask),
                             None if c.vit_shape is None else tuple(c.vit_shape), c.vit_start, c.joint, c.digest)
                   for c in w.images)
    return RequestLayout(rows=rows, h=w.h, w=w.w, cfg_factor=w.cfg_factor, prompt_tokens=w.prompt_tokens,
                         images=images)
