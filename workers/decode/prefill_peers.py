"""Which prefill bootstrap addresses a decode worker may pull KV from.

A request's `DisaggParams` name the prefill worker (the router copies them from its registry),
but anyone who reaches the decode worker's gRPC port can name any host:port. Decode therefore
checks the address against the deployment's prefill list *before* it opens a connection: a
refused address is never dialled, so the answer carries no timing of the target (no port scan).

Entries are "host:port". A host that is a DNS name also allows every address it resolves to (the
operator lists each prefill group's headless Service, whose name resolves to its pods' IPs);
resolution results are cached for `ttl_s`, and a miss re-resolves at most once per `ttl_s`.
An empty list allows loopback hosts only (a single machine: tests, `generate`).

A `*` in a host stands for one group index (one or more digits, nothing else): the operator lists
`v3-prefill-*-0.v3-prefill-*.llm.svc:8998`, which matches the leader names the router is given for
every prefill group, present or added later by scaling, without a restart of the decode pods. Such
a pattern is matched as text only (it is never resolved).

    peers = PrefillPeers(("p-prefill-0.ns.svc:8998",))
    await peers.check("10.1.2.3", 8998)   # passes if the name resolves to 10.1.2.3
    await peers.check("10.9.9.9", 22)     # TransferError(INVALID_ARGUMENT), no connection made
    PrefillPeers(("p-prefill-*-0.p-prefill-*.ns.svc:8998",))  # p-prefill-12-0.p-prefill-12.ns.svc ok
"""
from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
import time

from deepseek_pd.errors import UserError
from deepseek_pd.workers.engine.interface import FailureCode
from deepseek_pd.workers.engine.request_failure import TransferError


def parse_peer(entry: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port); raises UserError."""
    host, sep, port = entry.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"prefill peer {entry!r} must be HOST:PORT")
    return host, int(port)


def _pattern(host: str) -> re.Pattern[str] | None:
    """A host with `*` (a group index) as a full-match regex; None for a plain host."""
    if "*" not in host:
        return None
    return re.compile("".join("[0-9]+" if part == "*" else re.escape(part.lower())
                              for part in re.split(r"(\*)", host)))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _normal(host: str) -> str:
    try:
        return str(ipaddress.ip_address(host.removeprefix("[").removesuffix("]")))
    except ValueError:
        return host.lower()


class PrefillPeers:
    def __init__(self, entries: tuple[str, ...], ttl_s: float = 5.0) -> None:
        self.entries = [parse_peer(entry) for entry in entries]
        self._patterns = [(_pattern(h), p) for h, p in self.entries if "*" in h]
        self.ttl_s = ttl_s
        self._resolved: dict[int, set[str]] = {}  # port -> addresses the named hosts resolve to
        self._resolved_at = -float("inf")

    async def check(self, host: str, port: int) -> None:
        """Returns if (host, port) is a registered prefill bootstrap address; raises TransferError."""
        if self._allowed_statically(host, port):
            return
        if self._names() and time.monotonic() - self._resolved_at >= self.ttl_s:
            await self._resolve()
        if _normal(host) in self._resolved.get(port, ()):
            return
        listed = ", ".join(f"{h}:{p}" for h, p in self.entries) or "loopback addresses only"
        raise TransferError(FailureCode.INVALID_ARGUMENT,
                            f"bootstrap address {host}:{port} is not a registered prefill worker of this "
                            f"deployment ({listed}); not connecting")

    def _allowed_statically(self, host: str, port: int) -> bool:
        if not self.entries:
            return _is_loopback(_normal(host))
        if any(port == p and pattern.fullmatch(_normal(host)) for pattern, p in self._patterns):
            return True
        return any(_normal(host) == _normal(h) and port == p for h, p in self.entries)

    def _names(self) -> list[tuple[str, int]]:
        return [(h, p) for h, p in self.entries if not _is_ip(h) and "*" not in h]

    async def _resolve(self) -> None:
        """Looks up every named entry (DNS only: the prefill host itself is not contacted)."""
        loop = asyncio.get_running_loop()
        resolved: dict[int, set[str]] = {}
        for host, port in self._names():
            try:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError:
                continue  # a group that does not exist (yet): its name resolves to nothing
            resolved.setdefault(port, set()).update(_normal(info[4][0]) for info in infos)
        self._resolved, self._resolved_at = resolved, time.monotonic()


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False
