"""One request's AR phase on the host: which tokens its row holds, what it feeds next, when it ends.

The phase prefills the head (`<bos>` and the templated prompt; a prompt with input images is one
full-attention block and goes in one chunk), then generates up to `max_new_tokens` text tokens one
per step, then prefills the tail (`<boi> <img_size> <img_ratio>`, or `<answer>` first after a
think/recaption rewrite). A step feeds `work()` into the row's pages; the worker samples the next
token from the last fed position when `work().sample` is set, and `accept` takes it. `eos` ends the
text and is dropped; a stop id ends it and is kept (its K/V too), as the release keeps
`</recaption>`. The last generated token and the tail are fed in one chunk.

With `choice` (size=auto) the tail stops at `<img_size>` and the step that feeds it draws one of the
`choice` ids (the ratio tokens, greedily) from the tail's last position: `chosen`. It is not fed: the
DiT row that follows holds it.

No torch here: the scheduler plans with it, the engine feeds it the sampled ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class ARWorkPlan(NamedTuple):
    token_ids: list[int]
    start: int  # position of token_ids[0]
    sample: bool  # the worker draws the next token from the last fed position
    allowed: tuple[int, ...] | None = None  # the draw is confined to these ids (ARText.choice), in this order


@dataclass
class ARText:
    head: list[int]
    tail: list[int]
    max_new_tokens: int
    eos_id: int | None = None
    stop_ids: frozenset[int] = frozenset()
    whole_head: bool = False  # the head holds full-attention blocks (input images): one chunk
    generated: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose K/V are in the row's pages
    pending: int | None = None  # a sampled token not fed yet
    text_done: bool = False  # eos, a stop id or max_new_tokens ended the text
    awaiting: bool = False  # a step sampled for this row; its token is not accepted yet
    preemptions: int = 0
    choice: tuple[int, ...] = ()  # size=auto: after the tail, draw one of these ids (empty: nothing to draw)
    chosen: int | None = None  # the id drawn among `choice`
    keys: tuple[bytes, ...] = ()  # prefix cache: the keys of the head's full pages (empty: not cached)
    cache_hit: int = 0  # tokens of the head its row took from the prefix cache (this admission)

    def __post_init__(self) -> None:
        if not self.head:
            raise ValueError("the AR prefill needs at least one token (<bos>)")
        if self.max_new_tokens <= 0:
            self.text_done = True

    @property
    def tokens(self) -> list[int]:
        """The row as far as it is known: head, the generated text, then the tail once it ends."""
        return self.head + self.generated + (self.tail if self.text_done else [])

    @property
    def done(self) -> bool:
        fed = self.text_done and self.pending is None and self.computed == len(self.tokens)
        return fed and not self.awaiting and (not self.choice or self.chosen is not None)

    def work(self, budget: int | None) -> ARWorkPlan | None:
        """What the next step feeds (None: nothing fits `budget` query tokens, or nothing is left).
        A head chunk never splits a full-attention block (`whole_head`)."""
        if self.done or self.awaiting:
            return None
        if self.computed < len(self.head):
            rest = len(self.head) - self.computed
            n = rest if budget is None else min(rest, budget)
            if n <= 0 or (self.whole_head and n < rest):
                return None
            ids = self.head[self.computed:self.computed + n]
            last = self.computed + n == len(self.head)
            return ARWorkPlan(ids, self.computed, last and not self.text_done)
        ids = [] if self.pending is None else [self.pending]
        if not self.text_done:
            return self._fits(ARWorkPlan(ids, self.computed, True), budget)
        # the last token and the tail in one chunk; with a choice, its draw comes from the tail's end
        choice = self.choice or None
        return self._fits(ARWorkPlan(ids + self.tail, self.computed, choice is not None, choice), budget)

    @staticmethod
    def _fits(plan: ARWorkPlan, budget: int | None) -> ARWorkPlan | None:
        n = len(plan.token_ids)
        return None if n == 0 or (budget is not None and n > budget) else plan

    def fed(self, plan: ARWorkPlan) -> None:
        """The step that fed `plan` ran; its sampled token (if any) comes through `accept`."""
        self.computed = plan.start + len(plan.token_ids)
        if self.pending is not None and plan.token_ids[:1] == [self.pending]:
            self.pending = None
        self.awaiting = plan.sample

    def accept(self, token: int) -> None:
        """The token the worker drew after the last fed position."""
        if not self.awaiting:
            raise ValueError("no token was sampled for this row")
        self.awaiting = False
        if self.text_done:  # the draw after the tail: the choice
            if int(token) not in self.choice:
                raise ValueError(f"token {token} is not one of the {len(self.choice)} allowed ids")
            self.chosen = int(token)
            return
        if self.eos_id is not None and token == self.eos_id:
            self.text_done = True  # eos is dropped: the tail follows the text
            return
        self.generated.append(int(token))
        self.pending = int(token)
        if token in self.stop_ids or len(self.generated) >= self.max_new_tokens:
            self.text_done = True

    def tokens_after(self, plan: ARWorkPlan) -> int:
        """Token slots the row needs once `plan` is fed."""
        return plan.start + len(plan.token_ids)

    def max_tokens(self) -> int:
        """The most slots the row can ever need (admission sizes the pool check with it)."""
        return len(self.head) + self.max_new_tokens + len(self.tail)

    def skip(self, tokens: int) -> None:
        """The row begins with `tokens` of the head already in its pages (prefix-cache pages): the first
        work starts after them. Only before anything is fed, and never the head's last token (it draws)."""
        if self.computed or self.awaiting or not 0 <= tokens < len(self.head):
            raise ValueError(f"cannot skip {tokens} of a {len(self.head)}-token head with {self.computed} fed")
        self.computed = self.cache_hit = tokens

    def restart(self) -> None:
        """Preempted: the pages are gone; recompute from the head. The text is drawn again from the
        request's seed, so it is the same text (bit-identical on CPU fp32, like batching)."""
        self.generated, self.computed, self.pending, self.chosen, self.cache_hit = [], 0, None, None, 0
        self.text_done = self.max_new_tokens <= 0
        self.awaiting = False
        self.preemptions += 1
