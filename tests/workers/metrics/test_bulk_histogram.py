"""`BulkHistogram` renders exactly what `prometheus_client.Histogram` renders for the same values.

Oracle: prometheus_client's own Histogram, fed one value at a time, in a registry of its own;
random values, bucket bounds hit exactly, values past the last bound, batches of random sizes.
"""
from __future__ import annotations

import math
import random

import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.exposition import generate_latest

from deepseek_pd.workers.metrics.bulk_histogram import BulkHistogram
from deepseek_pd.workers.metrics.worker_metrics import ITL_BUCKETS


def samples(registry: CollectorRegistry) -> dict:
    text = generate_latest(registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if not s.name.endswith("_created")}


def test_batches_render_as_one_value_at_a_time() -> None:
    rng = random.Random()
    labels = {"role": rng.choice(["decode", "colocated"]), "rank": str(rng.randrange(8))}
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    bulk = BulkHistogram("x:itl_seconds", "doc", ITL_BUCKETS, labels)
    ours.register(bulk)
    oracle = Histogram("x:itl_seconds", "doc", list(labels), buckets=ITL_BUCKETS, registry=theirs).labels(**labels)
    assert samples(ours) == samples(theirs)  # empty: zero buckets, count and sum
    for _ in range(rng.randint(5, 30)):
        batch = [rng.choice([rng.expovariate(30), rng.choice(ITL_BUCKETS), rng.uniform(8, 100), 0.0])
                 for _ in range(rng.randint(0, 40))]
        bulk.observe_many(batch)
        for v in batch:
            oracle.observe(v)
    got, want = samples(ours), samples(theirs)
    assert got.keys() == want.keys()
    for key, v in want.items():
        assert math.isclose(got[key], v, rel_tol=1e-12), key


def test_buckets_must_increase() -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        BulkHistogram("x:h", "doc", (0.1, 0.1, 1), {})
