"""The one rule for a numeric setting with a range (a count, a size, a timeout): the value lies in its bounds,
and the refusal names them. Torch-free, as deepseek_pd/choices.py is for named settings: each
config keeps its fields' bounds in a torch-free table (model/runner_rules.py `RUNNER_BOUNDS`,
workers/engine/scheduler_config.py `SCHEDULER_BOUNDS`, workers/group/layout.py `GROUP_BOUNDS`,
deepseek_pd/transfer_limits.py for the transport and the bootstrap channel); the config applies them when it is built, and `serve`'s
engine-option table (workers/serve/engine_option_keys.py) applies the same ones before any worker
starts (the CLI, `up --worker-arg`, the operator's InvalidSpec), so both refuse in the same words.

Example: `Bounds(1).blocker("io_threads", 0)` -> "io_threads must be >= 1, got 0";
`Bounds(1, 16).blocker("grpc_streams", 17)` -> "grpc_streams must be in [1, 16], got 17";
`Bounds(0, open_low=True).blocker("send_timeout_s", 0.0)` -> "send_timeout_s must be > 0, got 0.0";
`Bounds(1).blocker("io_threads", 4)` -> None.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class Bounds:
    """Bounds of a number, inclusive (`high` None: no upper one; `open_low`: `low` itself is out, as
    for a timeout, which must be > 0); `why` is said with a refusal."""

    low: float
    high: float | None = None
    why: str = ""
    open_low: bool = False

    def blocker(self, name: str, value: float) -> str | None:
        """Why `value` is not a valid `name`, naming the bounds; None when it is within them."""
        above_low = value > self.low if self.open_low else value >= self.low
        if above_low and (self.high is None or value <= self.high):
            return None
        why = f" ({self.why})" if self.why else ""
        if self.high is None:
            return f"{name} must be {'>' if self.open_low else '>='} {self.low}{why}, got {value}"
        return f"{name} must be in {'(' if self.open_low else '['}{self.low}, {self.high}]{why}, got {value}"


def bounds_blocker(bounds: Mapping[str, Bounds], **values: float) -> str | None:
    """The first of `values` (each named in `bounds`) outside its bounds, said; None when none is."""
    for name, value in values.items():
        if (blocker := bounds[name].blocker(name, value)) is not None:
            return blocker
    return None
