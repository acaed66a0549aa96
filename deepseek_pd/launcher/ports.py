"""Free TCP ports for local clusters.

All ports of one cluster are reserved at once (every socket stays bound until all are chosen), so
they are distinct; the kernel hands out ephemeral ports in a rotating order, which makes an
immediate reuse by another process unlikely between closing here and the child binding. The
launcher still treats "cannot bind" in a child as a start-up failure with the child's log.
"""
from __future__ import annotations

import socket


def pick_free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def is_port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True
