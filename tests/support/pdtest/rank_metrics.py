"""Scraping a multi-rank worker's per-rank Prometheus ports (`--metrics-port P`: rank r on P + r)."""
from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

PREFIX = "deepseek_pd:"


def scrape(port: int) -> tuple[set[str], dict]:
    """(the `rank` labels seen, {(name, labels without role/model_name/rank): value})."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    ranks, samples = set(), {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            ranks.add(sample.labels.get("rank"))
            labels = frozenset((k, v) for k, v in sample.labels.items() if k not in ("role", "model_name", "rank"))
            samples[(sample.name, labels)] = sample.value
    return ranks, samples


def value(samples: dict, name: str, **labels: str) -> float:
    """One sample of a `scrape` result (0 when absent)."""
    return samples.get((PREFIX + name, frozenset(labels.items())), 0.0)
