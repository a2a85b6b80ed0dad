"""The rank process of the multi-process executor: its command socket, its heartbeat thread, its
startup (`worker_main`) and its message loop (`_serve`).

The pieces both executors share live beside it: the setup in `rank_setup.py`, what a rank runs
(one batch step and its votes) in `rank_steps.py`, and a stage replica's KV consumer in
`rank_receiver.py`. `RankHooks` (`hooks.py`) reach the rank through its options.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import traceback

from .hooks import rank_hooks
from .messages import (Ack, BatchStep, Heartbeat, InitCache, Ready, RegisterReceive, Registered,
                       SendKV, Shutdown, Unregister, decode, encode)
from .rank_receiver import RankReceiver
from .rank_setup import build_worker, init_group, placed_config, plan_num_blocks, resolve_bundle
from .rank_steps import group_vote, run_batch_step
from ..models.loader import param_bytes, resolve_device
from ..worker.batch import BatchStepper
from ..worker.threads import apply_process_settings


class _Inbox:
    """The rank's command socket, read by the main thread only (zmq sockets are not thread-safe)."""

    def __init__(self, sock):
        self.sock = sock

    def get(self, timeout_s: float | None = None):
        """The next command; None when `timeout_s` passed without one (None = block)."""
        if timeout_s is not None and not self.sock.poll(int(timeout_s * 1000)):
            return None
        return decode(self.sock.recv())


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
            parallel = init_group(config, rank, world_size, init_method, opts)
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



def _start_service(opts, worker, parallel, rank: int):
    """The rank's KV service, if its replica has a transfer role: the `rank_service` (e.g. an AR
    stage rank: runner + producer) or a `RankReceiver`; its transport goes through
    `RankHooks.on_transport` before any transfer."""
    transfer = getattr(opts, "transfer", None)
    if getattr(opts, "rank_service", None) is not None:
        service = opts.rank_service(transfer, worker, parallel, rank)
    elif transfer is not None:
        service = RankReceiver(transfer, worker, parallel, rank)
    else:
        return None
    transport = getattr(service, "transport", None)
    if transport is not None:
        rank_hooks(opts).on_transport(transport, rank, getattr(transfer, "kv_role", None))
    return service


def _serve(inbox: _Inbox, send, rank: int, config, bundle, parallel, opts) -> None:
    worker, vote, recv, stepper, hooks = None, group_vote(), None, None, rank_hooks(opts)
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
                    recv = _start_service(opts, worker, parallel, rank)
                    send(Ack(rank=rank, dest=None if recv is None else recv.rank_dest()))
                except Exception as e:
                    traceback.print_exc()
                    send(Ack(rank=rank, error=f"{type(e).__name__}: {e}"))
            elif isinstance(msg, (RegisterReceive, Unregister, SendKV)):
                reply = recv.handle(msg) if recv is not None else None
                if recv is None and isinstance(msg, RegisterReceive):  # refuse at once, not by timeout
                    reply = Registered(rank=rank, ticket_id=msg.ticket_id, error=f"rank {rank} hosts no KV consumer")
                if reply is not None:
                    send(reply)
                if recv is not None:
                    recv.forward(send)
            elif isinstance(msg, BatchStep):
                if stepper is None:
                    stepper = BatchStepper(worker)
                legacy = getattr(recv, "dense_import", None)
                send(run_batch_step(stepper, msg, rank=rank, vote=vote, hooks=hooks, legacy=legacy))
                if recv is not None:  # notices of other tickets keep flowing between steps
                    recv.forward(send)
    finally:
        if recv is not None:
            recv.close()
