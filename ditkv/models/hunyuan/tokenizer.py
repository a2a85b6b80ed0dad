"""Tokenizers: a byte-level one for the tiny model and a wrapper for a release `tokenizer.json`.

Both satisfy `TextTokenizer` (encode / decode / vocab_size / token_to_id). Special tokens are
never produced by `encode`: a prompt cannot smuggle in `<img>` or `<cfg>`; the layout builder
places specials by id.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Protocol, runtime_checkable

from ditkv.errors import ConfigError
from ditkv.models.hunyuan.config import BYTE_SPECIAL_IDS, BYTE_VOCAB_SIZE, HunyuanImage3Config


@runtime_checkable
class TextTokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids) -> str: ...

    def token_to_id(self, token: str) -> int | None: ...


# ---------------------------------------------------------------- byte tokenizer
# ids 0..255 are the UTF-8 bytes; the specials follow (BYTE_SPECIAL_IDS: the tiny preset's ids, in config.py)


class ByteTokenizer:
    """UTF-8 bytes as tokens. Matches the special ids of `HunyuanImage3Config.tiny()`."""

    vocab_size = BYTE_VOCAB_SIZE
    special_ids = BYTE_SPECIAL_IDS

    def __init__(self) -> None:
        self._names = {i: name for name, i in BYTE_SPECIAL_IDS.items()}

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        """Bytes decode as UTF-8 (invalid sequences replaced); specials print as their names."""
        out: list[str] = []
        run = bytearray()
        for i in (int(x) for x in ids):
            if 0 <= i < 256:
                run.append(i)
                continue
            if run:
                out.append(run.decode("utf-8", errors="replace"))
                run.clear()
            out.append(self._names.get(i, f"<unused_{i}>"))
        if run:
            out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_to_id(self, token: str) -> int | None:
        return BYTE_SPECIAL_IDS.get(token)


# ------------------------------------------------------------ tokenizers wrapper
class HFTokenizer:
    """A `tokenizers.Tokenizer` (release `tokenizer.json`) behind the `TextTokenizer` protocol."""

    def __init__(self, path: str | Path) -> None:
        from ditkv.models.hunyuan.files import read_json

        fix = "use the release's tokenizer.json, or remove it to use the byte tokenizer"
        # a garbage file is named here even where `tokenizers` is not installed
        if not isinstance(read_json(path, fix), dict):
            raise ConfigError("tokenizer", str(path), f"must hold a JSON object; {fix}")
        try:
            import tokenizers  # lazy: only real checkpoints need it
        except ImportError as exc:
            raise ConfigError(
                "tokenizer", str(path),
                "loading tokenizer.json needs the `tokenizers` package: pip install tokenizers",
            ) from exc
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception for any file it cannot parse
            raise ConfigError("tokenizer", str(path), f"not a tokenizers file ({exc}); {fix}") from exc
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


# Special tokens by name, as the release tokenizer defines them (the release code looks them up
# with `convert_tokens_to_ids`); `<img_size_B>` carries the model's base size B.
_RELEASE_TOKEN_NAMES = {
    "boi_token_id": "<boi>",
    "eoi_token_id": "<eoi>",
    "cfg_token_id": "<cfg>",
    "img_token_id": "<img>",
    "timestep_token_id": "<timestep>",
    "img_ratio_token_id": "<img_ratio_0>",
}


def resolve_special_ids(cfg: "HunyuanImage3Config", tokenizer: TextTokenizer,
                        named: dict[str, str] | None = None) -> "HunyuanImage3Config":
    """`cfg` with every special id looked up by its name in a real tokenizer: never a placeholder.

    `named`: bos/eos/pad token names (from tokenizer_config.json), looked up too. A missing name is a
    ConfigError naming it; ratio tokens must be consecutive ids."""
    names = dict(_RELEASE_TOKEN_NAMES)
    names["img_size_token_id"] = f"<img_size_{cfg.image_base_size or 1024}>"
    if cfg.use_guidance_token:
        names["guidance_token_id"] = "<guidance>"
    names.update({f"{k}_token_id": v for k, v in (named or {}).items()})
    changes: dict[str, int] = {}
    for field_name, name in names.items():
        tid = tokenizer.token_to_id(name)
        if tid is None:
            raise ConfigError("tokenizer", name, f"tokenizer.json has no token {name!r} (for {field_name}); a "
                              "HunyuanImage-3 tokenizer defines it: use the checkpoint's own tokenizer.json")
        changes[field_name] = int(tid)
    first = changes["img_ratio_token_id"]
    for k in range(cfg.num_ratio_tokens):
        tid = tokenizer.token_to_id(f"<img_ratio_{k}>")
        if tid != first + k:
            raise ConfigError(
                "img_ratio_token_id", first,
                f"<img_ratio_{k}> has id {tid}, expected {first + k}: ratio tokens must be consecutive",
            )
    from ditkv.models.hunyuan.template import instruct_code

    if instruct_code(cfg) and cfg.num_ratio_tokens > 1:  # the Instruct code's four extra buckets
        changes["img_ratio_extra_token_id"] = _extra_ratio_ids(tokenizer)
    return dataclasses.replace(cfg, **changes)


def _extra_ratio_ids(tokenizer: TextTokenizer) -> int:
    ids = [tokenizer.token_to_id(f"<img_ratio_{k}>") for k in range(33, 37)]
    if None in ids or ids != list(range(ids[0], ids[0] + 4)):
        raise ConfigError("tokenizer", "<img_ratio_33>", f"an Instruct checkpoint's tokenizer.json must define "
                          f"<img_ratio_33..36> at consecutive ids (its extra buckets), got {ids}: use the "
                          "checkpoint's own tokenizer.json")
    return int(ids[0])


def banned_generation_ids(cfg: HunyuanImage3Config) -> set[int]:
    """Special ids a text generation step must never emit (eos stays allowed: it stops)."""
    ids = {cfg.bos_token_id, cfg.pad_token_id, cfg.boi_token_id, cfg.eoi_token_id, cfg.img_token_id,
           cfg.timestep_token_id, cfg.guidance_token_id, cfg.cfg_token_id, cfg.img_size_token_id}
    ids.update(range(cfg.img_ratio_token_id, cfg.img_ratio_token_id + cfg.num_ratio_tokens))
    if cfg.img_ratio_extra_token_id is not None:  # an Instruct tokenizer's <img_ratio_33..36>
        ids.update(range(cfg.img_ratio_extra_token_id, cfg.img_ratio_extra_token_id + 4))
    return {i for i in ids if i is not None and i >= 0}
