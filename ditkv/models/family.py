"""The model-family interface and its registry: all that engine/, worker/ and stages/ know of a model.

A family (`models/<family>/family.py`) implements `ModelFamily` and registers itself; the layers
above find it from a model config (`family_of(config)`, by the config class's `family` name). They
never import `models.<family>` themselves (tests/test_layering.py keeps it that way), so a second
family is a new folder plus one `register` line in `_load_families`, not an edit in 11 files.

The methods, by concern:
- preprocessing: `request_layout` (a request's rows: token ids, positions, CFG rows, spans;
  `prompt_ids=`: the prompt given as ids, an AR text that extends it),
  `ar_head` and `image_tail_ids` (what an AR stage prefills), `output_bucket` (the sizes it
  generates), `auto_sizes` and `size_tail_ids` (`size=auto`: the buckets and ratio ids the AR phase
  chooses among, and what it prefills before it draws one), `auto_size_default` (the checkpoint
  makes auto the default size), `template` (prompt-template and
  rewrite helpers: `template.request_settings(config, bot_task)` is one request's template, the checkpoint's with the
  request's bot_task, which `request_layout(..., template=)` and `ar_head(..., template=)` take;
  `BOT_TASKS`, `REWRITE_TASKS`), `text_task(config, tokenizer, template)` (one task's AR text: whether the image
  row holds it or it extends the prompt, its stop ids and refusals, the tail after it, and what the row
  takes back), `banned_generation_ids` (special ids text generation never emits),
  `prefix_block_keys(config, layout, seed, block_size)` (per row, the chained blake2b keys of its full
  pages before the prefix end: the prefix cache's block identities, docs/prefix-cache.md; what a page
  holds, not where: under CFG parallel the engine adds the rank, `engine/prefix_ranks.py`),
  `input_image_keys(layout, seed)` (one key per input image: what its embeddings depend on, content,
  geometry, index and seed; the DiT runner's encoder cache, `worker/encoder_cache.py`),
  `input_image_tokens(config, max_height, max_width)` (the most embedding tokens one input image brings:
  an encoder-cache entry, counted in the startup memory plan),
  `ar_head_block_keys(config, head_ids, block_size, head=None, seed=0)` (an AR row's head: its full pages'
  keys, equal to a DiT row's for equal tokens at equal positions; a head with input images passes its
  `ar_head` and the seed of its VAE samples, and its pages name each image as a DiT row's do,
  docs/prefix-cache-ar.md);
- the wire: `layout_to_wire` / `layout_from_wire` (a layout as bytes, the same bit for bit);
- sampling: `sampler(config)` (an object with `set_timesteps` / `timestep` / `guide` / `step`),
  `initial_noise` and `noise` (the release's draws);
- the step's inputs and heads: `guidance_value` (the `<guidance>` slot of distilled checkpoints);
- loading and sharding: `claims` (a checkpoint's config.json is this family's), `load` / `load_shard`
  (model, tokenizer, codec from a folder; None: the bundled tiny preset), `load_frontend` (config and
  tokenizer only), `apply_quantization`, `shard_of`, `shard_key`, `shard_model`, `quantization_of`,
  `move_model`;
- run-time modes: `set_fused_elementwise`, `set_batch_invariant`, `batch_invariant_unusable`;
- CUDA graphs: `graph_blocker` (why a model's step cannot be captured), `prepare_capture`,
  `dense_routing` (a host-sync-free routing context for tests).
"""

from __future__ import annotations

from ..errors import ConfigError
from .family_api import ModelFamily, RequestLayout, check_input_image_count

__all__ = ["DEFAULT_FAMILY", "ModelFamily", "RequestLayout", "check_input_image_count", "families",
           "family_for_folder", "family_named", "family_of", "register"]
DEFAULT_FAMILY = "hunyuan_image_3"  # the bundled tiny preset's (no checkpoint folder to ask)

_FAMILIES: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> None:
    _FAMILIES[family.name] = family


def _load_families() -> None:
    if not _FAMILIES:
        from .hunyuan.family import HunyuanImage3Family

        register(HunyuanImage3Family())


def family_of(model_config) -> ModelFamily:
    """The family of a model config (its class's `family` name)."""
    _load_families()
    name = getattr(type(model_config), "family", None)
    fam = _FAMILIES.get(name)
    if fam is None:
        raise ConfigError("model", type(model_config).__name__,
                          f"no model family {name!r} is registered (known: {', '.join(sorted(_FAMILIES))})")
    return fam


def family_named(name: str) -> ModelFamily:
    _load_families()
    if name not in _FAMILIES:
        raise ConfigError("model", name,
                          f"no model family {name!r} is registered (known: {', '.join(sorted(_FAMILIES))})")
    return _FAMILIES[name]


def family_for_folder(folder) -> ModelFamily:
    """The family that reads a checkpoint folder: the first whose `claims(config.json)` says so."""
    import json
    from pathlib import Path

    path = Path(folder) / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # the default family's reader names what is wrong with the file
        return family_named(DEFAULT_FAMILY)
    if not isinstance(cfg, dict):  # the default family's reader names what is wrong with the file
        return family_named(DEFAULT_FAMILY)
    for fam in families():
        if fam.claims(cfg):
            return fam
    kind = cfg.get("model_type")
    raise ConfigError("model", str(folder), f"no registered model family reads this checkpoint (model_type "
                                            f"{kind!r}; known families: {', '.join(sorted(_FAMILIES))})")


def families() -> list[ModelFamily]:
    """Every registered family (process-wide settings reach them all)."""
    _load_families()
    return list(_FAMILIES.values())
