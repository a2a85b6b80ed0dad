"""The AR phases of the engine's step loop on one rank: every engine step, ONE forward over the AR
work of every request in an AR phase (prefill chunks and one-token decode queries), with the next
token drawn on the device for the works that ask for it.

The engine owns the AR rows' pages and decides stops; a rank keeps per request only what the pass
needs between steps (`ARRow`: the accepted block table and generation, the tokens written, the
sampling generator). Each work is checked before the pass (DESIGN invariant 5): a refused work never
enters it and changes nothing. The pass is `ARRunner._forward` for several rows: each work is a
paged row with its own queries `[start, start + n)` and limit `pos + 1` (a decode token is a row of
one query), through the same paged attention adapter and pool as the DiT rows, so a request's K/V
and tokens equal `ARRunner.run`'s and do not depend on what shared the step (CPU fp32: bit for bit).

Rank groups agree by vote (`agree`: on the refused works, `any_failed`: on a failed pass), so every
rank feeds the same works into the same collectives. The works are `engine.messages.ARWork`s (read by
field: the worker layer imports no engine module), and so is the head builder of a work with input
images (`head_of`, the engine's `ar_head_of`). Such a work carries the whole head from 0, which the rank
rebuilds and checks. After a prefix-cache hit it is fed from `cached` on (`fed_part`), and the images
wholly before that are not encoded (docs/prefix-cache-ar.md).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import torch

from ..attention.adapter import PagedAttentionAdapter
from ..attention.metadata import RowPhase, build_paged_metadata
from ..errors import MetadataError
from ..models.family import family_of
from ..models.text_settings import TextSampling
from .conditioning import CondEmbeds, encode_images
from .denoising import covered_images
from .sampling import row_generator, sample
from .step_inputs import Request as StepRequest, TokenRow, build as build_inputs, embed

log = logging.getLogger("ditkv.worker")
PEER_REFUSED = "stopped: the AR work was refused on a peer rank"
PEER_PASS = "stopped: the AR pass failed on a peer rank"


@dataclass
class ARRow:
    """What a rank keeps of one request's AR row between steps."""

    generation: int
    table: list[int]
    length: int = 0  # tokens whose K/V are in the pages: the next work starts here
    generator: torch.Generator | None = None  # its sampling noise, from the first drawing work's seed


@dataclass
class _Item:
    """An accepted work of this step and the row it leaves behind once the pass succeeds."""

    work: object  # the `ARWork`
    row: ARRow
    settings: TextSampling | None
    head: object = None  # the family's ARHead of a work with input images
    cond: CondEmbeds | None = None


