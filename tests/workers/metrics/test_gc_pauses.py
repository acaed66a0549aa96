"""A worker's garbage-collector discipline (workers/metrics/gc_pauses.py): every collection is timed
into its generation's series, long pauses are logged, and the startup heap is frozen out of later
collections without stopping the collection of what is made afterwards. CPython's own counters
(gc.get_stats, gc.get_objects) are the oracle."""
from __future__ import annotations

import gc
import logging
import random
import weakref

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client import generate_latest

from deepseek_pd.workers.metrics.gc_pauses import GcPauses, freeze_startup_heap
from deepseek_pd.workers.metrics.worker_metrics import GC_PAUSE_BUCKETS, WorkerMetrics


@pytest.fixture
def quiet_gc():
    """Only the test's own collections (no automatic ones in between); the state restored after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        if enabled:
            gc.enable()


def _collections() -> list[int]:
    return [stats["collections"] for stats in gc.get_stats()]


def test_each_collection_is_timed_into_its_generation(quiet_gc) -> None:
    rng = random.Random()
    seen: list[tuple[int, float]] = []
    pauses = GcPauses(lambda generation, seconds: seen.append((generation, seconds)), warn_s=float("inf"))
    pauses.install()
    pauses.install()  # idempotent: one callback
    before = _collections()
    plan = [rng.randrange(3) for _ in range(rng.randint(5, 15))]
    try:
        for generation in plan:
            gc.collect(generation)
    finally:
        pauses.uninstall()
    after = _collections()
    assert [g for g, _ in seen] == plan
    assert [b - a for a, b in zip(before, after)] == [plan.count(g) for g in range(3)]
    assert all(seconds >= 0 for _, seconds in seen)
    gc.collect()
    assert len(seen) == len(plan), "an uninstalled monitor still observed"


def test_a_long_pause_is_logged_with_its_generation(quiet_gc, caplog) -> None:
    pauses = GcPauses(lambda generation, seconds: None, warn_s=0.0)
    pauses.install()
    try:
        with caplog.at_level(logging.WARNING, logger="deepseek_pd.workers.metrics.gc_pauses"):
            gc.collect(2)
            gc.collect(1)
    finally:
        pauses.uninstall()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "generation 2" in lines[0] and "generation 1" in lines[1]


def test_the_frozen_heap_leaves_collections_but_new_garbage_is_still_collected(quiet_gc) -> None:
    rng = random.Random()
    startup = [{"i": i, "peer": None} for i in range(rng.randint(2000, 5000))]
    for a, b in zip(startup, startup[1:]):
        a["peer"] = b  # tracked containers, as a loaded model's modules are
    frozen = freeze_startup_heap()
    assert frozen == gc.get_freeze_count() >= len(startup)
    tracked = {id(o) for o in gc.get_objects()}
    assert not any(id(o) in tracked for o in startup), "a frozen object is still walked by collections"

    class Node:
        pass
    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle made after start: only the collector can free it
    alive = weakref.ref(a)
    del a, b
    assert gc.collect() > 0 and alive() is None


def test_pauses_reach_the_metrics_page_by_generation(quiet_gc) -> None:
    rng = random.Random()
    metrics = WorkerMetrics()
    drawn = [(rng.randrange(3), rng.uniform(0, 2)) for _ in range(rng.randint(20, 60))]
    for generation, seconds in drawn:
        metrics.observe_gc_pause(generation, seconds)
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}
    samples = families["deepseek_pd:gc_pause_seconds"].samples
    for generation in range(3):
        mine = [s for _, s in drawn if _ == generation]
        by = {(s.name, s.labels.get("le")): s.value for s in samples if s.labels["generation"] == str(generation)}
        assert by[("deepseek_pd:gc_pause_seconds_count", None)] == len(mine)
        assert by[("deepseek_pd:gc_pause_seconds_sum", None)] == pytest.approx(sum(mine))
        for bound in GC_PAUSE_BUCKETS:
            le = next(k[1] for k in by if k[1] is not None and float(k[1]) == bound)
            assert by[("deepseek_pd:gc_pause_seconds_bucket", le)] == sum(s <= bound for s in mine)
    frozen = families["deepseek_pd:gc_frozen_objects"].samples[0].value
    assert frozen == gc.get_freeze_count()


def test_an_unscraped_worker_keeps_a_bounded_backlog(quiet_gc) -> None:
    """Nobody reads /metrics: the pending pauses are folded as they pile up, none is lost."""
    rng = random.Random()
    metrics = WorkerMetrics()
    series = metrics._gc
    n = rng.randint(3 * series.FOLD_AT, 5 * series.FOLD_AT)
    for _ in range(n):
        metrics.observe_gc_pause(0, 0.0001)
        assert len(series.pending) < series.FOLD_AT
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}
    count = next(s.value for s in families["deepseek_pd:gc_pause_seconds"].samples
                 if s.name.endswith("_count") and s.labels["generation"] == "0")
    assert count == n
