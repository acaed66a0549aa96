"""`--engine-opt KEY=VALUE`: a field of a worker's frozen configs, set by name from the command line.

The keys, their types and the configs that hold them are one torch-free table
(workers/serve/engine_option_keys.py). A key sets the field of that name in each config that has one
(runner, bootstrap, scheduler, transport, group; only `deterministic` is in two: the runner's kernels
and the scheduler's cuts); the value is parsed as that field's type (bool: true/false/1/0/yes/no), and a
string setting's is checked against the names it may take, and a number against its config's range,
in the words the config itself refuses it in (deepseek_pd/choices.py: "moe_backend 'tritn' is not one
of auto, torch, ..."; deepseek_pd/bounds.py: "max_running_requests must be >= 1, got 0").
An unknown key is an error that names the closest key and lists the valid ones, never ignored;
fields that have a `serve` flag of their own are not engine options. Torch-free: `serve`'s flag
rules, `up` and the operator parse the options here before any worker runs.

Example: `--engine-opt handshake_timeout_s=5 --engine-opt max_running_requests=32
--engine-opt cuda_graph=false` parses (`parse_engine_options`) to
`{"handshake_timeout_s": 5.0, "max_running_requests": 32, "cuda_graph": False}` and is assigned
(`assign_engine_options`) as `{"runner": {"cuda_graph": False}, "bootstrap": {"handshake_timeout_s": 5.0},
"scheduler": {"max_running_requests": 32}, "transport": {}, "group": {}}`.
"""
from __future__ import annotations

import difflib
from typing import Any, Iterable, Mapping

from deepseek_pd.choices import not_one_of
from deepseek_pd.errors import UserError
from deepseek_pd.workers.serve.engine_option_keys import (
    ENGINE_OPTION_BOUNDS, ENGINE_OPTION_KEYS, Kind, all_keys, kind_of, targets_of)


def parse_key_values(items: Iterable[str]) -> dict[str, str]:
    """["a=1", "b=x"] -> {"a": "1", "b": "x"}; the last of repeated keys wins."""
    opts = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--engine-opt {item!r} must be KEY=VALUE")
        opts[key] = value
    return opts


def parse_engine_options(items: Iterable[str]) -> dict[str, Any]:
    """The `KEY=VALUE` items, each value parsed as its key's type; a UserError for an item that is
    not KEY=VALUE, an unknown key or a value of the wrong type."""
    parsed = {}
    for key, value in parse_key_values(items).items():
        kind = kind_of(key)
        if kind is None:
            close = difflib.get_close_matches(key, all_keys(), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise UserError(f"unknown --engine-opt {key!r}{hint}; valid keys: {', '.join(all_keys())}")
        parsed[key] = _parse(value, kind, key)
    return parsed


def assign_engine_options(options: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Parsed options (`parse_engine_options`) by the config they set: target -> field -> value."""
    assigned: dict[str, dict[str, Any]] = {target: {} for target in ENGINE_OPTION_KEYS}
    for key, value in options.items():
        for target in targets_of(key):
            assigned[target][key] = value
    return assigned


def parse_bool(raw: str) -> bool:
    """An engine option's bool: true/false/1/0/yes/no in any case; ValueError otherwise."""
    if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(raw)
    return raw.lower() in ("true", "1", "yes")


def _parse(raw: str, kind: Kind, key: str) -> Any:
    if isinstance(kind, tuple):
        if (blocker := not_one_of(key, raw, kind)) is not None:
            raise UserError(blocker)  # the words the config itself refuses it in
        return raw
    try:
        if kind is bool:
            return parse_bool(raw)
        value = kind(raw) if kind in (int, float) else raw
    except ValueError as exc:
        raise UserError(f"--engine-opt {key}={raw!r}: expected a {kind.__name__}") from exc
    if key in ENGINE_OPTION_BOUNDS and (blocker := ENGINE_OPTION_BOUNDS[key].blocker(key, value)) is not None:
        raise UserError(blocker)  # the words the config itself refuses it in
    return value
