"""AR text sampling on the device, seeded per request (issue 34 item 1).

`sample` draws one token per row of a logits batch, each row by its own settings (`TextSampling`,
text_settings.py), without leaving the device: temperature, top-k, top-p and banned ids are masks and
sorts over `[R, V]`, and the draw is the exponential race `argmax(p / E)`, `E ~ Exponential(1)` per
vocabulary entry, which picks entry i with probability p_i. The noise of a row comes from that row's
own generator, on the logits' device, so a request's tokens depend only on its seed and its own
logits, never on which other rows share the batch (torch.multinomial over the batch would draw every
row from one stream). The host syncs only where the caller reads the ids.

A row may be confined to `allowed` ids (`size=auto`: the ratio tokens): every other id is masked, the
family's banned ids do not apply to it, and a greedy row takes the first allowed id of the largest
logit in the order given (the release's argmax over its sliced vocabulary), not the lowest id.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..models.text_settings import TextSampling


def row_generator(seed: int, device) -> torch.Generator:
    """A request's own noise stream on `device` (where its logits are)."""
    return torch.Generator(device=torch.device(device)).manual_seed(int(seed))


def sample(logits: torch.Tensor, settings: Sequence[TextSampling], generators: Sequence[torch.Generator | None],
           banned: torch.Tensor | None = None,
           allowed: Sequence[torch.Tensor | None] | None = None) -> torch.Tensor:
    """One token id per row of `logits` [R, V] (any float dtype; computed in fp32), as a long tensor
    [R] on the logits' device. Row r follows `settings[r]` and draws its noise from `generators[r]`
    (on the logits' device; None only for a greedy row). `banned` (long ids on the device) are never
    drawn. `allowed[r]` (long ids on the device, or None): row r draws only among these (module
    docstring). Greedy rows are `argmax` of the masked logits, exactly."""
    if logits.dim() != 2 or len(settings) != logits.shape[0] or len(generators) != logits.shape[0]:
        raise ValueError(f"sample needs logits [R, V] and R settings and generators; got {tuple(logits.shape)}, "
                         f"{len(settings)} settings, {len(generators)} generators")
    if allowed is not None and len(allowed) != logits.shape[0]:
        raise ValueError(f"sample needs one allowed entry per row; got {len(allowed)} for {logits.shape[0]} rows")
    x = logits.float().clone()
    if banned is not None and banned.numel():
        x[:, banned] = float("-inf")
    confined = [] if allowed is None else [(r, ids) for r, ids in enumerate(allowed) if ids is not None]
    for r, ids in confined:  # only these ids, whatever is banned for text
        row = torch.full_like(x[r], float("-inf"))
        row[ids] = logits[r, ids].float()
        x[r] = row
    greedy_ids = torch.argmax(x, dim=-1)
    for r, ids in confined:  # the first allowed id of the largest logit, in the order given
        greedy_ids[r] = ids[torch.argmax(x[r, ids])]
    if all(s.greedy for s in settings):
        return greedy_ids
    dev, vocab = x.device, x.shape[1]
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
