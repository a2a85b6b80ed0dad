"""`ditkv train-tiny`: train the tiny HunyuanImage-3-architecture preset on the shapes dataset.

Recipe (defaults reproduce the shipped `ditkv/assets/tiny` weights' quality):
  * data: a pool of `--pool-size` ShapesDataset(seed) samples at 64x64 (train split, captions with
    dropped attributes); PixelCodec -> 48 x 16 x 16 latents = 256 image tokens per row;
  * rows: the exact inference rows (`build_request_layout`), full length
    (prefix + <timestep> + image tokens + <eoi>), HunyuanImage-3 mask (causal text, full image);
  * caption dropout: with p=`--p-uncond` the uncond row is used (prompt tokens -> <cfg>, one for one);
  * flow matching: sigma = shift(u), u ~ U(0, 1), shift = config.flow_shift (the sampler's shift);
    x_t = (1 - sigma) x0 + sigma * noise; target v = noise - x0 (the sampler integrates
    x <- x + (sigma_next - sigma) v from sigma = 1 to 0, so dx/dsigma = noise - x0);
  * loss: MSE on the image tokens' velocity; AdamW, warmup + cosine; EMA weights are saved.
Everything random comes from `--seed` (data order, noise, sigmas, dropout, init).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..argtypes import writable_dir, writable_file

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "assets" / "tiny"
IMAGE_SIZE = 64


def add_parser(sub) -> None:
    p = sub.add_parser("train-tiny", help="train the tiny model on synthetic shapes",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=str(DEFAULT_OUT), type=writable_dir, help="checkpoint folder to write")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:i]")
    p.add_argument("--seed", type=int, default=0, help="seed of the init, the rendered data and its order")
    p.add_argument("--steps", type=int, default=4500, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=256, help="rows per step")
    p.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate (warmup, then cosine decay)")
    p.add_argument("--warmup", type=int, default=300, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    p.add_argument("--ema", type=float, default=0.999, help="EMA decay of the saved weights")
    p.add_argument("--p-uncond", type=float, default=0.1, help="caption dropout (uncond row) rate")
    p.add_argument("--pool-size", type=int, default=32768, help="rendered training images")
    p.add_argument("--workers", type=int, default=0, help="render processes (0 = CPU count, max 16)")
    p.add_argument("--log-every", type=int, default=100, help="print the mean loss every N steps")
    p.add_argument("--eval-every", type=int, default=0, help="held-out accuracy every N steps (0 = end only)")
    p.add_argument("--no-eval", action="store_true", help="skip the held-out accuracy check")
    p.add_argument("--sweep", action="store_true", help="at the end, also score a few steps/guidance pairs")
    p.add_argument("--save-dtype", choices=["float32", "bfloat16"], default="bfloat16",
                   help="dtype of the saved weights")
    p.add_argument("--metrics", default=None, type=writable_file,
                   help="write step/loss/accuracy history here (JSON; default: not written)")


# ------------------------------------------------------------------------------ data
def _render_chunk(job: tuple[int, int, int, int]) -> tuple[list[str], np.ndarray]:
    from ..data import ShapesDataset

    seed, n, lo, hi = job
    ds = ShapesDataset(seed, n, size=IMAGE_SIZE)
    caps, imgs = [], np.empty((hi - lo, IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
    for j, i in enumerate(range(lo, hi)):
        cap, _, img = ds.sample(i)
        caps.append(cap)
        imgs[j] = img
    return caps, imgs


def render_pool(seed: int, n: int, workers: int) -> tuple[list[str], torch.Tensor]:
    """(captions, uint8 [n, 64, 64, 3]); each item depends only on (seed, index), not on workers."""
    chunk = 1024
    jobs = [(seed, n, lo, min(lo + chunk, n)) for lo in range(0, n, chunk)]
    workers = workers or min(os.cpu_count() or 1, 16)
    if workers > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(workers) as ex:
            parts = list(ex.map(_render_chunk, jobs))
    else:
        parts = [_render_chunk(j) for j in jobs]
    caps = [c for p in parts for c in p[0]]
    return caps, torch.from_numpy(np.concatenate([p[1] for p in parts]))


def caption_rows(cfg, tokenizer, captions: list[str]):
    """Row table of the unique captions: ids [0, U) are cond rows, [U, 2U) their uncond rows."""
    from ..models.hunyuan.layout import build_request_layout
    from .batch import build_row_table

    uniq = sorted(set(captions))
    lay = [build_request_layout(cfg, tokenizer, c, IMAGE_SIZE, IMAGE_SIZE, guidance_scale=2.0) for c in uniq]
    rows = [x.rows[0] for x in lay] + [x.rows[1] for x in lay]
    table = build_row_table(rows, lay[0].h, lay[0].w, cfg.pad_token_id)
    index = {c: i for i, c in enumerate(uniq)}
    return table, torch.tensor([index[c] for c in captions], dtype=torch.long), len(uniq)


# -------------------------------------------------------------------------- training
def shifted_sigma(u: torch.Tensor, shift: float) -> torch.Tensor:
    """The sampler's time shift applied to uniform u: s*u / (1 + (s-1)*u)."""
    return shift * u / (1.0 + (shift - 1.0) * u)


