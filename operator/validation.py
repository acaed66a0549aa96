"""Validates a DeepSeekDeployment the way the API server would: defaults, OpenAPI schema, CEL rules.

The operator runs it on every reconcile (a cluster older than CEL validation, or an object that
slipped past admission, still gets a clear InvalidSpec condition instead of broken children), and
the tests use it to prove the CRD accepts the examples and rejects bad specs.

Unknown fields are errors here (kubectl's default strict field validation), so a typo such as
`replica:` is reported instead of silently pruned.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import celpy
import jsonschema

from deepseek_pd.operator.crd import root_schema
from deepseek_pd.operator.defaults import apply_defaults
from deepseek_pd.operator.schema_types import Schema


@dataclass(frozen=True)
class Violation:
    """One problem: `field` is a dotted path from the object root (spec.prefill.size)."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def validate_object(obj: dict[str, Any]) -> list[Violation]:
    """All violations of a whole DeepSeekDeployment object (with metadata), after defaulting."""
    schema = root_schema()
    defaulted = apply_defaults(schema, obj)
    violations = _schema_violations(defaulted)
    if not violations:  # CEL assumes a structurally valid object, as the API server does
        violations = _cel_violations(schema, defaulted, "")
    return violations


def validate_spec(name: str, spec: Any) -> list[Violation]:
    """Convenience for the operator, which holds the spec and the name separately."""
    return validate_object({"metadata": {"name": name}, "spec": spec})


def _schema_violations(obj: dict[str, Any]) -> list[Violation]:
    validator = _json_validator()
    found = []
    for error in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path))):
        field = ".".join(str(p) for p in error.absolute_path) or "<root>"
        found.append(Violation(field, _short_message(error)))
    return found


def _short_message(error: jsonschema.ValidationError) -> str:
    if error.validator == "additionalProperties":
        return f"unknown field(s): {error.message.split('(')[-1].rstrip(')')}"
    if error.validator == "anyOf":
        return f"{error.instance!r} must be an integer or a string"
    return error.message


@functools.cache
def _json_validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(_to_json_schema(root_schema()))


def _to_json_schema(node: Schema) -> Schema:
    """OpenAPI structural schema -> JSON Schema: drops x-kubernetes-*, closes objects."""
    out: Schema = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key in ("description", "default", "format"):
            continue
        if key == "properties":
            out[key] = {name: _to_json_schema(child) for name, child in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _to_json_schema(value)
        elif key == "anyOf":
            out[key] = [_to_json_schema(v) for v in value]
        else:
            out[key] = value
    closed = "properties" in node and "additionalProperties" not in node
    if closed and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@functools.cache
def _program(expression: str) -> celpy.Runner:
    env = celpy.Environment()
    return env.program(env.compile(expression))


_UNCONVERTED = object()  # no ancestor has put this node's value into CEL's types


def _cel_violations(schema: Schema, value: Any, path: str, cel_value: Any = _UNCONVERTED) -> list[Violation]:
    """The CEL rules of `schema` and its descendants over `value` (`path`: the node's field).

    `cel_value` is `value` in CEL's types when an ancestor converted it already. The first node
    with rules converts its subtree once, and its rules and descendants share that (CEL does not
    mutate it): converting per rule was most of the CEL time of a reconcile pass."""
    rules = schema.get("x-kubernetes-validations", [])
    found: list[Violation] = []
    if rules and cel_value is _UNCONVERTED:
        try:
            cel_value = celpy.json_to_cel(value)
        except Exception as exc:  # what CEL cannot hold, each rule here rejects; descendants convert their own
            found = [_rejection(entry, path, exc) for entry in rules]
            return found + _child_violations(schema, value, path, _UNCONVERTED)
    for entry in rules:
        try:
            ok = _program(entry["rule"]).evaluate({"self": cel_value})
        except Exception as exc:  # an evaluation error is a rejection, as in the API server
            found.append(_rejection(entry, path, exc))
            continue
        if isinstance(ok, celpy.CELEvalError) or not bool(ok):
            found.append(Violation((path + entry.get("fieldPath", "")).lstrip(".") or "<root>", entry["message"]))
    return found + _child_violations(schema, value, path, cel_value)


def _child_violations(schema: Schema, value: Any, path: str, cel_value: Any) -> list[Violation]:
    """The CEL violations under the node: its properties' and its list items' (each with its own
    part of `cel_value`, when converted)."""
    converted = cel_value is not _UNCONVERTED
    found: list[Violation] = []
    if isinstance(value, dict):
        for key, child in schema.get("properties", {}).items():
            if key in value:
                child_cel = cel_value[celpy.celtypes.StringType(key)] if converted else _UNCONVERTED
                found += _cel_violations(child, value[key], f"{path}.{key}", child_cel)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            found += _cel_violations(schema["items"], item, f"{path}[{index}]",
                                     cel_value[index] if converted else _UNCONVERTED)
    return found


def _rejection(entry: dict[str, Any], path: str, exc: Exception) -> Violation:
    """A rule that could not be evaluated rejects, naming why (the API server does the same)."""
    return Violation((path + entry.get("fieldPath", "")).lstrip("."), f"{entry['message']} ({exc})")
