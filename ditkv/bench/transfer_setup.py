"""The workload of `ditkv bench transfer` (and its `--remote-ar` variant, transfer_remote.py): the
prompt set, the stage devices, the AR(0) -> DiT(1) stage file and the requests."""

from __future__ import annotations

COLORS = ("red", "green", "blue", "yellow", "purple", "white", "orange")


SHAPES = ("circle", "square", "triangle", "cross", "ring")


WHERE = ("", " in the top left corner", " at the bottom", " in the center of a dark background",
         " next to a smaller copy of itself on a striped background")


def prompt_set(n: int = 50, prompt_tokens: int | None = None) -> list[tuple[str, int]]:
    """Fixed (prompt, seed) pairs: varied lengths, deterministic. With `prompt_tokens`, every
    prompt is exactly that many text tokens for the tiny byte tokenizer (ASCII: one byte, one
    token): the default captions' words, repeated from a per-prompt offset, truncated to N bytes."""
    out = []
    for i in range(n):
        size = ("a small", "a large", "a")[i % 3]
        out.append((f"{size} {COLORS[i % 7]} {SHAPES[i % 5]}{WHERE[i % 5]}", i))
    if prompt_tokens is None:
        return out
    return [(synthetic_prompt(prompt_tokens, i), seed) for i, (_, seed) in enumerate(out)]


def synthetic_prompt(n: int, offset: int = 0) -> str:
    """`n` ASCII bytes of repeated caption words starting at word `offset` (prompts differ)."""
    words = " ".join(f"{s} {c} {sh}{w}" for s, c, sh, w in
                     zip(("a small", "a large", "a") * 35, COLORS * 15, SHAPES * 21, WHERE * 21)).split()
    words = words[offset % len(words):] + words[:offset % len(words)]
    text = " ".join(words)
    while len(text) < n:
        text = f"{text} {text}"
    return text[:n]


def _prompts(args) -> list[tuple[str, int]]:
    return prompt_set(prompt_tokens=getattr(args, "prompt_tokens", None))


def prompt_lengths(args) -> list[int]:
    """Text tokens of the benchmark's prompts (byte tokenizer: UTF-8 bytes)."""
    return [len(p.encode("utf-8")) for p, _ in _prompts(args)]


def stage_devices(args, kind: str) -> tuple[str, str]:
    """AR and DiT devices: CPU for the CPU transports; for `cuda` the first GPU and the second
    one when there is one (else both on the first)."""
    import torch

    gpu = kind == "cuda"
    ar = args.ar_device if args.ar_device != "auto" else ("cuda:0" if gpu else "cpu")
    dit = args.dit_device if args.dit_device != "auto" else \
        (("cuda:1" if torch.cuda.device_count() > 1 else "cuda:0") if gpu else "cpu")
    return ar, dit


def dit_blocks(args, model_config) -> int:
    """Pages for every request the DiT may hold at once (8 waiting for KV + 1 running + slack)."""
    ds = model_config.image_token_downsample
    row = (args.height // ds) * (args.width // ds) + 300 + _long_prompt(args)  # image + prompt and specials
    return max(512, 2 * -(-row // args.block_size) * 10)


def _long_prompt(args) -> int:
    """Text tokens of a `--prompt-tokens` prompt; 0 for the default caption set (the fixed sizes cover it)."""
    return (getattr(args, "prompt_tokens", None) or 0) if args is not None else 0


def _graph(mode: str, kind: str, bs: int, args=None, blocks: int = 512):
    from ..stages.graph import load_stage_graph

    return load_stage_graph(graph_data(mode, kind, bs, args, blocks))


def graph_data(mode: str, kind: str, bs: int, args=None, blocks: int = 512) -> dict:
    """The benchmark's AR(0) -> DiT(1) stage file as a dict (`mode`: legacy | native)."""
    ar_dev, dit_dev = stage_devices(args, kind) if args is not None else ("cpu", "cpu")
    extra = {} if args is None else {"dtype": args.dtype, "attention_backend": args.attention_backend}
    key = "kv_transfer_config" if mode == "native" else "legacy_kv_transfer"
    dit = {"model": "tiny", "device": dit_dev, "block_size": bs, "diffusion_kv_mode": "dense_legacy", **extra}
    if args is not None:  # admit the benchmark size (the tiny model's default envelope is 128x128)
        dit.update(max_image_height=args.height, max_image_width=args.width)
    if mode == "native":
        # the prefix cache off: this measures the transfer, and repeated prompts would skip cached pages
        dit.update(diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2, num_kv_blocks=blocks,
                   enable_prefix_caching=False)
    common = {"kv_connector": kind, "legacy_slots": 8, "legacy_max_tokens": 1024}
    ar_blocks, n = 256, _long_prompt(args)
    if n:  # long prompts: the profiled envelope, the legacy receive slot and the AR pool must hold them
        dit.update(max_prompt_tokens=max(256, n))
        common["legacy_max_tokens"] = max(1024, n + 64)  # prefix = prompt + <bos> <boi> <img_size> <img_ratio>
        ar_blocks = max(256, 2 * 8 * -(-(n + 64) // bs))  # 8 in flight + as many waiting on the DiT
    return {"stages": [
        {"stage_id": 0, "kind": "ar", "engine": {"model": "tiny", "device": ar_dev, "block_size": bs,
                                                 "num_kv_blocks": ar_blocks, **extra},
         key: {**common, "engine_id": "ar", "kv_role": "kv_producer"}},
        {"stage_id": 1, "kind": "dit", "inputs": [0], "engine": dit,
         key: {**common, "engine_id": "dit", "kv_role": "kv_consumer", "transfer_timeout": 60.0}}],
        "orchestrator": {"max_inflight": 8}}


def _requests(args, n: int):
    from ..engine.types import GenerationRequest

    ps = _prompts(args)
    return [GenerationRequest(prompt=ps[i % len(ps)][0], seed=ps[i % len(ps)][1], height=args.height,
                              width=args.width, steps=args.steps, guidance_scale=args.guidance)
            for i in range(n)]


def _positions(args, model_config) -> int:
    """Row positions the benchmark size needs (image tokens + the longest prompt + specials)."""
    ds = model_config.image_token_downsample
    return (args.height // ds) * (args.width // ds) + 8 + max(prompt_lengths(args))
