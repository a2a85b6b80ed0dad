"""`ditkv train-text-head`: fit ln_f + lm_head of a checkpoint so the AR stage (`ARRunner.run`,
`max_new_tokens > 0`) completes captions; every other tensor stays byte-identical.

The AR prefills `<bos> prompt`, decodes greedily (or sampled) from the last hidden state, stops at
`<eos>` and appends the bytes to the DiT prompt. So the rows are `<bos> caption <eos>`, causal over
text only, with the train split's ShapesDataset caption distribution enumerated exactly (held-out
combinations never occur). The trunk is frozen: its states are computed once (checked against
the AR runner's prefill + decode); equal prefixes have equal states, so the loss is a soft-target
cross-entropy per unique prefix weighted by frequency (= next-token CE over text positions).
Full-batch AdamW, lm_head re-initialised from `--seed`: deterministic."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

import torch

from ..argtypes import writable_dir, writable_file

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "assets" / "tiny"
HEAD_KEYS = ("model.ln_f.weight", "lm_head.weight")


def add_parser(sub) -> None:
    p = sub.add_parser("train-text-head", help="train the text head (AR caption completion) of a checkpoint",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="checkpoint folder to read")
    p.add_argument("--out", default=None, type=writable_dir, help="checkpoint folder to write (default: --model, in place)")
    p.add_argument("--no-save", action="store_true", help="train and evaluate only")
    p.add_argument("--seed", type=int, default=0, help="seed of the lm_head re-initialisation")
    p.add_argument("--steps", type=int, default=300, help="full-batch optimizer steps")
    p.add_argument("--lr", type=float, default=0.02, help="AdamW learning rate")
    p.add_argument("--max-new-tokens", type=int, default=40, help="AR budget of the completion eval")
    p.add_argument("--metrics", default=None, type=writable_file,
                   help="write the numbers here (JSON; default: not written)")


def caption_distribution() -> dict[str, float]:
    """caption -> probability under ShapesDataset(holdout=False) (same drop rule, no sampling)."""
    from ..data import DROP_PROBS, heldout_specs, train_specs

    held, pool, fields = set(heldout_specs()), train_specs(), list(DROP_PROBS)
    dist: dict[str, float] = {}
    for full in pool:
        for mask in itertools.product((False, True), repeat=len(fields)):
            p = 1.0 / len(pool)
            for f, drop in zip(fields, mask):
                p *= DROP_PROBS[f] if drop else 1.0 - DROP_PROBS[f]
            spec = replace(full, **{f: None for f, d in zip(fields, mask) if d})
            if spec.resolved() in held:
                spec = full  # as ShapesDataset: defaults would recreate a held-out combination
            cap = spec.caption()
            dist[cap] = dist.get(cap, 0.0) + p
    return dist


def text_row(cfg, tok, caption: str) -> list[int]:
    return [cfg.bos_token_id, *tok.encode(caption), cfg.eos_token_id]


@torch.no_grad()
def trunk_hidden(model, rows: list[list[int]], batch: int = 256) -> list[torch.Tensor]:
    """Last hidden states (before ln_f) of causal text-only rows, [len(row), hidden] each."""
    from .batch import RowAttention

    out = []
    scale = 1.0 / math.sqrt(model.config.attention_head_dim)
    for lo in range(0, len(rows), batch):
        chunk = rows[lo:lo + batch]
        length = max(len(r) for r in chunk)
        ids = torch.full((len(chunk), length), model.config.pad_token_id, dtype=torch.long)
        for i, r in enumerate(chunk):
            ids[i, :len(r)] = torch.tensor(r)
        pos = torch.arange(length).repeat(len(chunk), 1)  # pads sit after the row: never attended
        h = model.backbone(model.embed_tokens(ids.reshape(-1)), pos.reshape(-1), pos.reshape(-1),
                           RowAttention(pos + 1, scale)).view(len(chunk), length, -1)
        out.extend(h[i, :len(r)].float() for i, r in enumerate(chunk))
    return out


def prefix_targets(rows: list[list[int]], weights: list[float], hidden: list[torch.Tensor], vocab: int):
    """Unique prefixes' states [P, H] and their weighted next-token counts [P, vocab]."""
    index: dict[tuple, int] = {}
    states, targets = [], []
    for r, w, h in zip(rows, weights, hidden):
        for t in range(1, len(r)):
            key = tuple(r[:t])
            if key not in index:
                index[key] = len(states)
                states.append(h[t - 1])
                targets.append(torch.zeros(vocab, dtype=torch.float64))
            targets[index[key]][r[t]] += w
    return torch.stack(states), torch.stack(targets).float()


