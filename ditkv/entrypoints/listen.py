"""Where `ditkv serve` listens: the socket(s), bound before the model loads, and the uvicorn
server around them that drains the service before it stops.

Binding first makes a bad `--host` (a name that does not resolve, an address this machine does
not have) or a taken `--port` fail in a second, with one line naming the flag and the fix,
instead of after the model has loaded and been profiled (minutes for a real checkpoint). The
sockets are bound but not listening until uvicorn starts, so a client that connects while the
model loads is refused at once rather than left hanging.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import signal
import socket

log = logging.getLogger("ditkv.serve")
HOST_FIX = "give an address of this machine: 127.0.0.1 (this machine only), 0.0.0.0 (every interface), or a name "\
           "that resolves to one"


def _fail(message: str):
    raise SystemExit(f"ditkv serve: error: {message}")


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Bound TCP sockets for every address `host` resolves to (as asyncio's `create_server`
    binds them: "localhost" may be both ::1 and 127.0.0.1); SystemExit naming the flag if any fails."""
    try:
        # "" is every interface, as for asyncio (getaddrinfo would look it up as a name)
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        _fail(f"--host={host}: cannot resolve this host name ({getattr(e, 'strerror', None) or e}); {HOST_FIX}")
    sockets: list[socket.socket] = []
    for family, kind, proto, _, addr in dict.fromkeys(infos):  # one socket per distinct address
        sock = socket.socket(family, kind, proto)
        sockets.append(sock)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart while old connections linger
            if family == socket.AF_INET6:  # as asyncio: the IPv4 addresses get sockets of their own
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
        except OSError as e:
            for s in sockets:
                s.close()
            _fail(f"--host={host} --port={port}: cannot listen on {addr[0]} port {addr[1]} ({e.strerror or e}); "
                  + _bind_fix(e))
    return sockets


def _bind_fix(e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return "another process listens there: stop it or pick another --port"
    if e.errno == errno.EACCES:
        return "ports below 1024 need privileges: pick a --port of 1024 or above"
    if e.errno == errno.EADDRNOTAVAIL:
        return f"it is not an address of this machine; {HOST_FIX}"
    return HOST_FIX


def urls(sockets: list[socket.socket]) -> list[str]:
    """http://HOST:PORT of each bound socket: the port the system picked for --port 0, IPv6 bracketed."""
    out = []
    for sock in sockets:
        host, port = sock.getsockname()[:2]
        out.append(f"http://[{host}]:{port}" if sock.family == socket.AF_INET6 else f"http://{host}:{port}")
    return out


def run_server(app, sockets: list[socket.socket], *, host: str, port: int, log_level: str,
               shutdown_timeout: float, about: str = "") -> None:
    """Serve `app` on the bound `sockets` until SIGINT/SIGTERM: drain the app first
    (`app.state.drain`: in-flight requests get `shutdown_timeout` s), then uvicorn's shutdown.
    Once the sockets accept connections, one line names every address and `about` (the model)."""
    import uvicorn

    bound = sockets  # startup's own `sockets` argument shadows the name

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:  # logged only now: a client that reads it can connect at once
                log.info("listening on %s%s", ", ".join(urls(bound)), about)

        async def shutdown(self, sockets=None):
            # drain first: uvicorn would otherwise cancel handlers only after its own timeout
            await app.state.drain(shutdown_timeout)
            await super().shutdown(sockets)

        @contextlib.contextmanager
        def capture_signals(self):
            # like uvicorn's, minus re-raising the signal at exit: a graceful stop exits 0
            old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)

    # host and port only name the address in uvicorn's "running on" line: the sockets are bound
    server = Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                   timeout_graceful_shutdown=int(shutdown_timeout) + 10))
    try:
        server.run(sockets=sockets)
    finally:
        for sock in sockets:
            sock.close()
