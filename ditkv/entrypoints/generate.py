"""`ditkv generate`: one request (text-to-image, or editing with `--image`), written to a PNG."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from ..argtypes import cannot_write_in, true_false
from ..config import is_stage_file
from .engine_args import add_engine_arguments, config_from_args
from .quantize import graph_weights_label, weights_label


DEFAULT_SIDE = 64  # pixels, each side, when neither --size nor --height/--width is given
# --bot-task's choices: the default family's template BOT_TASKS, written out (importing the family loads
# torch; tests/test_bot_task.py keeps them equal); the engine checks the served model's own
BOT_TASKS = ("image", "auto", "think", "recaption")


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate one image from a prompt",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prompt", required=True, help="text prompt (see README for the tiny model's vocabulary)")
    p.add_argument("--negative-prompt", default=None,
                   help="what the image should not show: the uncond row's prompt under CFG (default: none)")
    p.add_argument("--image", action="append", default=None, metavar="IN.png",
                   help="input image to edit (PNG, JPEG or WEBP); repeat for several. The model must take input "
                        "images (its config's max_input_images; default: none, text-to-image)")
    p.add_argument("--size", default=None, metavar="WIDTHxHEIGHT|auto",
                   help="image size; 'auto': the model picks one of its resolution buckets after the prompt (and "
                        "the AR text), as the release's image_size='auto' (a checkpoint with resolution buckets; "
                        "a single engine or a stage graph) (default: --width x --height)")
    p.add_argument("--height", type=int, default=None,
                   help=f"image height in pixels (default: {DEFAULT_SIDE}, or size=auto where the checkpoint's "
                        "generation_config.json sets image_size auto)")
    p.add_argument("--width", type=int, default=None,
                   help=f"image width in pixels (default: {DEFAULT_SIDE}, or size=auto as for --height)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps, 1..--max-steps (default: the model's)")
    p.add_argument("--guidance", type=float, default=None, help="CFG scale; <= 1 disables CFG (default: model's)")
    p.add_argument("--seed", type=int, default=0, help="0..2**63-1")
    _add_text_arguments(p)
    p.add_argument("--out", default="out.png", help="output PNG path (its folder must exist and be writable)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_engine_arguments(p)
    p.set_defaults(func=run)


def _add_text_arguments(p) -> None:
    """The AR text settings of this request: the single engine's AR phase, or a stage graph's AR
    stage (`--config`)."""
    ar = "AR text before the image: "
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help=ar + "at most this many tokens; > 0 writes text with bot_task image (a stage graph: up to "
                             "its AR stage's max_new_tokens; default: 0 for bot_task image, else the stage's or the "
                             "checkpoint's)")
    p.add_argument("--temperature", type=float, default=None,
                   help=ar + "sampling temperature, >= 0; 0 = greedy (default: the stage's, else the checkpoint's "
                             "generation_config.json, else greedy)")
    p.add_argument("--top-k", type=int, default=None,
                   help=ar + "sample among the k most likely tokens; 0 or -1 = no cut (default: the checkpoint's)")
    p.add_argument("--top-p", type=float, default=None,
                   help=ar + "sample within the smallest set of tokens of this probability mass, in (0, 1]; "
                             "1 = no cut (default: the checkpoint's)")
    p.add_argument("--do-sample", type=true_false, default=None, metavar="true|false",
                   help=ar + "false = greedy whatever the temperature (default: the checkpoint's)")
    p.add_argument("--bot-task", default=None, choices=BOT_TASKS,
                   help="the prompt template's task, as the release's generate_image: 'image' draws from the prompt; "
                        "'think' / 'recaption' first write the release's rewrite (needs --max-new-tokens > 0 or the "
                        "checkpoint's max_new_tokens); 'auto' is generate_image's auto (no text; under "
                        "use_system_prompt dynamic the checkpoint's custom system prompt) (default: the checkpoint's "
                        "generation_config.json bot_task; a stage graph: its stages[0].bot_task, else that)")


def _check_out(out: str) -> None:
    """--out must be a writable .png path; checked before anything loads (a bad directory used to
    fail only once the image was made): a file is created and removed in its folder."""
    def fail(why: str):
        raise SystemExit(f"ditkv generate: error: --out={out}: {why}")

    if not out.lower().endswith(".png"):
        fail("must end in .png")
    path = Path(out)
    if path.is_dir():
        fail("is a directory; give a file name ending in .png")
    folder = path.parent  # "." for a bare file name
    if not folder.is_dir():
        fail(f"directory {folder} {'is not a directory' if folder.exists() else 'does not exist'}; "
             "create it or write elsewhere")
    why = cannot_write_in(folder)  # a real file, not os.access: root passes that on /proc
    if why is not None:
        fail(f"{why}; pick a folder you can write to")
    if path.exists() and not os.access(path, os.W_OK):
        fail("the file exists and is not writable; remove it or write elsewhere")


def _size(a) -> tuple[int, int] | str | None:
    """(width, height) asked for, 'auto', or None (neither --size nor --height/--width: the default)."""
    if a.size is None:
        if a.height is None and a.width is None:
            return None
        return (DEFAULT_SIDE if a.width is None else a.width, DEFAULT_SIDE if a.height is None else a.height)
    if a.height is not None or a.width is not None:
        raise SystemExit("ditkv generate: error: --size and --height/--width both give the size; pass one of them")
    if a.size == "auto":
        return "auto"
    try:
        w, h = (int(x) for x in a.size.lower().split("x"))
    except ValueError:
        raise SystemExit(f"ditkv generate: error: --size={a.size}: give WIDTHxHEIGHT in pixels (e.g. 64x64) or "
                         "'auto'") from None
    return w, h


def _checked_request(a, max_steps: int):
    """The request, checked by the rules the server and the engine apply (request_check.py), so a bad
    prompt, seed, size, steps or guidance fails before any model loads. size=auto passes here: the
    engine (or a stage graph's orchestrator) says at intake whether its model can pick."""
    from ..engine.request_check import check_request

    req = _request(a)
    check_request(req, max_steps)
    return req


def _auto_default(a, req, processor):
    """The checkpoint's image_size: auto makes a request without a size auto (a size given wins)."""
    if _size(a) is None and processor.auto_size_default:
        import msgspec

        return msgspec.structs.replace(req, height=None, width=None)
    return req


def run(a) -> None:
    _check_out(a.out)
    if a.config and is_stage_file(a.config):
        return _run_stages(a)
    from ..engine.engine import Engine

    config = config_from_args(a)  # EngineConfig's defaults: paged_scheduler, 2 rows per request
    req = _checked_request(a, config.max_steps)
    on_step, close_bar = _progress_bar(a)
    t0 = time.monotonic()
    engine = Engine(config, on_step=on_step)
    t_load = time.monotonic() - t0
    req = _auto_default(a, req, engine.processor)
    try:
        out = engine.generate(req)  # may refuse the request (too long for the pool, the envelope)
    finally:  # rank processes and pages are released on every path
        close_bar()
        engine.shutdown()
    s = out.stats
    if out.revised_prompt is not None:
        print(f"AR text: {out.revised_prompt!r}")
    ar = (f"AR {s.ar_generated_tokens} tokens in {s.ar_seconds:.2f}s (first after {s.ar_time_to_first_token_s:.2f}s) "
          f"+ DiT " if s.ar_prompt_tokens else "")
    _save(a, out, t_load, f"{ar}mode={config.diffusion_kv_mode} steps={s.steps}{cache_label(config, s)} "
                          f"blocks={s.blocks} prefix tokens reused={s.prefix_tokens_reused} | weights "
                          f"{weights_label(config)}")


def _progress_bar(a):
    """(on_step(request_id, step, total), close()): a tqdm bar on stderr, or nothing with --no-progress."""
    from tqdm import tqdm

    bar = None

    def on_step(rid, i, total):
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc="denoising", unit="step", file=sys.stderr)
        bar.update(1)

    def close():
        if bar is not None:
            bar.close()

    return (None if a.no_progress else on_step), close


