"""The process kubelet's pod addresses (pod_sandbox.PodNetwork.allocate): a released address comes
back only once the /24 has no fresh one, oldest release first, as host-local IPAM does. A replaced
pod given its predecessor's address at once was unreachable from pods that had talked to the
predecessor until their neighbour cache forgot the dead veth (the operator's token check of a
replaced decode group timed out so in tests/k8s/test_verified_rollout_e2e.py). Pure: no sandbox."""
from __future__ import annotations

import ipaddress
import random

from pod_sandbox import PodNetwork


def test_a_released_address_is_reused_only_once_the_subnet_has_no_fresh_one():
    rng = random.Random()
    network = PodNetwork(subnet=ipaddress.ip_network(f"10.{rng.randrange(100, 250)}.{rng.randrange(256)}.0/24"))
    held = [network.allocate() for _ in range(rng.randint(2, 40))]
    released = rng.sample(held, rng.randint(1, len(held)))
    for address in released:
        network.release(address)
    fresh = [network.allocate() for _ in range(254 - 2 - len(held) + 1)]  # .2 ... .254
    assert not set(fresh) & set(held) and len(set(fresh)) == len(fresh), "a released address came back while fresh ones remained"
    assert {ipaddress.ip_address(a) for a in held + fresh} == set(list(network.subnet.hosts())[1:])
    assert [network.allocate() for _ in released] == released  # then the oldest release first
