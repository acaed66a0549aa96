"""Pure builders for the router: sgl-model-gateway in PD mode with Kubernetes service discovery.

The router watches the leader pod (rank 0) of every group through label selectors, reads the
prefill bootstrap port from the `sglang.ai/bootstrap-port` annotation, and therefore needs a
ServiceAccount allowed to get/list/watch pods in the deployment's namespace (and nothing else).
"""
from __future__ import annotations

from typing import Any

from deepseek_pd.operator import names
from deepseek_pd.operator.spec import DeploymentSpec

Manifest = dict[str, Any]


def _meta(spec: DeploymentSpec) -> dict[str, Any]:
    return {"name": names.router_name(spec.name), "namespace": spec.namespace,
            "labels": names.base_labels(spec.name, "router")}


def _selector(spec: DeploymentSpec) -> dict[str, str]:
    return {names.LABEL_DEPLOYMENT: spec.name, names.LABEL_COMPONENT: "router"}


def build_router_service_account(spec: DeploymentSpec) -> Manifest:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(spec)}


def build_router_role(spec: DeploymentSpec) -> Manifest:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(spec),
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
    }


def build_router_role_binding(spec: DeploymentSpec) -> Manifest:
    name = names.router_name(spec.name)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(spec),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": spec.namespace}],
    }


def build_router_args(spec: DeploymentSpec) -> list[str]:
    def selector(role: str) -> list[str]:
        labels = names.router_pod_selector(spec.name, role)
        return [f"{key}={value}" for key, value in sorted(labels.items())]

    return [
        "-m", "sglang_router.launch_router",
        "--pd-disaggregation",
        "--service-discovery",
        "--service-discovery-namespace", spec.namespace,
        "--service-discovery-port", str(spec.decode.port),
        "--prefill-selector", *selector("prefill"),
        "--decode-selector", *selector("decode"),
        "--policy", spec.router.policy,
        "--model-path", spec.model.path,
        "--host", "0.0.0.0",
        "--port", str(spec.router.port),
        *spec.router.extra_args,
    ]


def build_router_deployment(spec: DeploymentSpec) -> Manifest:
    router = spec.router
    probe = {"tcpSocket": {"port": "http"}, "periodSeconds": 10, "failureThreshold": 3}
    container: dict[str, Any] = {
        "name": "router",
        "image": router.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["python3"],
        "args": build_router_args(spec),
        "ports": [{"name": "http", "containerPort": router.port, "protocol": "TCP"}],
        "readinessProbe": probe,
        "livenessProbe": {**probe, "failureThreshold": 6},
        "resources": dict(router.resources),
    }
    pod_spec: dict[str, Any] = {"serviceAccountName": names.router_name(spec.name),
                                "containers": [container]}
    if spec.model.volume is not None:  # the gateway tokenizes, so it reads the checkpoint's tokenizer
        pod_spec["volumes"] = [{"name": "model", **spec.model.volume}]
        container["volumeMounts"] = [{"name": "model", "mountPath": names.MODEL_MOUNT, "readOnly": True}]
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in spec.image_pull_secrets]
    if spec.model.hf_token_secret:
        container["env"] = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": spec.model.hf_token_secret, "key": "HF_TOKEN"}}}]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(spec),
        "spec": {
            "replicas": router.replicas,
            "selector": {"matchLabels": _selector(spec)},
            "template": {"metadata": {"labels": {**names.base_labels(spec.name, "router"),
                                                 **_selector(spec)}},
                         "spec": pod_spec},
        },
    }


def build_router_service(spec: DeploymentSpec) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(spec),
        "spec": {
            "type": spec.router.service_type,
            "selector": _selector(spec),
            "ports": [{"name": "http", "port": spec.router.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def router_endpoint(spec: DeploymentSpec) -> str:
    return f"http://{names.router_name(spec.name)}.{spec.namespace}.svc:{spec.router.port}"
