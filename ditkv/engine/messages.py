"""Control messages between the engine and its worker ranks (ZeroMQ frames, msgpack via msgspec).

Every message is a tagged struct, so one decoder reads any of them. A request joins the ranks'
running batch as a `NewRequest` inside the next `BatchStep`: its metadata snapshot
(`DiffusionKVMetadata`), the layout the front end built (ranks never tokenize) and its
`SamplingParams`. A request in its AR phase sends an `ARWork` with each `BatchStep` (a prefill chunk or
one decode token); the ranks answer the sampled ids. Only the output rank sends the image back. Images
travel as raw bytes plus their shape.
"""

from __future__ import annotations

import msgspec

from ..core.metadata import DiffusionKVMetadata
from ..transfer.ticket import DestEndpoint, RankDest

# step-boundary votes, all-reduced (MAX) across the ranks of one group so all stop at the same step
GO, STOP, ERROR = 0, 1, 2


class Msg(msgspec.Struct, tag=True, kw_only=True):
    pass


# ---- engine -> ranks ------------------------------------------------------------------------
class InitCache(Msg):
    num_blocks: int | None  # the pool size every rank agreed to (min over ranks); None = dense


class LegacyImport(msgspec.Struct, kw_only=True):
    """Legacy transfer into a DiT rank: which receive slot holds the prefix, how many tokens each
    row takes, and the producer's layout (source ranks' head ranges = the slot's chunks)."""
    slot: int
    tokens_per_row: list[int]
    num_layers: int
    head_dim: int
    src_heads: list[tuple[int, int]]


class InputImage(msgspec.Struct, array_like=True):
    """One decoded input image on the wire: RGB uint8 bytes (C order) and their shape [H, W, 3]."""
    data: bytes
    shape: tuple[int, int, int]


def pack_images(images) -> list[InputImage] | None:
    """`GenerationRequest.images` (uint8 arrays [H, W, 3]) -> wire form; None for no images."""
    if not images:
        return None
    return [InputImage(data=a.tobytes(), shape=tuple(int(d) for d in a.shape)) for a in images]


def unpack_images(images: list[InputImage] | None):
    """Wire form -> read-only uint8 arrays [H, W, 3] (views of the message bytes); None for none."""
    if not images:
        return None
    import numpy as np

    return [np.frombuffer(im.data, dtype=np.uint8).reshape(im.shape) for im in images]


class HeadImages(msgspec.Struct, array_like=True):
    """An AR head's input images on the wire, with the request fields the AR side rebuilds the head's
    layout from (`build_ar_head`: the same buckets, slots and positions as the DiT's image row)."""
    prompt: str
    height: int  # the output size: it picks the input images' buckets
    width: int
    rewrite_input: bool  # the head is a think/recaption AR input, not the cond row's text
    images: list[InputImage]
    bot_task: str | None = None  # the request's own task (its template); None: the checkpoint's


