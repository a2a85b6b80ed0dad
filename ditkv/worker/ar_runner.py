"""AR stage runner: the same transformer run causally as a language model over its own page pool.

It prefills a head (`<bos>` and the templated prompt), optionally generates up to N text tokens
(greedy or sampled; eos or a stop id ends it), then prefills a tail (`<boi> <img_size> <img_ratio>`):
exactly the DiT's prefix for the cond row, or as much of it as the AR can know (a think/recaption
rewrite: the orchestrator builds the DiT row from the generated text and imports the common part). Text RoPE is
1D (y = x = index), so the K/V written here at position p are the K/V the DiT would compute for
the same token at p: they can be imported page by page instead of recomputed.

Attention goes through the same `PagedAttentionAdapter` as the DiT, with one row whose span list
is empty (pure causal), so the page layout and geometry are identical on both stages. A head with
input images (the family's `ARHead`) brings their blocks as full-attention spans, their 2D positions and their
embeddings (`conditioning.py`, the DiT's own functions): the image-conditioned prefix's K/V are the
DiT's too. The runner
never allocates or frees blocks: the AR stage passes it the block ids it reserved.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from ..attention.adapter import PagedAttentionAdapter
from ..attention.metadata import RowPhase, build_paged_metadata
from .conditioning import CondEmbeds, encode_images
from ..models.text_settings import TextSampling
from .sampling import row_generator, sample
from .step_inputs import Request as StepRequest, TokenRow, build as build_inputs, embed


GREEDY = TextSampling()  # no text unless max_new_tokens is given; argmax when it is


@dataclass
class ARResult:
    request_id: str
    token_ids: list[int]  # the whole prefix whose K/V sit in the pages, in order
    generated_ids: list[int] = field(default_factory=list)  # text tokens the AR produced (no eos; a stop id kept)
    tokens_computed: int = 0
    chosen: int | None = None  # size=auto: the ratio id drawn after the tail (not in token_ids: the DiT feeds it)
    stats: dict = field(default_factory=dict)  # an AR stage's `RequestStats` ar_* fields of this job


class ARRunner:
    def __init__(self, model, backend, pool, codec=None):
        if pool.block_size <= 0 or not backend.supports_paged:
            raise ValueError("the AR runner needs a paged backend and a page pool")
        self.model, self.backend, self.pool = model, backend, pool
        self.codec = codec  # encodes a head's input images (image-conditioned generation)
        self.scale = 1.0 / math.sqrt(model.config.attention_head_dim)

    @property
    def device(self):
        return self.model.device

    def _forward(self, token_ids: list[int], start: int, block_ids: list[int], head=None,
                 cond: CondEmbeds | None = None) -> torch.Tensor:
        """Causal pass over tokens at positions [start, start + n); writes their K/V into the pages
        and returns the last token's hidden state. `head` (from 0): the input images' full-attention
        spans, 2D positions and slots, filled with `cond`."""
        n = len(token_ids)
        if -(-(start + n) // self.pool.block_size) > len(block_ids):
            raise ValueError(f"{start + n} tokens need more than the {len(block_ids)} pages given")
        spans = () if head is None else head.spans
        meta = build_paged_metadata([RowPhase(0, start, n, start + n, spans)], [list(block_ids)],
                                    self.pool.block_size, self.device)
        attn = PagedAttentionAdapter(self.backend, self.pool, meta, self.scale)
        if head is None:
            py = px = torch.arange(start, start + n)
        else:
            py, px = head.pos_y, head.pos_x
        row = TokenRow(torch.tensor(token_ids, dtype=torch.long), py, px)
        inp = build_inputs([StepRequest([row], [(0, n)], images=() if head is None else head.images, cond=cond)],
                           self.device)  # the DiT's own builder: the same embeddings, so the same K/V
        return self.model.backbone(embed(self.model, inp, [], []), inp.buf["py"], inp.buf["px"], attn)[-1]

    @torch.inference_mode()
    def run(self, request_id: str, head_ids: list[int], tail_ids: list[int], block_ids: list[int],
            sampling: TextSampling = GREEDY, eos_id: int | None = None, banned: Iterable[int] = (),
            stop_ids: Iterable[int] = (), head=None) -> ARResult:
        """Prefill `head_ids`, generate up to `sampling.max_new_tokens`, prefill `tail_ids`.

        Tokens are drawn on the device by `worker.sampling.sample` (greedy = argmax), the noise from a
        generator on the device seeded by `sampling.seed` (reproducible per request). `eos_id` ends
        generation and is dropped; a token in `stop_ids` ends it too but is kept (text and K/V), as
        the release keeps `</recaption>` in its rewrite. `head`: the head with input images
        (`build_ar_head`, its ids must be `head_ids`); their VAE samples are drawn from a CPU
        generator seeded by `sampling.seed`, images in order, as the DiT draws them."""
        ids = list(head_ids)
        if not ids:
            raise ValueError("the AR prefill needs at least one token (<bos>)")
        cond = None
        if head is not None:
            if list(head.token_ids) != ids:
                raise ValueError("the AR head's image layout does not match its token ids")
            if head.images:
                cond = encode_images(self.model, self.codec, head.images,
                                     torch.Generator(device="cpu").manual_seed(int(sampling.seed)))
        last = self._forward(ids, 0, block_ids, head, cond)
        computed = len(ids)
        generated: list[int] = []
        if sampling.max_new_tokens > 0:
            banned_t = torch.tensor(sorted(set(banned)), dtype=torch.long, device=self.device)
            gen = None if sampling.greedy else row_generator(sampling.seed, self.device)
            stops = {int(i) for i in stop_ids}
            for _ in range(sampling.max_new_tokens):
                logits = self.model.logits(last[None])
                tok = int(sample(logits, [sampling], [gen], banned_t)[0])  # the one host sync per token
                if eos_id is not None and tok == eos_id:
                    break
                generated.append(tok)
                last = self._forward([tok], len(ids), block_ids)
                ids.append(tok)
                computed += 1
                if tok in stops:
                    break
        if tail_ids:
            self._forward(list(tail_ids), len(ids), block_ids)
        ids.extend(tail_ids)
        computed += len(tail_ids)
        return ARResult(request_id, ids, generated, computed)
