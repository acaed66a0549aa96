"""The Secrets of one deployment, as a reconcile pass sees them.

Generated Secrets (the workers' HMAC secret, the router's control-plane key) are created once,
owned by the DeepSeekDeployment, and never patched: a reconcile that rewrote them would rotate the
secret under running pods, whose peers would then refuse each other (rotation is a documented,
deliberate step, docs/operations.md). One that already exists is kept as it is, so an admin may
create it beforehand with a value of their choice. The user's API-key Secret is only read, to
report a missing Secret or key as the SecretsReady condition instead of a router that silently
never starts.

The operator needs get/create/delete on secrets, never list or watch (chart RBAC).
"""
from __future__ import annotations

import base64
import binascii
import logging
from typing import Any

import kopf

from deepseek_pd.operator import names
from deepseek_pd.operator.build_secret import SECRET_KEY, build_internal_secret, internal_secret_name
from deepseek_pd.operator.kube import ApiError, KubeClient
from deepseek_pd.operator.router_keys import CONTROL_PLANE_KEY, build_control_plane_secret
from deepseek_pd.operator.spec import DeploymentSpec
from deepseek_pd.operator.status import condition

MIN_SECRET_BYTES = 16  # = workers/transport/internal_auth.py's floor


def generated_secret_names(deployment: str) -> tuple[str, ...]:
    return (internal_secret_name(deployment), names.control_plane_secret_name(deployment))


def _value(secret: dict[str, Any], key: str) -> bytes | None:
    encoded = (secret.get("data") or {}).get(key)
    if encoded is None:
        return None
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        return None


async def ensure_generated_secrets(client: KubeClient, owner: dict[str, Any], spec: DeploymentSpec,
                                   logger: logging.Logger | logging.LoggerAdapter) -> list[str]:
    """Creates the missing generated Secrets; returns problems with the existing ones."""
    problems = []
    wanted = ((build_internal_secret(spec.name, spec.namespace), SECRET_KEY),
              (build_control_plane_secret(spec), CONTROL_PLANE_KEY))
    for manifest, key in wanted:
        name = manifest["metadata"]["name"]
        current = await client.get("Secret", spec.namespace, name)
        if current is None:
            kopf.adopt(manifest, owner=owner)
            try:
                await client.create(manifest)
                logger.info("created Secret %s", name)
            except ApiError as exc:
                if exc.status != 409:  # created by a concurrent pass: theirs is as good
                    raise
            continue
        value = _value(current, key)
        if value is None or len(value.strip()) < MIN_SECRET_BYTES:
            problems.append(f"Secret {name} has no key {key!r} of at least {MIN_SECRET_BYTES} bytes; "
                            f"delete it and the operator creates a fresh one")
    return problems


async def check_user_secrets(client: KubeClient, spec: DeploymentSpec) -> list[str]:
    """Problems with the Secrets the spec names (router.apiKeySecret)."""
    ref = spec.router.api_key_secret
    if ref is None:
        return []
    secret = await client.get("Secret", spec.namespace, ref.name)
    if secret is None:
        return [f"router.apiKeySecret: Secret {ref.name} not found in namespace {spec.namespace}; "
                f"the router starts once it exists"]
    value = _value(secret, ref.key)
    if value is None or not value.strip() or any(c.isspace() for c in value.strip().decode(errors="replace")):
        return [f"router.apiKeySecret: Secret {ref.name} has no key {ref.key!r} holding one non-empty word"]
    return []


def secrets_condition(problems: list[str], generation: int | None, previous: dict[str, Any],
                      now: str) -> dict[str, Any]:
    before = {c.get("type", ""): c for c in previous.get("conditions") or []}
    if problems:
        return condition("SecretsReady", False, "SecretProblem", "; ".join(problems), generation,
                          before, now)
    return condition("SecretsReady", True, "AsExpected", "", generation, before, now)


async def delete_generated_secrets(client: KubeClient, namespace: str, deployment: str,
                                   logger: logging.Logger | logging.LoggerAdapter) -> None:
    for name in generated_secret_names(deployment):
        if await client.delete("Secret", namespace, name):
            logger.info("deleted Secret %s", name)
