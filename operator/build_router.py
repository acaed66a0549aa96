"""Pure builders for the router: smg (Shepherd Model Gateway) in PD mode, in front of the gRPC workers.

How it finds the workers is `spec.router.workerDiscovery` (see `router_discovery`): Static lists
every group's leader in its flags and needs no Kubernetes API access; Selector watches the leader
pods by label and gets a ServiceAccount allowed to get/list/watch pods in the deployment's
namespace (and nothing else).
"""
from __future__ import annotations

from typing import Any

from deepseek_pd import gateway, gateway_guard
from deepseek_pd.operator import names
from deepseek_pd.operator.build_model import hub_env
from deepseek_pd.operator.pod_security import secure_container
from deepseek_pd.operator.build_metrics import router_metrics_args, router_metrics_ports, scrape_annotations
from deepseek_pd.operator.router_client_budget import budget_args, budget_config_map, mount_budget
from deepseek_pd.operator.router_discovery import WORKER_DISCOVERY, RouterGroups, desired_groups
from deepseek_pd.operator.router_keys import CONTROL_PLANE_ENV, router_key_args, router_key_env
from deepseek_pd.operator.router_rollout import PROGRESS_DEADLINE_SECONDS
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


# The gateway gives up on a worker it cannot reach within --worker-startup-timeout-secs of
# registering it, and never retries; so it waits at least as long as the startup probe lets a
# worker load weights, plus time to schedule the pod and pull the image.
SCHEDULE_AND_PULL_SECONDS = 900
# A router pod being replaced (every scale change rolls a Static router) finishes its in-flight
# requests for this long after SIGTERM; the pod's grace period must cover it (the default 30 s
# would cut long generations).
SHUTDOWN_GRACE_SECONDS = 180
# The gateway counts every worker error against its circuit breaker, our INVALID_ARGUMENT answers
# to bad client requests included (measured with `deepseek-pd up`): a handful of malformed requests
# would open the breaker on healthy workers, so it stays off. Health checks remove dead workers, and
# retries (gateway.RETRY_ARGS: when they are safe, and why the backoff outlasts these health checks)
# move a request whose worker died before its first token to another pair. (smg's
# `--retry-max-retries 1`, used before, means one attempt: no retry at all.)
ROUTER_RESILIENCE_ARGS = ("--disable-circuit-breaker", *gateway.RETRY_ARGS, *gateway.WEDGE_ARGS,
                          *gateway.SLOW_CLIENT_ARGS, "--health-check-interval-secs", "5",
                          "--health-failure-threshold", "3")


# A router pod usually starts before its workers can answer (a new deployment, a scale-up or a
# rollout starts them together); the gateway then re-checks each worker it could not register
# every --worker-startup-check-interval seconds (smg's default: 30), and a worker ready just after a
# check idled that long out of traffic: most of a scale-up's reaction time on a model that loads in
# seconds (measured: workers ready at 3 s, registered at 30 s). A failed check is one refused gRPC
# connection: every second costs nothing, and stays below the health checks' period.
WORKER_STARTUP_CHECK_SECONDS = 1


def router_startup_timeout_seconds(spec: DeploymentSpec) -> int:
    return max(spec.prefill.startup_timeout_seconds,
               spec.decode.startup_timeout_seconds) + SCHEDULE_AND_PULL_SECONDS


def build_router_args(spec: DeploymentSpec, groups: RouterGroups | None = None) -> list[str]:
    """`python3` arguments of the router. `groups`: which groups it serves (Static mode lists
    them); default: every desired group. `router.extraArgs` come last, so they win."""
    discovery = WORKER_DISCOVERY[spec.router.worker_discovery]
    return [
        "-m", "smg.launch_router",
        "--pd-disaggregation",
        *discovery.worker_args(spec, desired_groups(spec) if groups is None else groups),
        "--worker-startup-timeout-secs", str(router_startup_timeout_seconds(spec)),
        "--worker-startup-check-interval", str(WORKER_STARTUP_CHECK_SECONDS),
        "--shutdown-grace-period-secs", str(SHUTDOWN_GRACE_SECONDS),
        *ROUTER_RESILIENCE_ARGS,
        "--max-payload-size", str(gateway.MAX_PAYLOAD_BYTES),
        *gateway_guard.ENABLE_ARGS,
        *router_key_args(spec),
        "--policy", spec.router.policy,
        "--model-path", spec.model.tokenizer_path,
        "--host", "0.0.0.0",
        "--port", str(spec.router.port),
        *router_metrics_args(spec),
        *budget_args(spec),
        *spec.router.extra_args,
    ]