def flow_pair(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor):
    """(x_t, target velocity) on the straight path: x_t = (1 - sigma) x0 + sigma noise, v = noise - x0.

    Sign check: the sampler steps x <- x + (sigma_next - sigma) v with sigma falling 1 -> 0, and
    d x_t / d sigma = noise - x0, so integrating this v from pure noise lands on x0."""
    s = sigma.reshape(-1, *([1] * (x0.dim() - 1)))
    return (1.0 - s) * x0 + s * noise, noise - x0


def lr_at(step: int, total: int, warmup: int, peak: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac)))  # cosine to 10%


def evaluate(model, tokenizer, codec, steps: int, guidance: float, seeds_per_caption: int = 1) -> dict:
    """Held-out accuracy (full captions never trained on) with the batched dense sampler."""
    from ..data import accuracy, heldout_specs
    from .batch import sample_dense

    specs = list(heldout_specs()) * seeds_per_caption
    caps = [s.caption() for s in specs]
    images = []
    for lo in range(0, len(caps), 128):  # 128 captions = 256 CFG rows per batch
        chunk = caps[lo:lo + 128]
        x = sample_dense(model, tokenizer, chunk, steps, guidance, list(range(lo, lo + len(chunk))))
        images.extend(codec.decode(x.to(model.dtype)).float().clamp(-1, 1).cpu())
    return accuracy(images, specs)


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def train(args) -> dict:
    from ..models.hunyuan import ByteTokenizer, HunyuanImage3Config, HunyuanImage3Model, PixelCodec
    from .batch import predict_velocity

    device = _device(args.device)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 weights, TF32 matmuls: fast and stable
        torch.backends.cudnn.allow_tf32 = True
    cfg = HunyuanImage3Config.tiny()
    tok, codec = ByteTokenizer(), PixelCodec(cfg.image_token_downsample)

    t0 = time.time()
    captions, pool = render_pool(args.seed, args.pool_size, args.workers)
    table, cap_id, n_caps = caption_rows(cfg, tok, captions)
    print(f"data: {len(captions)} images, {n_caps} captions, rows of {table.ids.shape[1]} tokens "
          f"({time.time() - t0:.1f}s)", flush=True)
    table, cap_id, pool = table.to(device), cap_id.to(device), pool.to(device)

    model = HunyuanImage3Model.from_config(cfg, seed=args.seed).to(device)
    model.requires_grad_(True).train()
    ema = copy.deepcopy(model).requires_grad_(False).eval()
    params = [p for p in model.parameters()]
    ema_params = list(ema.parameters())
    # lm_head and ln_f get no gradient (no text loss): AdamW skips them, they stay at init.
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=args.weight_decay)
    print(f"model: {sum(p.numel() for p in params) / 1e6:.2f}M params on {device}; "
          f"{args.steps} steps x {args.batch_size} rows", flush=True)

    g = torch.Generator().manual_seed(args.seed + 1)  # data order, sigmas, dropout (CPU: device-independent)
    g_noise = torch.Generator(device=device).manual_seed(args.seed + 2)
    history, running, t_start = [], 0.0, time.time()
    t_log = t_start
    for step in range(args.steps):
        b = args.batch_size
        idx = torch.randint(len(captions), (b,), generator=g).to(device)
        drop = (torch.rand(b, generator=g) < args.p_uncond).to(device)
        sigma = shifted_sigma(torch.rand(b, generator=g), cfg.flow_shift).to(device)
        rows = table.take(cap_id[idx] + drop.long() * n_caps)
        img = pool[idx].permute(0, 3, 1, 2).float() / 127.5 - 1.0
        x0 = codec.encode(img)
        noise = torch.randn(x0.shape, generator=g_noise, device=device)
        x_t, target = flow_pair(x0, noise, sigma)
        pred = predict_velocity(model, rows, x_t, sigma * 1000.0)
        loss = F.mse_loss(pred, target)

        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.warmup, args.lr)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        with torch.no_grad():
            decay = min(args.ema, (1.0 + step) / (10.0 + step))  # short memory early on
            torch._foreach_lerp_(ema_params, params, 1.0 - decay)
        running = running + loss.detach()  # summed on the device: no per-step sync

        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            n = args.log_every if (step + 1) % args.log_every == 0 else (step + 1) % args.log_every
            avg = float(running) / n
            now = time.time()
            ms = (now - t_log) / n * 1000
            print(f"step {step + 1}/{args.steps} loss {avg:.4f} lr {opt.param_groups[0]['lr']:.2e} "
                  f"{ms:.1f} ms/step elapsed {now - t_start:.0f}s", flush=True)
            history.append({"step": step + 1, "loss": avg, "ms_per_step": ms})
            running, t_log = 0.0, now
        if not args.no_eval and args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            acc = evaluate(ema, tok, codec, cfg.default_steps, cfg.default_guidance)
            print(f"  eval step {step + 1}: {_fmt(acc)}", flush=True)
            history.append({"step": step + 1, "heldout": acc})
            t_log = time.time()

    train_s = time.time() - t_start
    result = {"train_seconds": train_s, "device": str(device), "history": history, "args": vars(args)}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    print(f"trained {args.steps} steps in {train_s:.0f}s", flush=True)
    out = save(ema, args.out, args.save_dtype)
    print(f"saved {out}", flush=True)
    if not args.no_eval:
        # Score what was shipped: the saved (possibly bf16-rounded) weights, as fp32.
        from ..models.hunyuan import load_checkpoint

        shipped = load_checkpoint(args.out, device=device, dtype=torch.float32)
        pairs = [(cfg.default_steps, cfg.default_guidance)]
        if args.sweep:
            pairs += [(s, gd) for s in (8, 16) for gd in (3.0, 5.0, 7.0) if (s, gd) != pairs[0]]
        result["heldout"] = {}
        for st, gd in pairs:
            acc = evaluate(shipped, tok, codec, st, gd)
            print(f"heldout steps={st} guidance={gd}: {_fmt(acc)}", flush=True)
            result["heldout"][f"steps={st},guidance={gd}"] = acc
    if args.metrics:
        Path(args.metrics).write_text(json.dumps(result, indent=1, default=str) + "\n")
    return result


def save(model, out: str | Path, dtype_name: str) -> Path:
    """EMA weights -> checkpoint folder; bf16 halves the size (router stays fp32, as at load)."""
    from ..models.hunyuan import save_checkpoint

    export = copy.deepcopy(model).cpu()
    if dtype_name == "bfloat16":
        export = export.to(torch.bfloat16)
        for layer in export.model.layers:
            layer.mlp.gate.float()
    export.config = export.config.replace(torch_dtype=dtype_name)
    out = Path(out)
    save_checkpoint(export, out)
    return out


def _fmt(acc: dict) -> str:
    return " ".join(f"{k}={v:.3f}" for k, v in acc.items() if k != "n") + f" (n={acc['n']})"


def run(args) -> None:
    train(args)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ditkv.train.tiny", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    train(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