def _request(a):
    from .request_builder import build_requests

    size = _size(a)
    return build_requests(a.prompt, size=(DEFAULT_SIDE, DEFAULT_SIDE) if size is None else size, steps=a.steps,
                          guidance_scale=a.guidance,
                          seed=a.seed, negative_prompt=a.negative_prompt, images=_read_images(a.image),
                          text={"max_new_tokens": a.max_new_tokens, "temperature": a.temperature, "top_k": a.top_k,
                                "top_p": a.top_p, "do_sample": a.do_sample, "bot_task": a.bot_task})[0]


def _read_images(paths) -> list | None:
    """`--image` files, decoded and checked (size, format, pixels) before any model loads."""
    if not paths:
        return None
    from ..engine.request_check import MAX_INPUT_IMAGE_BYTES, MAX_INPUT_IMAGES
    from .images import ImageInputError, decode_image

    if len(paths) > MAX_INPUT_IMAGES:
        raise SystemExit(f"ditkv generate: error: {len(paths)} --image files, above the limit of {MAX_INPUT_IMAGES}")
    images = []
    for path in paths:
        data = _read_limited(path, MAX_INPUT_IMAGE_BYTES)
        try:
            images.append(decode_image(data, what=f"--image={path}", field="image"))
        except ImageInputError as e:
            raise SystemExit(f"ditkv generate: error: {e}") from None
    return images


