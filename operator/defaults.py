"""Structural defaulting, as the API server does it, from the CRD schema's `default` fields.

The operator applies it too, so a spec read from a server that skipped defaulting (an emulator,
an object stored before a field existed) means the same thing. Defaults never overwrite a value.
"""
from __future__ import annotations

import copy
from typing import Any

from deepseek_pd.operator.schema_types import Schema


def apply_defaults(schema: Schema, value: Any) -> Any:
    """Returns a defaulted deep copy of `value`; a missing field with a default gets it, recursively."""
    value = copy.deepcopy(value)
    _default_in_place(schema, value)
    return value


def _default_in_place(schema: Schema, value: Any) -> None:
    if isinstance(value, dict):
        for key, child in schema.get("properties", {}).items():
            if key not in value and "default" in child:
                value[key] = copy.deepcopy(child["default"])
            if key in value:
                _default_in_place(child, value[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in set(value) - set(schema.get("properties", {})):
                _default_in_place(extra, value[key])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            _default_in_place(schema["items"], item)
