"""The router's keys: a generated control-plane key, and the user's optional client API key.

smg locks `/workers` (add/remove workers) with `--control-plane-api-keys id:name:admin:<key>`
(deepseek_pd/gateway.py); the operator generates that key once per deployment into the Secret
`<cr>-router-control-plane` and never changes it. `spec.router.apiKeySecret` names a user's
Secret whose key becomes `--api-key`: every serving route then needs `Authorization: Bearer`.

Neither key is written into the Deployment: the container gets them as environment variables from
`secretKeyRef`, and the kubelet expands `$(VAR)` in the arguments when it starts the container.
A user Secret that does not exist keeps the router container from starting (the kubelet retries
until it appears) and the operator reports it (SecretsReady, operator/secret_reconcile.py), so a
router never serves unlocked by accident.
"""
from __future__ import annotations

import base64
from typing import Any

from deepseek_pd import gateway
from deepseek_pd.operator import names
from deepseek_pd.operator.spec import DeploymentSpec

CONTROL_PLANE_KEY = "control-plane-key"
CONTROL_PLANE_ENV = "DEEPSEEK_PD_CONTROL_PLANE_KEY"
API_KEY_ENV = "DEEPSEEK_PD_API_KEY"


def build_control_plane_secret(spec: DeploymentSpec, key: str | None = None) -> dict[str, Any]:
    """The Secret with a fresh control-plane key, created once; `key` for tests."""
    key = key if key is not None else gateway.new_key()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": names.control_plane_secret_name(spec.name), "namespace": spec.namespace,
                     "labels": names.base_labels(spec.name, "router")},
        "data": {CONTROL_PLANE_KEY: base64.b64encode(key.encode()).decode()},
    }


def router_key_env(spec: DeploymentSpec) -> list[dict[str, Any]]:
    """The keys as environment variables of the router container, from their Secrets."""
    env = [{"name": CONTROL_PLANE_ENV, "valueFrom": {"secretKeyRef": {
        "name": names.control_plane_secret_name(spec.name), "key": CONTROL_PLANE_KEY}}}]
    ref = spec.router.api_key_secret
    if ref is not None:
        env.append({"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    return env


def router_key_args(spec: DeploymentSpec) -> list[str]:
    """launch_router flags that take the keys from the environment (expanded by the kubelet)."""
    args = ["--control-plane-api-keys", gateway.control_plane_key_arg(f"$({CONTROL_PLANE_ENV})")]
    if spec.router.api_key_secret is not None:
        args += ["--api-key", f"$({API_KEY_ENV})"]
    return args
