"""Full-row batches for training (and a batched dense sampler) of the HunyuanImage-3 layout.

A training row is exactly what inference builds (`build_request_layout`): the cond row, or the
uncond row whose prompt tokens are all `<cfg>`. Rows of different caption lengths are padded at
the end to one length L and run as B*L packed tokens. Padding sits after `<eoi>`, so no real
query can see it (every real key limit is <= the row's seq_len); padded queries are causal and
their outputs are ignored.

The mask is the HunyuanImage-3 one, as per-query exclusive key limits: causal text/specials, and
the image block sees its whole span (`ditkv.attention.metadata.key_limits`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..attention.metadata import key_limits
from ..attention.torch_backend import masked_attention
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

    def take(self, idx: torch.Tensor) -> "RowTable":
        return RowTable(self.ids[idx], self.pos_y[idx], self.pos_x[idx], self.key_limit[idx],
                        self.ts_index[idx], self.img_index[idx], self.h, self.w)

    def to(self, device) -> "RowTable":
        return RowTable(*(t.to(device) for t in (self.ids, self.pos_y, self.pos_x, self.key_limit,
                                                 self.ts_index, self.img_index)), self.h, self.w)


def build_row_table(rows: list[RowInputs], h: int, w: int, pad_id: int) -> RowTable:
    """Pad rows to the longest; pad positions continue the row's index (causal, never attended)."""
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
    return RowTable(ids, pos_y, pos_x, limit, ts, img, h, w)


class RowAttention:
    """Training-time `attn(layer, q, k, v)`: dense masked attention over B padded rows of L tokens.

    The [B, L, L] boolean mask is built once per batch and shared by every layer."""

    def __init__(self, key_limit: torch.Tensor, scale: float) -> None:
        self.b, self.l = key_limit.shape
        keys = torch.arange(self.l, device=key_limit.device)
        self.allowed = keys[None, None, :] < key_limit[:, :, None]
        self.scale = scale

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        shape = (self.b, self.l)
        out = masked_attention(q.view(*shape, *q.shape[1:]), k.view(*shape, *k.shape[1:]),
                               v.view(*shape, *v.shape[1:]), self.allowed, self.scale)
        return out.reshape(q.shape)


def predict_velocity(model, rows: RowTable, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Velocity [B, C, h, w] (fp32) for latents x_t [B, C, h, w] at timesteps t [B] (= 1000*sigma).

    Assembles the inputs like the runner does: token embeddings, the <timestep> slot filled by
    `timestep_token(t)` and the image slots by `embed_image(x_t, t)`."""
    b, length = rows.ids.shape
    hidden = model.embed_tokens(rows.ids)  # [B, L, H]
    bi = torch.arange(b, device=hidden.device)
    hidden = hidden.index_put((bi, rows.ts_index), model.timestep_token(t).to(hidden.dtype))
    img = model.embed_image(x_t, t).to(hidden.dtype)  # [B, hw, H]
    hidden = hidden.index_put((bi[:, None].expand_as(rows.img_index), rows.img_index), img)
    attn = RowAttention(rows.key_limit, 1.0 / math.sqrt(model.config.attention_head_dim))
    out = model.backbone(hidden.reshape(b * length, -1), rows.pos_y.reshape(-1), rows.pos_x.reshape(-1), attn)
    img_out = out.view(b, length, -1)[bi[:, None], rows.img_index]  # [B, hw, H]
    return model.final_layer_velocity(img_out, t, rows.h, rows.w).float()


@torch.no_grad()
def sample_dense(model, tokenizer, captions: list[str], steps: int, guidance: float, seeds: list[int],
                 height: int = 64, width: int = 64) -> torch.Tensor:
    """Batched Euler sampling with full recompute each step -> latents [B, C, h, w] fp32.

    Same math as the engine (prefix K/V does not depend on the image, so recompute == reuse);
    used for cheap accuracy checks during training."""
    cfg = model.config
    layouts = [build_request_layout(cfg, tokenizer, c, height, width, guidance) for c in captions]
    two = layouts[0].cfg_factor == 2
    rows = [lay.rows[0] for lay in layouts] + ([lay.rows[1] for lay in layouts] if two else [])
    table = build_row_table(rows, layouts[0].h, layouts[0].w, cfg.pad_token_id).to(model.device)
    x = torch.cat([initial_latents(cfg, table.h, table.w, s, model.device) for s in seeds])
    sig = flow_sigmas(steps, cfg.flow_shift)
    n = len(captions)
    for i in range(steps):
        xin = torch.cat([x, x]) if two else x
        t = (sig[i] * 1000.0).reshape(1).to(model.device).expand(xin.shape[0])
        v = predict_velocity(model, table, xin, t)
        v = cfg_combine(v[:n], v[n:], guidance) if two else v
        x = euler_step(x, v, sig[i], sig[i + 1])
    return x
