"""Free TCP ports for local clusters.

All ports of one cluster are reserved at once (every socket stays bound until all are chosen), so
they are distinct; the kernel hands out ephemeral ports in a rotating order, which makes an
immediate reuse by another process unlikely between closing here and the child binding. The
launcher still treats "cannot bind" in a child as a start-up failure with the child's log.

A multi-rank worker needs runs of consecutive ports (`serve --metrics-port P` puts rank r of a
node on P + r): `pick_free_port_blocks` reserves whole runs, never overlapping each other or
the single ports picked in the same call.
"""
from __future__ import annotations

import socket
from typing import Sequence

from deepseek_pd.errors import UserError

BLOCK_ATTEMPTS = 200  # tries per run of consecutive ports before giving up


def pick_free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    return pick_free_port_blocks([1] * count, host)


def pick_free_port_blocks(sizes: Sequence[int], host: str = "127.0.0.1") -> list[int]:
    """The first port of each run of `sizes[i]` consecutive free ports, in order; every port of every
    run is distinct. Raises UserError if no such run is found (a nearly exhausted port range)."""
    sockets: list[socket.socket] = []
    try:
        firsts = []
        for size in sizes:
            if size < 1:
                raise ValueError(f"a port block needs at least one port, got {size}")
            firsts.append(_reserve_block(size, host, sockets))
        return firsts
    finally:
        for sock in sockets:
            sock.close()


def _reserve_block(size: int, host: str, held: list[socket.socket]) -> int:
    """Binds a run of `size` ports (kept bound in `held`) and returns its first port."""
    for _ in range(BLOCK_ATTEMPTS):
        first = _bind(host, 0)
        run = [first]
        port = first.getsockname()[1]
        for offset in range(1, size):
            if port + offset >= 65536:
                break
            try:
                run.append(_bind(host, port + offset))
            except OSError:
                break
        if len(run) == size:
            held.extend(run)
            return port
        for sock in run:
            sock.close()
    raise UserError(f"found no {size} consecutive free TCP ports on {host} in {BLOCK_ATTEMPTS} tries")


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def is_port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True
