"""`spec.router.clientBudget`: a per-client request budget at the router (smg's tenant rate limit).

smg reads the policy from a file at start, so the operator renders it into a ConfigMap mounted
read-only into the router pod, passes the flags that load it, and stamps the policy's digest on
the pod template: changing the budget rolls the router (a mounted ConfigMap alone would change
under a running gateway that never re-reads it). The policy text and the flags are the ones `up`
uses (`deepseek_pd/gateway.py`), written once.

Example: clientBudget {requestsPerMinute: 600, clientHeader: X-Real-IP} renders
    ConfigMap v3-router-client-budget   client-budget.yaml: default_policy: ... requests_per_minute: 600
    router args  --tenant-rate-limit-enabled --tenant-rate-limit-config /etc/deepseek-pd-router/client-budget.yaml
                 --trust-tenant-header --tenant-header-name X-Real-IP
"""
from __future__ import annotations

import hashlib
from typing import Any

from deepseek_pd import gateway
from deepseek_pd.operator import names
from deepseek_pd.operator.spec import DeploymentSpec

Manifest = dict[str, Any]
MOUNT = "/etc/deepseek-pd-router"
VOLUME = "client-budget"
ANNOTATION = f"{names.GROUP}/client-budget"


def config_map_name(deployment: str) -> str:
    return f"{names.router_name(deployment)}-client-budget"


def _policy(spec: DeploymentSpec) -> str | None:
    budget = spec.router.client_budget
    return None if budget is None else gateway.client_budget_policy(budget.requests_per_minute)


def budget_config_map(spec: DeploymentSpec) -> Manifest | None:
    """The policy's ConfigMap, or None without a budget (the reconciler then deletes an old one)."""
    policy = _policy(spec)
    if policy is None:
        return None
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": config_map_name(spec.name), "namespace": spec.namespace,
                         "labels": names.base_labels(spec.name, "router")},
            "data": {gateway.CLIENT_BUDGET_FILE: policy}}


def budget_args(spec: DeploymentSpec) -> list[str]:
    budget = spec.router.client_budget
    if budget is None:
        return []
    return list(gateway.client_budget_flags(f"{MOUNT}/{gateway.CLIENT_BUDGET_FILE}", budget.client_header))


def mount_budget(spec: DeploymentSpec, pod_spec: dict[str, Any], container: dict[str, Any],
                 annotations: dict[str, str]) -> None:
    """Mounts the policy into the router container and stamps its digest (a change rolls the pods)."""
    policy = _policy(spec)
    if policy is None:
        return
    pod_spec.setdefault("volumes", []).append({"name": VOLUME, "configMap": {"name": config_map_name(spec.name)}})
    container.setdefault("volumeMounts", []).append({"name": VOLUME, "mountPath": MOUNT, "readOnly": True})
    annotations[ANNOTATION] = hashlib.sha256(policy.encode()).hexdigest()[:16]
