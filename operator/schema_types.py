"""Small constructors for OpenAPI v3 (structural) schema nodes, so the CRD reads as a table.

Each returns a plain dict; `crd_spec.py` composes them. Keeping `description` mandatory on
objects and fields makes `kubectl explain deepseekdeployment.spec...` useful.
"""
from __future__ import annotations

from typing import Any

Schema = dict[str, Any]

# The apiserver's resource.Quantity grammar (a number with an optional SI/binary suffix).
QUANTITY_PATTERN = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
# An integer, or a percentage of the group count (LeaderWorkerSet / Deployment convention).
INT_OR_PERCENT_PATTERN = r"^(0|[1-9][0-9]*)%?$"


def rule(expression: str, message: str, field_path: str | None = None) -> dict[str, str]:
    """One CEL `x-kubernetes-validations` entry; `field_path` points the error at a field."""
    entry = {"rule": expression, "message": message}
    if field_path:
        entry["fieldPath"] = field_path
    return entry


def obj(description: str, properties: dict[str, Schema], *, required: list[str] | None = None,
        rules: list[dict[str, str]] | None = None, default: dict | None = None) -> Schema:
    node: Schema = {"type": "object", "description": description, "properties": properties}
    if required:
        node["required"] = required
    if rules:
        node["x-kubernetes-validations"] = rules
    if default is not None:
        # The API server validates a default as written, against this object's CEL rules, without
        # first filling in its fields' own defaults: so `default={}` is written out in full.
        filled = {name: child["default"] for name, child in properties.items() if "default" in child}
        node["default"] = {**filled, **default}
    return node


def integer(description: str, *, minimum: int | None = None, maximum: int | None = None,
            default: int | None = None) -> Schema:
    node: Schema = {"type": "integer", "format": "int32", "description": description}
    if minimum is not None:
        node["minimum"] = minimum
    if maximum is not None:
        node["maximum"] = maximum
    if default is not None:
        node["default"] = default
    return node


def string(description: str, *, enum: list[str] | None = None, default: str | None = None,
           pattern: str | None = None, min_length: int | None = None,
           max_length: int | None = None) -> Schema:
    node: Schema = {"type": "string", "description": description}
    if enum:
        node["enum"] = enum
    if default is not None:
        node["default"] = default
    if pattern:
        node["pattern"] = pattern
    if min_length is not None:
        node["minLength"] = min_length
    if max_length is not None:
        node["maxLength"] = max_length
    return node


def boolean(description: str, *, default: bool | None = None) -> Schema:
    node: Schema = {"type": "boolean", "description": description}
    if default is not None:
        node["default"] = default
    return node


def array(description: str, items: Schema, *, default: list | None = None,
          max_items: int | None = None) -> Schema:
    node: Schema = {"type": "array", "description": description, "items": items}
    if default is not None:
        node["default"] = default
    if max_items is not None:
        node["maxItems"] = max_items
    return node


def string_map(description: str) -> Schema:
    return {"type": "object", "description": description, "additionalProperties": {"type": "string"}}


def int_or_percent(description: str, *, default: int | str) -> Schema:
    return {
        "description": description,
        "x-kubernetes-int-or-string": True,
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "pattern": INT_OR_PERCENT_PATTERN,
        "minimum": 0,
        "default": default,
    }


def quantity(description: str, *, default: str | None = None) -> Schema:
    node: Schema = {
        "description": description,
        "x-kubernetes-int-or-string": True,
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "pattern": QUANTITY_PATTERN,
    }
    if default is not None:
        node["default"] = default
    return node


def opaque_object(description: str) -> Schema:
    """A Kubernetes core type we pass through unchanged (affinity, a toleration, an EnvVar)."""
    return {"type": "object", "description": description, "x-kubernetes-preserve-unknown-fields": True}


# What the API server's pod validation (1.37) admits in an EnvVar, so that every env the CRD takes
# renders a StatefulSet the server takes (the CR fuzzing found a fieldRef without fieldPath that
# passed the CRD and was refused as the StatefulSet's create). Each rule is the server's own,
# written as a schema; where a schema cannot say it exactly it is stricter, never looser.
# An env name: printable ASCII but '=' (RelaxedEnvironmentVariableValidation, GA in 1.34).
ENV_NAME_PATTERN = r"^[ -<>-~]+$"
# Downward API fields an env may read (validEnvDownwardAPIFieldPathExpressions), and one label or
# annotation by its key: a qualified name, optionally prefixed by a DNS subdomain (annotation keys
# are checked lowercased, so any case passes there).
_QUALIFIED = r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]"
_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_SUBDOMAIN_ANY_CASE = r"[a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?(\.[a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?)*"
ENV_FIELD_PATH_PATTERN = (
    r"^(metadata\.(name|namespace|uid)|spec\.(nodeName|serviceAccountName)|status\.(hostIPs?|podIPs?)"
    rf"|metadata\.labels\['({_SUBDOMAIN}/)?{_QUALIFIED}'\]"
    rf"|metadata\.annotations\['({_SUBDOMAIN_ANY_CASE}/)?{_QUALIFIED}'\])$")
