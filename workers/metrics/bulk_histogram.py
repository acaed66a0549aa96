"""`BulkHistogram`: a Prometheus histogram fed a batch of observations at a time.

`prometheus_client.Histogram.observe` takes a lock and walks the buckets once per value; the
decode engine observes one inter-token gap per request per step, so a batch of 256 rows would
pay that 256 times per step. Here one call takes the whole step's gaps under one lock, and the
series is rendered at scrape time from plain counts (a custom collector, public API only).

Semantics are Prometheus's: a value `v` lands in the first bucket whose upper bound `le >= v`
(else `+Inf`), `_sum` adds `v`, `_count` adds 1. A chunk of n tokens that arrived `interval`
after the previous one counts as n observations of `interval / n`: that is SGLang's
`observe_inter_token_latency` rule (n in the bucket of interval/n, `interval` added to the sum),
and the caller expresses it by passing `interval / n` n times.
"""
from __future__ import annotations

import bisect
import threading
from typing import Iterable, Sequence

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString  # how Histogram writes `le`


def cumulative_buckets(bounds: Sequence[float], counts: Sequence[int]) -> list[tuple[str, int]]:
    """Prometheus's (le, cumulative count) pairs from per-bucket `counts` (one more than `bounds`:
    the last counts values above every bound)."""
    cumulative, running = [], 0
    for bound, count in zip(list(bounds) + [float("inf")], counts):
        running += count
        cumulative.append((floatToGoString(bound), running))
    return cumulative


class BulkHistogram:
    """One histogram series with fixed label values; register it on a `CollectorRegistry`."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float],
                 labels: dict[str, str]) -> None:
        bounds = [float(b) for b in buckets]
        if bounds != sorted(set(bounds)) or not bounds:
            raise ValueError(f"{name}: buckets must be strictly increasing, got {buckets}")
        self._name, self._doc = name, documentation
        self._bounds = bounds
        self._label_names, self._label_values = list(labels), list(labels.values())
        self._counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf only)
        self._sum = 0.0
        self._lock = threading.Lock()  # the exporter may read from another thread

    def observe_many(self, values: Iterable[float]) -> None:
        """Adds every value in `values` (one lock for the lot)."""
        counts, bounds, locate = self._counts, self._bounds, bisect.bisect_left
        with self._lock:
            for value in values:
                counts[locate(bounds, value)] += 1
                self._sum += value

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self._name, self._doc, labels=self._label_names)]

    def collect(self) -> list[HistogramMetricFamily]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        family = HistogramMetricFamily(self._name, self._doc, labels=self._label_names)
        family.add_metric(self._label_values, cumulative_buckets(self._bounds, counts), total)
        return [family]

