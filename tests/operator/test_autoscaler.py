"""The pure autoscaling planner (operator/autoscaler.py) and the metric reading it is fed
(operator/autoscale_metrics.py), on random metric series from a printed seed.

The oracle for every pass is the HPA rule restated here from its documentation, independently of
the planner's code: per metric ceil(groups * reading / target) unless within the tolerance, the
highest over metrics, clamped; grow only to the lowest such recommendation of the scale-up
window, shrink only to the highest of the scale-down window.
"""
from __future__ import annotations

import math
import os
import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from deepseek_pd.operator.autoscale_metrics import (
    TTFT, histogram_quantile, parse_sample, role_reading,
)
from deepseek_pd.operator.autoscaler import (
    AutoscalingSpec, Decision, MetricTarget, decide, hold_while_rolling, one_role_at_a_time,
)
from deepseek_pd.workers.metrics.worker_metrics import TTFT_BUCKETS

SEED = int(os.environ.get("AUTOSCALER_SEED", random.randrange(2**32)))


@pytest.fixture
def rng() -> random.Random:
    print(f"seed {SEED} (AUTOSCALER_SEED={SEED} repeats it)")
    return random.Random(SEED)


def _spec(rng: random.Random) -> AutoscalingSpec:
    low = rng.randint(1, 3)
    return AutoscalingSpec(min_replicas=low, max_replicas=low + rng.randint(0, 6),
                           metrics=(MetricTarget("tpotP90Seconds", rng.choice([0.02, 0.05, 0.1])),
                                    MetricTarget("kvCacheUsage", rng.choice([0.6, 0.8]))),
                           scale_up_window=rng.choice([0, 30, 60]), scale_down_window=rng.choice([60, 300]))


def _oracle_wanted(spec: AutoscalingSpec, current: int, readings: dict) -> int:
    wanted = []
    for m in spec.metrics:
        ratio = readings[m.name] / m.target
        wanted.append(current if abs(ratio - 1) <= spec.tolerance else math.ceil(round(current * ratio, 9)))
    return min(max(max(wanted), spec.min_replicas), spec.max_replicas)


def test_random_series_stay_in_bounds_and_follow_both_windows(rng):
    for _ in range(40):
        spec = _spec(rng)
        current, history, recs, now = spec.min_replicas, (), [], 0.0
        for _ in range(rng.randint(20, 120)):
            now += rng.choice([1, 5, 10, 30])
            burst = rng.random() < 0.3
            readings = {"tpotP90Seconds": spec.metrics[0].target * rng.uniform(1.0, 4.0) if burst
                        else spec.metrics[0].target * rng.uniform(0.0, 1.2),
                        "kvCacheUsage": rng.uniform(0.0, 1.0)}
            d = decide("decode", spec, current, readings, history, now)
            recs.append((now, _oracle_wanted(spec, current, readings)))
            window_up = [r for t, r in recs if now - t <= spec.scale_up_window]
            window_down = [r for t, r in recs if now - t <= spec.scale_down_window]
            assert spec.min_replicas <= d.replicas <= spec.max_replicas, d
            if d.replicas > current:
                assert d.replicas == min(window_up) and d.reason.startswith("scale up"), (d, window_up)
            elif d.replicas < current:
                assert d.replicas == max(window_down) and d.reason.startswith("scale down"), (d, window_down)
            else:
                assert min(window_up) <= current <= max(window_down), (d, window_up, window_down)
            assert d.readings == readings and str(current) in d.reason or d.reason.startswith("hold")
            current, history = d.replicas, d.history


def test_a_burst_shorter_than_the_up_window_adds_nothing_and_idleness_shorter_than_the_down_window_removes_nothing(rng):
    target = 0.05
    spec = AutoscalingSpec(1, 8, (MetricTarget("tpotP90Seconds", target),), scale_up_window=60, scale_down_window=300)
    history, now, current = (), 0.0, 2
    for _ in range(10):  # calm, on target, for 100 s
        now += 10
        d = decide("decode", spec, current, {"tpotP90Seconds": target}, history, now)
        assert not d.changed
        history = d.history
    burst = rng.randint(1, 5)  # fewer passes than the 60 s window holds
    for _ in range(burst):
        now += 10
        d = decide("decode", spec, current, {"tpotP90Seconds": target * rng.uniform(3, 5)}, history, now)
        assert not d.changed and "scale-up window" in d.reason, d.reason
        history = d.history
    for _ in range(7):  # the burst lasts: after a whole window it scales
        now += 10
        d = decide("decode", spec, current, {"tpotP90Seconds": target * 3}, history, now)
        history = d.history
        if d.changed:
            break
    assert d.changed and d.replicas == 6, d  # ceil(2 * 3) once the whole window agrees
    current, history, scaled_at = d.replicas, d.history, now
    for step in range(1, 40):  # idle: it shrinks to the minimum once the 300 s window holds no 6
        now += 10
        d = decide("decode", spec, current, {"tpotP90Seconds": 0.0}, history, now)
        history = d.history
        if d.changed:
            break
    assert d.replicas == 1 and d.reason.startswith("scale down 6 -> 1"), d
    assert now - scaled_at > 300 >= now - 10 - scaled_at, (now, scaled_at)