# A key prefix is at most 253 characters: one bound on the whole path keeps it so for labels (and
# annotations), stricter than the server only for a long key name under a long prefix.
ENV_FIELD_PATH_MAX = len("metadata.labels['") + 253 + len("/x']")
ENV_RESOURCE_PATTERN = r"^(limits|requests)\.(cpu|memory|ephemeral-storage|hugepages-.*)$"
CPU_DIVISORS = ["1m", "1"]
BYTE_DIVISORS = ["1", "1k", "1M", "1G", "1T", "1P", "1E", "1Ki", "1Mi", "1Gi", "1Ti", "1Pi", "1Ei"]
# A Secret or ConfigMap name (a DNS-1123 subdomain) and one of its keys (not '.', '..' or '..x').
OBJECT_NAME_PATTERN = rf"^{_SUBDOMAIN}$"
DATA_KEY_PATTERN = r"^\.?[-_a-zA-Z0-9][-._a-zA-Z0-9]*$"


def env_var(description: str) -> Schema:
    """A core EnvVar: a name is required, so a `{}` item is refused here, not by the pod's create."""
    return obj(description, {
        "name": string("Variable name: printable ASCII, no '='.", min_length=1, pattern=ENV_NAME_PATTERN),
        "value": string("Its value ($(VAR) references are expanded by the kubelet)."),
        "valueFrom": env_var_source("Where the value comes from (a core EnvVarSource)."),
    }, required=["name"], rules=[rule("!has(self.valueFrom) || !has(self.value) || self.value == ''",
                                      "valueFrom may not be set when value is not empty")])


ENV_VAR_SOURCES = ("fieldRef", "resourceFieldRef", "configMapKeyRef", "secretKeyRef")


def _key_selector(kind: str) -> Schema:
    return obj(f"A key of a {kind} in the pod's namespace (a core {kind}KeySelector).", {
        "name": string(f"The {kind}'s name.", min_length=1, max_length=253, pattern=OBJECT_NAME_PATTERN),
        "key": string("The key.", min_length=1, max_length=253, pattern=DATA_KEY_PATTERN),
        "optional": boolean(f"Start the pod even if the {kind} or the key is missing."),
    }, required=["name", "key"])


def env_var_source(description: str) -> Schema:
    """A core EnvVarSource: exactly one of its four references, each typed as the pod's create
    checks it (an unknown key: the API server prunes it here, leaving none)."""
    sources = {
        "fieldRef": obj("A field of the pod (a core ObjectFieldSelector).", {
            "apiVersion": string("The schema version of fieldPath.", enum=["v1"]),
            "fieldPath": string("metadata.name, metadata.namespace, metadata.uid, spec.nodeName, "
                                "spec.serviceAccountName, status.hostIP(s), status.podIP(s), "
                                "metadata.labels['<key>'] or metadata.annotations['<key>'].",
                                pattern=ENV_FIELD_PATH_PATTERN, max_length=ENV_FIELD_PATH_MAX),
        }, required=["fieldPath"]),
        "resourceFieldRef": obj("A resource of a container (a core ResourceFieldSelector).", {
            "containerName": string("The container (default: this one)."),
            "resource": string("limits.<r> or requests.<r>, r: cpu, memory, ephemeral-storage or "
                               "hugepages-<size>.", pattern=ENV_RESOURCE_PATTERN),
            "divisor": string("The unit of the value: 1m or 1 for cpu, else 1 or a power of 1k/1Ki up to 1E/1Ei.",
                              enum=sorted(set(CPU_DIVISORS + BYTE_DIVISORS))),
        }, required=["resource"], rules=[rule(
            f"!has(self.divisor) || (self.resource.endsWith('.cpu') ? self.divisor in {CPU_DIVISORS} "
            f": self.divisor in {BYTE_DIVISORS})",
            "divisor: 1m or 1 for cpu; 1, 1k..1E or 1Ki..1Ei for memory, ephemeral-storage and hugepages",
            ".divisor")]),
        "configMapKeyRef": _key_selector("ConfigMap"),
        "secretKeyRef": _key_selector("Secret"),
    }
    # CEL has no size() of an object with declared properties: maxProperties bounds the count.
    node = obj(description, sources,
               rules=[{"rule": " || ".join(f"has(self.{name})" for name in ENV_VAR_SOURCES),
                       "message": f"valueFrom takes exactly one of {', '.join(ENV_VAR_SOURCES)}"}])
    node["maxProperties"] = 1
    return node


def resource_requirements(description: str) -> Schema:
    return obj(description, {
        "limits": {"type": "object", "description": "Maximum resources, e.g. nvidia.com/gpu: 8.",
                   "additionalProperties": quantity("A quantity.")},
        "requests": {"type": "object", "description": "Guaranteed resources.",
                     "additionalProperties": quantity("A quantity.")},
    })