def _read_limited(path: str, limit: int) -> bytes:
    """At most `limit` bytes of `path`, or SystemExit naming the limit: one byte more is read to
    tell, never the rest, whatever the file is (a pipe, /dev/stdin and /dev/zero have no size)."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise SystemExit(f"ditkv generate: error: --image={path}: cannot read it ({e.strerror or e})") from None
    if len(data) > limit:
        raise SystemExit(f"ditkv generate: error: --image={path}: larger than the limit of {limit} bytes per image; "
                         "send a smaller file")
    return data


def cache_label(config, s) -> str:
    """With a step cache: ' (cached C of N steps, ratio R, TYPE)'; nothing without one."""
    cache = config.step_cache
    if not cache.active:
        return ""
    ratio = s.cached_steps / s.steps if s.steps else 0.0
    return f" (step cache {cache.type}: cached {s.cached_steps} of {s.steps} steps, ratio {ratio:.2f})"


def _save(a, out, t_load: float, details: str) -> None:
    """Write the PNG and the closing line, or exit non-zero with the request's error."""
    from PIL import Image

    if not out.ok:
        raise SystemExit(f"ditkv generate: error: {out.error}")
    Image.fromarray(out.image).save(a.out)
    height, width = out.image.shape[:2]
    asked = _size(a) or (DEFAULT_SIDE, DEFAULT_SIDE)
    if out.stats.auto_size is not None:
        print(f"size=auto: the model chose {out.stats.auto_size}")
    elif (width, height) != asked:  # a release model generates at its resolution buckets
        print(f"note: size {asked[0]}x{asked[1]} snapped to the model's resolution bucket {width}x{height}")
    print(f"wrote {a.out} ({width}x{height}) in {out.stats.run_time_s:.2f}s (+{t_load:.2f}s load) | {details}")


def _run_stages(a) -> None:
    """`--config STAGES.yaml` with a `stages:` section: the AR(0) -> DiT(1) graph, in-process."""
    from ..stages.graph import stage_graph_from_args
    from ..stages.orchestrator import Orchestrator

    graph = stage_graph_from_args(a, "ditkv generate")
    req = _checked_request(a, graph.dit.engine.max_steps)
    t0 = time.monotonic()
    on_step, close_bar = _progress_bar(a)
    orch = Orchestrator(graph, on_step=on_step).start()
    t_load = time.monotonic() - t0
    req = _auto_default(a, req, orch.processor)
    try:
        out = orch.generate(req)
    finally:
        close_bar()
        orch.shutdown()
    s = out.stats
    if out.revised_prompt is not None:
        print(f"AR text: {out.revised_prompt!r}")
    _save(a, out, t_load, f"stages=AR->DiT transfer={graph.mode}/{graph.dit.transfer.kv_connector} "
                          f"steps={s.steps} imported prefix tokens={s.imported_tokens} "
                          f"| weights {graph_weights_label(graph)}")
