"""Free TCP ports for local clusters.

All ports of one cluster are reserved at once (every socket stays bound until all are chosen), so
they are distinct. They are drawn at random from below the kernel's ephemeral range
(/proc/sys/net/ipv4/ip_local_port_range): a port in that range can be taken by any outgoing
connection between closing it here and the child binding it, and a starting group makes many
(gloo's mesh, gRPC); that race failed a rank's metrics listener at start-up. Where the range
leaves too little room below it, the kernel picks (port 0), as before. The launcher still treats
"cannot bind" in a child as a start-up failure with the child's log.

A multi-rank worker needs runs of consecutive ports (`serve --metrics-port P` puts rank r of a
node on P + r): `pick_free_port_blocks` reserves whole runs, never overlapping each other or
the single ports picked in the same call.

Mooncake's TransferEngine draws its own listening ports (its handshake RPC and its TCP transport)
at random from MC_MIN_RPC_PORT..MC_MAX_RPC_PORT (both included), 15000-17000 unless set. A port picked here and
handed to a child could be taken by a Mooncake engine starting meanwhile (that failed a decode
rank's listener in a group test), so that range is never drawn.

Ports are released when a pick returns and bound later by the child, so a second pick in the same
process (the next group of the same cluster or test) could draw a port the first one handed out.
Each pick is remembered for `RECENT_S` and not drawn again meanwhile.
"""
from __future__ import annotations

import random
import socket
import threading
import time
from pathlib import Path
from typing import Sequence

from deepseek_pd import env
from deepseek_pd.errors import UserError

BLOCK_ATTEMPTS = 200  # tries per run of consecutive ports before giving up
LOWEST_PORT = 10000  # below: well-known and commonly configured service ports
MIN_ROOM = 2000  # fewer candidate ports than this below the ephemeral range: let the kernel pick
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
RECENT_S = 300.0  # a picked port is not drawn again for this long (its child may not have bound it yet)
_recent: dict[int, float] = {}  # port -> when it was handed out
_recent_lock = threading.Lock()


def _drawable(first: int, size: int, avoided: range) -> bool:
    """Whether the run [first, first + size) stays out of `avoided` (the ports Mooncake draws at
    random) and out of the ports this process handed out in the last RECENT_S."""
    if first < avoided.stop and first + size > avoided.start:
        return False
    cutoff = time.monotonic() - RECENT_S
    return all(_recent.get(port, cutoff) <= cutoff for port in range(first, first + size))


def _remember(ports: Sequence[int]) -> None:
    now = time.monotonic()
    for port, when in list(_recent.items()):
        if when <= now - RECENT_S:
            del _recent[port]
    _recent.update((port, now) for port in ports)


def candidate_range() -> range | None:
    """The ports to draw from: [LOWEST_PORT, start of the ephemeral range); None where that is
    unknown or too small (the kernel picks then)."""
    try:
        ephemeral_low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if ephemeral_low - LOWEST_PORT < MIN_ROOM:
        return None
    return range(LOWEST_PORT, ephemeral_low)


def pick_free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    return pick_free_port_blocks([1] * count, host)


def pick_free_port_blocks(sizes: Sequence[int], host: str = "127.0.0.1") -> list[int]:
    """The first port of each run of `sizes[i]` consecutive free ports, in order; every port of every
    run is distinct. Raises UserError if no such run is found (a nearly exhausted port range)."""
    sockets: list[socket.socket] = []
    candidates = candidate_range()
    avoided = env.mooncake_rpc_ports()
    try:
        with _recent_lock:
            firsts = []
            for size in sizes:
                if size < 1:
                    raise ValueError(f"a port block needs at least one port, got {size}")
                firsts.append(_reserve_block(size, host, sockets, candidates, avoided))
            _remember([first + offset for first, size in zip(firsts, sizes) for offset in range(size)])
        return firsts
    finally:
        for sock in sockets:
            sock.close()


def _reserve_block(size: int, host: str, held: list[socket.socket], candidates: range | None,
                   avoided: range) -> int:
    """Binds a run of `size` ports (kept bound in `held`), its first drawn from `candidates` (None:
    the kernel's pick), `_drawable` against `avoided`, and returns its first port."""
    for _ in range(BLOCK_ATTEMPTS):
        wanted = 0 if candidates is None else random.randrange(candidates.start, candidates.stop - size + 1)
        if wanted and not _drawable(wanted, size, avoided):
            continue  # checked before binding: a bind here could race a Mooncake engine's own
        try:
            first = _bind(host, wanted)
        except OSError:
            continue  # taken: draw again
        run = [first]
        port = first.getsockname()[1]
        if not wanted and not _drawable(port, size, avoided):  # the kernel's pick may repeat a pick, or
            first.close()  # fall in Mooncake's range where the ephemeral range starts low
            continue
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
