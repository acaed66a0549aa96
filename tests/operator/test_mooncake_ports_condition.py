"""The `MooncakePortsGuarded` condition (operator/kv_ports_status.py): False, naming the cure, where
nothing the operator renders keeps other pods off Mooncake's engine ports (rdma.hostNetwork, or the
NetworkPolicy switched off), True where the NetworkPolicy does or no engine listens; and the real
kopf operator reports it in the CR's status, following the spec."""
from __future__ import annotations

import pathlib
import random

import pytest
import yaml

from deepseek_pd.operator import names
from deepseek_pd.operator.build_network_policy import build_network_policy
from deepseek_pd.operator.build_workers import build_group_statefulset
from deepseek_pd.operator.kv_ports_status import CONDITION, mooncake_ports_verdict
from deepseek_pd.operator.spec import DeploymentSpec

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def _raw(backend: str, protocol: str, host_network: bool, policy: bool) -> dict:
    raw = yaml.safe_load((EXAMPLES / "deepseek-v3-h200.yaml").read_text())["spec"]
    if backend == "grpc" or protocol == "tcp":
        raw["kvTransfer"] = {"backend": backend, **({"protocol": protocol} if protocol else {})}
    raw["rdma"] = {**raw["rdma"], "hostNetwork": host_network}
    raw["networkPolicy"] = {"enabled": policy}
    return raw


@pytest.mark.parametrize("backend,protocol", [("grpc", ""), ("mooncake", "tcp"), ("mooncake", "rdma")])
@pytest.mark.parametrize("host_network", [False, True])
@pytest.mark.parametrize("policy", [False, True])
def test_the_condition_is_false_exactly_where_the_rendered_pods_leave_the_ports_open(backend, protocol,
                                                                                    host_network, policy):
    spec = DeploymentSpec.parse("v3", "llm", _raw(backend, protocol, host_network, policy))
    ok, reason, message = mooncake_ports_verdict(spec)
    # The oracle: what the builders render. A pod on the host network, or no policy at all, is
    # guarded by nothing the operator renders.
    pod = build_group_statefulset(spec, "decode", random.randrange(2))["spec"]["template"]["spec"]
    on_host = pod.get("hostNetwork", False)
    rendered = build_network_policy(spec) if spec.network_policy.enabled else None
    assert ok == (backend == "grpc" or (rendered is not None and not on_host)), (reason, message)
    if not ok:
        assert reason == ("HostNetwork" if on_host else "NetworkPolicyDisabled")
        assert "15000-17000" in message and ("firewall" in message if on_host else "policy" in message)


def test_the_operator_reports_it_and_follows_the_spec(cluster):
    name = f"mp{random.randint(0, 9999)}"
    body = yaml.safe_load((EXAMPLES / "cpu-minimal.yaml").read_text())
    body["metadata"] = {"name": name, "namespace": "llm"}
    body["spec"]["kvTransfer"] = {"backend": "mooncake", "protocol": "tcp"}
    body["spec"]["networkPolicy"] = {"enabled": False}
    cluster.create(body)

    def reported(status: str) -> dict | None:
        conditions = ((cluster.get(names.KIND, name) or {}).get("status") or {}).get("conditions", [])
        found = next((c for c in conditions if c["type"] == CONDITION), None)
        return found if found and found["status"] == status else None
    assert cluster.wait_for("the ports reported open", lambda: reported("False"))["reason"] == "NetworkPolicyDisabled"
    cluster.patch(names.KIND, name, {"spec": {"networkPolicy": {"enabled": True}}})
    assert cluster.wait_for("the ports reported guarded", lambda: reported("True"))["reason"] == "NetworkPolicy"
    cluster.delete(names.KIND, name)