def test_groups_added_after_a_roll_longer_than_the_down_window_stay_a_whole_window(rng):
    """The groups a scale-up adds take a while to come up (pods start, the router rolls); the
    passes meanwhile hold. The first idle reading after that roll (seen on the control plane: a
    2 s scrape window in which the router switched pods) must not remove them at once: idleness
    must last the whole down window from the roll's end, as it would have without the roll."""
    target, window = 0.05, rng.choice([20, 60, 300])
    spec = AutoscalingSpec(1, 4, (MetricTarget("tpotP90Seconds", target),), 0, window)
    d = decide("decode", spec, 1, {"tpotP90Seconds": target * 3}, (), 0.0)
    assert d.changed and d.replicas == 3, d
    history, now, roll_ends = d.history, 0.0, window + rng.uniform(1, 3 * window)
    while now < roll_ends:
        now += 2
        d = hold_while_rolling("decode", spec, 3, {"tpotP90Seconds": target * rng.uniform(0, 3)}, history, now)
        assert not d.changed
        history = d.history
    roll_ends = now
    while True:
        now += 2
        d = decide("decode", spec, 3, {"tpotP90Seconds": 0.0}, history, now)
        history = d.history
        if d.changed:
            break
    assert d.replicas == 1 and now - roll_ends > window, (now, roll_ends, window, d)


def test_within_tolerance_nothing_moves_and_no_reading_holds(rng):
    spec = AutoscalingSpec(1, 10, (MetricTarget("queueDepthPerGroup", 4.0),), 0, 0)
    for _ in range(50):
        current = rng.randint(1, 10)
        d = decide("prefill", spec, current, {"queueDepthPerGroup": 4.0 * rng.uniform(0.91, 1.09)}, (), 100.0)
        assert not d.changed
    d = decide("prefill", spec, 3, {"queueDepthPerGroup": None}, (), 100.0)
    assert not d.changed and "no metric could be read" in d.reason


def test_bounds_edited_below_the_current_count_apply_at_once():
    spec = AutoscalingSpec(1, 2, (MetricTarget("kvCacheUsage", 0.8),), 60, 300)
    d = decide("decode", spec, 5, {"kvCacheUsage": 1.0}, (), 0.0)
    assert d.replicas == 2 and "outside [1, 2]" in d.reason


def test_one_role_changes_per_pass_the_one_changed_least_recently():
    grow = {r: Decision(r, 1, 2, "scale up", {}, ()) for r in ("prefill", "decode")}
    picked = one_role_at_a_time(grow, {"prefill": 50.0, "decode": 10.0})
    assert picked["decode"].changed and not picked["prefill"].changed
    assert "one role at a time, decode changes first" in picked["prefill"].reason
    assert one_role_at_a_time(grow, {})["prefill"].changed  # never scaled: the first in order


def test_p90_of_the_window_matches_the_observed_latencies(rng):
    """The workers' own histogram (same buckets), scraped twice: the p90 of the second window
    only, against the exact p90 of the latencies observed in it (within its bucket)."""
    registry = CollectorRegistry()
    hist = Histogram(TTFT, "ttft", ["rank"], buckets=TTFT_BUCKETS, registry=registry).labels(rank="0")
    for _ in range(200):
        hist.observe(rng.uniform(0.01, 0.1))  # an earlier, fast window
    before = {"p0/0": parse_sample(generate_latest(registry).decode())}
    window = [rng.lognormvariate(-0.5, 0.8) for _ in range(rng.randint(50, 400))]
    for value in window:
        hist.observe(value)
    after = {"p0/0": parse_sample(generate_latest(registry).decode())}
    got = role_reading("prefill", before, after, groups=1)["ttftP90Seconds"]
    exact = sorted(window)[math.ceil(0.9 * len(window)) - 1]
    bounds = (0.0, *TTFT_BUCKETS, math.inf)
    bucket = next(i for i in range(1, len(bounds)) if exact <= bounds[i])
    assert bounds[bucket - 1] <= got <= min(bounds[bucket], TTFT_BUCKETS[-1]), (got, exact)
    assert role_reading("prefill", after, after, groups=1)["ttftP90Seconds"] == 0.0  # idle window
    assert role_reading("prefill", {}, {}, groups=1)["ttftP90Seconds"] is None  # nothing scraped


def test_histogram_quantile_interpolates_like_prometheus():
    buckets = [(0.1, 10.0), (0.2, 50.0), (math.inf, 100.0)]
    assert histogram_quantile(0.3, buckets) == pytest.approx(0.1 + 0.1 * (30 - 10) / 40)
    assert histogram_quantile(0.9, buckets) == 0.2  # in +Inf: the highest finite bound
    assert histogram_quantile(0.9, [(0.1, 0.0), (math.inf, 0.0)]) is None


def test_a_change_in_the_same_second_as_the_decision_before_it_is_posted():
    """Scaled follows lastScaleAt, not the decision's whole-second time: the hold written by the
    pass that read a new target and the scale-up one pass later can share their second (an e2e run
    then found no Scaled Event for a scale-up that happened)."""
    from deepseek_pd.operator.autoscale_reconcile import decision_events

    second = "2026-12-06T19:56:48Z"
    hold = {"from": 1, "to": 1, "reason": "hold: tpotP90Seconds 0.01 vs target 0.02: wants 1",
            "readings": {"tpotP90Seconds": 0.01}, "time": second}
    up = {"from": 1, "to": 2, "reason": "scale up 1 -> 2: tpotP90Seconds 0.03 vs target 0.02",
          "readings": {"tpotP90Seconds": 0.03}, "time": second}
    before = {"decode": {"lastDecision": hold, "lastScaleAt": 0.0}}
    after = {"decode": {"lastDecision": up, "lastScaleAt": 1796586000.25, "lastScale": up}}
    assert [(t, r) for t, r, _ in decision_events(before, after)] == [("Normal", "Scaled")]
    steady = {"decode": {"lastDecision": {**up, "from": 2}, "lastScaleAt": 1796586000.25}}
    assert decision_events(after, steady) == []  # a later hold posts nothing
