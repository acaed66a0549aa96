"""Speculative decoding in `bench serving`'s report, from the decode workers' own /metrics.

A decode worker with `--speculative-num-steps` counts the tokens its MTP layer drafted and those the
target accepted, and observes each verify row's accept length (workers/metrics/worker_metrics.py:
`deepseek_pd:spec_draft_tokens_total`, `spec_accepted_tokens_total`, `spec_accept_length`). Scraped
before and after the load, their differences summed over the workers (every rank of a group exports
its own) give the run's figures:

    {"drafted": 1200, "accepted": 950, "accept_rate": 0.79, "verify_rows": 560, "emitted": 1510,
     "accept_length": 2.70, "workers": 2}

`accept_length` is SGLang's: tokens emitted per verify row (1 + the accepted drafts). Workers that
export none of them (an older image) are left out; when no verify ran over the run (no worker
speculates) there is no figure (None), so a run without speculation reports nothing, not zeros.
"""
from __future__ import annotations

import urllib.request
from typing import Iterable

from prometheus_client.parser import text_string_to_metric_families

_PREFIX = "deepseek_pd:"
# sample name (without the prefix) -> the key its total is kept under
_SAMPLES = {"spec_draft_tokens_total": "drafted", "spec_accepted_tokens_total": "accepted",
            "spec_accept_length_count": "verify_rows", "spec_accept_length_sum": "emitted"}


def parse_totals(text: str) -> dict[str, float]:
    """The speculative totals in one /metrics page, summed over label sets; {} when it has none."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = _SAMPLES.get(sample.name.removeprefix(_PREFIX)) if sample.name.startswith(_PREFIX) else None
            if key is not None:
                totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def scrape_totals(urls: Iterable[str], timeout_s: float = 5.0) -> dict[str, dict[str, float]]:
    """url -> its totals, for the URLs that answer and export them."""
    found = {}
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response:
                totals = parse_totals(response.read().decode())
        except OSError:
            continue
        if totals:
            found[url] = totals
    return found


def speculation_summary(before: dict[str, dict[str, float]],
                        after: dict[str, dict[str, float]]) -> dict[str, float] | None:
    """The run's figures (module docstring) from two scrapes; None when no verify ran."""
    total = dict.fromkeys(_SAMPLES.values(), 0.0)
    for url, now in after.items():
        then = before.get(url, {})
        for key in total:
            total[key] += now.get(key, 0.0) - then.get(key, 0.0)
    rows, drafted = total["verify_rows"], total["drafted"]
    if rows <= 0:
        return None
    return {"drafted": int(drafted), "accepted": int(total["accepted"]),
            "accept_rate": total["accepted"] / drafted if drafted else None,
            "verify_rows": int(rows), "emitted": int(total["emitted"]),
            "accept_length": total["emitted"] / rows, "workers": len(after)}


def describe(summary: dict[str, float]) -> str:
    """One line for the printed summary."""
    length = f"{summary['accept_length']:.2f}"
    rate = "n/a" if summary["accept_rate"] is None else f"{summary['accept_rate']:.2f}"
    return (f"speculative decoding: accept length {length} over {summary['verify_rows']} verify rows; "
            f"drafted {summary['drafted']}, accepted {summary['accepted']} (rate {rate}), "
            f"from {summary['workers']} decode rank(s)")
