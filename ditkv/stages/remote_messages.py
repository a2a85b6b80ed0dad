"""Control messages between an orchestrator and a separately deployed AR stage (`ditkv stage`):
msgspec tagged structs, msgpack over one ZeroMQ DEALER (orchestrator) / ROUTER (server) pair.
`remote_ar.py` is the orchestrator's side, `ar_server.py` the server's."""

from __future__ import annotations

import msgspec

from ..engine.messages import HeadImages
from ..transfer.descriptors import PoolGeometry
from ..transfer.ticket import DestEndpoint, SourceEndpoint

# 3: Submit carries a head's input images; 4: and top_k, top_p, do_sample (an older peer would drop them);
# 5: a replica runs its jobs batched in its engine (issue 34): ARDone comes in finishing order, not
# submit order, and up to the server's max_num_seqs jobs hold AR pages at once; a head's images name the
# request's own bot_task (`HeadImages.bot_task`); Submit.choice and ARDone.chosen (size=auto) are new in 5 too;
# 6: Dispatch's `RowDest.skip_pages` (the DiT stage's cached pages): an older server would write them
PROTOCOL = 6


class RMsg(msgspec.Struct, tag=True, kw_only=True):
    pass


# ---- orchestrator -> AR stage server -----------------------------------------------------------
class Hello(RMsg):
    protocol: int
    heartbeat_interval: float
    heartbeat_timeout: float


class Submit(RMsg):
    replica: int
    ticket_id: str
    request_id: str
    mode: str
    head_ids: list[int]
    tail_ids: list[int]
    max_new_tokens: int  # with temperature ... do_sample: a `TextSampling` (`sampling.to_wire`)
    temperature: float
    seed: int
    stop_ids: list[int] = []  # generation also ends at these, kept (a think/recaption rewrite)
    images: HeadImages | None = None  # the head's input images (image-conditioned generation)
    top_k: int = 0
    top_p: float = 1.0
    do_sample: bool = True
    choice: list[int] = []  # size=auto: after the tail, draw one of these ratio ids (greedily)


class Cancel(RMsg):
    replica: int
    request_id: str


class Dispatch(RMsg):
    ticket_id: str
    dest: DestEndpoint
    timeout_s: float


class Release(RMsg):
    ticket_id: str  # the source pages are no longer needed (never dispatched, or settled)


class Bye(RMsg):
    pass


# ---- both ways ---------------------------------------------------------------------------------
class Beat(RMsg):
    stats: list[dict[str, int]] = []  # server -> orchestrator: `ARReplica.stats()` per replica


# ---- AR stage server -> orchestrator -----------------------------------------------------------
class Welcome(RMsg):
    protocol: int
    error: str | None = None
    stage: dict[str, str | int | float] = {}  # `stage_summary` of the server's stage file
    dtype: str = ""  # the pools' resolved dtype
    geometry: list[PoolGeometry] = []  # per replica
    pid: int = 0
    instance: str = ""  # random per server process: a reconnecting client tells a restart from a blip
    held: list[str] = []  # this client's ticket ids whose dispatched write the server has not settled yet


class ARDone(RMsg):
    ticket_id: str
    request_id: str
    token_ids: list[int] = []
    generated_ids: list[int] = []
    tokens_computed: int = 0
    source: SourceEndpoint | None = None
    error: str | None = None
    chosen: int | None = None  # size=auto: the ratio id drawn (Submit.choice)
    stats: dict[str, float] = {}  # the job's ar_* `RequestStats` on the server (its AR stage's clock)


class Sent(RMsg):
    ticket_id: str
    src: int
    dst: int
    error: str | None = None
    nbytes: int = 0


class Settled(RMsg):
    ticket_id: str
    error: str | None = None  # the server had no such ticket: nothing was written


class Refused(RMsg):
    error: str  # a message the server could not use


ANY = Hello | Submit | Cancel | Dispatch | Release | Bye | Beat | Welcome | ARDone | Sent | Settled | Refused
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(ANY)


def encode(m: RMsg) -> bytes:
    return _enc.encode(m)


def decode(data: bytes) -> RMsg:
    return _dec.decode(data)


def stage_summary(spec) -> dict:
    """What must agree between the AR stage server and the orchestrator's stage file (host-local
    fields such as device, kv_ip and the replica count are the server's own)."""
    e, t = spec.engine, spec.transfer
    return {"engine.model": str(e.model), "engine.block_size": e.block_size, "engine.num_kv_blocks": e.num_kv_blocks,
            "engine.tensor_parallel_size": e.tensor_parallel_size, "engine.torch_threads": e.torch_threads,
            "max_new_tokens": spec.max_new_tokens, "transfer.mode": t.mode, "kv_connector": t.kv_connector,
            **{k: "checkpoint's" if getattr(spec, k) is None else repr(getattr(spec, k))  # text defaults
               for k in ("temperature", "top_k", "top_p", "do_sample")},
            "engine_id": t.engine_id, "kv_role": t.kv_role, "protocol": t.protocol}
