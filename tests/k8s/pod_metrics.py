"""A worker pod's Prometheus page, read as the operator reads it (pod IP, the `metrics` port).

    metrics_url(pod)                  http://<pod IP>:<its metrics containerPort>/metrics
    scrape(url)                       {(sample name, frozenset(labels)): value}
    total(samples, name, **labels)    the sum of `name` over the samples whose labels include `labels`
"""
from __future__ import annotations

import urllib.request


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels): value} of one Prometheus text page."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: dict, name: str, **labels: str) -> float:
    """The sum of `name` over every sample whose labels include `labels`."""
    return sum(v for (n, have), v in samples.items() if n == name and set(labels.items()) <= have)


def metrics_url(pod: dict) -> str:
    port = next(p["containerPort"] for p in pod["spec"]["containers"][0]["ports"] if p["name"] == "metrics")
    return f"http://{pod['status']['podIP']}:{port}/metrics"
