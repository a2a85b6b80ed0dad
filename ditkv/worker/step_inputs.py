"""One step's packed inputs, built one way for every pass: eager DiT steps, CUDA-graph replays and
the AR runner's prefills.

`build` turns the query ranges of the rows of one or several requests into index tensors on the
device: the packed token ids and 2D positions, where each request's `<timestep>` / `<guidance>`
slots and generated-image tokens sit, and which input-image slots (editing) the range covers.
`embed` then makes the hidden states from them (token embeddings, then each request's timestep,
guidance and image embeddings copied into their slots) and `velocities` reads each request's
image tokens back out through the final layer. A CUDA graph keeps one `StepInputs` as its static
buffers and refills it in place (`copy_from`) for another request of its bucket, so a replay runs
exactly the eager step's embedding code on persistent buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .conditioning import fill_image_slots


@dataclass(frozen=True)
class TokenRow:
    """A row of plain tokens (an AR pass: no `<timestep>`, no generated image)."""

    token_ids: torch.Tensor
    pos_y: torch.Tensor
    pos_x: torch.Tensor


@dataclass(frozen=True)
class Request:
    """What `build` needs of one request: its rows (the family's row inputs), each row's query range
    `(lo, hi)`, its latent grid and the `<guidance>` value (None: no slot is filled). `images` and
    `cond`: the input images and their embeddings, for the ranges that cover their slots. A first step's
    range may start inside an input image's block (a prefix-cache hit ending there): only the slots in
    range are filled, and the attention metadata lets them see the whole block (cached keys included). So
    `cond` needs only the images with a slot in some range: those wholly before every row's range may be
    absent (`CondEmbeds.skipped`), and reading one raises."""

    rows: list
    spans: list[tuple[int, int]]
    h: int = 0
    w: int = 0
    guidance: torch.Tensor | None = None
    images: tuple = ()
    cond: object = None


@dataclass(frozen=True)
class Shape:
    """The host-side shape of one request's part (fixed for a graph's bucket)."""

    ts_slots: int  # rows whose `<timestep>` falls in their range
    g_slots: int  # rows whose `<guidance>` falls in their range
    h: int
    w: int
    tokens: int  # query tokens of the request


class StepInputs:
    def __init__(self, buf: dict[str, torch.Tensor], shapes: list[Shape], fills: list):
        self.buf, self.shapes, self.fills = buf, shapes, fills

    @property
    def num_tokens(self) -> int:
        return self.buf["ids"].shape[0]

    def copy_from(self, other: "StepInputs") -> None:
        """Refill these (persistent) buffers with `other`'s values: same keys, shapes and slots."""
        if other.shapes != self.shapes or other.buf.keys() != self.buf.keys():
            raise ValueError("the step inputs are not of this graph's bucket")
        if other.fills:
            raise ValueError("a captured step never fills input-image slots (a denoise step reads the prefix)")
        for k, v in other.buf.items():
            self.buf[k].copy_(v)


def build(requests: list[Request], device) -> StepInputs:
    """The packed inputs of `requests`' query ranges, rows in request order."""
    ids, py, px, ts_idx, g_idx, g_val, img_dst, fills, shapes, per_req, off = [], [], [], [], [], [], [], [], [], {}, 0
    for j, rq in enumerate(requests):
        n_ts = n_g = 0
        img_rows, start = [], off
        for row, (lo, hi) in zip(rq.rows, rq.spans):
            ids.append(row.token_ids[lo:hi])
            py.append(row.pos_y[lo:hi])
            px.append(row.pos_x[lo:hi])
            ti = getattr(row, "timestep_index", None)
            if ti is not None and lo <= ti < hi:
                ts_idx.append(off + ti - lo)
                n_ts += 1
            gi = getattr(row, "guidance_index", None)
            if gi is not None and lo <= gi < hi:
                if rq.guidance is None:
                    raise ValueError("a <guidance> slot needs the request's guidance value (guidance_input)")
                g_idx.append(off + gi - lo)
                g_val.append(rq.guidance.reshape(1))
                n_g += 1
            hw = rq.h * rq.w
            a = getattr(row, "image_start", None)
            if hw and a is not None and a < hi and a + hw > lo:
                if not (lo <= a and a + hw <= hi):
                    raise ValueError(f"rows [{lo}, {hi}) cover part of the image tokens [{a}, {a + hw}): a step "
                                     "computes a row's image tokens whole")
                img_rows.append(torch.arange(off + a - lo, off + a - lo + hw))
            if rq.images:
                fills.append((off, lo, hi, rq.images, rq.cond))
            off += hi - lo
        if img_rows:
            if len(img_rows) != n_ts:
                raise ValueError("every row whose image tokens are computed also computes its <timestep>")
            per_req[f"img{j}"] = torch.stack(img_rows)
            img_dst.extend(img_rows)
        shapes.append(Shape(n_ts, n_g, rq.h, rq.w, off - start))
    buf = {"ids": torch.cat(ids), "py": torch.cat(py), "px": torch.cat(px)}
    if ts_idx:
        buf["ts_idx"] = torch.tensor(ts_idx)
    if img_dst:
        buf["img_dst"] = torch.cat(img_dst)
    if g_idx:
        buf["g_idx"], buf["g"] = torch.tensor(g_idx), torch.cat([v.float().cpu() for v in g_val])
    buf |= per_req
    return StepInputs({k: v.to(device) for k, v in buf.items()}, shapes, fills)


def embed(model, inp: StepInputs, xs: list, ts: list) -> torch.Tensor:
    """Hidden states [N, hidden] of the packed tokens: each request's timestep, guidance and image
    embeddings (its latents `xs[j]` at timestep `ts[j]`, shared by its rows) copied into their slots,
    then the input images' embeddings into theirs."""
    b = inp.buf
    hidden = model.embed_tokens(b["ids"])
    if "ts_idx" in b:
        t_emb = torch.cat([model.timestep_token(t.expand(s.ts_slots)) for t, s in zip(ts, inp.shapes) if s.ts_slots])
        hidden = hidden.index_copy(0, b["ts_idx"], t_emb.to(hidden.dtype))
    if "g_idx" in b:
        g_emb, at = [], 0
        for s in inp.shapes:  # one guidance value per request, its own embedder (not the timestep's)
            if s.g_slots:
                g_emb.append(model.guidance_token(b["g"][at:at + s.g_slots]))
                at += s.g_slots
        hidden = hidden.index_copy(0, b["g_idx"], torch.cat(g_emb).to(hidden.dtype))
    if "img_dst" in b:
        # a request's rows (cond, uncond) share its latents and timestep: its image is embedded once
        imgs = [model.embed_image(x, t.reshape(1)).expand(s.ts_slots, -1, -1).reshape(-1, hidden.shape[-1])
                for j, (x, t, s) in enumerate(zip(xs, ts, inp.shapes)) if f"img{j}" in b]
        hidden = hidden.index_copy(0, b["img_dst"], torch.cat(imgs).to(hidden.dtype))
    for off, lo, hi, images, cond in inp.fills:
        fill_image_slots(hidden[off:off + hi - lo], images, lo, hi, cond)
    return hidden


def velocities(model, out: torch.Tensor, inp: StepInputs, ts: list) -> list[torch.Tensor]:
    """Each request's image-token outputs through the final layer -> velocity [R, C, h, w] fp32."""
    return [model.final_layer_velocity(out[inp.buf[f"img{j}"]], t.expand(s.ts_slots), s.h, s.w).float()
            for j, (t, s) in enumerate(zip(ts, inp.shapes))]