def check_against_ar(model, rows: list[list[int]], hidden: list[torch.Tensor], atol: float = 1e-4) -> float:
    """The AR runner's own prefill + one decode step give the states used for training."""
    runner = ar_runner(model)
    worst = 0.0
    with torch.inference_mode():
        for r, h in zip(rows, hidden):
            k = len(r) - 1
            pre = runner._forward(r[:k], 0, list(range(runner.pool.num_blocks)))  # noqa: SLF001
            dec = runner._forward([r[k]], k, list(range(runner.pool.num_blocks)))  # noqa: SLF001
            worst = max(worst, float((pre - h[k - 1]).abs().max()), float((dec - h[k]).abs().max()))
    if worst > atol:
        raise AssertionError(f"training states differ from the AR runner's by {worst:.2e}")
    return worst


def train_head(model, states: torch.Tensor, targets: torch.Tensor, steps: int, lr: float, seed: int,
               log_every: int = 100) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Full-batch AdamW on (ln_f, lm_head); the model itself is not modified. Returns fp32 weights."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    ln_w = torch.ones(cfg.hidden_size, requires_grad=True)
    head_w = (torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 0.02).requires_grad_(True)
    eps = getattr(model.model.ln_f, "eps", cfg.rms_norm_eps)
    normed = states * torch.rsqrt(states.pow(2).mean(-1, keepdim=True) + eps)  # = ln_f without its scale
    total = targets.sum()
    opt = torch.optim.AdamW([ln_w, head_w], lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    losses = []
    flush = torch.set_flush_denormal(True)  # tiny softmax tails turn denormal: 10x slower steps on CPU
    try:
        for step in range(steps):
            logp = torch.log_softmax((normed * ln_w) @ head_w.T, dim=-1)
            loss = -(targets * logp).sum() / total
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if log_every and ((step + 1) % log_every == 0 or step == 0):
                print(f"step {step + 1}/{steps} loss {losses[-1]:.4f}", flush=True)
    finally:
        if flush:
            torch.set_flush_denormal(False)
    return {"model.ln_f.weight": ln_w.detach(), "lm_head.weight": head_w.detach()}, losses


@torch.no_grad()
def install_head(model, head: dict[str, torch.Tensor], dtype=torch.bfloat16) -> None:
    """Put the head into `model`, rounded through the checkpoint's storage dtype (what ships)."""
    model.model.ln_f.weight.copy_(head["model.ln_f.weight"].to(dtype))
    model.lm_head.weight.copy_(head["lm_head.weight"].to(dtype))


def ar_runner(model, blocks: int = 8, block_size: int = 16):
    from ..attention.torch_backend import TorchBackend
    from ..worker.ar_runner import ARRunner
    from ..worker.page_pool import PagePool

    c = model.config
    pool = PagePool(blocks, c.num_hidden_layers, c.num_key_value_heads, block_size, c.attention_head_dim,
                    model.dtype, model.device)
    return ARRunner(model, TorchBackend(), pool)


def is_caption(text: str) -> bool:
    """Exactly a caption of the grammar `a [size] [color] <shape>[ in the <position>]`."""
    from ..data import parse_caption

    try:
        return parse_caption(text).caption() == text
    except ValueError:
        return False


def complete(model, tok, prompts: list[str], max_new_tokens: int, runner=None) -> list[tuple[str, bool]]:
    """Greedy completion through the real AR runner -> (prompt + generated text, ended with eos)."""
    from ..models.hunyuan.layout import image_tail_ids
    from ..models.hunyuan.tokenizer import banned_generation_ids
    from ..models.text_settings import TextSampling

    c = model.config
    need = -(-(max(len(p) for p in prompts) + 1 + max_new_tokens + 3) // 16)
    runner = runner or ar_runner(model, blocks=need)
    out = []
    for p in prompts:
        res = runner.run("eval", [c.bos_token_id, *tok.encode(p)], image_tail_ids(c, 64, 64), list(range(need)),
                         TextSampling(max_new_tokens=max_new_tokens), c.eos_token_id, banned_generation_ids(c))
        out.append((p + tok.decode(res.generated_ids), len(res.generated_ids) < max_new_tokens))
    return out


def cut_after_color(spec) -> str:
    """'a large blue square in the top left' -> 'a large blue'."""
    return replace(spec, position=None).caption().rsplit(" ", 1)[0]


def evaluate(model, tok, max_new_tokens: int) -> dict:
    """Held-out next-token accuracy (AR's banned ids masked) and completion accuracy."""
    from ..data import heldout_specs
    from ..models.hunyuan.tokenizer import banned_generation_ids

    c, specs = model.config, heldout_specs()
    rows = [text_row(c, tok, s.caption()) for s in specs]
    banned = torch.tensor(sorted(banned_generation_ids(c)))
    hit = n = 0
    for r, h in zip(rows, trunk_hidden(model, rows)):
        logits = model.logits(h[:-1].to(model.dtype)).float()
        logits[:, banned] = float("-inf")
        hit += int((logits.argmax(-1) == torch.tensor(r[1:])).sum())
        n += len(r) - 1
    prompts = [cut_after_color(s) for s in specs]
    done = complete(model, tok, prompts, max_new_tokens)
    ok = [eos and is_caption(text) for text, eos in done]
    fails = [f"{p!r} -> {text!r}" + ("" if eos else " (no eos)") for p, (text, eos), k in zip(prompts, done, ok)
             if not k]
    return {"next_token_acc": hit / n, "next_token_n": n, "completion_acc": sum(ok) / len(ok),
            "completion_n": len(ok), "completions": [t for t, _ in done], "failures": fails}


def write_head(src: str | Path, out: str | Path, head: dict[str, torch.Tensor]) -> list[Path]:
    """Copy checkpoint `src` to `out` (may be the same folder) with only the head tensors replaced,
    in each tensor's stored dtype; every other tensor is written back unchanged."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from ..models.hunyuan.checkpoint import INDEX_NAME

    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weight_map = json.loads((src / INDEX_NAME).read_text())["weight_map"]
    written = []
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name not in set(weight_map.values()) and src.resolve() != out.resolve():
            shutil.copy2(f, out / f.name)
    for name in sorted(set(weight_map.values())):
        keys = [k for k in HEAD_KEYS if weight_map.get(k) == name]
        if not keys:
            if src.resolve() != out.resolve():
                shutil.copy2(src / name, out / name)
            continue
        with safe_open(str(src / name), "pt") as fh:
            meta = fh.metadata()
        shard = load_file(str(src / name))
        for k in keys:
            shard[k] = head[k].to(shard[k].dtype).contiguous()
        tmp = out / (name + ".tmp")
        save_file(shard, str(tmp), metadata=meta)
        shutil.copymode(src / name, tmp)
        os.replace(tmp, out / name)
        written.append(out / name)
    return written


def train(args) -> dict:
    from ..models.hunyuan import load_checkpoint, load_tokenizer

    torch.manual_seed(args.seed)
    model, tok = load_checkpoint(args.model, dtype=torch.float32), load_tokenizer(args.model)
    c = model.config
    t0 = time.time()
    dist = caption_distribution()
    caps = sorted(dist)
    rows = [text_row(c, tok, s) for s in caps]
    hidden = trunk_hidden(model, rows)
    worst = check_against_ar(model, rows[:: max(1, len(rows) // 4)], hidden[:: max(1, len(rows) // 4)])
    states, targets = prefix_targets(rows, [dist[s] for s in caps], hidden, c.vocab_size)
    t_data = time.time() - t0
    print(f"data: {len(caps)} train captions, {len(states)} unique prefixes, trunk states in {t_data:.1f}s "
          f"(max diff vs AR runner {worst:.1e})", flush=True)
    head, losses = train_head(model, states, targets, args.steps, args.lr, args.seed)
    t_train = time.time() - t0
    install_head(model, head)
    result = {"train_seconds": t_train, "final_loss": losses[-1], "captions": len(caps),
              "prefixes": len(states), **evaluate(model, tok, args.max_new_tokens)}
    print(f"trained in {t_train:.1f}s; held-out next-token accuracy {result['next_token_acc']:.3f} "
          f"(n={result['next_token_n']}), completion accuracy {result['completion_acc']:.3f} "
          f"(n={result['completion_n']})", flush=True)
    for f in result["failures"]:
        print("  miss:", f)
    if not args.no_save:
        out = args.out or args.model
        print("saved", *write_head(args.model, out, {k: v.to(torch.bfloat16) for k, v in head.items()}))
    if args.metrics:
        Path(args.metrics).write_text(json.dumps({**result, "args": vars(args)}, indent=1, default=str) + "\n")
    return result


def run(args) -> None:
    train(args)


if __name__ == "__main__":  # python -m ditkv.train.text_head
    p = argparse.ArgumentParser(prog="python -m ditkv.train.text_head", description=__doc__)
    add_arguments(p)
    train(p.parse_args())
