"""`--engine-opt KEY=VALUE`: any field of a worker's frozen configs, set by name from the command line.

A key sets the field of that name in each config class that has one (runner, bootstrap, scheduler,
transport, group; only `deterministic` is in two: the runner's kernels and the scheduler's cuts);
the value is parsed as that field's type (bool: true/false/1/0/yes/no). Unknown keys are an error that lists
the valid ones, never ignored; fields that have a `serve` flag of their own are not engine options.

Example: `--engine-opt handshake_timeout_s=5 --engine-opt max_running_requests=32
--engine-opt cuda_graph=false` gives
`{"bootstrap": {"handshake_timeout_s": 5.0}, "scheduler": {"max_running_requests": 32},
"runner": {"cuda_graph": False}, "transport": {}}`.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Iterable, Mapping

from deepseek_pd.errors import UserError


def parse_key_values(items: Iterable[str]) -> dict[str, str]:
    """["a=1", "b=x"] -> {"a": "1", "b": "x"}; the last of repeated keys wins."""
    opts = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--engine-opt {item!r} must be KEY=VALUE")
        opts[key] = value
    return opts


def assign_engine_options(raw: Mapping[str, str], targets: Mapping[str, type],
                          excluded: Mapping[str, Iterable[str]]) -> dict[str, dict[str, Any]]:
    """Assigns each option to every config class (by target name) that has a field of that name,
    skipping `excluded[target]` fields (those set by flags), and parses its value."""
    fields_of = {}
    for name, cls in targets.items():
        skip = set(excluded.get(name, ()))
        fields_of[name] = {f.name for f in dataclasses.fields(cls) if f.init and f.name not in skip}
    assigned: dict[str, dict[str, Any]] = {name: {} for name in targets}
    for key, value in raw.items():
        owners = [name for name, fields in fields_of.items() if key in fields]
        if not owners:
            valid = sorted({k for fields in fields_of.values() for k in fields})
            raise UserError(f"unknown --engine-opt {key!r}; valid keys: {', '.join(valid)}")
        for owner in owners:
            default = getattr(targets[owner](), key)
            kind = type(default) if default is not None else _optional_type(targets[owner], key)
            assigned[owner][key] = _parse(value, kind, key)
    return assigned


def _optional_type(cls: type, key: str) -> type:
    """X of a field annotated `X | None` (its default None says nothing about how to parse it)."""
    hint = typing.get_type_hints(cls)[key]
    args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return args[0] if len(args) == 1 else str


def parse_bool(raw: str) -> bool:
    """An engine option's bool: true/false/1/0/yes/no in any case; ValueError otherwise. The
    operator's memory plan reads `--engine-opt` bools through this too (operator/memory_flags.py)."""
    if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(raw)
    return raw.lower() in ("true", "1", "yes")


def _parse(raw: str, kind: type, key: str) -> Any:
    try:
        if kind is bool:
            return parse_bool(raw)
        if kind in (int, float):
            return kind(raw)
    except ValueError as exc:
        raise UserError(f"--engine-opt {key}={raw!r}: expected a {kind.__name__}") from exc
    return raw
