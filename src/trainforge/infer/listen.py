"""Bind ``trainforge serve``'s port before the model loads.

The port is bound first and the bound socket handed to uvicorn
(``uvicorn.Server.run(sockets=[sock])``): a busy port fails in a fraction of a second with
one line naming the address and ``--port`` (exit 2), instead of after the model has loaded
with uvicorn's raw error (exit 3), and nothing can take the port while the model loads.
This module imports nothing heavy (no torch, no FastAPI) so the check runs first.
"""

from __future__ import annotations

import errno
import socket

from trainforge.errors import TrainforgeError


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``; ``TrainforgeError`` (exit 2) naming the
    address and the fix if it cannot be had."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise TrainforgeError(f"cannot listen on {where}: {e.strerror}; give an address of this machine with "
                              "--host") from None
    sock = socket.socket(family, kind, proto)
    try:
        # As uvicorn does: a port in TIME_WAIT after a restart can be taken again, a live listener cannot.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            fix = "another process listens there; choose a free port with --port (or stop that process)"
        elif e.errno == errno.EACCES:
            fix = "ports below 1024 need privileges; choose one above with --port"
        else:
            fix = "check --host and --port"
        raise TrainforgeError(f"cannot listen on {where}: {e.strerror}; {fix}") from None
    sock.set_inheritable(True)
    return sock
