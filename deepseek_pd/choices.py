"""The one rule for a setting that takes one of a few names (a backend, a mode): the value is one of
them, and the refusal lists them all. Torch-free: `serve`'s engine-option table
(workers/serve/engine_option_keys.py), which the CLI, `up` and the operator check before any worker
starts, and the configs that a worker builds (`RunnerConfig`, `TransportConfig`) apply it to the same
tuples, so a value both accept is the same value, and both refuse in the same words.

Example: `not_one_of("moe_backend", "tritn", ("auto", "torch", "triton"))` ->
"moe_backend 'tritn' is not one of auto, torch, triton"; `not_one_of("moe_backend", "torch", ...)` -> None.
"""
from __future__ import annotations

from typing import Sequence


def not_one_of(name: str, value: object, choices: Sequence[str]) -> str | None:
    """Why `value` is not a valid `name`, naming every choice; None when it is one of `choices`."""
    if value in choices:
        return None
    return f"{name} {value!r} is not one of {', '.join(choices)}"
