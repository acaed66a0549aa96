"""How the router finds the workers (`spec.router.workerDiscovery`), chosen once per build.

sgl-model-gateway decides HTTP or gRPC per worker from the URL scheme, and our workers speak only
gRPC (`sglang.grpc.scheduler.SglangScheduler`). The gateway's Kubernetes service discovery in
0.3.2 builds `http://<pod-ip>:<port>` URLs (upstream: sgl-project/sglang#11567 and #12045; smg
documents a HTTP-then-gRPC probe, untested here), so discovered workers never become healthy. Two modes:

    Static    (default) the operator lists the leader (rank 0) of every group through the
              group's headless Service. DeepSeekDeployment "v3" in namespace "llm", 2 prefill
              groups and 1 decode group, port 30000, bootstrap port 8998:
                  --prefill grpc://v3-prefill-0-0.v3-prefill-0.llm.svc:30000 8998
                  --prefill grpc://v3-prefill-1-0.v3-prefill-1.llm.svc:30000 8998
                  --decode  grpc://v3-decode-0-0.v3-decode-0.llm.svc:30000
              The flags change when groups come or go, so the router Deployment rolls. A group
              replaced in place keeps its name (the gateway reconnects through DNS). The router
              needs no Kubernetes API access: no Role, no service-account token.
    Selector  `--service-discovery` with the rank-0 label selectors, for gateways whose discovery
              connects over gRPC. The router watches pods, so it gets a Role (get/list/watch pods).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from deepseek_pd.operator import names
from deepseek_pd.operator.spec import DeploymentSpec

# role -> indices of the groups the router sends requests to (Static mode lists exactly these).
RouterGroups = Mapping[str, Sequence[int]]


@dataclass(frozen=True)
class WorkerDiscovery:
    """One way for the router to find workers: its launch_router flags and its API access."""

    worker_args: Callable[[DeploymentSpec, RouterGroups], list[str]]
    needs_pod_access: bool  # the router lists/watches pods: Role, RoleBinding, mounted token
    lists_groups: bool  # its arguments name the groups: retiring one waits for the router rollout


def desired_groups(spec: DeploymentSpec) -> dict[str, tuple[int, ...]]:
    """Groups 0..replicas-1 of each role: what the router serves once the spec is reached."""
    return {role: tuple(range(spec.role(role).replicas)) for role in names.ROLES}


def worker_url(spec: DeploymentSpec, role: str, index: int) -> str:
    """gRPC URL of group `index`'s leader, resolvable through its headless Service."""
    address = names.leader_address(spec.name, role, index, spec.namespace)
    return f"grpc://{address}:{spec.role(role).port}"


def _static_args(spec: DeploymentSpec, groups: RouterGroups) -> list[str]:
    args: list[str] = []
    for index in sorted(groups.get("prefill", ())):
        # The gateway hands this port and the URL's host to decode for the KV handshake.
        args += ["--prefill", worker_url(spec, "prefill", index), str(spec.prefill.bootstrap_port)]
    for index in sorted(groups.get("decode", ())):
        args += ["--decode", worker_url(spec, "decode", index)]
    return args


def _selector_args(spec: DeploymentSpec, groups: RouterGroups) -> list[str]:
    del groups  # the gateway finds the groups itself

    def selector(role: str) -> list[str]:
        labels = names.router_pod_selector(spec.name, role)
        return [f"{key}={value}" for key, value in sorted(labels.items())]

    return [
        "--service-discovery",
        "--service-discovery-namespace", spec.namespace,
        "--service-discovery-port", str(spec.decode.port),
        "--prefill-selector", *selector("prefill"),
        "--decode-selector", *selector("decode"),
    ]


WORKER_DISCOVERY: dict[str, WorkerDiscovery] = {
    "Static": WorkerDiscovery(_static_args, needs_pod_access=False, lists_groups=True),
    "Selector": WorkerDiscovery(_selector_args, needs_pod_access=True, lists_groups=False),
}
