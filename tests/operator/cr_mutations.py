"""Hypothesis strategies that mutate a DeepSeekDeployment the way a careless or hostile user would.

A mutation picks one place in the object (any field of the spec, at any depth, or the name) and
either drops it, replaces it with arbitrary JSON (wrong types, NaN, huge numbers, odd strings),
replaces it with a value drawn from the CRD schema of that field (other enum members, numbers
on and just past each bound, fields the example leaves out), or adds an unknown key. Drawing
from the schema is what gets past validation into the builders; arbitrary JSON is what tests
the validation itself.
"""
from __future__ import annotations

import copy
from typing import Any

from hypothesis import strategies as st

from deepseek_pd.operator import names
from deepseek_pd.operator.crd_spec import spec_schema
from deepseek_pd.operator.schema_types import Schema

Path = tuple[str | int, ...]

ODD_STRINGS = st.sampled_from([
    "", " ", "-", "0", "-1", "1e400", "NaN", "None", "null", "true", "25%", "101%", "%", "1Gi", "1.5",
    "a" * 300, "名前", "\x00", "$(HOME)", "${X}", "--flag=1", "a b", "A", "a.b", "/", "../..", "\n",
])
JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-2**40, 2**40), st.sampled_from([2**31, -2**31 - 1, 2**63]),
    st.floats(allow_nan=True, allow_infinity=True), ODD_STRINGS, st.text(max_size=12),
)
ANY_JSON = st.recursive(JSON_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)), max_leaves=6)
# metadata.name as the API server admits it (a DNS-1123 subdomain: dots allowed), reaching past
# the CRD's length limit.
CR_NAMES = st.from_regex(r"\A[a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?(\.[a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?)?\Z")


def paths(value: Any, prefix: Path = ()) -> list[Path]:
    """Every place in `value`, parents before children (the root is ())."""
    found = [prefix]
    if isinstance(value, dict):
        for key in value:
            found += paths(value[key], (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += paths(item, (*prefix, index))
    return found


def schema_at(schema: Schema | None, path: Path) -> Schema | None:
    """The CRD schema node that governs `path` in the spec, or None outside the schema."""
    for step in path:
        if schema is None:
            return None
        if isinstance(step, int):
            schema = schema.get("items") if isinstance(schema.get("items"), dict) else None
        elif step in schema.get("properties", {}):
            schema = schema["properties"][step]
        else:
            extra = schema.get("additionalProperties")
            schema = extra if isinstance(extra, dict) else None
    return schema


def _numbers(node: Schema) -> st.SearchStrategy[int]:
    """Integers on and just past the schema's bounds, and some in between."""
    low, high = node.get("minimum", -2**31), node.get("maximum", 2**31 - 1)
    edges = [low - 1, low, low + 1, high - 1, high, high + 1, 0, 1, 2, 3, 4, 7, 8, 16, 64]
    return st.one_of(st.sampled_from(edges), st.integers(low, high))


def from_schema(node: Schema | None, depth: int = 0) -> st.SearchStrategy[Any]:
    """Values shaped by a CRD schema node: mostly plausible, often on an edge, sometimes wrong."""
    if node is None or depth > 3 or node.get("x-kubernetes-preserve-unknown-fields"):
        return ANY_JSON
    if "enum" in node:
        return st.one_of(st.sampled_from(node["enum"]), ODD_STRINGS)
    if node.get("x-kubernetes-int-or-string"):
        return st.one_of(_numbers(node), st.sampled_from(["0", "1", "0%", "50%", "100%", "1Gi", "500m", "x"]))
    kind = node.get("type")
    if kind == "integer":
        return _numbers(node)
    if kind == "number":
        return st.one_of(st.floats(allow_nan=False), _numbers(node))
    if kind == "boolean":
        return st.booleans()
    if kind == "string":
        return st.one_of(ODD_STRINGS, st.text(max_size=20), st.from_regex(r"\A[a-z][-a-z0-9]{0,20}\Z"))
    if kind == "array":
        return st.lists(from_schema(node.get("items"), depth + 1), max_size=node.get("maxItems", 3) + 1)
    if kind == "object" and node.get("properties"):
        props = node["properties"]
        required = {k: from_schema(props[k], depth + 1) for k in node.get("required", [])}
        optional = {k: from_schema(v, depth + 1) for k, v in props.items() if k not in required}
        return st.fixed_dictionaries(required, optional=optional)
    if kind == "object":
        return st.dictionaries(st.text(min_size=1, max_size=10), from_schema(node.get("additionalProperties"),
                                                                             depth + 1), max_size=3)
    return ANY_JSON


def _set(root: dict, path: Path, value: Any) -> None:
    parent = root
    for step in path[:-1]:
        parent = parent[step]
    parent[path[-1]] = value


def _drop(root: dict, path: Path) -> None:
    parent = root
    for step in path[:-1]:
        parent = parent[step]
    del parent[path[-1]]


@st.composite
def mutation(draw: st.DrawFn, spec: dict) -> tuple[str, Path, Any]:
    """One (operation, path, value) on `spec`; `apply` performs it."""
    path = draw(st.sampled_from(paths(spec)))
    node = schema_at(spec_schema(), path)
    value = spec
    for step in path:
        value = value[step]
    operations = ["replace-json", "replace-schema"]
    if path:
        operations.append("drop")
    if isinstance(value, dict):
        operations.append("extra-key")
        missing = [k for k in (node or {}).get("properties", {}) if k not in value]
        if missing:
            operations += ["add-field", "add-field"]  # the example's unused options: likelier
    operation = draw(st.sampled_from(operations))
    if operation == "drop":
        return operation, path, None
    if operation == "replace-json":
        return operation, path, draw(ANY_JSON)
    if operation == "replace-schema":
        return operation, path, draw(from_schema(node))
    if operation == "extra-key":
        key = draw(st.text(min_size=1, max_size=10).filter(lambda k: k not in value))
        return operation, (*path, key), draw(ANY_JSON)
    key = draw(st.sampled_from(missing))
    return operation, (*path, key), draw(from_schema(node["properties"][key]))


def apply(spec: dict, change: tuple[str, Path, Any]) -> dict:
    """A mutated deep copy of `spec`."""
    operation, path, value = change
    out = copy.deepcopy(spec)
    if operation == "drop":
        _drop(out, path)
    elif not path:
        return value
    else:
        _set(out, path, value)
    return out


@st.composite
def mutated_cr(draw: st.DrawFn, example: dict, max_changes: int = 3) -> dict:
    """`example` (a whole DeepSeekDeployment) with 1..max_changes mutations, applied in turn,
    and sometimes another name."""
    cr = copy.deepcopy(example)
    for _ in range(draw(st.integers(1, max_changes))):
        spec = cr["spec"]
        if not isinstance(spec, dict):
            break
        cr["spec"] = apply(spec, draw(mutation(spec)))
    if draw(st.booleans()):
        cr["metadata"]["name"] = draw(CR_NAMES)
    return cr
