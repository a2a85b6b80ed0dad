"""Worker side of the executors: one request on one rank, and the per-rank process main loop.

`run_request` is shared by both executors: install the metadata snapshot, run the denoising loop,
and clear the request's rows on every path before reporting (the scheduler frees blocks only
after every rank reported). Ranks of one group vote at each step boundary (all-reduce MAX of
GO/STOP/ERROR), so an abort or a rank-local exception stops every rank at the same step and no
rank is left waiting in a collective the others never enter.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import traceback
from collections import deque
from collections.abc import Callable

import torch

from .messages import (ERROR, GO, STOP, Abort, Ack, ARDone, ARRun, BatchDone, BatchStep, Execute,
                       Heartbeat, InitCache, RankStats, Ready, Received, RegisterReceive, Registered, RequestDone, SendKV,
                       Shutdown, StepDone, Unregister, decode, encode)
from .sizing import resolve_num_blocks
from .test_seam import hooks
from ..models.hunyuan.sharded_load import shard_of
from ..models.loader import load_model, load_model_shard, param_bytes, resolve_device, resolve_dtype
from ..worker.batch import PEER_STEP, BatchStepper
from ..worker.page_pool import bytes_per_block
from ..worker.threads import apply_process_settings
from ..worker.worker import DiTWorker

log = logging.getLogger("ditkv.worker")
OUTPUT_RANK = 0  # the rank whose image is returned (every rank ends with the same latents)


# ---- setup (both executors) -----------------------------------------------------------------
def resolve_bundle(config, model_bundle, parallel=None):
    """A (model, tokenizer, codec) tuple, a zero-argument factory returning one, or None = load `config.model`.

    A TP/EP rank (`parallel` with tp or ep > 1) loading `config.model` itself reads only its shard
    (`load_checkpoint_shard`); the model comes back already sharded and marked `_ditkv_sharded`."""
    if callable(model_bundle):
        return model_bundle()
    if model_bundle is not None:
        return model_bundle
    if parallel is not None and (parallel.tp_size > 1 or parallel.ep_size > 1):
        device = parallel.device or resolve_device(config.device)
        bundle = load_model_shard(config.model, parallel, device, resolve_dtype(config.dtype, device),
                                  config.quantization, tuple(config.quantization_ignored_layers))
        if bundle is not None:
            return bundle
    device = resolve_device(config.device)
    return load_model(config.model, device, resolve_dtype(config.dtype, device), config.quantization,
                      tuple(config.quantization_ignored_layers))


def profile_non_kv_bytes(config, model, tokenizer, parallel=None) -> int:
    """Run the maximum-shape profile request (dense) and return its non-KV peak.

    Unsharded model: one rank runs the whole model alone (an upper bound for any parallel layout).
    Sharded model (`parallel` given): it cannot run alone, so every rank of the replica profiles
    its own shard in lockstep through a parallel runner (the collectives pair up across ranks)."""
    from .profiling import default_envelope, profile_max_shape
    from ..worker.dit_runner import DiTRunner

    env = default_envelope(config, model.config)
    res = profile_max_shape(DiTRunner(model, paged=False, parallel=parallel), model, tokenizer, env)
    log.info("memory profile %dx%d, %d prompt tokens (%d tokens, CFG on): non-KV peak %d bytes in %.2fs",
             env.max_width, env.max_height, env.max_prompt_tokens, res.tokens, res.non_kv_bytes, res.seconds)
    return res.non_kv_bytes


def plan_num_blocks(config, model, tokenizer=None, parallel=None) -> int | None:
    """KV blocks this rank can afford (None in dense mode); the executor takes the min over ranks.
    Counts rank-local KV heads; the non-KV memory is the model's parameters (a sharded model: the
    rank's shard; else the unsharded weights, an upper bound) or the profile's peak if larger."""
    if not config.paged:
        return None
    from ..worker.parallel import local_num_kv_heads

    mc = model.config
    bpb = bytes_per_block(mc.num_hidden_layers, local_num_kv_heads(config, mc), config.block_size,
                          mc.attention_head_dim, model.dtype)
    non_kv = param_bytes(model)
    if config.profile_memory and not config.num_kv_blocks:
        par = parallel if shard_of(model) is not None else None  # an unsharded model profiles alone, as before
        non_kv = max(non_kv, profile_non_kv_bytes(config, model, tokenizer, par))
    n, why = resolve_num_blocks(config, bpb, resolve_device(config.device), non_kv)
    log.info("KV pool: %d blocks x %d tokens, %d bytes (%s)", n, config.block_size, n * bpb, why)
    return n


def build_worker(config, num_blocks, bundle, parallel=None) -> DiTWorker:
    return DiTWorker(config, num_blocks=num_blocks, model_bundle=bundle, parallel=parallel)


def group_vote() -> Callable:
    """Step-boundary agreement over the default process group (one flag, or a list of flags voted
    element-wise); identity without one."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return lambda flag: flag
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")

    def vote(flag):
        many = isinstance(flag, list)
        t = torch.tensor(flag if many else [flag], dtype=torch.int32, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [int(f) for f in t.tolist()] if many else int(t.item())

    return vote


# ---- one request on one rank ----------------------------------------------------------------
def layout_of(worker, msg: Execute):
    """The request's layout, rebuilt on the rank from the message (the engine's is not sent);
    input images travel in the message and reach the model's layout unchanged."""
    from .messages import unpack_images

    images = unpack_images(msg.images)
    if msg.prompt_ids is not None:  # AR-generated text: the ids, not a string
        from ..models.hunyuan.layout import build_request_layout
        from ..worker.worker import FixedPromptTokenizer

        tok = FixedPromptTokenizer(worker.tokenizer, msg.prompt_ids)
        layout = build_request_layout(worker.model.config, tok, "", msg.height, msg.width, msg.guidance,
                                      msg.negative_prompt, images=images)
        worker.runner.local_layout(layout)
        return layout
    if msg.rewrite is not None:  # a think/recaption rewrite: the image row holds the AR stage's text
        from ..models.hunyuan.layout import build_request_layout

        layout = build_request_layout(worker.model.config, worker.tokenizer, msg.prompt, msg.height, msg.width,
                                      msg.guidance, msg.negative_prompt, rewrite=msg.rewrite, images=images)
        worker.runner.local_layout(layout)
        return layout
    if images:
        return worker.layout(msg.prompt, msg.height, msg.width, msg.guidance, msg.negative_prompt, images=images)
    return worker.layout(msg.prompt, msg.height, msg.width, msg.guidance, msg.negative_prompt)


def run_request(worker, msg: Execute, *, rank: int = 0, layout=None, vote=None,
                on_step: Callable[[int], None] | None = None,
                check_stop: Callable[[], bool] | None = None, fault=None, dense_import=None) -> RequestDone:
    """Run `msg` on this rank and report; never raises for a request-level failure.

    Each rank calls `vote` exactly once per step boundary while healthy (the start of every
    step, plus a final boundary after decoding) and exactly once more after its own failure,
    which pairs with the peers' next boundary: they learn of the error there and stop too.
    """
    rid = msg.request_id
    vote = vote or (lambda flag: flag)
    st = {"boundary": 0, "agreed": GO, "stopped_at": None, "vote_broken": False}

    def cast(flag: int) -> int:
        try:
            return vote(flag)
        except BaseException:
            st["vote_broken"] = True  # the collective itself failed: voting again would hang
            raise

    def should_stop() -> bool:
        i = st["boundary"]
        st["boundary"] += 1
        if fault is not None and fault[0] == rank and fault[1] == msg.prompt and fault[2] == i:
            raise RuntimeError(f"injected fault on rank {rank} at step {i}")
        agreed = cast(STOP if (check_stop is not None and check_stop()) else GO)
        if agreed != GO:
            st["agreed"], st["stopped_at"] = agreed, i
        return agreed != GO

    voted_final = False
    try:
        if layout is None:
            layout = layout_of(worker, msg)
        if msg.metadata is not None:
            worker.install(msg.metadata, request_id=rid)  # another request's snapshot binds nothing
        if callable(dense_import):  # legacy: the rank's heads of its receive slot
            dense_import = dense_import()
        img, rs = worker.execute(rid, layout, msg.steps, msg.guidance, msg.seed, msg.reuse_prefix,
                                 on_step=on_step, should_stop=should_stop, dense_import=dense_import)
        voted_final = True
        if cast(GO) == ERROR:  # a peer failed in the last step or while decoding
            return RequestDone(request_id=rid, rank=rank, status="stopped", stopped_at=msg.steps,
                               error="stopped: a peer rank failed")
        stats = RankStats(steps=rs.steps, prefix_tokens_reused=rs.prefix_tokens_reused,
                          tokens_computed=rs.tokens_computed, imported_tokens=rs.imported_tokens)
        out = rank == OUTPUT_RANK
        return RequestDone(request_id=rid, rank=rank, status="ok", stats=stats,
                           image=img.tobytes() if out else None, image_shape=tuple(img.shape) if out else None)
    except InterruptedError:
        peer = st["agreed"] == ERROR
        return RequestDone(request_id=rid, rank=rank, status="stopped", stopped_at=st["stopped_at"],
                           error="stopped: a peer rank failed" if peer else None)
    except Exception as e:
        log.exception("rank %d: request %s failed", rank, rid)
        if not voted_final and not st["vote_broken"]:
            try:
                cast(ERROR)  # let the peers stop at their next boundary with us
            except Exception:
                log.exception("rank %d: step-boundary vote failed", rank)
        return RequestDone(request_id=rid, rank=rank, status="error", error=f"{type(e).__name__}: {e}")
    finally:
        if msg.metadata is not None:
            worker.remove(rid, msg.metadata.generation)  # rows cleared before the engine frees blocks


# ---- step-level batching on one rank of a group ----------------------------------------------
PEER_START = "stopped: the request failed to start on a peer rank"
def run_batch_step(stepper, msg: BatchStep, *, rank: int = 0, vote=None) -> BatchDone:
    """Apply `msg` on this rank: drops, starts, one step. The ranks agree (two votes) on which starts
    failed and on whether the shared pass failed anywhere, so every rank keeps the same batch and
    enters the same collectives. Never raises for a request-level failure."""
    vote = vote or (lambda flag: flag)
    for rid in msg.drops:
        stepper.drop(rid)
    errors: dict[str, str] = {}
    for ex in msg.starts:
        try:
            stepper.start(ex.request_id, layout_of(stepper.worker, ex), ex.steps, ex.guidance, ex.seed,
                          ex.metadata, ex.reuse_prefix)
        except Exception as e:  # bad input of this request only
            log.warning("rank %d: request %s failed to start: %s", rank, ex.request_id, e)
            errors[ex.request_id] = f"{type(e).__name__}: {e}"
    if msg.starts:
        flags = vote([ERROR if ex.request_id in errors else GO for ex in msg.starts])
        for ex, f in zip(msg.starts, flags):
            if f != GO and ex.request_id not in errors:
                stepper.drop(ex.request_id)
                errors[ex.request_id] = PEER_START
    # a peer's failure is reported as "stopped", so the engine shows the failing rank's own error
    ended = [RequestDone(request_id=rid, rank=rank, status="stopped" if e == PEER_START else "error", error=e)
             for rid, e in errors.items()]
    failed = []

    def any_failed(mine: bool) -> bool:
        failed.append(mine)
        return vote(ERROR if mine else GO) != GO

    out = rank == OUTPUT_RANK
    for o in stepper.step(any_failed=any_failed, decode=out):
        s = o.stats
        stats = None if s is None else RankStats(steps=s.steps, prefix_tokens_reused=s.prefix_tokens_reused,
                                                 tokens_computed=s.tokens_computed, imported_tokens=s.imported_tokens)
        img = o.image
        status = "stopped" if o.status == "error" and o.error == PEER_STEP else o.status
        ended.append(RequestDone(request_id=o.request_id, rank=rank, status=status, error=o.error, stats=stats,
                                 image=img.tobytes() if img is not None else None,
                                 image_shape=tuple(img.shape) if img is not None else None))
    return BatchDone(request_id=msg.request_id, rank=rank, ended=ended,
                     error="the batched step failed on this rank" if any(failed) else None)


# ---- the per-rank process -------------------------------------------------------------------
class _Inbox:
    """The rank's command socket, read by the main thread only (zmq sockets are not thread-safe)."""

    def __init__(self, sock):
        self.sock, self.pending = sock, deque()

    def get(self, timeout_s: float | None = None):
        """The next command; None when `timeout_s` passed without one (None = block)."""
        if self.pending:
            return self.pending.popleft()
        if timeout_s is not None and not self.sock.poll(int(timeout_s * 1000)):
            return None
        return decode(self.sock.recv())

    def abort_requested(self, rid: str) -> bool:
        """Non-blocking: read what has arrived; True on Abort(rid) or Shutdown."""
        import zmq

        hit = False
        while self.sock.poll(0, zmq.POLLIN):
            m = decode(self.sock.recv())
            if isinstance(m, Abort):
                hit = hit or m.request_id == rid
            else:
                hit = hit or isinstance(m, Shutdown)
                self.pending.append(m)
        return hit


def _heartbeat(zctx, address: str, rank: int, interval: float, stop: threading.Event) -> None:
    """Own socket, own thread: beats while the main thread computes; exits the process if the
    engine process is gone (no orphaned ranks)."""
    import zmq

    ppid = os.getppid()
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, f"h{rank}".encode())
    sock.connect(address)
    beat = encode(Heartbeat(rank=rank))
    while not stop.wait(interval):
        if os.getppid() != ppid:
            os._exit(3)
        try:
            sock.send(beat, zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # engine busy or gone; the ppid check decides
    sock.close()


def _init_group(config, rank: int, world_size: int, init_method: str, opts):
    """The replica's process group: `init_parallel` for real parallelism, a plain gloo group for
    the test-only replicated ranks (full model on every rank, no sharding)."""
    if world_size == 1:
        return None
    if hooks(opts).replicate_ranks:
        import datetime

        import torch.distributed as dist

        if torch.cuda.is_available():
            from ..worker.parallel import bind_device

            torch.cuda.set_device(torch.device(bind_device("cuda", rank, torch.cuda.device_count(), opts.devices)))
        timeout = datetime.timedelta(seconds=opts.collective_timeout_s or 600)
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
        return None
    from ..worker.parallel import init_parallel  # presence checked by the executor before spawning

    return init_parallel(config, rank, world_size, init_method, timeout_s=opts.collective_timeout_s,
                         devices=getattr(opts, "devices", None))


def placed_config(config, parallel, opts, rank: int):
    """With a stage placement, the rank's config names its bound device, so that the model load,
    the memory plan and the pool all land on that GPU (not on the stage's base device)."""
    if not getattr(opts, "devices", None):
        return config
    from dataclasses import replace

    from ..worker.parallel import bind_device

    dev = str(parallel.device) if parallel is not None and parallel.device is not None else \
        bind_device(config.device, rank, torch.cuda.device_count(), opts.devices)
    return replace(config, device=dev)


def worker_main(rank: int, world_size: int, config, address: str, model_bundle, opts, init_method: str) -> None:
    """Spawn target of one rank: start up, report Ready, then serve commands until Shutdown."""
    import zmq

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the engine, which shuts us down
    apply_process_settings(config)  # the same count in every process: bit-identical sums
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    zctx = zmq.Context()
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)  # let the last reply leave before exit
    sock.setsockopt(zmq.IDENTITY, f"r{rank}".encode())
    sock.connect(address)
    stop = threading.Event()
    hb = threading.Thread(target=_heartbeat, args=(zctx, address, rank, opts.heartbeat_interval_s, stop),
                          daemon=True, name=f"ditkv-heartbeat-{rank}")
    hb.start()
    send = lambda m: sock.send(encode(m))  # noqa: E731
    try:
        try:
            parallel = _init_group(config, rank, world_size, init_method, opts)
            config = placed_config(config, parallel, opts, rank)
            bundle = resolve_bundle(config, model_bundle, parallel)
            bound = parallel.device if parallel is not None and parallel.device is not None else \
                resolve_device(config.device)
            num_blocks = plan_num_blocks(config, bundle[0], bundle[1], parallel)
            send(Ready(rank=rank, pid=os.getpid(), num_blocks=num_blocks, device=str(bound),
                       weight_bytes=param_bytes(bundle[0])))
        except Exception as e:
            traceback.print_exc()
            send(Ready(rank=rank, pid=os.getpid(), error=f"{type(e).__name__}: {e}"))
            return
        _serve(_Inbox(sock), send, rank, config, bundle, parallel, opts)
    finally:
        stop.set()
        hb.join(timeout=2 * opts.heartbeat_interval_s)
        sock.close()
        zctx.term()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class _Receiver:
    """A rank's KV consumer (stage replicas): its pool registered with the transport; receives are
    registered by the replica and every completion notice is forwarded to it as `Received`."""

    def __init__(self, transfer, worker, parallel, rank: int):
        from ..transfer.connector import KVConsumer, transfer_pool
        from ..transfer.transport import make_transport

        if worker.pool is not None:
            transfer_pool(worker.pool, transfer.kv_connector)  # the pool moves into registrable memory
        self.transport = make_transport(transfer.kv_connector, transfer.kv_ip, transfer.protocol,
                                        transfer.max_descriptors_per_batch)
        par = parallel
        shard = 0 if par is None else par.tp_rank * par.sp_size + par.sp_rank  # TP first, then Ulysses
        lo = shard * worker.num_kv_heads
        # legacy (dense cache, no pool): receive slots sized for the whole producer's tokens (every head)
        mc = worker.model.config
        token_bytes = (mc.num_hidden_layers * 2 * mc.num_key_value_heads * mc.attention_head_dim
                       * torch.empty((), dtype=worker.dtype).element_size())
        self.consumer = KVConsumer(transfer, self.transport, rank, worker.pool, lo, lo + worker.num_kv_heads,
                                   token_bytes=token_bytes, device=worker.device)
        self.rank, self.dtype = rank, worker.dtype

    def dense_import(self, li):
        """The rank's KV-head range of receive slot `li.slot` (a `LegacyImport`) as a `DenseImport`."""
        from ..transfer.descriptors import legacy_heads
        from ..worker.dit_runner import DenseImport

        c = self.consumer
        kv = legacy_heads(c.slots.buffer[li.slot], li.src_heads, li.num_layers, max(li.tokens_per_row),
                          li.head_dim, self.dtype, c.head_lo, c.head_hi)
        return DenseImport(kv, list(li.tokens_per_row))

    @property
    def busy(self) -> bool:
        return self.consumer.expecting

    def rank_dest(self):
        return self.consumer.rank_dest()

    def handle(self, msg) -> Registered | None:
        from ..transfer.connector import BadBlockIdsError, RegistrationError

        if isinstance(msg, ARRun):
            return ARDone(rank=self.rank, request_id=msg.request_id, error=f"rank {self.rank} is a DiT rank")
        if isinstance(msg, SendKV):
            return None
        if isinstance(msg, Unregister):
            self.consumer.unregister(msg.ticket_id)
            return None
        try:
            self.consumer.register_rows(msg.ticket_id, [ids for _, _, ids in msg.rows])
            return Registered(rank=self.rank, ticket_id=msg.ticket_id)
        except RegistrationError as e:
            return Registered(rank=self.rank, ticket_id=msg.ticket_id, error=str(e),
                              bad_block_ids=isinstance(e, BadBlockIdsError))

    def forward(self, send) -> None:
        for tid, notice_rank, rows, src in self.consumer.poll():
            send(Received(rank=self.rank, ticket_id=tid, notice_rank=notice_rank, rows=rows, src_rank=src))

    def close(self) -> None:
        self.transport.close()  # unlinks this rank's pool segment


