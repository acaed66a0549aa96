"""The DeepSeekRoleScales' I/O, once per reconcile pass (the rule: role_scale.py).

Creates each role's DeepSeekRoleScale when missing, carries spec.replicas across (to the
deployment, or from it) and writes the status its scale subresource reports. A cluster without the
DeepSeekRoleScale CRD (an older chart) answers 404: the pass goes on without them, and tries again
on the next one.
"""
from __future__ import annotations

from typing import Any

import kopf

from deepseek_pd.operator import names
from deepseek_pd.operator.kube import ApiError, KubeClient
from deepseek_pd.operator.role_scale import build_role_scale, role_scale_status, sync_step
from deepseek_pd.operator.spec import DeploymentSpec


async def sync_role_scales(client: KubeClient, body: dict[str, Any], spec: DeploymentSpec,
                           existing: dict[str, int]) -> None:
    """One pass over both roles; `existing`: groups per role that exist now. Returns nothing: a
    value pushed into the deployment's spec.<role>.replicas is acted on by the pass its own update
    event runs (this pass's spec predates it, and nothing later in it reads the replicas: the
    autoscaler would, but an HPA and `<role>.autoscaling` on one role are unsupported, role_scale.py)."""
    pushed: dict[str, int] = {}
    for role in names.ROLES:
        name = names.role_scale_name(spec.name, role)
        scale = await client.get(names.SCALE_KIND, spec.namespace, name)
        if scale is None:
            manifest = build_role_scale(spec.name, spec.namespace, role, spec.role(role).replicas)
            kopf.adopt(manifest, owner=body)
            try:
                scale = await client.create(manifest)
            except ApiError as exc:
                if exc.status == 404:  # the CRD is not installed
                    return
                raise
        step = sync_step(scale, spec.role(role).replicas)
        if step.pull is not None:
            await client.patch(names.SCALE_KIND, spec.namespace, name, {"spec": {"replicas": step.pull}})
        if step.push is not None:
            pushed[role] = step.push
        status = role_scale_status(step, existing.get(role, 0), spec.name, role)
        if (scale.get("status") or {}) != status:
            await client.patch_status(names.SCALE_KIND, spec.namespace, name, {"status": status})
    if pushed:
        await client.patch(names.KIND, spec.namespace, spec.name,
                           {"spec": {role: {"replicas": n} for role, n in pushed.items()}})
