"""A request's AR text settings (`TextSampling`): how its tokens are drawn, as the release's
generation_config.json names them, with vLLM's meaning of "off" (`top_k` 0 or -1, `top_p` 1).

No torch here: stage files, request checks and checkpoint configs validate these settings without
loading it; `sampling.sample` draws with them on the device.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from ..errors import ConfigError, is_finite_number

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
        self._check("temperature", self.temperature, (int, float), lambda v: is_finite_number(v) and v >= 0,
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