def _serve(inbox: _Inbox, send, rank: int, config, bundle, parallel, opts) -> None:
    worker, vote, recv, stepper = None, group_vote(), None, None
    try:
        while True:
            # with a consumer, wake up often enough to forward completion notices promptly
            wait = None if recv is None else (0.002 if recv.busy else 0.05)
            msg = inbox.get(wait)
            if recv is not None:
                recv.forward(send)
            if msg is None:
                continue
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, InitCache):
                try:
                    worker = build_worker(config, msg.num_blocks, bundle, parallel)
                    if getattr(opts, "rank_service", None) is not None:  # e.g. an AR stage rank: runner + producer
                        recv = opts.rank_service(opts.transfer, worker, parallel, rank, hooks(opts).send_gate)
                    elif getattr(opts, "transfer", None) is not None:
                        recv = _Receiver(opts.transfer, worker, parallel, rank)
                    send(Ack(rank=rank, dest=None if recv is None else recv.rank_dest()))
                except Exception as e:
                    traceback.print_exc()
                    send(Ack(rank=rank, error=f"{type(e).__name__}: {e}"))
            elif isinstance(msg, (RegisterReceive, Unregister, ARRun, SendKV)):
                reply = recv.handle(msg) if recv is not None else None
                if recv is None and isinstance(msg, RegisterReceive):  # refuse at once, not by timeout
                    reply = Registered(rank=rank, ticket_id=msg.ticket_id, error=f"rank {rank} hosts no KV consumer")
                if recv is None and isinstance(msg, ARRun):
                    reply = ARDone(rank=rank, request_id=msg.request_id, error=f"rank {rank} hosts no AR runner")
                if reply is not None:
                    send(reply)
                if recv is not None:
                    recv.forward(send)
            elif isinstance(msg, BatchStep):
                if stepper is None:
                    stepper = BatchStepper(worker)
                send(run_batch_step(stepper, msg, rank=rank, vote=vote))
            elif isinstance(msg, Execute):
                rid = msg.request_id
                on_step = None
                if rank == OUTPUT_RANK:
                    on_step = lambda i: send(StepDone(request_id=rid, rank=rank, step=i, total=msg.steps))  # noqa: E731

                def check_stop(rid=rid):
                    if recv is not None:  # notices of other tickets keep flowing during a long request
                        recv.forward(send)
                    return inbox.abort_requested(rid)
                dense = None
                if msg.legacy is not None:  # built inside run_request: a failure goes through the vote
                    dense = lambda li=msg.legacy: recv.dense_import(li)  # noqa: E731
                done = run_request(worker, msg, rank=rank, vote=vote, on_step=on_step,
                                   check_stop=check_stop, fault=hooks(opts).inject_fault, dense_import=dense)
                send(done)
            # an Abort for a request this rank already finished is stale: ignore it
    finally:
        if recv is not None:
            recv.close()
