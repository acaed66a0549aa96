"""`Loads` carries typed fields, and the worker's metrics read them by name, not from a dict by key:
each gauge WorkerMetrics exports from a Loads is that Loads' field (random loads, printed seed)."""
from __future__ import annotations

import dataclasses
import random

from deepseek_pd.workers.engine.interface import Loads
from deepseek_pd.workers.metrics.worker_metrics import MetricLabels, WorkerMetrics

GAUGES = {"num_running_reqs": "num_running", "num_queue_reqs": "num_waiting",
          "kv_pool_used_pages": "kv_used_pages", "kv_pool_total_pages": "kv_total_pages",
          "kv_pool_cached_pages": "cached_pages"}


def test_the_metrics_export_each_typed_field() -> None:
    seed = random.randrange(2 ** 32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    assert all(f.type != "dict" for f in dataclasses.fields(Loads)), "Loads has an untyped dict again"
    for _ in range(20):
        total = rng.randint(1, 10_000)
        loads = Loads(rng.randint(0, 500), rng.randint(0, 500), rng.randint(0, total), total,
                      cached_pages=rng.randint(0, total), reserved_pages=rng.randint(0, total),
                      in_flight_per_dp_rank=tuple(rng.randint(0, 9) for _ in range(rng.randint(0, 4))))
        labels = MetricLabels(rng.choice(["prefill", "decode"]), "m", rng.randrange(4))
        metrics = WorkerMetrics(labels)
        metrics.watch_loads(lambda: loads)
        for gauge, name in GAUGES.items():
            assert metrics.registry.get_sample_value(f"deepseek_pd:{gauge}", labels.values()) == getattr(loads, name)
        usage = metrics.registry.get_sample_value("deepseek_pd:token_usage", labels.values())
        assert usage == loads.kv_used_pages / loads.kv_total_pages