def _http_probe(path: str, failure_threshold: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": 10, "timeoutSeconds": 5,
            "failureThreshold": failure_threshold}


def build_router_deployment(spec: DeploymentSpec, groups: RouterGroups | None = None) -> Manifest:
    router = spec.router
    container: dict[str, Any] = {
        "name": "router",
        "image": router.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["python3"],
        "args": build_router_args(spec, groups),
        "ports": [{"name": "http", "containerPort": router.port, "protocol": "TCP"},
                  *router_metrics_ports(spec)],
        # /readiness answers 503 until the gateway has healthy prefill and decode workers, so a
        # rolled router pod takes traffic only once it has registered them (the old pod serves
        # until then); /liveness does not depend on the workers.
        "readinessProbe": _http_probe("/readiness", 3),
        "livenessProbe": _http_probe("/liveness", 6),
        "resources": dict(router.resources),
        # smg keeps WASM modules in memory only: load the n guard into every new gateway process.
        "lifecycle": {"postStart": {"exec": {"command": gateway_guard.post_start_command(router.port, CONTROL_PLANE_ENV)}}},
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": names.router_name(spec.name),
        "automountServiceAccountToken": WORKER_DISCOVERY[router.worker_discovery].needs_pod_access,
        "terminationGracePeriodSeconds": SHUTDOWN_GRACE_SECONDS + 10,
        "containers": [container],
    }
    if spec.model.volume is not None:  # the gateway tokenizes, so it reads the checkpoint's tokenizer
        pod_spec["volumes"] = [{"name": "model", **spec.model.volume}]
        container["volumeMounts"] = [{"name": "model", "mountPath": names.MODEL_MOUNT, "readOnly": True}]
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in spec.image_pull_secrets]
    container["env"] = router_key_env(spec)
    if spec.model.hub is not None:  # the gateway fetches the tokenizer from the Hub (or its mirror)
        container["env"] += hub_env(spec.model.hub)
    annotations = scrape_annotations(spec, spec.metrics.router_port)
    mount_budget(spec, pod_spec, container, annotations)
    secure_container(spec, pod_spec, container)  # no capabilities, read-only root, seccomp
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(spec),
        "spec": {
            "replicas": router.replicas,
            "progressDeadlineSeconds": PROGRESS_DEADLINE_SECONDS,
            "selector": {"matchLabels": _selector(spec)},
            "template": {"metadata": {"labels": {**names.base_labels(spec.name, "router"), **_selector(spec)},
                                      "annotations": annotations},
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
            "ports": [{"name": "http", "port": spec.router.port, "targetPort": "http", "protocol": "TCP"},
                      *({"name": p["name"], "port": p["containerPort"], "targetPort": p["name"], "protocol": "TCP"}
                        for p in router_metrics_ports(spec))],
        },
    }


def router_endpoint(spec: DeploymentSpec) -> str:
    return f"http://{names.router_name(spec.name)}.{spec.namespace}.svc:{spec.router.port}"


def build_router_children(spec: DeploymentSpec, groups: RouterGroups | None = None) -> list[Manifest]:
    """The router's objects; the Role and RoleBinding only when it reads pods (Selector)."""
    access: list[Manifest] = []
    if WORKER_DISCOVERY[spec.router.worker_discovery].needs_pod_access:
        access = [build_router_role(spec), build_router_role_binding(spec)]
    return [build_router_service_account(spec), *access, *filter(None, [budget_config_map(spec)]),
            build_router_deployment(spec, groups), build_router_service(spec)]
