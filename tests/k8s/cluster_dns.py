"""The cluster's DNS server for pods of the process kubelet: what CoreDNS answers, from the same
names as their /etc/hosts (cluster_hosts.py).

Not every resolver reads /etc/hosts first: gRPC's c-ares resolver asks the nameserver of
/etc/resolv.conf, which a pod's network namespace cannot reach on this machine, and waits out its
timeouts. So each pod's resolv.conf names this server on the node's bridge address, with the
search path a kubelet writes (`<ns>.svc.cluster.local svc.cluster.local cluster.local`,
ndots:5). It answers A queries for the cluster's names, an empty NOERROR for other types of a
known name, and NXDOMAIN for everything else (pods here have no upstream DNS to forward to).
UDP only; answers carry a 5 s TTL.
"""
from __future__ import annotations

import contextlib
import ipaddress
import socket
import struct
import threading
from typing import Callable

TYPE_A = 1
CLASS_IN = 1
NXDOMAIN = 3


def resolv_conf(nameserver: str, namespace: str) -> str:
    return (f"nameserver {nameserver}\n"
            f"search {namespace}.svc.cluster.local svc.cluster.local cluster.local\n"
            "options ndots:5\n")


def _question(packet: bytes) -> tuple[str, int, int, int]:
    """(name, qtype, qclass, end offset) of the first question."""
    labels, offset = [], 12
    while packet[offset]:
        length = packet[offset]
        labels.append(packet[offset + 1:offset + 1 + length].decode("ascii", "replace"))
        offset += 1 + length
    qtype, qclass = struct.unpack("!HH", packet[offset + 1:offset + 5])
    return ".".join(labels).lower().rstrip("."), qtype, qclass, offset + 5


def answer(packet: bytes, lookup: Callable[[str], list[str]]) -> bytes:
    """The response to one query packet."""
    ident, flags = struct.unpack("!HH", packet[:4])
    name, qtype, qclass, end = _question(packet)
    addresses = lookup(name)
    rcode = 0 if addresses else NXDOMAIN
    records = [a for a in addresses if qtype == TYPE_A and qclass == CLASS_IN]
    header = struct.pack("!HHHHHH", ident, 0x8180 | (flags & 0x0100) | rcode, 1, len(records), 0, 0)
    body = b"".join(struct.pack("!HHHIH", 0xC00C, TYPE_A, CLASS_IN, 5, 4) + ipaddress.IPv4Address(a).packed
                    for a in records)
    return header + packet[12:end] + body


class DnsServer:
    """Serves `lookup(name) -> [IPv4]` on (host, 53/udp) until `stop()`."""

    def __init__(self, host: str, lookup: Callable[[str], list[str]], port: int = 53) -> None:
        self.address = (host, port)
        self.lookup = lookup
        self._sock: socket.socket | None = None

    def start(self) -> "DnsServer":
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(self.address)
        threading.Thread(target=self._serve, name="cluster-dns", daemon=True).start()
        return self

    def _serve(self) -> None:
        assert self._sock is not None
        while True:
            try:
                packet, peer = self._sock.recvfrom(4096)
            except OSError:
                return  # closed by stop()
            with contextlib.suppress(Exception):  # a malformed query gets no answer, as from CoreDNS
                self._sock.sendto(answer(packet, self.lookup), peer)

    def stop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
