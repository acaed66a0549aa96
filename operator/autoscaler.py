"""The pure autoscaling planner: a role's SLO readings -> how many groups it should have, and why.

It decides, `autoscale_reconcile.py` reads the metrics and applies (by patching
`spec.<role>.replicas`, the field the scale subresource and a user's HPA drive too).

Per metric, as the HorizontalPodAutoscaler does: wanted = ceil(groups * reading / target), left
at the current count while the reading is within `tolerance` of the target; the role's
recommendation is the highest over its metrics (the most pressed SLO wins), clamped to
[minReplicas, maxReplicas]. A metric with no reading (no pod could be scraped) does not vote;
with none at all the role holds.

Stabilisation, both ways (HPA's behavior.*.stabilizationWindowSeconds): recommendations are kept
with their time; the role grows only to the *lowest* recommendation of the last
`scale_up_window` seconds, and shrinks only to the *highest* of the last `scale_down_window`, so a
burst must last a whole window to add groups and idleness a whole window to remove them.

Worked example (decode, target tpotP90Seconds 0.05, 2 groups, up window 60 s, down window 300 s):
    t=0    tpot 0.09 -> wants ceil(2*1.8)=4; lowest of [0:4]            = 4 -> scale 2 -> 4
    t=30   tpot 0.02 -> wants ceil(4*0.4)=2; highest of last 300 s [4,2] = 4 -> hold
    t=330  tpot 0.02 -> wants 2;            highest of last 300 s [2,2] = 2 -> scale 4 -> 2
Only one role changes per pass (`one_role_at_a_time`): prefill and decode pressure each other
(prefill speed sets decode's arrival rate), so each change is observed before the next.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

NO_METRICS = "no metric could be read"


@dataclass(frozen=True)
class MetricTarget:
    name: str      # autoscale_metrics.ROLE_METRICS
    target: float  # the SLO: seconds for a p90, requests per group, or a 0..1 fraction


@dataclass(frozen=True)
class AutoscalingSpec:
    """`<role>.autoscaling` of the CRD, resolved."""

    min_replicas: int
    max_replicas: int
    metrics: tuple[MetricTarget, ...]
    scale_up_window: float
    scale_down_window: float
    tolerance: float = 0.1


@dataclass(frozen=True)
class Recommendation:
    at: float      # seconds (the operator's wall clock, kept in status)
    replicas: int


@dataclass(frozen=True)
class Decision:
    """What the planner read and chose for one role, and why (status + an Event)."""

    role: str
    current: int
    replicas: int
    reason: str
    readings: dict[str, float | None]
    history: tuple[Recommendation, ...]

    @property
    def changed(self) -> bool:
        return self.replicas != self.current


def _wanted(current: int, reading: float, target: float, tolerance: float) -> int:
    ratio = reading / target
    if abs(ratio - 1.0) <= tolerance:
        return current
    # 1e-9: 0.15 / 0.05 is 3.0000000000000004 in floats, and one whole group is too much to add for it
    return math.ceil(current * ratio - 1e-9) if current else (1 if reading > 0 else 0)


def recommend(spec: AutoscalingSpec, current: int,
              readings: dict[str, float | None]) -> tuple[int | None, str]:
    """(groups, the metric that set it) for this pass alone; None groups: nothing was read."""
    votes = []
    for metric in spec.metrics:
        value = readings.get(metric.name)
        if value is not None:
            votes.append((_wanted(current, value, metric.target, spec.tolerance), metric, value))
    if not votes:
        return None, (f"{NO_METRICS} from the role's pods (are they Ready, and their metrics port "
                      f"reachable from the operator?)")
    wanted, metric, value = max(votes, key=lambda v: v[0])
    clamped = min(max(wanted, spec.min_replicas), spec.max_replicas)
    why = f"{metric.name} {value:.4g} vs target {metric.target:.4g}: wants {wanted}"
    if clamped != wanted:
        why += f", clamped to [{spec.min_replicas}, {spec.max_replicas}]"
    return clamped, why


def decide(role: str, spec: AutoscalingSpec, current: int, readings: dict[str, float | None],
           history: tuple[Recommendation, ...], now: float) -> Decision:
    """One role, one pass. `history`: this role's earlier recommendations (from status)."""
    keep_for = max(spec.scale_up_window, spec.scale_down_window)
    history = tuple(r for r in history if now - r.at <= keep_for)
    bounded = min(max(current, spec.min_replicas), spec.max_replicas)
    if bounded != current:  # a spec edit moved the bounds: follow them at once, no window
        why = f"{current} groups is outside [{spec.min_replicas}, {spec.max_replicas}]"
        return Decision(role, current, bounded, why, readings, history)
    wanted, why = recommend(spec, current, readings)
    if wanted is None:
        return Decision(role, current, current, f"hold: {why}", readings, history)
    history = (*history, Recommendation(now, wanted))
    up = min(r.replicas for r in history if now - r.at <= spec.scale_up_window)
    down = max(r.replicas for r in history if now - r.at <= spec.scale_down_window)
    if up > current:
        return Decision(role, current, up, f"scale up {current} -> {up}: {why}", readings, history)
    if down < current:
        return Decision(role, current, down, f"scale down {current} -> {down}: {why}", readings, history)
    if wanted > current:
        why = f"hold: {why}; waiting for the {spec.scale_up_window:g} s scale-up window (lowest {up})"
    elif wanted < current:
        why = f"hold: {why}; waiting for the {spec.scale_down_window:g} s scale-down window (highest {down})"
    else:
        why = f"hold: {why}"
    return Decision(role, current, current, why, readings, history)


def hold_while_rolling(role: str, spec: AutoscalingSpec, current: int, readings: dict[str, float | None],
                       history: tuple[Recommendation, ...], now: float) -> Decision:
    """One pass of a role whose groups are rolling out or being added/removed: nothing changes,
    and the pass counts as a recommendation to keep `current` groups. Without it a roll that
    outlasted the scale-down window left no recommendation in it, and the first idle reading after
    the roll (a router switching pods, say) removed the groups just added at once."""
    keep_for = max(spec.scale_up_window, spec.scale_down_window)
    kept = tuple(r for r in history if now - r.at <= keep_for)
    return Decision(role, current, current, "hold: groups are rolling out or being added/removed", readings,
                    (*kept, Recommendation(now, current)))


def one_role_at_a_time(decisions: dict[str, Decision], last_scaled: dict[str, float]) -> dict[str, Decision]:
    """At most one role changes per pass: the one that changed least recently (never: first, in
    the order given). The others hold, saying so; their history is kept, so they go next."""
    changing = [role for role, d in decisions.items() if d.changed]
    if len(changing) <= 1:
        return decisions
    first = min(changing, key=lambda role: last_scaled.get(role, -math.inf))
    return {role: d if role == first or not d.changed else
            Decision(role, d.current, d.current, f"hold: one role at a time, {first} changes first "
                     f"(wanted {d.replicas})", d.readings, d.history)
            for role, d in decisions.items()}
