"""Full-row batches for training (and a batched dense sampler) of the HunyuanImage-3 layout.

A training row is exactly what inference builds (`build_request_layout`): the cond row, or the
uncond row whose prompt tokens are all `<cfg>`. Rows of different caption lengths are padded at
the end to one length L and run as B*L packed tokens. Padding sits after `<eoi>`, so no real
query can see it (every real key limit is <= the row's seq_len); padded queries are causal and
their outputs are ignored.

The mask is the HunyuanImage-3 one, as per-query exclusive key limits: causal text/specials, and
the image block sees its whole span (`ditkv.attention.metadata.key_limits`).

Rows with input images (editing, `build_request_layout(..., images=)`): each input image's
`<timestep>` slot is filled with `timestep_token(0)` and its latent slots with the image path at
t = 0 (`embed_image(latents, 0)`), as `DiTRunner.condition` does; its block is one more full
span of the row's mask. Pass the rows' `CondImage`s to `build_row_table(images=)` and the clean
latents to `predict_velocity(cond=)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..attention.metadata import key_limits
from ..attention.torch_backend import limit_attention
from ..models.hunyuan.layout import RowInputs, build_request_layout
from ..models.hunyuan.sampler import cfg_combine, euler_step, flow_sigmas, initial_latents


@dataclass
class RowTable:
    """Padded per-row tensors, indexable by row id (on the training device)."""

    ids: torch.Tensor  # long [N, L]; padded with pad_token_id
    pos_y: torch.Tensor  # long [N, L]
    pos_x: torch.Tensor  # long [N, L]
    key_limit: torch.Tensor  # long [N, L]; query i sees keys j < key_limit[i]
    ts_index: torch.Tensor  # long [N]; index of <timestep>
    img_index: torch.Tensor  # long [N, h*w]; indices of the image tokens (row-major)
    h: int
    w: int
    # input images (editing): K images per row, each of cond_h x cond_w latent cells
    cond_ts_index: torch.Tensor | None = None  # long [N, K]; their <timestep> slots
    cond_img_index: torch.Tensor | None = None  # long [N, K * cond_h * cond_w]; their latent slots
    cond_h: int = 0
    cond_w: int = 0

    def take(self, idx: torch.Tensor) -> "RowTable":
        cond = [None if t is None else t[idx] for t in (self.cond_ts_index, self.cond_img_index)]
        return RowTable(self.ids[idx], self.pos_y[idx], self.pos_x[idx], self.key_limit[idx],
                        self.ts_index[idx], self.img_index[idx], self.h, self.w, *cond, self.cond_h, self.cond_w)

    def to(self, device) -> "RowTable":
        cond = [None if t is None else t.to(device) for t in (self.cond_ts_index, self.cond_img_index)]
        return RowTable(*(t.to(device) for t in (self.ids, self.pos_y, self.pos_x, self.key_limit,
                                                 self.ts_index, self.img_index)), self.h, self.w,
                        *cond, self.cond_h, self.cond_w)


def build_row_table(rows: list[RowInputs], h: int, w: int, pad_id: int, images: list | None = None) -> RowTable:
    """Pad rows to the longest; pad positions continue the row's index (causal, never attended).

    `images`: per row, its layout's input images (`RequestLayout.images`); every row must have the
    same number of them, all of one latent grid."""
    if not rows:
        raise ValueError("build_row_table needs at least one row")
    length = max(r.seq_len for r in rows)
    n, hw = len(rows), h * w
    ids = torch.full((n, length), pad_id, dtype=torch.long)
    pos_y = torch.arange(length).repeat(n, 1)
    pos_x = pos_y.clone()
    limit = pos_y + 1
    for i, r in enumerate(rows):
        if r.guidance_index is not None:
            raise NotImplementedError("training rows with a <guidance> token are not supported")
        ids[i, : r.seq_len] = r.token_ids
        pos_y[i, : r.seq_len] = r.pos_y
        pos_x[i, : r.seq_len] = r.pos_x
        limit[i, : r.seq_len] = key_limits(0, r.seq_len, r.full_attn_spans).long()
    ts = torch.tensor([r.timestep_index for r in rows], dtype=torch.long)
    img = torch.tensor([r.image_start for r in rows], dtype=torch.long)[:, None] + torch.arange(hw)
    if not images or not any(images):
        return RowTable(ids, pos_y, pos_x, limit, ts, img, h, w)
    if len(images) != n or len({len(ims) for ims in images}) != 1 or len({(c.h, c.w) for ims in images for c in ims}) != 1:
        raise ValueError("build_row_table: every row needs the same number of input images, of one latent grid")
    if any(c.vit_start is not None for ims in images for c in ims):
        raise NotImplementedError("training rows with vision-encoder tokens are not supported")
    ch, cw = images[0][0].h, images[0][0].w
    cond_ts = torch.tensor([[c.timestep_index for c in ims] for ims in images], dtype=torch.long)
    cond_img = torch.stack([torch.cat([c.vae_start + torch.arange(ch * cw) for c in ims]) for ims in images])
    return RowTable(ids, pos_y, pos_x, limit, ts, img, h, w, cond_ts, cond_img, ch, cw)


class RowAttention:
    """Training-time `attn(layer, q, k, v)`: dense attention with per-query key limits over B padded
    rows of L tokens (`limit_attention`: on the CPU in the engine's fixed tiles, so a padded row's
    tokens get the bits of the unpadded row the engine runs, on any CPU; elsewhere one masked SDPA)."""

    def __init__(self, key_limit: torch.Tensor, scale: float) -> None:
        self.b, self.l = key_limit.shape
        self.key_limit = key_limit
        self.scale = scale

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        shape = (self.b, self.l)
        out = limit_attention(q.view(*shape, *q.shape[1:]), k.view(*shape, *k.shape[1:]),
                              v.view(*shape, *v.shape[1:]), self.key_limit, self.scale, 0)
        return out.reshape(q.shape)


def predict_velocity(model, rows: RowTable, x_t: torch.Tensor, t: torch.Tensor,
                     cond: torch.Tensor | None = None) -> torch.Tensor:
    """Velocity [B, C, h, w] (fp32) for latents x_t [B, C, h, w] at timesteps t [B] (= 1000*sigma).

    Assembles the inputs like the runner does: token embeddings, the <timestep> slot filled by
    `timestep_token(t)` and the image slots by `embed_image(x_t, t)`; with input images (rows built
    with `images=`), `cond` [B, K, C, ch, cw] holds their clean latents, embedded at t = 0 as
    `DiTRunner.condition` does."""
    b, length = rows.ids.shape
    hidden = model.embed_tokens(rows.ids)  # [B, L, H]
    bi = torch.arange(b, device=hidden.device)
    hidden = hidden.index_put((bi, rows.ts_index), model.timestep_token(t).to(hidden.dtype))
    img = model.embed_image(x_t, t).to(hidden.dtype)  # [B, hw, H]
    hidden = hidden.index_put((bi[:, None].expand_as(rows.img_index), rows.img_index), img)
    if rows.cond_img_index is not None:
        if cond is None or cond.shape[:2] != (b, rows.cond_ts_index.shape[1]):
            raise ValueError("rows with input images need cond latents [B, K, C, h, w]")
        k = cond.shape[1]
        t0 = torch.zeros(b * k, device=hidden.device)
        ctok = model.embed_image(cond.flatten(0, 1), t0).to(hidden.dtype).reshape(b, -1, hidden.shape[-1])
        hidden = hidden.index_put((bi[:, None].expand_as(rows.cond_img_index), rows.cond_img_index), ctok)
        ts0 = model.timestep_token(t0[:1]).to(hidden.dtype)  # [1, H]
        hidden = hidden.index_put((bi[:, None].expand_as(rows.cond_ts_index), rows.cond_ts_index),
                                  ts0.expand(b * k, -1).reshape(b, k, -1))
    attn = RowAttention(rows.key_limit, 1.0 / math.sqrt(model.config.attention_head_dim))
    out = model.backbone(hidden.reshape(b * length, -1), rows.pos_y.reshape(-1), rows.pos_x.reshape(-1), attn)
    img_out = out.view(b, length, -1)[bi[:, None], rows.img_index]  # [B, hw, H]
    return model.final_layer_velocity(img_out, t, rows.h, rows.w).float()


@torch.no_grad()
def sample_dense(model, tokenizer, captions: list[str], steps: int, guidance: float, seeds: list[int],
                 height: int = 64, width: int = 64, images: list | None = None, codec=None) -> torch.Tensor:
    """Batched Euler sampling with full recompute each step -> latents [B, C, h, w] fp32.

    Same math as the engine (prefix K/V does not depend on the image, so recompute == reuse);
    used for cheap accuracy checks during training. `images`: per caption, its input images (uint8
    [H, W, 3] arrays, as a request's `images`); their latents come from `codec.encode_sample` of the
    layout's preprocessed pixels, as in `DiTRunner.condition` (the tiny PixelCodec needs no noise)."""
    cfg = model.config
    per = images if images is not None else [None] * len(captions)
    layouts = [build_request_layout(cfg, tokenizer, c, height, width, guidance, images=im)
               for c, im in zip(captions, per)]
    two = layouts[0].cfg_factor == 2
    rows = [lay.rows[0] for lay in layouts] + ([lay.rows[1] for lay in layouts] if two else [])
    ims = [lay.images for lay in layouts] * (2 if two else 1)
    table = build_row_table(rows, layouts[0].h, layouts[0].w, cfg.pad_token_id, images=ims).to(model.device)
    cond = None
    if table.cond_img_index is not None:
        if codec is None:
            raise ValueError("sample_dense with input images needs the model's codec")
        cond = torch.stack([torch.cat([codec.encode_sample(c.vae_pixels.to(model.device, model.dtype))
                                       for c in lay.images]) for lay in layouts]).float()
        cond = torch.cat([cond, cond]) if two else cond
    x = torch.cat([initial_latents(cfg, table.h, table.w, s, model.device) for s in seeds])
    sig = flow_sigmas(steps, cfg.flow_shift)
    n = len(captions)
    for i in range(steps):
        xin = torch.cat([x, x]) if two else x
        t = (sig[i] * 1000.0).reshape(1).to(model.device).expand(xin.shape[0])
        v = predict_velocity(model, table, xin, t, cond)
        v = cfg_combine(v[:n], v[n:], guidance) if two else v
        x = euler_step(x, v, sig[i], sig[i + 1])
    return x
