"""Whether a prefill worker's bootstrap address is this machine's own: where a same-host offer can help.

A decode worker offers its KV pool for direct writes (direct_pool.py) only to a prefill that can
open it, which is never one on another host, and the offer has a cost: a transfer offered the
pool counts as one-sided (the peer might write the pages itself), so its pages are held for the
late-write grace (send_timeout_s, 30 s by default) when it fails. A Kubernetes pod dialling
another pod's IP would pay that on every aborted request and never gain a direct write. The
address decides: a loopback address, or one bound in this network namespace (`up`, or pods with
the host's network), may be this host; any other is not. Names are never resolved (workers
advertise their IP, `--advertise-host`): the host comes with each request, and a lookup of a name
a caller made up would block the decode worker's event loop for every other request.

    shares_host("127.0.0.1")   # True
    shares_host("10.4.2.17")   # True only where that address is one of this host's own
"""
from __future__ import annotations

import functools
import ipaddress
import socket


def _bound_here(address: str) -> bool:
    """A socket can bind `address` only in the network namespace that owns it (no packet is sent)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((address, 0))
    except OSError:
        return False
    return True


@functools.lru_cache(maxsize=256)
def shares_host(host: str) -> bool:
    """Whether `host` (an IP address, or "localhost") may be this machine; any other name: no."""
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return address.is_loopback or (not address.is_unspecified and _bound_here(str(address)))
