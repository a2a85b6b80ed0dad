"""`ditkv bench prefix`: the cross-request prefix cache on vs off, per workload (docs/prefix-cache.md).

Each case runs twice over:

- **engine** (CPU fp32, a bundled tiny model): each request alone through a cache-off and a cache-on
  `Engine` in turn (A/B in one process, the order swapped every request). Time to the first denoise step
  per request = from `add_request` (layout and block keys included) to the end of the engine step that
  admits it and runs its first step (the prefill). The images with the cache on must equal the cache
  off bit for bit.
- **release** (control plane only, HunyuanImage-3 release KV geometry, as `ditkv bench capacity`): the
  case's requests at release sizes, each built by the real layout builder and keyed by the real
  `prefix_block_keys`, arrive one after another (each after the previous one's first step, so its
  pages are cached: the "iterate on an edit" pattern) into a `DiffusionKVCacheManager` of the byte
  budget; none finishes. Requests held at once = how many are admitted before one does not fit (or
  `--max-num-seqs` are running). Also: the pool pages that hold all of the case's requests at once.

Cases (`CASES`, name -> `Case`; a new workload adds an entry):

- `edits`: edits of one input image, one seed, a different prompt each (tiny-edit model);
- `system`: text-to-image requests behind one ~1k-token system prompt (tiny model);
- `think`: requests with an AR phase behind one shared system prompt (tiny model, engine run only:
  `prefix_think.think_case`).
- `think-edits`: the same, every request also editing one input image with one seed (tiny-edit): the
  AR head holds the image before the text, so its pages hit too (`think_case(edits=True)`).

    ditkv bench prefix                      # both cases, 16 requests each, a table then the JSON
    ditkv bench prefix --cases edits --json
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .. import argtypes as at
from ..errors import ConfigError
from .capacity import KV_BYTES_PER_TOKEN
from .common import emit, machine
from .prefix_engine import run_engine

GOAL_HELD_RATIO = 2.0  # issue 36: requests held at once, 16 edits of one image, >= 2x the cache off
GOAL_SAVED_OVER_SHARE = 0.9  # issue 36: first-step time saved >= 0.9 x the shared share (system prompt)
# a shared system text of about 1k tokens (byte tokenizer: one token per character)
SYSTEM = ("You are a careful illustrator working for a picture book. Draw exactly what the request asks, with "
          "flat colours, clean dark outlines, a plain light background, soft even light and no text. ") * 6
EDIT_PROMPTS = ["make it blue", "make it red and bigger", "move it to the top left", "make it a square",
                "paint it green", "make it much smaller", "turn it into a circle", "move it to the right",
                "make it yellow", "put it in the centre", "make it purple", "give it a thick border",
                "make it orange", "move it down a little", "make it dark grey", "make it twice as wide"]


@dataclass(frozen=True)
class Case:
    """One workload. `tiny(args, n)` -> (model name, bundle changes (a callable on the loaded config, or
    None), GenerationRequests) for the engine run; `release(args, n)` -> (config, per request (layout, seed))
    at release geometry for the control-plane run (None: no such run). `engine(args)`: an engine run of
    its own instead of `tiny`'s (its result dict)."""

    help: str
    tiny: Callable | None
    release: Callable | None
    engine: Callable | None = None


