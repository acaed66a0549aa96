"""What a worker pod needs to start with internal authentication on, and to be locked down.

`serve` refuses to start without the deployment secret (workers/transport/internal_auth.py), and a
decode worker pulls KV only from the prefill addresses in `--prefill-peers`
(workers/decode/prefill_peers.py). For DeepSeekDeployment "v3" in namespace "llm", bootstrap port
8998, a decode pod gets

    --prefill-peers v3-prefill-*-0.v3-prefill-*.llm.svc:8998,v3-prefill-peers.llm.svc:8998

The first entry matches, as text, the leader name the router is given for every prefill group
(`--prefill grpc://v3-prefill-1-0.v3-prefill-1.llm.svc:30000 8998`, router_discovery.py), so
scaling prefill needs no decode restart. The second is a headless Service over every prefill pod:
a router that finds workers by label (Selector) hands decode pod IPs, which it resolves to.
"""
from __future__ import annotations

from typing import Any

from deepseek_pd.operator import names
from deepseek_pd.operator.build_secret import internal_secret_mount
from deepseek_pd.operator.pod_security import secure_container, worker_capabilities
from deepseek_pd.operator.spec import DeploymentSpec, RoleSpec

Manifest = dict[str, Any]


def prefill_peer_entries(spec: DeploymentSpec) -> tuple[str, ...]:
    """Decode's `--prefill-peers` entries: every prefill group's leader, and every prefill pod."""
    port = spec.prefill.bootstrap_port
    pattern = names.leader_address(spec.name, "prefill", "*", spec.namespace)  # type: ignore[arg-type]
    peers = f"{names.prefill_peers_service_name(spec.name)}.{spec.namespace}.svc"
    return (f"{pattern}:{port}", f"{peers}:{port}")


def prefill_peers(spec: DeploymentSpec, role: RoleSpec) -> tuple[str, ...]:
    """`serve --prefill-peers` of the role's pods (the secret itself comes through the environment)."""
    return prefill_peer_entries(spec) if role.role == "decode" else ()


def secure_worker_pod(spec: DeploymentSpec, pod_spec: Manifest) -> None:
    """Mounts the deployment secret into the worker container and locks the pod down (in place,
    on a pod spec `build_pod_template` has just built). `prefill_peers` go into the worker's
    argv (build_worker_args)."""
    container = pod_spec["containers"][0]
    volume, mount, env = internal_secret_mount(spec.name)
    pod_spec["volumes"] = [*pod_spec.get("volumes", []), volume]
    container["volumeMounts"] = [*container.get("volumeMounts", []), mount]
    container["env"] = [*container.get("env", []), env]
    secure_container(spec, pod_spec, container, worker_capabilities(spec))
    pod_spec["automountServiceAccountToken"] = False  # workers never talk to the API server


def build_prefill_peers_service(spec: DeploymentSpec) -> Manifest:
    """Headless Service over every prefill pod (ready or not): its name resolves to their IPs."""
    labels = {**names.base_labels(spec.name, "prefill"), names.LABEL_ROLE: "prefill"}
    port = spec.prefill.bootstrap_port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": names.prefill_peers_service_name(spec.name), "namespace": spec.namespace,
                     "labels": labels},
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": names.role_selector(spec.name, "prefill"),
                 "ports": [{"name": "bootstrap", "port": port, "targetPort": port, "protocol": "TCP"}]},
    }
