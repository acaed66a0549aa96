"""DeepSeekRoleScale: one object per role of a DeepSeekDeployment, whose `scale` subresource is that
role's group count, so a user's HPA, KEDA or `kubectl scale` can drive prefill as well as decode.

A CRD version has exactly one scale subresource; the DeepSeekDeployment's is decode's (its
spec.decode.replicas). Each role's DeepSeekRoleScale (named `<deployment>-<role>`, owned by the
deployment) mirrors spec.<role>.replicas both ways, as Dynamo's scaling adapter does:

    spec.replicas                the role's groups; an HPA writes it through /scale
    status.syncedReplicas        spec.replicas as last carried over by the operator
    status.replicas, .selector   what the scale subresource reports (groups that exist; the
                                 role's pods, which an HPA averages its pod metrics over)

Per reconcile pass (`sync_step`): spec.replicas != status.syncedReplicas means someone scaled the
DeepSeekRoleScale since the last pass, and the deployment follows it (`push`); otherwise the
deployment is the truth (its own edit, or the operator's autoscaler) and the DeepSeekRoleScale
follows it (`pull`). Worked example, `kubectl scale dsrs/v3-prefill --replicas 3` with 1 group:
    spec 3, synced 1, deployment 1 -> push 3: spec.prefill.replicas = 3, synced = 3
    next pass: spec 3, synced 3, deployment 3 -> nothing
An HPA and `<role>.autoscaling` on the same role would fight: use one of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepseek_pd.operator import names
from deepseek_pd.operator.crd_builder import ScalePaths, build_custom_resource, crd_as_yaml
from deepseek_pd.operator.schema_types import Schema, integer, obj, string


@dataclass(frozen=True)
class SyncStep:
    push: int | None   # set spec.<role>.replicas of the deployment to this
    pull: int | None   # set the DeepSeekRoleScale's spec.replicas to this
    synced: int        # status.syncedReplicas afterwards: the role's groups once applied


def sync_step(scale: dict[str, Any], deployment_replicas: int) -> SyncStep:
    """Which side follows which, for one role (see the module docstring)."""
    wanted = (scale.get("spec") or {}).get("replicas")
    synced = (scale.get("status") or {}).get("syncedReplicas")
    if isinstance(wanted, int) and wanted != synced and wanted != deployment_replicas:
        return SyncStep(push=wanted, pull=None, synced=wanted)
    if wanted != deployment_replicas:
        return SyncStep(push=None, pull=deployment_replicas, synced=deployment_replicas)
    return SyncStep(push=None, pull=None, synced=deployment_replicas)


def build_role_scale(deployment: str, namespace: str, role: str, replicas: int) -> dict[str, Any]:
    """A new DeepSeekRoleScale (the executor adds the owner reference)."""
    return {"apiVersion": names.API_VERSION, "kind": names.SCALE_KIND,
            "metadata": {"name": names.role_scale_name(deployment, role), "namespace": namespace,
                         "labels": {**names.base_labels(deployment, role), names.LABEL_ROLE: role}},
            "spec": {"deployment": deployment, "role": role, "replicas": replicas}}


def role_scale_status(step: SyncStep, existing_groups: int, deployment: str, role: str) -> dict[str, Any]:
    return {"replicas": existing_groups, "syncedReplicas": step.synced,
            "selector": names.selector_string(names.role_selector(deployment, role))}


def _schema() -> Schema:
    return obj("The group count of one role of a DeepSeekDeployment (its scale subresource).", {
        "apiVersion": string("APIVersion of the object."),
        "kind": string("Kind of the object."),
        "metadata": {"type": "object"},
        "spec": obj("Kept in step with the deployment's spec.<role>.replicas by the operator.", {
            "deployment": string("The DeepSeekDeployment (same namespace; informational: the operator finds "
                                 "this object by its name, `<deployment>-<role>`)."),
            "role": string("The role whose groups this scales.", enum=list(names.ROLES)),
            "replicas": integer("The role's groups (what an HPA or `kubectl scale` sets).",
                                minimum=0, maximum=1000),
        }, required=["deployment", "role", "replicas"]),
        "status": obj("Written by the operator.", {
            "replicas": integer("Groups of the role that exist."),
            "syncedReplicas": integer("spec.replicas as last carried over to or from the deployment."),
            "selector": string("Label selector of the role's pods."),
        }),
    })


def build_role_scale_crd() -> dict[str, Any]:
    return build_custom_resource(
        crd_name=names.SCALE_CRD_NAME, kind=names.SCALE_KIND, plural=names.SCALE_PLURAL,
        singular=names.SCALE_KIND.lower(), short_names=["dsrs"], schema=_schema(),
        scale=ScalePaths(".spec.replicas", ".status.replicas", ".status.selector"),
        printer_columns=[
            {"name": "Deployment", "type": "string", "jsonPath": ".spec.deployment"},
            {"name": "Role", "type": "string", "jsonPath": ".spec.role"},
            {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
            {"name": "Current", "type": "integer", "jsonPath": ".status.replicas"}])


def role_scale_crd_yaml() -> str:
    """The CRD as the chart ships it (charts/crds/deepseekrolescales.yaml)."""
    return crd_as_yaml(build_role_scale_crd(), "deepseek-pd operator crd --role-scale", "role_scale.py")
