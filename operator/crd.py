"""The DeepSeekDeployment CustomResourceDefinition, built as a dict from `crd_spec.spec_schema()`.

`deepseek-pd operator crd` prints it; `charts/crds/deepseekdeployments.yaml` is that output,
and tests/charts checks the two are identical, so the schema is edited in one place only.
"""
from __future__ import annotations

from typing import Any

from deepseek_pd.operator import names
from deepseek_pd.operator.crd_builder import ScalePaths, build_custom_resource, crd_as_yaml
from deepseek_pd.operator.crd_spec import spec_schema
from deepseek_pd.operator.schema_types import Schema, array, integer, obj, rule, string

CONDITION_TYPES = ("Available", "Progressing", "Degraded", "InvalidSpec", "ModelReady", "SecretsReady",
                   "MemoryPlanFits", "GangScheduling", "RolloutVerified", "MooncakePortsGuarded")
PHASES = ("Pending", "Progressing", "Available", "Degraded", "Failed")


def _role_status(role: str) -> Schema:
    return obj(f"Observed {role} groups.", {
        "replicas": integer("Groups that exist (including surge groups during a rollout)."),
        "readyReplicas": integer("Groups whose every pod is Ready."),
        "updatedReplicas": integer("Groups running the current revision."),
        "ready": string("readyReplicas/desired, for `kubectl get`."),
        "revision": string("Hash of the current pod template of this role."),
        "selector": string("Label selector of the role's pods (the scale subresource's)."),
    })


def _autoscaling_status() -> Schema:
    def decision(what: str) -> Schema:
        return obj(what, {
            "from": integer("Groups before."),
            "to": integer("Groups chosen."),
            "reason": string("Why, naming the metric that decided and the window it waits for."),
            "readings": {"type": "object", "description": "Metric name -> value read (absent: not read).",
                         "additionalProperties": {"type": "number"}},
            "time": {"type": "string", "format": "date-time",
                     "description": "When this decision was first made."},
        })

    role = obj("The autoscaler's state for one role (operator/autoscale_reconcile.py).", {
        "lastDecision": decision("The last pass's decision: what it read, what it chose and why."),
        "lastScale": decision("The last decision that changed the groups (kept while later passes hold)."),
        "recommendations": array("Recent recommendations (the stabilisation windows' memory).",
                                 obj("One pass's recommendation.", {
                                     "at": {"type": "number", "description": "Unix time, seconds."},
                                     "replicas": integer("Groups recommended."),
                                 })),
        "lastScaleAt": {"type": "number", "description": "Unix time of the last change (0: never)."},
    })
    return obj("Per role with spec.<role>.autoscaling.", {"prefill": role, "decode": role})


def status_schema() -> Schema:
    condition = obj("A standard metav1.Condition.", {
        "type": string("Condition type.", enum=list(CONDITION_TYPES)),
        "status": string("True, False or Unknown.", enum=["True", "False", "Unknown"]),
        "reason": string("CamelCase reason."),
        "message": string("Human-readable detail."),
        "lastTransitionTime": {"type": "string", "format": "date-time",
                               "description": "When status last changed."},
        "observedGeneration": integer("Generation the condition was computed from."),
    }, required=["type", "status"])
    return obj("Observed state, written by the operator only.", {
        "phase": string("Summary: " + ", ".join(PHASES) + ".", enum=list(PHASES)),
        "observedGeneration": {"type": "integer", "format": "int64",
                               "description": "metadata.generation this status describes."},
        "conditions": {**array(", ".join(CONDITION_TYPES) + ".", condition),
                       "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
        "prefill": _role_status("prefill"),
        "decode": _role_status("decode"),
        "autoscaling": _autoscaling_status(),
        "rollout": obj("Verified rollouts (operator/rollout_reconcile.py).", {
            role: obj(f"The {role} rollout being checked.", {
                "revision": string("The revision whose groups are checked."),
                "verified": array("Groups of that revision that answered as the old one.", integer("A group.")),
                "failed": string("Why the rollout stopped: the group, the prompt, the first differing token."),
            }) for role in names.ROLES}),
        "routerEndpoint": string("In-cluster URL of the router's OpenAI-compatible API."),
        "routerReadyReplicas": integer("Ready router pods."),
    })


def _printer_columns() -> list[dict[str, Any]]:
    return [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Prefill", "type": "string", "jsonPath": ".status.prefill.ready",
         "description": "Ready/desired prefill groups"},
        {"name": "Decode", "type": "string", "jsonPath": ".status.decode.ready",
         "description": "Ready/desired decode groups"},
        {"name": "Model", "type": "string",
         "jsonPath": '.status.conditions[?(@.type=="ModelReady")].reason',
         "description": "ModelReady's reason: Ready, Downloading, or why the download failed"},
        {"name": "Memory", "type": "string",
         "jsonPath": '.status.conditions[?(@.type=="MemoryPlanFits")].reason',
         "description": "MemoryPlanFits' reason: Fits, DoesNotFit, NotApplicable, ModelUnknown, ..."},
        {"name": "Router", "type": "string", "jsonPath": ".status.routerEndpoint"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]


def root_schema() -> Schema:
    """The whole object's openAPIV3Schema, including the root rule on metadata.name."""
    return {
        "type": "object",
        "description": "A DeepSeek-V2/V3 deployment with disaggregated prefill and decode.",
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            # A CRD may declare metadata.name (only name and generateName), which makes it a valid
            # fieldPath for the root rule below.
            "metadata": {"type": "object", "properties": {"name": {"type": "string"}}},
            "spec": spec_schema(),
            "status": status_schema(),
        },
        "required": ["spec"],
        "x-kubernetes-validations": [
            rule(f"size(self.metadata.name) <= {names.MAX_NAME_LENGTH}",
                 f"metadata.name must be at most {names.MAX_NAME_LENGTH} characters (child names "
                 "append -<role>-<group>-<rank>)", ".metadata.name"),
            # The API server admits any DNS-1123 subdomain ("0.v3"), but the name starts Service
            # names, which must be DNS-1035 labels: refused here rather than by the first create.
            rule(f"self.metadata.name.matches('{names.DNS_1035_LABEL}')",
                 "metadata.name must start with a lowercase letter and hold only lowercase letters, "
                 "digits and '-' (it starts the names of the deployment's Services)", ".metadata.name"),
        ],
    }


def build_crd() -> dict[str, Any]:
    # A CRD has one scale subresource: decode's groups, the role that follows load (kubectl
    # scale, an HPA or KEDA). Prefill's is its DeepSeekRoleScale's (role_scale.py).
    return build_custom_resource(
        crd_name=names.CRD_NAME, kind=names.KIND, plural=names.PLURAL, singular=names.SINGULAR,
        short_names=list(names.SHORT_NAMES), categories=["all"], schema=root_schema(),
        scale=ScalePaths(".spec.decode.replicas", ".status.decode.replicas", ".status.decode.selector"),
        printer_columns=_printer_columns())


def crd_yaml() -> str:
    """The CRD as the chart ships it (block style, key order preserved)."""
    return crd_as_yaml(build_crd(), "deepseek-pd operator crd", "crd_spec.py")