class ARStepper:
    def __init__(self, worker):
        self.worker = worker
        self.rows: dict[str, ARRow] = {}
        self._banned: torch.Tensor | None = None
        self._graphs = None  # `ar_graph.DecodeGraphs` (CUDA), False where graphs are off or unusable

    def end(self, request_id: str) -> None:
        """Forget a request's AR row (its pages stay the scheduler's); idempotent."""
        self.rows.pop(request_id, None)

    def blocks_in_use(self, exclude_request: str | None = None) -> set[int]:
        """The pages an AR row may still write (from the page of its next position on): no other row may
        hold them. Its earlier pages are written and read-only (they may be prefix-cache pages)."""
        bs = self.worker.pool.block_size
        return {b for rid, row in self.rows.items() if rid != exclude_request for b in row.table[row.length // bs:]}

    def pages_held(self) -> set[int]:
        """Every page of every AR row (a DiT row may hold none of them as its own, written page)."""
        return {b for row in self.rows.values() for b in row.table}

    @torch.inference_mode()
    def run(self, works: list, any_failed: Callable[[bool], bool] | None = None,
            agree: Callable[[list[bool]], list[bool]] | None = None,
            head_of: Callable | None = None) -> tuple[list[int], dict[str, str]]:
        """One AR pass over `works` (`ARWork`s) -> (one sampled id per work, -1 where none was drawn;
        request id -> error of the refused or failed works). `agree` (rank groups): told which works this
        rank refused, returns which any rank refused; `any_failed`: as in `BatchStepper.step`;
        `head_of(model config, tokenizer, HeadImages, ids)`: the head of a work with input images. A
        failed pass forgets its requests' rows (their pages may be half written): the engine fails them."""
        failed: dict[str, str] = {}
        items = self._accept(works, failed, head_of)
        if agree is not None and works:
            for i, refused in enumerate(agree([it is None for it in items])):
                if refused and items[i] is not None:
                    items[i] = None
                    failed[works[i].request_id] = PEER_REFUSED
        ids = [-1] * len(works)
        live = [(i, it) for i, it in enumerate(items) if it is not None]
        if not live:
            return ids, failed
        err = drawn = None
        try:
            drawn = self._pass([it for _, it in live])
        except Exception as e:  # the shared pass failed: none of its works can continue
            log.exception("AR pass over %d works failed", len(live))
            err = f"{type(e).__name__}: {e}"
        if any_failed is not None and any_failed(err is not None) and err is None:
            err = PEER_PASS
        for (i, it), tok in zip(live, drawn if err is None else [-1] * len(live)):
            rid = it.work.request_id
            if err is None:
                self.rows[rid], ids[i] = it.row, tok
            else:
                self.end(rid)
                failed[rid] = err
        return ids, failed

    # ---- checks (before the pass: a refused work writes nothing) ---------------------------------
    def _accept(self, works: list, failed: dict[str, str], head_of) -> list[_Item | None]:
        """Each work checked in order; a work may not write a page of a DiT row, of another request's
        AR row, or of a work accepted before it in this step."""
        w = self.worker
        dit = (w.rows.blocks_in_use(), w.rows.writable_blocks()) if w.rows is not None else (set(), set())
        bs = w.pool.block_size if w.pool is not None else 1
        owner: dict[int, set[str]] = {}  # page -> the AR rows that hold it (shared prefix-cache pages: several)
        writer = {b: rid for rid, row in self.rows.items() for b in row.table[row.length // bs:]}
        for rid, row in self.rows.items():
            for b in row.table:
                owner.setdefault(b, set()).add(rid)
        count = Counter(wk.request_id for wk in works)
        items: list[_Item | None] = []
        for wk in works:
            try:
                if count[wk.request_id] > 1:
                    raise MetadataError(f"request {wk.request_id!r} has {count[wk.request_id]} AR works in one "
                                        "step; send at most one per request and step")
                item = self._check(wk, owner, writer, dit, head_of)
            except Exception as e:
                log.warning("AR work of request %s refused: %s", wk.request_id, e)
                failed[wk.request_id] = f"{type(e).__name__}: {e}"
                item = None
            else:
                for b in item.row.table:
                    owner.setdefault(b, set()).add(wk.request_id)
                writer.update((b, wk.request_id) for b in item.row.table[item.work.start // bs:])
            items.append(item)
        return items

    def _check(self, wk, owner: dict[int, set[str]], writer: dict[int, str], dit: tuple[set[int], set[int]],
               head_of) -> _Item:
        w = self.worker
        if w.pool is None:
            raise MetadataError(f"request {wk.request_id!r}: AR work sent to a dense_legacy worker; AR phases "
                                "run over the page pool (set diffusion_kv_mode=paged_scheduler)")
        if w.parallel.sp_size > 1:
            raise MetadataError(f"request {wk.request_id!r}: the AR pass does not shard its tokens; run AR "
                                "phases with ulysses_degree=1")
        prev = self.rows.get(wk.request_id)
        wk, whole = fed_part(wk)
        check_table(wk, prev, w.pool.num_blocks, w.pool.block_size)
        check_tokens(wk, prev, w.model.config.vocab_size)
        check_allowed(wk, w.model.config.vocab_size)
        check_pages(wk, owner, writer, dit, w.pool.block_size)
        settings = wire_settings(wk)
        head = self._head(wk, whole, settings, head_of)
        gen = prev.generator if prev is not None else None
        if wk.sample and gen is None and not settings.greedy:
            gen = row_generator(settings.seed, w.model.device)
        row = ARRow(wk.generation, list(wk.block_ids), wk.start + len(wk.token_ids), gen)
        return _Item(wk, row, settings, head)

    def _head(self, wk, whole: list[int] | None, settings: TextSampling | None, head_of):
        """The head of a work with input images, `whole` its ids (host work only: every check runs before
        any rank enters the pass's collectives; the images are encoded in the pass)."""
        if wk.images is None:
            return None
        if settings is None:
            raise MetadataError(f"request {wk.request_id!r}: a work with input images needs `sampling`: its "
                                "seed draws the images' VAE samples")
        if head_of is None:
            raise MetadataError(f"request {wk.request_id!r}: a work with input images needs a head builder "
                                "(run(..., head_of=engine.messages.ar_head_of))")
        w = self.worker
        if w.codec is None:
            raise MetadataError(f"request {wk.request_id!r}: input images need the model's image codec; this "
                                "worker has none (load the model with its VAE)")
        return head_of(w.model.config, w.tokenizer, wk.images, whole)

    # ---- the pass -------------------------------------------------------------------------------
    def _pass(self, items: list[_Item]) -> list[int]:
        """One backbone pass over every item's tokens (one paged row each) -> the drawn ids."""
        w = self.worker
        model, dev = w.model, w.model.device
        replay = self._graph_logits(items)
        if replay is not None:  # every item a one-token decode: the captured pass
            ids = self._draw(replay, items)
            return ids.tolist()  # the step's one device-to-host transfer
        phases, reqs, last, off = [], [], [], 0
        for it in items:
            if it.head is not None and it.head.images:
                # VAE samples from a CPU generator seeded by the request's seed, as ARRunner and the DiT draw
                # them; the images wholly in cached pages are skipped, the generator advanced past their samples
                gen = torch.Generator(device="cpu").manual_seed(int(it.settings.seed))
                skip = covered_images(it.head, [it.work.start])
                it.cond = encode_images(model, w.codec, it.head.images, gen, skip=skip)
            wk, n = it.work, len(it.work.token_ids)
            phases.append(RowPhase(off, wk.start, n, wk.start + n, () if it.head is None else it.head.spans))
            reqs.append(step_request(it))
            off += n
            last.append(off - 1)
        meta = build_paged_metadata(phases, [it.row.table for it in items], w.pool.block_size, dev)
        attn = PagedAttentionAdapter(w.backend, w.pool, meta, 1.0 / math.sqrt(model.config.attention_head_dim))
        inp = build_inputs(reqs, dev)  # the DiT's own builder: the same embeddings, so the same K/V
        hidden = model.backbone(embed(model, inp, [], []), inp.buf["py"], inp.buf["px"], attn)
        out = [-1] * len(items)
        drawing = [i for i, it in enumerate(items) if it.work.sample]
        if drawing:
            at = torch.tensor([last[i] for i in drawing], device=dev)
            ids = self._draw(self._logits(hidden.index_select(0, at)), [items[i] for i in drawing])
            for i, tok in zip(drawing, ids.tolist()):  # the step's one device-to-host transfer
                out[i] = tok
        return out

    def _graph_logits(self, items: list[_Item]) -> torch.Tensor | None:
        """The logits of a decode-only step from a CUDA graph replay (`ar_graph.py`), or None: not
        every item is a drawing one-token decode, graphs are off or unusable here, or the bucket is
        not captured yet."""
        if not all(it.work.sample and len(it.work.token_ids) == 1 and it.head is None for it in items):
            return None
        if self._graphs is False:
            return None
        if self._graphs is None:
            from .ar_graph import DecodeGraphs, decode_graph_unusable

            w = self.worker
            why = None if w.config.cuda_graphs != "off" else "cuda_graphs=off"
            why = why or decode_graph_unusable(w, w.backend)
            self._graphs = False if why else DecodeGraphs(w, w.backend)
            self.graphs_off = why
            if why:
                return None
        return self._graphs.logits([it.work.token_ids[0] for it in items], [it.work.start for it in items],
                                   [list(it.row.table) for it in items])

    def _logits(self, last: torch.Tensor) -> torch.Tensor:
        """The text head over the items' last hidden states [S, hidden]."""
        model = self.worker.model
        if last.device.type == "cpu":  # `ARRunner`'s M = 1 text head: a CPU GEMM's bits depend on M
            return torch.cat([model.logits(h[None]) for h in last])
        return model.logits(last)

    def _draw(self, logits: torch.Tensor, items: list[_Item]) -> torch.Tensor:
        """The next token of each item from its logits [S, vocab], on the device."""
        settings = [it.settings for it in items]
        gens = [it.row.generator for it in items]
        allowed = [None if it.work.allowed is None else torch.tensor(it.work.allowed, dtype=torch.long).to(
            logits.device, non_blocking=True) for it in items]
        # `sample` cuts every row of a call once one row cuts (top-k / top-p), and a cut at top_p 1 may
        # still drop ids whose mass rounds away: rows that cut and rows that don't never share a call
        cuts = [0 < s.top_k < logits.shape[-1] or s.top_p < 1 for s in settings]
        groups = [[i for i, c in enumerate(cuts) if c == flag] for flag in (False, True)]
        if not all(groups):
            return sample(logits, settings, gens, self.banned, allowed)
        out = torch.empty(len(items), dtype=torch.long, device=logits.device)
        for sel in groups:
            at = torch.tensor(sel, device=logits.device)
            out[at] = sample(logits[at], [settings[i] for i in sel], [gens[i] for i in sel], self.banned,
                             [allowed[i] for i in sel])
        return out

    @property
    def banned(self) -> torch.Tensor:
        """The ids text generation never emits (the family's), on the device; computed once."""
        if self._banned is None:
            cfg = self.worker.model.config
            ids = sorted(family_of(cfg).banned_generation_ids(cfg))
            self._banned = torch.tensor(ids, dtype=torch.long, device=self.worker.model.device)
        return self._banned


def step_request(it: _Item) -> StepRequest:
    """One work's tokens for `step_inputs.build`: text positions are 1D (y = x = index); a head with
    input images brings its 2D positions, its images and their embeddings."""
    wk, n = it.work, len(it.work.token_ids)
    if it.head is None:
        py = px = torch.arange(wk.start, wk.start + n)
        row = TokenRow(torch.tensor(wk.token_ids, dtype=torch.long), py, px)
        return StepRequest([row], [(0, n)])
    # the whole head, its queries from `start` on (a prefix-cache hit may end inside an image's block: its
    # remaining slots are filled here and see the whole block through the span's key limit)
    row = TokenRow(torch.tensor(it.head.token_ids, dtype=torch.long), it.head.pos_y, it.head.pos_x)
    return StepRequest([row], [(wk.start, wk.start + n)], images=it.head.images, cond=it.cond)


def fed_part(wk) -> tuple[object, list[int] | None]:
    """(the work as fed, the whole head's ids or None). A work with input images is its row's first and
    carries the whole head from 0, which the rank rebuilds and checks (`head_of`); with `cached`
    prefix-cache positions it feeds the head only from there on (`ARWork` keeps `images` at start 0)."""
    if wk.images is None:
        return wk, None
    if wk.start != 0:
        raise MetadataError(f"request {wk.request_id!r}: input images come with the head only (start 0, "
                            f"token_ids the whole head), got start={wk.start}")
    whole, cached = list(wk.token_ids), getattr(wk, "cached", 0)
    if type(cached) is not int or cached <= 0:
        return wk, whole  # no cached positions, or a bad value that `check_table` names
    if cached >= len(whole):
        raise MetadataError(f"request {wk.request_id!r}: cached={cached} covers the whole {len(whole)}-token head; "
                            "the head's last token is always fed (its logits draw), so cache at most its "
                            "earlier whole pages")
    return msgspec.structs.replace(wk, token_ids=whole[cached:], start=cached), whole


def check_table(wk, prev: ARRow | None, num_blocks: int, block_size: int) -> None:
    """The work's block table: valid ids, no page twice, the accepted table's extension, enough pages."""
    rid, ids = wk.request_id, wk.block_ids
    if type(wk.generation) is not int or wk.generation < 0:  # a bool is an int in Python
        raise MetadataError(f"request {rid!r}: generation must be an int >= 0, got {wk.generation!r}; send the "
                            "generation the scheduler stamped on the AR row's table")
    odd = [b for b in ids if type(b) is not int]
    if odd:
        raise MetadataError(f"request {rid!r}: block ids must be ints, got {odd[:4]!r}; send the block ids the "
                            "scheduler reserved")
    bad = [b for b in ids if not 0 <= b < num_blocks]
    if bad:
        raise MetadataError(f"request {rid!r}: block ids {bad[:4]} outside [0, {num_blocks})")
    twice = sorted(b for b, c in Counter(ids).items() if c > 1)
    if twice:
        raise MetadataError(f"request {rid!r}: block ids {twice[:4]} appear more than once in the table; each "
                            "page of a row is its own block")
    if prev is not None:
        if wk.generation < prev.generation:
            raise MetadataError(f"request {rid!r}: stale generation {wk.generation} < accepted {prev.generation}")
        if ids[:len(prev.table)] != prev.table:
            raise MetadataError(f"request {rid!r}: the table does not extend the accepted one (its first "
                                f"{len(prev.table)} blocks {prev.table[:4]}...); an AR row's table only grows "
                                "within its phase (end_ar, then restart from 0)")
        if len(ids) != len(prev.table) and wk.generation == prev.generation:
            raise MetadataError(f"request {rid!r}: the table grew at generation {wk.generation}, which was "
                                "accepted with the shorter table; stamp a new generation when the table grows")
    cached = getattr(wk, "cached", 0)
    if type(cached) is not int or cached < 0 or cached % block_size or cached // block_size > len(ids):
        raise MetadataError(f"request {rid!r}: cached={cached!r} must be whole pages of the table "
                            f"(a multiple of {block_size}, at most {len(ids)} pages)")
    need = -(-(wk.start + len(wk.token_ids)) // block_size)
    if len(ids) < need:
        raise MetadataError(f"request {rid!r}: {wk.start + len(wk.token_ids)} tokens need {need} pages of "
                            f"{block_size}, the table has {len(ids)}; grow the table first")


def check_tokens(wk, prev: ARRow | None, vocab: int) -> None:
    """The fed tokens: at least one, valid ids, right after the tokens already in the pages."""
    rid = wk.request_id
    if not wk.token_ids:
        raise MetadataError(f"request {rid!r}: token_ids is empty; an AR work feeds at least one token")
    bad = [t for t in wk.token_ids if type(t) is not int or not 0 <= t < vocab]
    if bad:
        raise MetadataError(f"request {rid!r}: token ids {bad[:4]!r} are not ints in [0, {vocab}) (the "
                            "model's vocabulary)")
    length = getattr(wk, "cached", 0) if prev is None else prev.length  # a new row: after its cached pages
    if wk.start != length:
        raise MetadataError(f"request {rid!r}: start={wk.start} but {length} tokens are in its pages; feed the "
                            f"next token at position {length} (or end_ar and restart from 0)")


def check_pages(wk, owner: dict[int, set[str]], writer: dict[int, str], dit: tuple[set[int], set[int]],
                block_size: int) -> None:
    """No page in two places unless nobody writes it: the pages this work may write (from the page of
    `start` on) are in no other row, DiT or AR; its earlier pages (written, or prefix-cache pages) are
    no other row's still-written page (`dit` = (every DiT page, the DiT pages still written))."""
    mine, table = wk.request_id, wk.block_ids
    cut = wk.start // block_size
    for b in table[cut:]:
        others = owner.get(b, set()) - {mine}
        if b in dit[0] or others:
            whose = "a DiT row" if b in dit[0] else f"the AR row of request {sorted(others)[0]!r}"
            raise MetadataError(f"request {mine!r}: block id {b} is in use by {whose}; give every row its own "
                                "pages (end the other row first), or share only written prefix-cache pages")
    for b in table[:cut]:
        if b in dit[1] or writer.get(b, mine) != mine:
            whose = "a DiT row" if b in dit[1] else f"the AR row of request {writer[b]!r}"
            raise MetadataError(f"request {mine!r}: block id {b} before its start is still written by {whose}; a "
                                "row shares only pages nobody writes any more (prefix-cache pages)")


def check_allowed(wk, vocab: int) -> None:
    """`allowed` (size=auto: the ids the draw is confined to): only on a drawing work, distinct ids of the
    vocabulary, at least one."""
    ids = getattr(wk, "allowed", None)
    if ids is None:
        return
    rid = wk.request_id
    if not wk.sample:
        raise MetadataError(f"request {rid!r}: allowed confines a draw, and this work draws nothing (sample=False); "
                            "send allowed only with sample=True")
    if not ids:
        raise MetadataError(f"request {rid!r}: allowed is empty; give the ids the draw may take, or None for any")
    bad = [t for t in ids if type(t) is not int or not 0 <= t < vocab]
    if bad:
        raise MetadataError(f"request {rid!r}: allowed ids {bad[:4]!r} are not ints in [0, {vocab}) (the model's "
                            "vocabulary)")
    if len(set(ids)) != len(ids):
        raise MetadataError(f"request {rid!r}: allowed lists an id twice; list each id once, in the order a tie "
                            "goes by")


def wire_settings(wk) -> TextSampling | None:
    """The work's `TextSampling` (validated again here); required when it draws a token."""
    if wk.sampling is None:
        if wk.sample:
            raise MetadataError(f"request {wk.request_id!r}: sample=True needs `sampling` "
                                "(text_settings.to_wire of the request's TextSampling)")
        return None
    try:
        return TextSampling(**wk.sampling)
    except TypeError as e:  # unknown or missing keys
        raise MetadataError(f"request {wk.request_id!r}: sampling {wk.sampling!r} is not a TextSampling ({e}); "
                            "send text_settings.to_wire(settings)") from e
