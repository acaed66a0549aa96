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


def env_var(description: str) -> Schema:
    """A core EnvVar: a name is required, so a `{}` item is refused here, not by the pod's create."""
    return obj(description, {
        "name": string("Variable name.", min_length=1),
        "value": string("Its value ($(VAR) references are expanded by the kubelet)."),
        "valueFrom": env_var_source("Where the value comes from (a core EnvVarSource)."),
    }, required=["name"])


ENV_VAR_SOURCES = ("fieldRef", "resourceFieldRef", "configMapKeyRef", "secretKeyRef")


def env_var_source(description: str) -> Schema:
    """A core EnvVarSource: exactly one of its four references, each passed through as written.
    The pod's create refuses anything else, which would otherwise surface only as a failed apply
    of the StatefulSet (an unknown key: the API server prunes it here, leaving none)."""
    # CEL has no size() of an object with declared properties: maxProperties bounds the count.
    node = obj(description, {name: opaque_object(f"A core {name[0].upper()}{name[1:]}.") for name in ENV_VAR_SOURCES},
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
