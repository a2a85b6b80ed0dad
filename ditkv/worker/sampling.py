"""AR text sampling on the device, seeded per request (issue 34 item 1).

`TextSampling` is one request's settings (the release's generation_config.json keys, vLLM's meaning of
"off": `top_k` 0 or -1, `top_p` 1). `sample` draws one token per row of a logits batch without leaving
the device: temperature, top-k, top-p and banned ids are masks and sorts over `[R, V]`, and the draw
is the exponential race `argmax(p / E)`, `E ~ Exponential(1)` per vocabulary entry, which picks entry
i with probability p_i. The noise of a row comes from that row's own generator, on the logits'
device, so a request's tokens depend only on its seed and its own logits, never on which other rows
share the batch (torch.multinomial over the batch would draw every row from one stream). The host
syncs only where the caller reads the ids.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace

import torch

from ..errors import ConfigError

# release generation_config.json keys that set a checkpoint's AR sampling defaults (`TextSampling` fields)
SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "top_p", "max_new_tokens")


@dataclass(frozen=True)
class TextSampling:
    """How one request's AR text is drawn. Greedy (argmax) when `do_sample` is false or `temperature`
    is 0; otherwise softmax at `temperature`, cut to the `top_k` most likely ids (0 or -1: no cut)
    and to the smallest set whose mass reaches `top_p` (1: no cut)."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    do_sample: bool = True
    max_new_tokens: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        self._check("temperature", self.temperature, (int, float), lambda v: math.isfinite(v) and v >= 0,
                    "a number >= 0 (0 = greedy)")
        self._check("top_k", self.top_k, int, lambda v: v >= -1, "an integer >= 1, or 0 / -1 for no top-k cut")
        self._check("top_p", self.top_p, (int, float), lambda v: 0 < v <= 1, "a number in (0, 1] (1 = no top-p cut)")
        self._check("do_sample", self.do_sample, bool, lambda v: True, "true or false (false = greedy)")
        self._check("max_new_tokens", self.max_new_tokens, int, lambda v: v >= 0, "an integer >= 0")
        self._check("seed", self.seed, int, lambda v: True, "an integer")

    @staticmethod
    def _check(name, value, types, ok, valid: str) -> None:
        # bool is an int to Python: only do_sample may be one
        if (isinstance(value, bool) and types is not bool) or not isinstance(value, types) or not ok(value):
            raise ConfigError(name, value, f"{name} must be {valid}")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    def override(self, **changes) -> "TextSampling":
        """A copy with the given settings; a None value keeps this one's (a request's "not set")."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    @classmethod
    def from_release(cls, gen: dict, where: str = "generation_config.json") -> "TextSampling":
        """The AR defaults of a release generation config (`SAMPLING_KEYS`; null = absent).
        `repetition_penalty` is accepted only at 1: ditkv has no penalties, and silently sampling
        without one would give other text than the checkpoint's authors tuned for."""
        rp = gen.get("repetition_penalty")
        if rp is not None and (isinstance(rp, bool) or not isinstance(rp, (int, float)) or rp != 1):
            raise ConfigError("repetition_penalty", rp, f"{where} sets repetition_penalty={rp!r}, but ditkv does not "
                              "implement repetition penalties: set it to 1.0 or remove it")
        try:
            return cls(**{k: gen[k] for k in SAMPLING_KEYS if gen.get(k) is not None})
        except ConfigError as e:
            raise ConfigError(e.field, e.value, f"{e.fix} (in {where})") from e


def checkpoint_sampling(cfg) -> TextSampling:
    """A model config's AR defaults: its generation_config.json's `SAMPLING_KEYS`, which
    `checkpoint.apply_generation_config` keeps in `cfg.extra` (none: greedy, no text)."""
    return TextSampling.from_release({k: cfg.extra.get(k) for k in SAMPLING_KEYS}, "the model config")


def to_wire(s: TextSampling) -> dict:
    """The settings as flat message fields (the stage messages carry them one by one)."""
    return asdict(s)


def from_wire(msg) -> TextSampling:
    """The settings a message built with `to_wire` carries (validated again on this side)."""
    return TextSampling(**{f.name: getattr(msg, f.name) for f in fields(TextSampling)})


def row_generator(seed: int, device) -> torch.Generator:
    """A request's own noise stream on `device` (where its logits are)."""
    return torch.Generator(device=torch.device(device)).manual_seed(int(seed))


def sample(logits: torch.Tensor, settings: Sequence[TextSampling], generators: Sequence[torch.Generator | None],
           banned: torch.Tensor | None = None) -> torch.Tensor:
    """One token id per row of `logits` [R, V] (any float dtype; computed in fp32), as a long tensor
    [R] on the logits' device. Row r follows `settings[r]` and draws its noise from `generators[r]`
    (on the logits' device; None only for a greedy row). `banned` (long ids on the device) are never
    drawn. Greedy rows are `argmax` of the masked logits, exactly."""
    if logits.dim() != 2 or len(settings) != logits.shape[0] or len(generators) != logits.shape[0]:
        raise ValueError(f"sample needs logits [R, V] and R settings and generators; got {tuple(logits.shape)}, "
                         f"{len(settings)} settings, {len(generators)} generators")
    x = logits.float().clone()
    if banned is not None and banned.numel():
        x[:, banned] = float("-inf")
    greedy_ids = torch.argmax(x, dim=-1)
    if all(s.greedy for s in settings):
        return greedy_ids
    dev, (rows, vocab) = x.device, x.shape
    temps = _to(dev, [1.0 if s.greedy else float(s.temperature) for s in settings])
    x = x / temps[:, None]
    ks = [vocab if s.top_k <= 0 else min(s.top_k, vocab) for s in settings]
    if any(k < vocab for k in ks) or any(s.top_p < 1 for s in settings):
        x = _cut(x, _to(dev, ks), _to(dev, [float(s.top_p) for s in settings]))
    probs = torch.softmax(x, dim=-1)
    noise = torch.ones_like(probs)
    for r, (s, g) in enumerate(zip(settings, generators)):
        if not s.greedy:
            if g is None:
                raise ValueError(f"row {r} samples (temperature {s.temperature}) but has no generator")
            noise[r].exponential_(generator=g)
    # an Exponential(1) draw of exactly 0 would make p / E infinite (or nan at p = 0)
    sampled = torch.argmax(probs / noise.clamp_min(torch.finfo(noise.dtype).tiny), dim=-1)
    is_greedy = _to(dev, [s.greedy for s in settings])
    return torch.where(is_greedy, greedy_ids, sampled)


def _to(dev: torch.device, values: list) -> torch.Tensor:
    """Per-row settings on the device. non_blocking: a plain copy from host memory would wait for
    the device's queued work (a sync per step); an async one stages the values and returns."""
    return torch.tensor(values).to(dev, non_blocking=True)


def _cut(x: torch.Tensor, ks: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`x` with every id outside a row's top-k and top-p set at -inf. The top-p set is the smallest
    prefix of the sorted ids whose mass reaches p: an id stays while the mass before it is < p, so
    the most likely id always stays (any p > 0)."""
    vals, idx = torch.sort(x, dim=-1, descending=True, stable=True)  # stable: ties keep id order
    rank = torch.arange(x.shape[-1], device=x.device)
    vals = vals.masked_fill(rank[None, :] >= ks[:, None], float("-inf"))
    probs = torch.softmax(vals, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs
    vals = vals.masked_fill(before >= top_p[:, None], float("-inf"))
    return torch.full_like(x, float("-inf")).scatter(-1, idx, vals)
