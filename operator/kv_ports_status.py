"""The `MooncakePortsGuarded` condition: whether anything the operator renders keeps other pods off
the Mooncake engine ports of a deployment's workers.

Mooncake's TransferEngine authenticates no peer (issue 20): whoever reaches an engine's ports can
read the staging of transfers in flight (ciphertext of their KV, with the deployment secret) and
write it, failing those requests by their KV MAC. In a pod network the deployment's NetworkPolicy
opens that range only to its own worker pods (build_network_policy.py). Two specs leave it open,
and say so here rather than only in docs/operations.md §8:
    kvTransfer.backend grpc                           True   NoMooncake (no engine listens)
    mooncake, the NetworkPolicy rendered              True   NetworkPolicy
    mooncake over rdma with rdma.hostNetwork          False  HostNetwork (no NetworkPolicy
                                                             applies to host-network pods)
    mooncake, networkPolicy.enabled false             False  NetworkPolicyDisabled
A False condition does not change the phase: the deployment serves; closing the ports is left to a
node firewall (or an own policy) that this condition names.
"""
from __future__ import annotations

from typing import Any

from deepseek_pd.env import MOONCAKE_RPC_PORTS
from deepseek_pd.operator.spec import DeploymentSpec
from deepseek_pd.operator.status import condition

CONDITION = "MooncakePortsGuarded"


def mooncake_ports_verdict(spec: DeploymentSpec) -> tuple[bool, str, str]:
    """(status, reason, message) of the condition for `spec` (the table above)."""
    ports = f"Mooncake's engine ports ({MOONCAKE_RPC_PORTS.start}-{MOONCAKE_RPC_PORTS[-1]})"
    if spec.kv_transfer.backend != "mooncake":
        return True, "NoMooncake", "KV moves over the bootstrap gRPC stream: no Mooncake engine listens"
    risk = ("Mooncake authenticates no peer: whoever reaches them can read the staging of transfers in "
            "flight (ciphertext) and write it, failing those requests")
    if spec.rdma_enabled and spec.rdma.host_network:
        return False, "HostNetwork", (
            f"rdma.hostNetwork puts the worker pods on their nodes' network, where no NetworkPolicy "
            f"applies: {ports} are open to every host and pod that reaches the nodes. {risk}. Allow "
            f"them only between this deployment's nodes with a node firewall (docs/operations.md §8)")
    if not spec.network_policy.enabled:
        return False, "NetworkPolicyDisabled", (
            f"networkPolicy.enabled is false: {ports} are open to every pod of the cluster. {risk}. "
            f"Enable it, or admit only this deployment's worker pods by a policy of your own")
    return True, "NetworkPolicy", f"{ports} admit only this deployment's worker pods (NetworkPolicy)"


def mooncake_ports_condition(spec: DeploymentSpec, generation: int | None, previous: dict[str, Any],
                             now: str) -> dict[str, Any]:
    """The condition itself, keeping its lastTransitionTime while its status holds (status.condition)."""
    before = {c.get("type", ""): c for c in previous.get("conditions") or []}
    return condition(CONDITION, *mooncake_ports_verdict(spec), generation, before, now)
