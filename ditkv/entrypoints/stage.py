"""`ditkv stage --config STAGES.yaml --stage 0 --bind tcp://HOST:PORT`: the AR stage as a separate
server (`stages/ar_server.py`); orchestrators reach it through `remote:` in their stage file."""

from __future__ import annotations

import logging
import signal
import threading

from ..errors import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser("stage", help="run one stage of a stage file as a separate server (AR stage only)")
    p.add_argument("--config", required=True, help="the stage file (the same one the orchestrator uses)")
    p.add_argument("--stage", type=int, default=0, help="stage id to serve (only 0, the AR stage, for now)")
    p.add_argument("--bind", required=True, help="ZeroMQ address to listen on, tcp://HOST:PORT")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="least severe log messages shown")
    p.set_defaults(func=run)


def run(args) -> None:
    from ..stages.graph import check_address, load_stage_graph
    from ..stages.ar_server import ARStageServer

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.stage != 0:
        raise ConfigError("--stage", args.stage, "only the AR stage (0) can run as a separate server for now")
    check_address(args.bind, "--bind")
    graph = load_stage_graph(args.config)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server = ARStageServer(graph, args.bind)
    try:
        server.serve(stop)
    finally:
        server.close()
