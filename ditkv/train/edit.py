"""`ditkv train-tiny-edit`: fine-tune the tiny model to edit an input image by instruction.

Recipe (the shipped `ditkv/assets/tiny-edit` weights, `--model tiny-edit`, are two runs: these defaults
from the text-to-image weights in `ditkv/assets/tiny`, then `--init ditkv/assets/tiny-edit --steps 1500
--lr 8e-4` from that output; docs/tiny-model.md "Editing"):
  * init: the shipped text-to-image weights (`--init`, loaded as fp32); the config gains
    `max_input_images: 1` and `cond_image_type: "vae"` (input images as latent tokens only);
  * edit data: `--edit-pool` pairs of `EditDataset(seed)` (`ditkv.data.edits`: train pairs only,
    attribute-balanced, source and target drawn with the same jitter) at 64x64;
  * edit rows: exactly the engine's rows for `prompt=instruction, images=[source]`
    (`build_request_layout(..., images=)`): `<bos> <boi> <img_size> <img_ratio> <timestep> <img>x256
    <eoi> instruction <boi> <img_size> <img_ratio> <timestep> <img>x256 <eoi>`, the HunyuanImage-3
    mask with the input image and the target each a full-attention span; the input image's slots
    hold the image path at t = 0 and `timestep_token(0)`, as `DiTRunner.condition` fills them;
  * text-to-image rows (to keep that skill): `train-tiny`'s own data and rows (`--t2i-pool` images of
    `ShapesDataset(seed)`), `--t2i-rows` of them per step;
  * caption dropout `--p-uncond` on both kinds (the uncond row keeps the input image, as CFG does);
  * flow matching as `train-tiny` (shifted sigma, v = noise - x0), MSE on the target image only;
  * AdamW, warmup + cosine to 10%; the EMA weights are saved (bf16, router fp32).
Everything random comes from `--seed`.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..argtypes import writable_dir, writable_file
from .tiny import IMAGE_SIZE, _device, _fmt, caption_rows, flow_pair, lr_at, render_pool, save, shifted_sigma

ASSETS = Path(__file__).resolve().parent.parent / "assets"
DEFAULT_INIT, DEFAULT_DIR = ASSETS / "tiny", ASSETS / "tiny-edit"
EDIT_CONFIG = {"max_input_images": 1, "cond_image_type": "vae"}


def add_parser(sub) -> None:
    p = sub.add_parser("train-tiny-edit", help="fine-tune the tiny model to edit images by instruction",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--init", default=str(DEFAULT_INIT), help="checkpoint folder to start from")
    p.add_argument("--out", default=str(DEFAULT_DIR), type=writable_dir, help="checkpoint folder to write")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:i]")
    p.add_argument("--seed", type=int, default=0, help="seed of the init, the rendered data and its order")
    p.add_argument("--split-seed", type=int, default=0, help="seed of the edit train/held-out split")
    p.add_argument("--steps", type=int, default=1700, help="optimizer steps")
    p.add_argument("--edit-rows", type=int, default=192, help="edit rows per step")
    p.add_argument("--t2i-rows", type=int, default=64, help="text-to-image rows per step")
    p.add_argument("--lr", type=float, default=5e-4, help="peak AdamW learning rate (warmup, then cosine decay)")
    p.add_argument("--warmup", type=int, default=100, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    p.add_argument("--ema", type=float, default=0.998, help="EMA decay of the saved weights")
    p.add_argument("--p-uncond", type=float, default=0.1, help="caption dropout (uncond row) rate")
    p.add_argument("--edit-pool", type=int, default=32768, help="rendered edit pairs")
    p.add_argument("--t2i-pool", type=int, default=32768, help="rendered text-to-image images")
    p.add_argument("--workers", type=int, default=0, help="render processes (0 = CPU count, max 16)")
    p.add_argument("--log-every", type=int, default=100, help="print the mean loss every N steps")
    p.add_argument("--eval-every", type=int, default=0, help="held-out accuracy every N steps (0 = end only)")
    p.add_argument("--no-eval", action="store_true", help="skip the held-out accuracy checks")
    p.add_argument("--sweep", action="store_true", help="at the end, also score steps/guidance 8/3.0 and 16/5.0")
    p.add_argument("--save-dtype", choices=["float32", "bfloat16"], default="bfloat16",
                   help="dtype of the saved weights")
    p.add_argument("--metrics", default=None, type=writable_file,
                   help="write step/loss/accuracy history here (JSON; default: not written)")
    p.add_argument("--time-limit", type=float, default=0,
                   help="safety net: stop the loop (and save) after this many training seconds (0 = none)")


# ------------------------------------------------------------------------------ data
def _render_edit_chunk(job: tuple[int, int, int, int, int]):
    from ..data.edits import EditDataset, all_edits

    seed, split_seed, n, lo, hi = job
    ds = EditDataset(seed, n, IMAGE_SIZE, split_seed=split_seed)
    index = {e: i for i, e in enumerate(all_edits())}
    ids = np.empty(hi - lo, np.int64)
    src = np.empty((hi - lo, IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
    tgt = np.empty_like(src)
    for j, i in enumerate(range(lo, hi)):
        pair, src[j], tgt[j] = ds.sample(i)
        ids[j] = index[pair.edit]
    return ids, src, tgt


def render_edit_pool(seed: int, n: int, workers: int, split_seed: int = 0):
    """(instruction ids [n] into `all_edits()`, source uint8 [n, 64, 64, 3], target uint8 [n, 64, 64, 3]);
    each item depends only on (seed, index), not on workers."""
    chunk = 1024
    jobs = [(seed, split_seed, n, lo, min(lo + chunk, n)) for lo in range(0, n, chunk)]
    workers = workers or min(os.cpu_count() or 1, 16)
    if workers > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(workers) as ex:
            parts = list(ex.map(_render_edit_chunk, jobs))
    else:
        parts = [_render_edit_chunk(j) for j in jobs]
    return tuple(torch.from_numpy(np.concatenate([p[k] for p in parts])) for k in range(3))


def edit_rows(cfg, tokenizer):
    """Row table of the instructions (`all_edits()` order) with one 64x64 input image: ids [0, E) are
    cond rows, [E, 2E) their uncond rows. The rows (and the image slots) do not depend on the
    image's pixels, so a blank image stands in."""
    from ..data.edits import all_edits
    from ..models.hunyuan.layout import build_request_layout
    from .batch import build_row_table

    blank = np.zeros((IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
    lay = [build_request_layout(cfg, tokenizer, e.instruction, IMAGE_SIZE, IMAGE_SIZE, guidance_scale=2.0,
                                images=[blank]) for e in all_edits()]
    rows = [x.rows[0] for x in lay] + [x.rows[1] for x in lay]
    images = [x.images for x in lay] * 2
    return build_row_table(rows, lay[0].h, lay[0].w, cfg.pad_token_id, images=images), len(lay)


def cond_pixels(u8: torch.Tensor) -> torch.Tensor:
    """uint8 [B, H, W, 3] -> [B, 3, H, W] in [-1, 1] with `vision.vae_pixels`' arithmetic (a 64x64 image
    at the 64x64 output size is not resized, so this is bit-identical to what the engine encodes)."""
    return (u8.permute(0, 3, 1, 2).float() / 255.0 - 0.5) / 0.5


# ------------------------------------------------------------------------ evaluation
def evaluate_edits(model, tokenizer, codec, steps: int, guidance: float, seed: int = 0, split_seed: int = 0,
                   limit: int | None = None) -> dict:
    """Held-out edit accuracy with the batched dense sampler (= the engine's math): the checker's
    per-field accuracy against the target spec over every held-out pair, and `all` per edit kind."""
    from ..data import EditDataset
    from .batch import sample_dense

    ds = EditDataset(seed, limit, IMAGE_SIZE, holdout=True, split_seed=split_seed)
    samples = [ds.sample(i) for i in range(len(ds))]
    images = []
    for lo in range(0, len(samples), 128):
        chunk = samples[lo:lo + 128]
        x = sample_dense(model, tokenizer, [p.instruction for p, _, _ in chunk], steps, guidance,
                         list(range(lo, lo + len(chunk))), images=[[s] for _, s, _ in chunk], codec=codec)
        images.extend(codec.decode(x.to(model.dtype)).float().clamp(-1, 1).cpu())
    return edit_scores(images, [p for p, _, _ in samples])


def edit_scores(images, pairs) -> dict:
    """{field accuracies over all pairs, n, by_edit: {attribute: {all, n}}}."""
    from ..data import check
    from ..data.edits import EDIT_ATTRIBUTES

    results = [check(im, p.target) for im, p in zip(images, pairs)]
    out = {f: float(np.mean([r[f"{f}_ok"] for r in results])) for f in ("shape", "color", "size", "position")}
    out["all"] = float(np.mean([r["all_ok"] for r in results]))
    out["n"] = len(results)
    out["by_edit"] = {}
    for a in EDIT_ATTRIBUTES:
        rs = [r for r, p in zip(results, pairs) if p.attribute == a]
        if rs:
            out["by_edit"][a] = {"all": float(np.mean([r["all_ok"] for r in rs])),
                                 "changed_ok": float(np.mean([r[f"{a}_ok"] for r in rs])), "n": len(rs)}
    return out


def _fmt_edit(acc: dict) -> str:
    by = " ".join(f"{a}:{v['all']:.3f}" for a, v in acc["by_edit"].items())
    return _fmt({k: v for k, v in acc.items() if k != "by_edit"}) + f" | by edit {by}"


# -------------------------------------------------------------------------- training
def load_init(folder, device):
    from ..models.hunyuan import load_checkpoint

    model = load_checkpoint(folder, device=device, dtype=torch.float32)
    model.config = model.config.replace(**EDIT_CONFIG)
    return model


def write_config(out_dir: Path, raw: dict, dtype_name: str) -> None:
    """The init folder's config.json, as it was, plus EDIT_CONFIG (keys sorted, as saved before)."""
    data = dict(raw, **EDIT_CONFIG, torch_dtype=dtype_name)
    (Path(out_dir) / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def train(args) -> dict:
    from ..models.hunyuan import ByteTokenizer, PixelCodec
    from .batch import predict_velocity
    from .tiny import evaluate as evaluate_t2i

    device = _device(args.device)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    init_raw = json.loads((Path(args.init) / "config.json").read_text())
    model = load_init(args.init, device)
    cfg = model.config
    tok, codec = ByteTokenizer(), PixelCodec(cfg.image_token_downsample)

    t0 = time.time()
    e_ids, e_src, e_tgt = render_edit_pool(args.seed, args.edit_pool, args.workers, args.split_seed)
    etable, n_instr = edit_rows(cfg, tok)
    captions, t_pool = render_pool(args.seed, args.t2i_pool, args.workers)
    ttable, cap_id, n_caps = caption_rows(cfg, tok, captions)
    print(f"data: {len(e_ids)} edit pairs ({n_instr} instructions, rows of {etable.ids.shape[1]} tokens), "
          f"{len(captions)} text-to-image images ({n_caps} captions, rows of {ttable.ids.shape[1]} tokens) "
          f"({time.time() - t0:.1f}s)", flush=True)
    etable, e_ids, e_src, e_tgt = etable.to(device), e_ids.to(device), e_src.to(device), e_tgt.to(device)
    ttable, cap_id, t_pool = ttable.to(device), cap_id.to(device), t_pool.to(device)

    model.requires_grad_(True).train()
    ema = copy.deepcopy(model).requires_grad_(False).eval()
    params = list(model.parameters())
    ema_params = list(ema.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=args.weight_decay)
    print(f"model: {sum(p.numel() for p in params) / 1e6:.2f}M params on {device}; {args.steps} steps x "
          f"({args.edit_rows} edit + {args.t2i_rows} text-to-image rows)", flush=True)

    g = torch.Generator().manual_seed(args.seed + 1)  # data order, sigmas, dropout (CPU: device-independent)
    g_noise = torch.Generator(device=device).manual_seed(args.seed + 2)
    be, bt = args.edit_rows, args.t2i_rows
    history, run_e, run_t, t_start = [], 0.0, 0.0, time.time()
    t_log = t_start

    def evaluate_all(m, steps=cfg.default_steps, guidance=cfg.default_guidance):
        return (evaluate_edits(m, tok, codec, steps, guidance, split_seed=args.split_seed),
                evaluate_t2i(m, tok, codec, steps, guidance))

    for step in range(args.steps):
        # edit rows
        idx = torch.randint(len(e_ids), (be,), generator=g).to(device)
        drop = (torch.rand(be, generator=g) < args.p_uncond).to(device)
        sigma = shifted_sigma(torch.rand(be, generator=g), cfg.flow_shift).to(device)
        rows = etable.take(e_ids[idx] + drop.long() * n_instr)
        cond = codec.encode(cond_pixels(e_src[idx]))[:, None]
        x0 = codec.encode(e_tgt[idx].permute(0, 3, 1, 2).float() / 127.5 - 1.0)
        noise = torch.randn(x0.shape, generator=g_noise, device=device)
        x_t, target = flow_pair(x0, noise, sigma)
        loss_e = F.mse_loss(predict_velocity(model, rows, x_t, sigma * 1000.0, cond), target)
        # text-to-image rows (train-tiny's)
        loss_t = torch.zeros((), device=device)
        if bt:
            idx = torch.randint(len(captions), (bt,), generator=g).to(device)
            drop = (torch.rand(bt, generator=g) < args.p_uncond).to(device)
            sigma = shifted_sigma(torch.rand(bt, generator=g), cfg.flow_shift).to(device)
            rows = ttable.take(cap_id[idx] + drop.long() * n_caps)
            x0 = codec.encode(t_pool[idx].permute(0, 3, 1, 2).float() / 127.5 - 1.0)
            noise = torch.randn(x0.shape, generator=g_noise, device=device)
            x_t, target = flow_pair(x0, noise, sigma)
            loss_t = F.mse_loss(predict_velocity(model, rows, x_t, sigma * 1000.0), target)
        loss = (be * loss_e + bt * loss_t) / (be + bt)  # the mean over all rows

        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.warmup, args.lr)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        with torch.no_grad():
            decay = min(args.ema, (1.0 + step) / (10.0 + step))
            torch._foreach_lerp_(ema_params, params, 1.0 - decay)
        run_e, run_t = run_e + loss_e.detach(), run_t + loss_t.detach()

        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            n = args.log_every if (step + 1) % args.log_every == 0 else (step + 1) % args.log_every
            le, lt = float(run_e) / n, float(run_t) / n
            now = time.time()
            ms = (now - t_log) / n * 1000
            print(f"step {step + 1}/{args.steps} loss edit {le:.4f} t2i {lt:.4f} lr {opt.param_groups[0]['lr']:.2e} "
                  f"{ms:.1f} ms/step elapsed {now - t_start:.0f}s", flush=True)
            history.append({"step": step + 1, "loss_edit": le, "loss_t2i": lt, "ms_per_step": ms})
            run_e, run_t, t_log = 0.0, 0.0, now
        if not args.no_eval and args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            acc_e, acc_t = evaluate_all(ema)
            print(f"  eval step {step + 1}: edit {_fmt_edit(acc_e)}\n  eval step {step + 1}: t2i {_fmt(acc_t)}",
                  flush=True)
            history.append({"step": step + 1, "heldout_edit": acc_e, "heldout_t2i": acc_t})
            t_log = time.time()
        if args.time_limit and time.time() - t_start > args.time_limit and step + 1 < args.steps:
            print(f"time limit: stopped after {step + 1} of {args.steps} steps", flush=True)
            result_stopped = step + 1
            break
    else:
        result_stopped = None

    train_s = time.time() - t_start
    result = {"train_seconds": train_s, "device": str(device), "history": history, "args": vars(args),
              "stopped_at": result_stopped}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    print(f"trained {result_stopped or args.steps} steps in {train_s:.0f}s", flush=True)
    out = save(ema, args.out, args.save_dtype)
    write_config(out, init_raw, args.save_dtype)
    print(f"saved {out}", flush=True)
    if not args.no_eval:
        from ..models.hunyuan import load_checkpoint

        shipped = load_checkpoint(args.out, device=device, dtype=torch.float32)  # what was saved, as fp32
        result["heldout"] = {}
        pairs = [(cfg.default_steps, cfg.default_guidance)] + ([(8, 3.0), (16, 5.0)] if args.sweep else [])
        for st, gd in pairs:
            acc_e, acc_t = evaluate_all(shipped, st, gd)
            print(f"heldout steps={st} guidance={gd}: edit {_fmt_edit(acc_e)}\n"
                  f"heldout steps={st} guidance={gd}: t2i {_fmt(acc_t)}", flush=True)
            result["heldout"][f"steps={st},guidance={gd}"] = {"edit": acc_e, "t2i": acc_t}
    if args.metrics:
        Path(args.metrics).write_text(json.dumps(result, indent=1, default=str) + "\n")
    return result


def run(args) -> None:
    train(args)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ditkv.train.edit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    train(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
