"""What the autoscaler reads: the serving metrics the workers already export (workers/metrics/
worker_metrics.py), scraped from the pods the operator owns, turned into one number per SLO metric.

    role     CRD name (autoscaling.metrics[].name)   from the workers' /metrics
    prefill  ttftP90Seconds                          p90 of deepseek_pd:time_to_first_token_seconds
                                                     over the requests finished since the last scrape
    prefill  queueDepthPerGroup                      sum of deepseek_pd:num_queue_reqs / groups
    decode   tpotP90Seconds                          p90 of deepseek_pd:time_per_output_token_seconds
                                                     over the requests finished since the last scrape
    decode   kvCacheUsage                            mean of deepseek_pd:token_usage (0..1) over ranks

A p90 comes from the increase of the cumulative buckets between two scrapes of the same rank
(Prometheus' histogram_quantile over a rate, with linear interpolation inside the bucket), summed
over every rank of the role. No request finished in the window: the p90 is 0 (idle: the role may
shrink); no rank could be scraped at all: None (no evidence: that metric does not vote).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

from prometheus_client.parser import text_string_to_metric_families

PREFIX = "deepseek_pd:"
TTFT = PREFIX + "time_to_first_token_seconds"
TPOT = PREFIX + "time_per_output_token_seconds"
QUEUE = PREFIX + "num_queue_reqs"
KV_USAGE = PREFIX + "token_usage"

# The metric names a role's autoscaling may target (the CRD's enum comes from here).
ROLE_METRICS: dict[str, tuple[str, ...]] = {
    "prefill": ("ttftP90Seconds", "queueDepthPerGroup"),
    "decode": ("tpotP90Seconds", "kvCacheUsage"),
}
QUANTILE = 0.9


@dataclass(frozen=True)
class RankSample:
    """One scrape of one rank: cumulative histogram buckets (upper bound -> count) and gauges."""

    histograms: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)


def parse_sample(text: str) -> RankSample:
    """A worker's /metrics text -> the series the autoscaler uses (others are ignored)."""
    histograms: dict[str, list[tuple[float, float]]] = {}
    gauges: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (TTFT + "_bucket", TPOT + "_bucket"):
                bound = float(sample.labels["le"])
                histograms.setdefault(sample.name[: -len("_bucket")], []).append((bound, sample.value))
            elif sample.name in (QUEUE, KV_USAGE):
                gauges[sample.name] = sample.value
    return RankSample({k: tuple(sorted(v)) for k, v in histograms.items()}, gauges)


def bucket_increase(before: RankSample | None, after: RankSample, name: str) -> tuple[tuple[float, float], ...]:
    """Per-bucket increase of a cumulative histogram between two scrapes. A rank that restarted
    (counts went down) or was not seen before counts from zero, as Prometheus' rate() does."""
    now = after.histograms.get(name, ())
    then = dict(before.histograms.get(name, ())) if before else {}
    if any(count < then.get(bound, 0.0) for bound, count in now):
        then = {}
    return tuple((bound, count - then.get(bound, 0.0)) for bound, count in now)


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) buckets; None when
    empty. The +Inf bucket answers with the highest finite bound, as Prometheus does."""
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return ordered[-1][0]


def _sum_buckets(parts: Iterable[tuple[tuple[float, float], ...]]) -> tuple[tuple[float, float], ...]:
    total: dict[float, float] = {}
    for part in parts:
        for bound, count in part:
            total[bound] = total.get(bound, 0.0) + count
    return tuple(sorted(total.items()))


def role_reading(role: str, before: dict[str, RankSample], after: dict[str, RankSample],
                 groups: int) -> dict[str, float | None]:
    """The role's metrics from this pass's scrapes (`after`, rank key -> sample) against the last
    pass's (`before`). `groups`: the role's current groups (queue depth is per group)."""
    def p90(name: str) -> float | None:
        if not after:
            return None
        value = histogram_quantile(QUANTILE, _sum_buckets(bucket_increase(before.get(k), s, name)
                                                          for k, s in after.items()))
        return 0.0 if value is None else value  # scraped, nothing finished: idle

    def gauges(name: str) -> list[float]:
        return [s.gauges[name] for s in after.values() if name in s.gauges]

    if role == "prefill":
        queued = gauges(QUEUE)
        return {"ttftP90Seconds": p90(TTFT),
                "queueDepthPerGroup": sum(queued) / groups if queued and groups else None}
    usage = gauges(KV_USAGE)
    return {"tpotP90Seconds": p90(TPOT), "kvCacheUsage": sum(usage) / len(usage) if usage else None}