def _edit_image(h: int, w: int, seed: int = 3) -> np.ndarray:
    """One input image (a small square on a plain background, what tiny-edit was trained on)."""
    a = np.full((h, w, 3), 240, dtype=np.uint8)
    r = np.random.default_rng(seed)
    y, x = r.integers(h // 8, h // 2), r.integers(w // 8, w // 2)
    a[y:y + h // 4, x:x + w // 4] = r.integers(0, 256, 3, dtype=np.uint8)
    return a


def _prompts(n: int) -> list[str]:
    return [EDIT_PROMPTS[i % len(EDIT_PROMPTS)] + (f" (variant {i // len(EDIT_PROMPTS)})" if i >= len(EDIT_PROMPTS)
                                                   else "") for i in range(n)]


def _edits_tiny(args, n: int):
    from ..engine.types import GenerationRequest

    size = args.size
    img = _edit_image(size, size)
    return "tiny-edit", None, [
        GenerationRequest(prompt=p, request_id=f"edit{i}", height=size, width=size, steps=args.steps,
                          guidance_scale=2.0, seed=5, images=[img]) for i, p in enumerate(_prompts(n))]


def _release_cfg(**changes):
    from ..models.hunyuan import HunyuanImage3Config

    return HunyuanImage3Config.release().replace(**changes)


# the release Instruct's vision encoder (SigLIP2 so400m, patch 16, naflex at up to 1024 patches): only its
# token count matters here (the layout, not the weights)
RELEASE_VIT = {"vit": {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
                       "num_attention_heads": 16, "num_patches": 256, "patch_size": 16},
               "vit_aligner": {"input_dim": 1152, "n_embed": 4096, "projector_type": "mlp_gelu", "depth": 2},
               "vit_processor": {"patch_size": 16, "max_num_patches": 1024}}


def _edits_release(args, n: int):
    from ..models.hunyuan import ByteTokenizer
    from ..models.hunyuan.layout import build_request_layout

    # a 1024^2 input: 4096 latent tokens, <joint_img_sep>, 1024 vision tokens, before the prompt. The byte
    # tokenizer has no <joint_img_sep>: 299, the first id after its specials
    cfg = _release_cfg(max_input_images=1, extra=RELEASE_VIT, joint_img_sep_token_id=299)
    img, tok = _edit_image(1024, 1024), ByteTokenizer()
    return cfg, [(build_request_layout(cfg, tok, p, 1024, 1024, 5.0, images=[img]), 5) for p in _prompts(n)]


def _with_system(text: str):
    return lambda cfg: cfg.replace(extra={**cfg.extra, "use_system_prompt": "custom", "system_prompt": text})


def _system_text(tokens: int) -> str:
    return (SYSTEM * (tokens // len(SYSTEM) + 1))[:tokens]


def _system_tiny(args, n: int):
    from ..engine.types import GenerationRequest

    size = args.size
    return "tiny", _with_system(_system_text(args.system_tokens)), [
        GenerationRequest(prompt=f"request {i}: {p}", request_id=f"sys{i}", height=size, width=size,
                          steps=args.steps, guidance_scale=2.0, seed=i)
        for i, p in enumerate(_prompts(n))]


def _system_release(args, n: int):
    from ..models.hunyuan import ByteTokenizer
    from ..models.hunyuan.layout import build_request_layout

    cfg = _with_system(_system_text(args.system_tokens))(_release_cfg())
    tok = ByteTokenizer()
    return cfg, [(build_request_layout(cfg, tok, f"request {i}: {p}", 1024, 1024, 5.0), i)
                 for i, p in enumerate(_prompts(n))]


def _nohit_tiny(args, n: int):
    """Requests that share nothing: each prompt begins with its own number, no system prompt, so no
    full page of one request equals another's (the cost of the cache where it never hits)."""
    from ..engine.types import GenerationRequest

    size = args.size
    return "tiny", None, [
        GenerationRequest(prompt=f"{i:03d} {p}", request_id=f"nohit{i}", height=size, width=size,
                          steps=args.steps, guidance_scale=2.0, seed=i)
        for i, p in enumerate(_prompts(n))]


def _think(args) -> dict:
    from .prefix_think import think_case

    return think_case(n=args.requests, size=args.size, steps=args.steps)


def _think_edits(args) -> dict:
    from .prefix_think import think_case

    return think_case(n=args.requests, size=args.size, steps=args.steps, edits=True)


CASES: dict[str, Case] = {
    "edits": Case("edits of one input image, one seed, a prompt each (tiny-edit)", _edits_tiny, _edits_release),
    "system": Case("text-to-image behind one ~1k-token system prompt (tiny)", _system_tiny, _system_release),
    "nohit": Case("requests that share no page (distinct prompts, no system prompt; the cache's cost, goal >= "
                  "0.98 on/off)", _nohit_tiny, None),
    "think": Case("requests with an AR phase (16 text tokens) behind one shared system prompt (tiny; engine run "
                  "only: bench_prefix_think.think_case)", None, None, _think),
    "think-edits": Case("think requests editing one input image with one seed, behind the same shared text "
                        "(tiny-edit; engine run only: think_case(edits=True))", None, None, _think_edits),
}


def add_arguments(p):
    p.add_argument("--cases", type=_case_list, default=",".join(CASES),
                   help=f"comma-separated cases: {', '.join(f'{k} ({c.help})' for k, c in CASES.items())}")
    p.add_argument("--requests", type=at.positive_int, default=16, help="requests per case")
    p.add_argument("--steps", type=at.positive_int, default=None,
                   help="denoising steps per request (engine run; default 2, 3 with --geometry release: its second "
                        "step is timed as a denoise step for the prefix-prefill measure)")
    p.add_argument("--size", type=at.positive_int, default=None,
                   help="engine run: image side in px (the edits' input image too; default 64, 1024 with "
                        "--geometry release)")
    p.add_argument("--geometry", choices=("tiny", "release"), default="tiny",
                   help="engine run: the bundled tiny models on the CPU in fp32, or the release architecture with "
                        "random weights (--layers, --quantization, --device; cases system and nohit)")
    p.add_argument("--layers", type=at.positive_int, default=4, help="--geometry release: decoder layers")
    p.add_argument("--quantization", choices=("fp8",), default=None,
                   help="--geometry release: FP8 W8A8 weights (default: none, the device's bf16)")
    p.add_argument("--device", default="auto", help="--geometry release: where the model runs (auto: cuda if any)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="--geometry release: the engine's batch_invariant mode (on == off bit for bit on a GPU)")
    p.add_argument("--shrink", action="store_true",
                   help="--geometry release: the release structure at toy widths (a CPU check of the path)")
    p.add_argument("--system-tokens", type=at.positive_int, default=1000,
                   help="the system case's shared text, in tokens (characters: the byte tokenizer)")
    p.add_argument("--budget-gib", type=at.positive_float, default=64.0,
                   help="release run: KV byte budget (GiB) per rank, as bench capacity")
    p.add_argument("--block-size", type=at.positive_int, default=64,
                   help="page size in tokens: the release runs (the tiny engine run uses 16)")
    p.add_argument("--max-num-seqs", type=at.positive_int, default=256,
                   help="release run: most requests running at once (the engine's max_num_seqs)")
    p.add_argument("--skip-engine", action="store_true", help="only the release (control-plane) run")
    p.add_argument("--json", action="store_true", help="print one JSON object only (else a table, then the JSON)")


def _case_list(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in CASES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown case(s) {bad or text!r}: give a comma-separated list of "
                                         f"{', '.join(CASES)}")
    return names


# ---- release geometry (control plane) ------------------------------------------------------------
def _admit(cfg, items, args, cache: bool, blocks: int, cap: int, commit: bool = True) -> tuple[int, object]:
    """Requests admitted one after another, each committing its prefix (as after its first step; not with
    `commit=False`: all arrive in one tick, before any first step), until one does not fit in `blocks`
    pages or `cap` run -> (how many, the manager)."""
    from ..core.kv_manager import DiffusionKVCacheManager
    from ..core.layout import RowLayout
    from ..models.hunyuan.prefix_keys import prefix_block_keys

    mgr = DiffusionKVCacheManager(blocks, args.block_size, 2, prefix_caching=cache)
    held = 0
    for i, (layout, seed) in enumerate(items[:cap]):
        keys = prefix_block_keys(cfg, layout, seed, args.block_size) if cache else None
        if mgr.reserve_request(f"r{i}", RowLayout.of(layout), prefix_keys=keys) is None:
            break
        if commit:
            mgr.commit_prefix(f"r{i}")
        held += 1
    return held, mgr


def run_release(case: Case, args) -> dict:
    budget = int(args.budget_gib * (1 << 30))
    blocks = budget // (args.block_size * KV_BYTES_PER_TOKEN)
    cfg, probe = case.release(args, 1)
    per_request = sum(-(-r.seq_len // args.block_size) for r in probe[0][0].rows)
    if per_request > blocks:
        need = per_request * args.block_size * KV_BYTES_PER_TOKEN / (1 << 30)
        raise ConfigError("budget_gib", args.budget_gib, f"holds {blocks} pages, one request needs {per_request}: "
                          f"give at least {need:.2f} GiB")
    # enough requests to fill the pool even at 4x fewer pages per request, so "held at once" is the
    # pool's (or max_num_seqs') limit, not the trace's
    cfg, items = case.release(args, max(args.requests, min(args.max_num_seqs, 4 * blocks // per_request + 2)))
    out = {"pool_blocks": blocks, "block_size": args.block_size, "budget_bytes": budget,
           "max_num_seqs": args.max_num_seqs, "seq_len_per_row": probe[0][0].rows[0].seq_len,
           "prefix_len_per_row": probe[0][0].rows[0].prefix_len, "rows_per_request": len(probe[0][0].rows),
           "requests_in_trace": len(items)}
    for cache, tag in ((False, "off"), (True, "on")):
        held, mgr = _admit(cfg, items, args, cache, blocks, args.max_num_seqs)
        out[f"held_{tag}"] = held
        out[f"hit_tokens_{tag}"] = mgr.cache_hit_tokens
        # the pages the first `requests` need together: the pool size that holds them all at once
        whole = sum(-(-r.seq_len // args.block_size) for layout, _ in items[:args.requests] for r in layout.rows)
        n, mgr = _admit(cfg, items, args, cache, whole, args.requests)
        if n != args.requests:
            raise RuntimeError(f"a pool of {whole} pages held {n} of {args.requests} requests that need at most that")
        out[f"blocks_for_requests_{tag}"] = mgr.pool.num_used
        out[f"shared_rows_tokens_{tag}"] = mgr.shared_row_tokens
        # the same requests arriving in one tick: nothing cached yet, only a request's own rows share
        n, mgr = _admit(cfg, items, args, cache, whole, args.requests, commit=False)
        out[f"blocks_for_requests_one_tick_{tag}"] = mgr.pool.num_used
        out[f"held_one_tick_{tag}"] = _admit(cfg, items, args, cache, blocks, args.max_num_seqs, commit=False)[0]
    out["held_ratio"] = out["held_on"] / out["held_off"] if out["held_off"] else float("inf")
    out["trace_exhausted"] = out["held_on"] == len(items) < args.max_num_seqs  # held_on is then a lower bound
    return out


def run(args) -> dict:
    release = args.geometry == "release"
    args.size = args.size or (1024 if release else 64)
    args.steps = args.steps or (3 if release else 2)
    if args.geometry == "release" and not args.skip_engine:
        from .prefix_release import check_case, check_device

        for name in args.cases:
            check_case(name)
        check_device(args)
    result = {"cases": {}, "goal_held_ratio_edits": GOAL_HELD_RATIO,
              "goal_saved_over_share_system": GOAL_SAVED_OVER_SHARE, "machine": machine()}
    table = []
    for name in args.cases:
        case = CASES[name]
        res = {"release": run_release(case, args)} if case.release is not None else {}
        if not args.skip_engine:
            res["engine"] = case.engine(args) if case.engine is not None else run_engine(case, args)
        result["cases"][name] = res
        table.append(_table_row(name, res, args.requests))
    columns = list(dict.fromkeys(k for row in table for k in row))  # the think case has columns of its own
    emit(result, args.json, [{k: row.get(k, "") for k in columns} for row in table], columns or None)
    return result


def _table_row(name: str, res: dict, n: int) -> dict:
    rel, eng = res.get("release"), res.get("engine")
    row = {"case": name}
    if name in ("think", "think-edits"):
        if eng is not None:
            row |= {"ttfs off ms": eng["cache_off"]["mean_ttfs_s"] * 1e3,
                    "ttfs on ms": eng["cache_on"]["mean_ttfs_s"] * 1e3, "off/on": eng["speedup_mean_ttfs"],
                    "AR prefill tokens off": eng["cache_off"]["ar_prefill_tokens"],
                    "AR prefill tokens on": eng["cache_on"]["ar_prefill_tokens"], "bit-identical": eng["bit_identical"]}
        return row
    if eng is not None:
        row |= {"ttfs off ms": eng["ttfs_mean_off_s"] * 1e3, "ttfs on ms": eng["ttfs_mean_on_s"] * 1e3,
                "off/on": eng["ttfs_ratio"], "whole request off/on": eng["total_ratio"],
                "off/on, hits": eng["ttfs_later_mean_off_s"] / eng["ttfs_later_mean_on_s"],
                "hit share": eng["hit_share_of_first_step"], "saved/share": eng["time_saved_over_share"],
                "saved/share, medians": eng["time_saved_over_share_median"],
                "prefix prefill saved/share": eng.get("prefix_prefill_saved_over_share"),
                "bit-identical": eng["bit_identical"]}
    if rel is None:
        return row
    row |= {"pool blocks": rel["pool_blocks"], "max_num_seqs": rel["max_num_seqs"], "held off": rel["held_off"],
            "held on": rel["held_on"], "held on/off": rel["held_ratio"],
            f"blocks for {n} off": rel["blocks_for_requests_off"], f"blocks for {n} on": rel["blocks_for_requests_on"],
            "held one tick off": rel["held_one_tick_off"], "held one tick on": rel["held_one_tick_on"],
            f"blocks for {n} one tick on": rel["blocks_for_requests_one_tick_on"]}
    return row
