"""The pods a DeepSeekDeployment becomes, from the operator's pure builders alone (no cluster).

    rendered = RenderedDeployment(spec)
    rendered.objects           every child the operator creates for `spec` (worker StatefulSets and
                               Services, ConfigMaps, Secrets, the router Deployment and Services)
    rendered.pods()            the Pod objects the StatefulSet and Deployment controllers would make
                               (name, labels with the pod-index, hostname/subdomain, status.podIP)
    rendered.argv(c, env)      the container's command + args, `$(VAR)` expanded from `env` as the
                               kubelet does (pdtest.pod_inputs.container_env gives `env`)
    cpu_minimal_spec(rng, 2)   examples/cpu-minimal.yaml with 2 pods per group (dp2/ep2 and tp2)

Pod DNS names follow Kubernetes: `<hostname>.<subdomain>.<ns>.svc` for a StatefulSet pod behind its
headless Service. Nothing here knows the operator's naming rules beyond what the objects say.
"""
from __future__ import annotations

import copy
import pathlib
import random

import yaml

from deepseek_pd.operator import names
from deepseek_pd.operator.build_secret import build_internal_secret
from deepseek_pd.operator.build_workers import build_group_service, build_group_statefulset
from deepseek_pd.operator.reconcile import build_static_children
from deepseek_pd.operator.router_keys import build_control_plane_secret
from deepseek_pd.operator.spec import DeploymentSpec

from pdtest.pod_inputs import Obj, expand

_KIND_PATHS = {"Secret": "secrets", "ConfigMap": "configmaps"}
EXAMPLES = pathlib.Path(__file__).resolve().parents[3] / "examples"
# Multi-pod layouts of one CPU rank per pod: DP attention with EP, and TP attention.
MULTI_POD_LAYOUTS = ({"dp": 2, "ep": 2}, {"tp": 2})


def cpu_minimal_spec(rng: random.Random, pods_per_group: int = 1) -> DeploymentSpec:
    """examples/cpu-minimal.yaml; with `pods_per_group` > 1 each role spans that many pods, one
    role with DP+EP and the other with TP (which gets which drawn by `rng`)."""
    raw = yaml.safe_load((EXAMPLES / "cpu-minimal.yaml").read_text())["spec"]
    if pods_per_group > 1:
        for role, layout in zip(names.ROLES, rng.sample(MULTI_POD_LAYOUTS, 2)):
            raw[role].update(size=pods_per_group, parallelism=dict(layout))
    return DeploymentSpec.parse("tiny", "llm", raw)


class RenderedDeployment:
    """Every object the operator renders for `spec` at its desired size, and their pods."""

    def __init__(self, spec: DeploymentSpec, pod_ip: str = "127.0.0.1") -> None:
        self.spec = spec
        self.pod_ip = pod_ip
        groups = [(role, index) for role in names.ROLES for index in range(spec.role(role).replicas)]
        self.objects: list[Obj] = [
            *build_static_children(spec),
            *(build_group_statefulset(spec, role, index) for role, index in groups),
            *(build_group_service(spec, role, index) for role, index in groups),
            build_internal_secret(spec.name, spec.namespace),
            build_control_plane_secret(spec),
        ]

    def of_kind(self, kind: str) -> list[Obj]:
        return [obj for obj in self.objects if obj["kind"] == kind]

    # pdtest.pod_inputs.Objects: Secrets and ConfigMaps by their API path.
    def get(self, path: str) -> Obj | None:
        *_, namespace, plural, name = path.strip("/").split("/")
        for obj in self.objects:
            meta = obj["metadata"]
            if (_KIND_PATHS.get(obj["kind"]), meta["namespace"], meta["name"]) == (plural, namespace, name):
                return obj
        return None

    def create(self, path: str, obj: Obj) -> Obj:
        raise NotImplementedError(f"rendered pods get no service-account tokens ({path})")

    def pods(self) -> list[Obj]:
        """Worker pods (every rank of every group), then the router's pod(s)."""
        pods = []
        for sts in self.of_kind("StatefulSet"):
            for index in range(sts["spec"]["replicas"]):
                pod = self._pod(sts, f"{sts['metadata']['name']}-{index}")
                pod["metadata"]["labels"].update({names.LABEL_POD_INDEX: str(index),
                                                  "statefulset.kubernetes.io/pod-name": pod["metadata"]["name"]})
                pod["spec"].update(hostname=pod["metadata"]["name"], subdomain=sts["spec"]["serviceName"])
                pods.append(pod)
        for deployment in self.of_kind("Deployment"):
            for index in range(deployment["spec"]["replicas"]):
                pods.append(self._pod(deployment, f"{deployment['metadata']['name']}-{index}"))
        return pods

    def _pod(self, owner: Obj, name: str) -> Obj:
        template = copy.deepcopy(owner["spec"]["template"])
        metadata = {**template.get("metadata", {}), "name": name, "namespace": owner["metadata"]["namespace"],
                    "uid": f"uid-{name}"}
        metadata["labels"] = dict(metadata.get("labels", {}))
        return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"],
                "status": {"podIP": self.pod_ip, "podIPs": [{"ip": self.pod_ip}], "hostIP": self.pod_ip}}

    @staticmethod
    def argv(container: Obj, env: dict[str, str]) -> list[str]:
        """command + args with `$(VAR)` expanded from the container's env (unknown names kept)."""
        return [expand(arg, env) for arg in [*container.get("command", []), *container.get("args", [])]]


def pod_dns_name(pod: Obj) -> str | None:
    """`<hostname>.<subdomain>.<ns>.svc` of a pod with both set (StatefulSet pods), else None."""
    spec = pod["spec"]
    if not (spec.get("hostname") and spec.get("subdomain")):
        return None
    return f"{spec['hostname']}.{spec['subdomain']}.{pod['metadata']['namespace']}.svc"


def selects(service: Obj, pod: Obj) -> bool:
    selector = service["spec"].get("selector") or {}
    return bool(selector) and selector.items() <= pod["metadata"]["labels"].items() \
        and service["metadata"]["namespace"] == pod["metadata"]["namespace"]


def container_ports(pod: Obj) -> list[int]:
    return [p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])]