def ar_head_of(cfg, tokenizer, wire: HeadImages | None, head_ids):
    """The `ARHead` an AR stage prefills for `head_ids` (None: a text-only head); refuses a head whose
    rebuilt ids differ (the stages' tokenizers or templates disagree)."""
    if wire is None:
        return None
    from ..errors import LayoutError
    from ..models.family import family_of

    fam = family_of(cfg)
    template = None if wire.bot_task is None else fam.template.request_settings(cfg, wire.bot_task)
    head = fam.ar_head(cfg, tokenizer, wire.prompt, wire.height, wire.width, rewrite_input=wire.rewrite_input,
                       images=unpack_images(wire.images), template=template)
    if head.token_ids != list(head_ids):
        raise LayoutError("the AR stage rebuilt a different prompt with images than the orchestrator sent: the "
                          "stages must load the same model folder (tokenizer, config, prompt template)", field="image")
    return head


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How one request samples: resolved once at intake (the model's defaults filled in)."""
    steps: int
    guidance: float
    seed: int
    # the request's own step cache (`step_cache_config.StepCacheConfig.to_wire`); None: the engine's
    cache: dict | None = None


class NewRequest(Msg):
    """A request joining the running batch. Ranks check the layout against the metadata before
    writing anything."""
    request_id: str
    metadata: DiffusionKVMetadata | None  # None: dense_legacy
    layout: bytes  # the model family's wire form of the request layout (`ModelFamily.layout_to_wire`)
    params: SamplingParams
    reuse_prefix: bool = True
    legacy: LegacyImport | None = None  # dense_legacy stage replicas: fill the dense cache from a slot


class Shutdown(Msg):
    pass


class RegisterReceive(Msg):
    """Expect a KV transfer into this rank's pool: rows are (row id, tokens, destination block ids)."""
    ticket_id: str
    rows: list[tuple[int, int, list[int]]]


class Unregister(Msg):
    ticket_id: str  # the receive is over (ran, or settled after a failure)


class SendKV(Msg):
    """AR rank: write its KV-head range of `src_blocks` to every destination rank it overlaps."""
    ticket_id: str
    mode: str
    src_blocks: list[int]
    num_tokens: int
    dest: DestEndpoint


# ---- ranks -> engine ------------------------------------------------------------------------
class Ready(Msg):
    rank: int
    pid: int
    num_blocks: int | None = None  # what this rank can afford (paged mode)
    error: str | None = None  # startup failed; the engine raises it
    device: str | None = None  # the device this rank bound (placement checks)
    weight_bytes: int | None = None  # the rank's parameter bytes (a sharded load: its shard only)


class Ack(Msg):
    rank: int
    error: str | None = None
    dest: RankDest | None = None  # with a KV consumer: where producers write into this rank's pool


class Registered(Msg):
    rank: int
    ticket_id: str
    error: str | None = None  # the rank refused
    bad_block_ids: bool = False  # ... because the block ids lie outside its pool (`BadBlockIdsError`)


class Received(Msg):
    """A completion notice this rank's consumer saw (data landed in its pool)."""
    rank: int
    ticket_id: str
    notice_rank: int  # the rank the notice names (must equal `rank`; the replica checks)
    rows: list[int]
    src_rank: int = 0  # the producer rank that wrote (a tensor-parallel AR has several)


class Sent(Msg):
    """An AR rank's write of one ticket to one destination rank returned (ok, or `error`)."""
    rank: int
    ticket_id: str
    dest_rank: int
    nbytes: int = 0
    error: str | None = None


class Heartbeat(Msg):
    rank: int


class RankStats(msgspec.Struct, kw_only=True):
    steps: int = 0
    prefix_tokens_reused: int = 0
    tokens_computed: int = 0
    imported_tokens: int = 0
    cached_steps: int = 0
    encoder_cache_hits: int = 0


class RankEnd(Msg):
    """How one request ended on one rank (inside its `BatchDone`); its rows are already cleared."""
    request_id: str
    rank: int
    status: str  # "ok" | "stopped" (a peer rank failed) | "error"
    error: str | None = None
    image: bytes | None = None  # output rank only, status "ok"
    image_shape: tuple[int, ...] | None = None
    stats: RankStats | None = None


class ARWork(msgspec.Struct, kw_only=True):
    """One request's AR work in one step: feed `token_ids` at positions [start, start + len) into its row's pages."""
    request_id: str
    generation: int  # the AR row's block-table generation (grows by 1 when the table grows)
    block_ids: list[int]  # the row's whole block table so far; append-only across steps of one AR phase
    token_ids: list[int]  # a prefill chunk, or the one token sampled last step
    start: int  # position of token_ids[0]; positions [0, start) are already in the pages
    sample: bool = False  # draw the next token from the last fed position's logits
    sampling: dict | None = None  # `ditkv.models.text_settings.to_wire(TextSampling)`; required when sample is True
    # only with start == 0: the head's input images; token_ids is then the whole head (the rank rebuilds and checks
    # it), fed from `cached` on after a prefix-cache hit (`worker/ar_batch.fed_part`)
    images: HeadImages | None = None
    # only with sample: draw among these ids alone (size=auto: the <img_ratio_k> of each bucket, k in order); the
    # family's banned ids do not apply, and a greedy draw takes the first of the largest logit in this order
    allowed: list[int] | None = None
    # leading positions of the table taken from the prefix cache, written and read-only: a new row's first
    # work starts here instead of 0, or, with `images`, says `start` 0 and is fed from here
    # (docs/prefix-cache-ar.md); never written by this work
    cached: int = 0


class BatchStep(Msg):
    """Step-level batching: every rank drops `drops` (their AR state too), forgets the AR state of
    `ar_ends`, starts `starts` (in order, so rows pack alike everywhere), runs one AR pass over `ar`
    (`worker.ar_batch.ARStepper`), then one step of its whole running batch. The ends come before the
    starts: at the AR->DiT handover a request's DiT row starts on the pages its AR row just left."""
    request_id: str  # "batch-<n>": pairs the ranks' replies with this step
    starts: list[NewRequest] = []
    drops: list[str] = []
    ar: list[ARWork] = []
    ar_ends: list[str] = []


class BatchDone(Msg):
    """One rank's report of a `BatchStep`: the requests that ended in it (failed start, error, ok)
    and its AR pass (one sampled id per `ARWork`, -1 where none was drawn; the failed works)."""
    request_id: str
    rank: int
    ended: list[RankEnd] = []
    error: str | None = None  # the shared forward (DiT step or AR pass) failed on this rank
    ar_ids: list[int] = []
    ar_failed: list[tuple[str, str]] = []  # (request id, error)


ANY = (InitCache | Shutdown | RegisterReceive | Unregister | Ready | Ack | Heartbeat | Registered | Received
       | SendKV | Sent | BatchStep | BatchDone)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ANY)


def encode(msg: Msg) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Msg:
    return _decoder.decode(data)
